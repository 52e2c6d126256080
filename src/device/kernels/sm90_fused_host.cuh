// Host halves of the fused kernel's launchers (sm90_fused_launch.h), written once for both
// dtypes; sm90_fused_fp8.cu and sm90_fused_bf16.cu instantiate them.
#pragma once

#include <mutex>
#include <vector>

#include "device/kernels/launch_cooperative.h"
#include "device/kernels/sm90_fused_moe.cuh"

namespace epmoe::fused {

template <bool kFp8>
cudaError_t configure_fused(int device, int* grid) {
  // Both variants have the same block, smem and so the same occupancy.
  using Cfg = FusedMoeConfig<kFp8, false>;
  static_assert(Cfg::kSmemBytes == FusedMoeConfig<kFp8, true>::kSmemBytes, "one grid serves both variants");
  // Why per device and locked: the attribute belongs to the function in one device's context,
  // and layers on different devices may be created from different threads.
  static std::mutex mu;
  static std::vector<int> grid_of;  // 0: not configured yet
  if (device < 0 || !grid) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(device) < grid_of.size() && grid_of[device] > 0) {
    *grid = grid_of[device];
    return cudaSuccess;
  }
  cudaError_t e = cudaFuncSetAttribute(sm90_fused_moe_kernel<kFp8, false>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(sm90_fused_moe_kernel<kFp8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  // The grid of a cooperative launch must be co-resident: SMs x the blocks per SM that the
  // occupancy API allows for this block size and smem (1 here). Every phase loops over its work
  // with a grid stride, so any such grid is correct.
  int per_sm = 0, per_sm_deferred = 0, sms = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sm90_fused_moe_kernel<kFp8, false>, Cfg::kThreads,
                                                    Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_deferred, sm90_fused_moe_kernel<kFp8, true>,
                                                    Cfg::kThreads, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  per_sm = per_sm < per_sm_deferred ? per_sm : per_sm_deferred;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorLaunchOutOfResources;
  if (grid_of.size() <= size_t(device)) grid_of.resize(size_t(device) + 1, 0);
  grid_of[device] = per_sm * sms;
  *grid = grid_of[device];
  return cudaSuccess;
}

template <bool kFp8>
cudaError_t launch_fused(const FusedMoeMaps& m, const FusedMoeParams& p, bool deferred, int grid,
                         cudaStream_t stream) {
  using Cfg = FusedMoeConfig<kFp8, false>;
  if (deferred)
    return launch_cooperative(sm90_fused_moe_kernel<kFp8, true>, grid, Cfg::kThreads, size_t(Cfg::kSmemBytes), stream,
                              m.a1, m.b1, m.a2, m.b2, m.a1_64, m.a2_64, m.d1, m.d2, m.b1_64, p);
  return launch_cooperative(sm90_fused_moe_kernel<kFp8, false>, grid, Cfg::kThreads, size_t(Cfg::kSmemBytes), stream,
                            m.a1, m.b1, m.a2, m.b2, m.a1_64, m.a2_64, m.d1, m.d2, m.b1_64, p);
}

}  // namespace epmoe::fused
