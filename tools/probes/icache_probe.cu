// epmoe-icache-probe: how much straight-line code an SM keeps in its instruction caches, within one
// launch and from one launch to the next. The question it answers: a megakernel decode call runs
// ~160 KB of distinct SASS once each (dispatch, the GEMM roles, combine), and ncu puts a large share
// of the one-shot phases' stall samples on "no instruction"; is that code cold because it does not
// fit, or because each launch starts cold (docs/DESIGN.md, "What bounds the layer now")?
//
//   epmoe-icache-probe [--launches N]
//
// For each code size (1024 .. 16384 SASS instructions of 16 bytes: 16 .. 256 KB), one block of four
// warps per SM (the dynamic shared memory keeps it at one) runs the same straight-line block of
// independent FMAs three times in a loop, timing each pass with clock64; then the next launch does
// the same. Each row: the median over the SMs of each pass's cycles per instruction of one warp.
// A pass that finds its code cached runs at ~1 cycle per instruction; a cold one pays the fetch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tools/probes/probe_cuda.h"

namespace {

constexpr int kPasses = 3;

// kInstr FMAs in four independent chains, kInstr / 4 each; asm volatile keeps every one.
template <int kInstr>
__global__ void __launch_bounds__(128, 1) straight_code(float* sink, long long* cycles) {
  float a = float(threadIdx.x), b = a + 1.0f, c = a + 2.0f, d = a + 3.0f;
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    __syncwarp();
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < kInstr / 4; ++i) {
      asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFE, 0f3C000000;" : "+f"(a));
      asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFE, 0f3C000000;" : "+f"(b));
      asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFE, 0f3C000000;" : "+f"(c));
      asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFE, 0f3C000000;" : "+f"(d));
    }
    __syncwarp();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[blockIdx.x * kPasses + pass] = t1 - t0;
  }
  if (a + b + c + d == 1234.5f) *sink = a;
}

template <int kInstr>
void run_size(int sms, int launches, float* sink, long long* d_cycles) {
  const int smem = 160 * 1024;  // one block per SM
  PROBE_CUDA(cudaFuncSetAttribute(straight_code<kInstr>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<long long> h(size_t(sms) * kPasses);
  std::printf("%6d instr %4d KB |", kInstr, kInstr * 16 / 1024);
  for (int l = 0; l < launches; ++l) {
    straight_code<kInstr><<<sms, 128, smem>>>(sink, d_cycles);
    PROBE_CUDA(cudaGetLastError());
    PROBE_CUDA(cudaDeviceSynchronize());
    PROBE_CUDA(cudaMemcpy(h.data(), d_cycles, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    for (int p = 0; p < kPasses; ++p) {
      std::vector<double> v;
      for (int s = 0; s < sms; ++s) v.push_back(double(h[size_t(s) * kPasses + p]) / kInstr);
      std::printf(" %6.2f", probe_median(v));
    }
    std::printf(" |");
  }
  std::printf("\n");
}

template <int... kInstr>
void run_sizes(int sms, int launches, float* sink, long long* d_cycles) {
  (run_size<kInstr>(sms, launches, sink, d_cycles), ...);
}

}  // namespace

int main(int argc, char** argv) {
  int launches = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--launches") && i + 1 < argc) {
      launches = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: epmoe-icache-probe [--launches N]\n");
      return 2;
    }
  }
  int dev = 0, sms = 0;
  PROBE_CUDA(cudaGetDevice(&dev));
  PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  float* sink;
  long long* d_cycles;
  PROBE_CUDA(cudaMalloc(&sink, sizeof(float)));
  PROBE_CUDA(cudaMalloc(&d_cycles, size_t(sms) * kPasses * sizeof(long long)));
  std::printf("cycles per instruction (one warp per SM sub-partition), median over %d SMs; per launch: pass 1 2 3\n",
              sms);
  // The last size again after the largest one ran: does a launch of other code evict it?
  run_sizes<1024, 2048, 4096, 6144, 8192, 8704, 9216, 9728, 10240, 12288, 16384, 4096>(sms, launches, sink,
                                                                                       d_cycles);
  PROBE_CUDA(cudaFree(sink));
  PROBE_CUDA(cudaFree(d_cycles));
  return 0;
}
