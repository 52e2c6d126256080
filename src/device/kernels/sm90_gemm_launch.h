// Host-callable launchers of the sm90 grouped GEMM kernels (one translation unit per dtype keeps
// the heavy template instantiations apart). Called by src/host/gemm.cpp.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"

namespace epmoe::gemm::detail {

enum class GemmStage { kL1, kL2 };

// Sets the kernel's dynamic shared-memory attribute on `device` (which must be current) and
// checks that one block fits on an SM. Once per kernel and device (later calls return the first
// success at once); thread-safe. Call before the first launch on that device.
cudaError_t configure_sm90_grouped_gemm_fp8(GemmStage stage, int device);
cudaError_t configure_sm90_grouped_gemm_bf16(GemmStage stage, int device);

// Enqueues the kernel with cudaLaunchKernelEx and returns that call's result (no other CUDA
// call). grid = persistent block count (one per SM); A is [rows][k] with a 128-row x 128-byte
// box (map_a64: the same with a 64-row box, for tiles of at most 64 rows), B is [groups * n][k] with a 256-row x 128-byte box, both 128-byte swizzled; D (L2 only,
// unused by L1) is the output pool [rows][n] bf16 with a 64 x 64 box, 128-byte swizzled.
cudaError_t launch_sm90_grouped_gemm_fp8(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_a64,
                                         const CUtensorMap& map_b, const CUtensorMap& map_d,
                                         const GroupedGemmParams& p, int grid, cudaStream_t stream);
cudaError_t launch_sm90_grouped_gemm_bf16(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_a64,
                                          const CUtensorMap& map_b, const CUtensorMap& map_d,
                                          const GroupedGemmParams& p, int grid, cudaStream_t stream);

// W1 user layout [G][2I][H] -> internal [G][2I][H] with 128-row blocks ordered
// gate0, up0, gate1, up1, ...; FP8 scales [G][2I/128][H/128] follow the same block order.
// row_bytes = H * element size; scales may be null (BF16).
cudaError_t launch_w1_interleave(const void* w_user, void* w_internal, int num_groups, int inter,
                                 int64_t row_bytes, const float* s_user, float* s_internal, int k_blocks,
                                 cudaStream_t stream);

}  // namespace epmoe::gemm::detail
