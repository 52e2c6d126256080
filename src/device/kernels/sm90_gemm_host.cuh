// Host halves of the grouped GEMM launchers (sm90_gemm_launch.h), written once for both dtypes;
// sm90_gemm_fp8.cu and sm90_gemm_bf16.cu instantiate them (one translation unit per dtype keeps
// the heavy kernel instantiations apart).
#pragma once

#include <mutex>
#include <vector>

#include "device/kernels/sm90_gemm_launch.h"
#include "device/kernels/sm90_grouped_gemm.cuh"

namespace epmoe::gemm::detail {

template <class Cfg>
cudaError_t configure(int device) {
  constexpr int kSmem = Cfg::Layout::kAllocBytes;
  // Why per device and locked: the attribute belongs to the function in one device's context,
  // and layers on different devices may be created from different threads.
  static std::mutex mu;
  static std::vector<bool> done;
  if (device < 0) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(device) < done.size() && done[device]) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(sm90_grouped_gemm_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (e != cudaSuccess) return e;
  int blocks = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, sm90_grouped_gemm_kernel<Cfg>, kNumThreads, kSmem);
  if (e != cudaSuccess) return e;
  if (blocks < 1) return cudaErrorLaunchOutOfResources;
  if (done.size() <= size_t(device)) done.resize(size_t(device) + 1, false);
  done[device] = true;
  return cudaSuccess;
}

template <class Cfg>
cudaError_t launch(const CUtensorMap& a, const CUtensorMap& a64, const CUtensorMap& b, const CUtensorMap& d,
                   const GroupedGemmParams& p, int grid, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kNumThreads);
  cfg.dynamicSmemBytes = Cfg::Layout::kAllocBytes;
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, sm90_grouped_gemm_kernel<Cfg>, a, a64, b, d, p);
}

// Why 4 stages: 4 x 48.5 KB (FP8) or 4 x 48 KB (BF16) fills the 227 KB of smem.
template <bool kFp8>
using L1Config = Sm90GroupedGemmConfig<kFp8, Sm90Epilogue::kSwiGLUDeferred, 4>;
template <bool kFp8>
using L2Config = Sm90GroupedGemmConfig<kFp8, Sm90Epilogue::kStoreBf16Deferred, 4>;

template <bool kFp8>
cudaError_t configure_stage(GemmStage stage, int device) {
  return stage == GemmStage::kL1 ? configure<L1Config<kFp8>>(device) : configure<L2Config<kFp8>>(device);
}

template <bool kFp8>
cudaError_t launch_stage(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_a64,
                         const CUtensorMap& map_b, const CUtensorMap& map_d, const GroupedGemmParams& p, int grid,
                         cudaStream_t stream) {
  return stage == GemmStage::kL1 ? launch<L1Config<kFp8>>(map_a, map_a64, map_b, map_d, p, grid, stream)
                                 : launch<L2Config<kFp8>>(map_a, map_a64, map_b, map_d, p, grid, stream);
}

}  // namespace epmoe::gemm::detail
