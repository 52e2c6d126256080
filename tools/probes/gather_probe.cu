// Probe: how fast W warps of one block can gather rows by index into shared memory with cp.async,
// the way the dropped gathered FP8 L1 kernel fed its A tiles (docs/DESIGN.md, dropped designs).
//
// Each block owns a 4-stage ring of 16 KB stages (128 rows x 128 bytes, 128-byte swizzled as TMA
// would write them). W gathering warps fill stage after stage with 16-byte cp.async copies of
// randomly indexed rows of a 4096 x 7168-byte token array (cp.async.mbarrier.arrive.noinc on the
// stage's "full" barrier); one consumer warp waits for each stage and releases it at once. No math,
// no other traffic: the time per stage is what the gather alone can feed. The grouped GEMM's
// 128 x 256 FP8 tile consumes one such stage per ~1,360 cycles.
//
// Built with the project as epmoe-gather-probe. Run (GPU): epmoe-gather-probe
// Prints, per W in {1, 2, 4, 8, 16}: time, bandwidth, and cycles per stage (mean over the blocks).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_cuda.h"

namespace {

constexpr int kStages = 4;
constexpr int kStageBytes = 128 * 128;
constexpr int kRowBytes = 7168;      // one token row (H of the DSV3 slice, e4m3)
constexpr int kTokens = 4096;
constexpr int kPoolRows = 32768;     // 8 rows per token, as top-8 routing makes
constexpr int kKBlocks = 56 * 8;     // stages per block: eight tiles of 56 K blocks
constexpr long long kSpinLimit = 2000000000LL;  // cycles: a lost arrival traps instead of hanging

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Bounded wait on one mbarrier phase (traps after kSpinLimit cycles).
__device__ __forceinline__ void wait_phase(uint32_t bar, uint32_t parity) {
  const long long start = clock64();
  for (;;) {
    uint32_t ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    if (ok) return;
    if (clock64() - start > kSpinLimit) asm volatile("trap;");
  }
}

template <int W>
__global__ void __launch_bounds__(32 * (W + 1), 1)
    gather_probe(const uint8_t* x, const int* idx, unsigned long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int warp = int(threadIdx.x / 32);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&full[s])), "r"(32 * W));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])), "r"(1));
    }
  }
  __syncthreads();
  const long long t0 = clock64();
  int stage = 0;
  uint32_t phase = 0;
  if (warp < W) {
    for (int kb = 0; kb < kKBlocks; ++kb) {
      if (kb >= kStages) wait_phase(smem_u32(&empty[stage]), phase ^ 1u);
      const int tile = int(blockIdx.x + (kb / 56) * gridDim.x) % (kPoolRows / 128);
      const int k_off = (kb % 56) * 128;
      for (int c = int(threadIdx.x); c < 1024; c += 32 * W) {  // copy c: row c / 8, chunk c % 8
        const int r = c / 8, chunk = c % 8;
        const uint8_t* src = x + size_t(__ldg(idx + tile * 128 + r)) * kRowBytes + k_off + chunk * 16;
        const uint32_t dst = smem_u32(smem + stage * kStageBytes + r * 128 + ((chunk ^ (r & 7)) << 4));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(&full[stage])) : "memory");
      if (++stage == kStages) stage = 0, phase ^= 1u;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    for (int kb = 0; kb < kKBlocks; ++kb) {
      wait_phase(smem_u32(&full[stage]), phase);
      if (threadIdx.x % 32 == 0)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[stage])) : "memory");
      if (++stage == kStages) stage = 0, phase ^= 1u;
    }
    if (threadIdx.x % 32 == 0) cycles[blockIdx.x] = (unsigned long long)(clock64() - t0);
  }
}

template <int W>
void measure(const uint8_t* x, const int* idx, unsigned long long* cycles, int sms) {
  constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8;
  PROBE_CUDA(cudaFuncSetAttribute(gather_probe<W>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  gather_probe<W><<<sms, 32 * (W + 1), kSmem>>>(x, idx, cycles);  // warm-up
  PROBE_CUDA(cudaGetLastError());
  cudaEvent_t a, b;
  PROBE_CUDA(cudaEventCreate(&a));
  PROBE_CUDA(cudaEventCreate(&b));
  constexpr int kReps = 5;
  PROBE_CUDA(cudaEventRecord(a));
  for (int i = 0; i < kReps; ++i) gather_probe<W><<<sms, 32 * (W + 1), kSmem>>>(x, idx, cycles);
  PROBE_CUDA(cudaGetLastError());
  PROBE_CUDA(cudaEventRecord(b));
  PROBE_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  PROBE_CUDA(cudaEventElapsedTime(&ms, a, b));
  ms /= kReps;
  std::vector<unsigned long long> c(sms);
  PROBE_CUDA(cudaMemcpy(c.data(), cycles, sizeof(unsigned long long) * sms, cudaMemcpyDeviceToHost));
  double mean = 0;
  for (unsigned long long v : c) mean += double(v);
  mean /= sms;
  const double bytes = double(sms) * kKBlocks * kStageBytes;
  std::printf("W=%2d gathering warps: %.3f ms, %5.0f GB/s in all, %5.1f GB/s per SM, %5.0f cycles per 16 KB stage\n", W,
              ms, bytes / ms / 1e6, bytes / ms / 1e6 / sms, mean / kKBlocks);
  PROBE_CUDA(cudaEventDestroy(a));
  PROBE_CUDA(cudaEventDestroy(b));
}

}  // namespace

int main() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("epmoe-gather-probe: needs a GPU, none visible.\n");
    return 0;
  }
  int sms = 0;
  PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* x = nullptr;
  int* idx = nullptr;
  unsigned long long* cycles = nullptr;
  PROBE_CUDA(cudaMalloc(&x, size_t(kTokens) * kRowBytes));
  PROBE_CUDA(cudaMemset(x, 1, size_t(kTokens) * kRowBytes));
  std::vector<int> h(kPoolRows);
  uint64_t s = 1;
  for (int& v : h) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = int((s >> 33) % kTokens);
  }
  PROBE_CUDA(cudaMalloc(&idx, sizeof(int) * kPoolRows));
  PROBE_CUDA(cudaMemcpy(idx, h.data(), sizeof(int) * kPoolRows, cudaMemcpyHostToDevice));
  PROBE_CUDA(cudaMalloc(&cycles, sizeof(unsigned long long) * sms));
  measure<1>(x, idx, cycles, sms);
  measure<2>(x, idx, cycles, sms);
  measure<4>(x, idx, cycles, sms);
  measure<8>(x, idx, cycles, sms);
  measure<16>(x, idx, cycles, sms);
  PROBE_CUDA(cudaFree(x));
  PROBE_CUDA(cudaFree(idx));
  PROBE_CUDA(cudaFree(cycles));
  return 0;
}
