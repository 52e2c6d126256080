// epmoe-launch-probe: host time of one kernel launch (cudaLaunchKernelEx) against its parameter
// bytes, the cooperative attribute and the grid, with the GPU running behind (nothing waits for
// it inside a timed batch). The question it answers: how much of a forward call's enqueue time is
// the megakernel's 1.5 KB of parameters and its cooperative launch (docs/BENCHMARKS.md, "Host time
// per eager call").
//
//   epmoe-launch-probe [--calls N] [--repeats N]
//
// Each row: median over --repeats batches of --calls launches of an empty 132 x 384 kernel (each
// batch after a synchronize), in microseconds per launch; also the small host calls a forward makes
// around its launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tools/probes/probe_cuda.h"

namespace {

template <int kBytes>
struct Blob {
  unsigned char b[kBytes];
};

// Reads one byte of its parameters so that they are not dead.
template <int kBytes>
__global__ void empty_kernel(const __grid_constant__ Blob<kBytes> p, int* sink) {
  if (p.b[threadIdx.x % kBytes] == 0xAB && blockIdx.x == 0x7fffffff) *sink = 1;
}

template <class F>
double time_us(int calls, int repeats, F&& f) {
  std::vector<double> per;
  for (int r = 0; r < repeats; ++r) {
    PROBE_CUDA(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    const auto t1 = std::chrono::steady_clock::now();
    per.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  PROBE_CUDA(cudaDeviceSynchronize());
  return probe_median(per);
}

template <int kBytes>
double launch_us(int grid, int threads, bool cooperative, cudaStream_t s, int* sink, int calls, int repeats) {
  Blob<kBytes> blob;
  std::memset(&blob, 1, sizeof(blob));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.stream = s;
  cfg.attrs = cooperative ? attr : nullptr;
  cfg.numAttrs = cooperative ? 1 : 0;
  return time_us(calls, repeats, [&] { PROBE_CUDA(cudaLaunchKernelEx(&cfg, empty_kernel<kBytes>, blob, sink)); });
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 2000, repeats = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--calls")) calls = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
  }
  int sms = 0;
  PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  PROBE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* sink;
  PROBE_CUDA(cudaMalloc(&sink, 4));
  cudaEvent_t ev;
  PROBE_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  std::printf("host us per call (median of %d x %d calls), grid %d x 384, GPU running behind\n", repeats, calls, sms);
  for (int coop = 0; coop < 2; ++coop) {
    const char* kind = coop ? "cooperative" : "plain";
    std::printf("  %-12s   64 B params: %6.2f\n", kind, launch_us<64>(sms, 384, coop, s, sink, calls, repeats));
    std::printf("  %-12s  256 B params: %6.2f\n", kind, launch_us<256>(sms, 384, coop, s, sink, calls, repeats));
    std::printf("  %-12s  768 B params: %6.2f\n", kind, launch_us<768>(sms, 384, coop, s, sink, calls, repeats));
    std::printf("  %-12s 1536 B params: %6.2f\n", kind, launch_us<1536>(sms, 384, coop, s, sink, calls, repeats));
    std::printf("  %-12s 3072 B params: %6.2f\n", kind, launch_us<3072>(sms, 384, coop, s, sink, calls, repeats));
  }
  std::printf("  plain 16 x 512, 256 B:      %6.2f\n", launch_us<256>(16, 512, false, s, sink, calls, repeats));
  std::printf("  cooperative 16 x 512, 256 B: %6.2f\n", launch_us<256>(16, 512, true, s, sink, calls, repeats));
  std::printf("  cudaEventRecord:            %6.2f\n",
              time_us(calls, repeats, [&] { PROBE_CUDA(cudaEventRecord(ev, s)); }));
  std::printf("  cudaStreamWaitEvent:        %6.2f\n",
              time_us(calls, repeats, [&] { PROBE_CUDA(cudaStreamWaitEvent(s, ev, 0)); }));
  cudaStreamCaptureStatus cs;
  std::printf("  cudaStreamIsCapturing:      %6.2f\n",
              time_us(calls, repeats, [&] { PROBE_CUDA(cudaStreamIsCapturing(s, &cs)); }));
  int dev = 0;
  std::printf("  cudaGetDevice:              %6.2f\n", time_us(calls, repeats, [&] { PROBE_CUDA(cudaGetDevice(&dev)); }));
  PROBE_CUDA(cudaFree(sink));
  return 0;
}
