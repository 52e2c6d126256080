// One cooperative launch: every block of the grid is co-resident, so blocks may spin on each other
// (the standalone dispatch and combine, the fused megakernel). The caller sizes the grid so that it
// fits (occupancy API or at most one block per SM); cudaLaunchKernelEx refuses a grid that does not.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace epmoe {

template <class... KernelArgs, class... Args>
inline cudaError_t launch_cooperative(void (*kernel)(KernelArgs...), int grid, int threads, size_t smem_bytes,
                                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace epmoe
