// epmoe-gpu-check: is this machine fit to run epmoe? Prints the GPUs, runs an sm_90a kernel
// (wgmma-capable target), checks the loaded libnccl and initialises an NCCL communicator
// across all local GPUs from one process (ncclCommInitAll).
#include <cooperative_groups.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "epmoe/version.h"

namespace {

int g_failures = 0;

bool cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("FAIL %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  ++g_failures;
  return false;
}

bool nccl_ok(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return true;
  std::printf("FAIL %s: %s\n", what, ncclGetErrorString(r));
  ++g_failures;
  return false;
}

// Writes a value computed from the cluster rank (an sm_90-only register), so the check proves that the
// sm_90a cubin (not a JIT-compiled PTX fallback) ran.
__global__ void sm90a_probe(unsigned* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  out[threadIdx.x] = 0x90a00000u + threadIdx.x + cooperative_groups::this_cluster().block_rank();
#else
  out[threadIdx.x] = 0xdeadu;
#endif
}

}  // namespace

int main() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("epmoe-gpu-check: no CUDA GPU visible (%s). epmoe needs Hopper GPUs (sm_90).\n",
                e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 1;
  }
  std::printf("epmoe %s: %d GPU(s)\n", epmoe::version_string(), count);
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    if (!cuda_ok(cudaGetDeviceProperties(&p, d), "cudaGetDeviceProperties")) continue;
    int clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, d);
    std::printf("  [%d] %s sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB, smem/block optin %zu KiB, clock %d MHz\n",
                d, p.name, p.major, p.minor, p.multiProcessorCount,
                p.totalGlobalMem / double(1 << 30), p.l2CacheSize >> 20,
                p.sharedMemPerBlockOptin >> 10, clock_khz / 1000);
    if (p.major != 9) {
      std::printf("FAIL device %d is sm_%d%d; epmoe's kernels are built for sm_90a\n", d, p.major, p.minor);
      ++g_failures;
    }
    for (int q = 0; q < count; ++q) {
      if (q == d) continue;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, d, q);
      std::printf("      peer access %d -> %d: %s\n", d, q, can ? "yes" : "NO");
      if (!can) ++g_failures;
    }
  }

  // An sm_90a kernel on every GPU.
  for (int d = 0; d < count; ++d) {
    cudaSetDevice(d);
    unsigned* buf = nullptr;
    if (!cuda_ok(cudaMalloc(&buf, 32 * sizeof(unsigned)), "cudaMalloc")) continue;
    sm90a_probe<<<1, 32>>>(buf);
    cuda_ok(cudaGetLastError(), "launch sm90a_probe");
    unsigned host[32] = {};
    cuda_ok(cudaMemcpy(host, buf, sizeof(host), cudaMemcpyDeviceToHost), "copy probe");
    bool good = true;
    for (unsigned i = 0; i < 32; ++i) good &= host[i] == 0x90a00000u + i;
    std::printf("  sm_90a kernel on GPU %d: %s\n", d, good ? "ok" : "WRONG RESULT");
    if (!good) ++g_failures;
    cudaFree(buf);
  }

  int code = 0;
  epmoe::Status st = epmoe::check_nccl_runtime_version(&code);
  std::printf("  NCCL loaded: version code %d (compiled against %d): %s\n", code, NCCL_VERSION_CODE,
              st.ok() ? "ok" : st.message().c_str());
  if (!st.ok()) {
    ++g_failures;
  } else if (count >= 2) {
    std::vector<ncclComm_t> comms(count);
    std::vector<int> devs(count);
    for (int d = 0; d < count; ++d) devs[d] = d;
    if (nccl_ok(ncclCommInitAll(comms.data(), count, devs.data()), "ncclCommInitAll")) {
      // One all-reduce of ones proves the communicator moves data.
      std::vector<float*> bufs(count);
      const size_t n = 1 << 20;
      for (int d = 0; d < count; ++d) {
        cudaSetDevice(d);
        cuda_ok(cudaMalloc(&bufs[d], n * sizeof(float)), "cudaMalloc");
        std::vector<float> ones(n, 1.0f);
        cuda_ok(cudaMemcpy(bufs[d], ones.data(), n * sizeof(float), cudaMemcpyHostToDevice), "h2d");
      }
      nccl_ok(ncclGroupStart(), "ncclGroupStart");
      for (int d = 0; d < count; ++d)
        nccl_ok(ncclAllReduce(bufs[d], bufs[d], n, ncclFloat, ncclSum, comms[d], 0), "ncclAllReduce");
      nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
      bool good = true;
      for (int d = 0; d < count; ++d) {
        cudaSetDevice(d);
        cuda_ok(cudaDeviceSynchronize(), "sync");
        float v = 0;
        cuda_ok(cudaMemcpy(&v, bufs[d] + n - 1, sizeof(float), cudaMemcpyDeviceToHost), "d2h");
        good &= v == float(count);
        cudaFree(bufs[d]);
      }
      std::printf("  NCCL %d-rank communicator (ncclCommInitAll) + all-reduce: %s\n", count,
                  good ? "ok" : "WRONG SUM");
      if (!good) ++g_failures;
      for (auto c : comms) ncclCommDestroy(c);
    }
  } else {
    std::printf("  NCCL multi-rank check skipped: 1 GPU\n");
  }

  std::printf("epmoe-gpu-check: %s (%d failure(s))\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
