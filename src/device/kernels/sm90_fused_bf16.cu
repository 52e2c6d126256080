// The fused MoE megakernel, BF16 instantiation (sm90_fused_moe.cuh has the kernel).
#include "device/kernels/sm90_fused_host.cuh"

namespace epmoe::fused {

cudaError_t configure_sm90_fused_moe_bf16(int device, int* grid) { return configure_fused<false>(device, grid); }

cudaError_t launch_sm90_fused_moe_bf16(const FusedMoeMaps& maps, const FusedMoeParams& p, bool deferred, int grid,
                                      cudaStream_t stream) {
  return launch_fused<false>(maps, p, deferred, grid, stream);
}

}  // namespace epmoe::fused
