// The fused MoE megakernel, BF16 instantiation (sm90_fused_moe.cuh has the kernel).
#include "device/kernels/sm90_fused_host.cuh"

namespace epmoe::fused {

cudaError_t configure_sm90_fused_moe_bf16(int device, int* grid) { return configure_fused<false>(device, grid); }

cudaError_t launch_sm90_fused_moe_bf16(const CUtensorMap& a1, const CUtensorMap& b1, const CUtensorMap& a2,
                                      const CUtensorMap& b2, const FusedMoeParams& p, int grid, cudaStream_t stream) {
  return launch_fused<false>(a1, b1, a2, b2, p, grid, stream);
}

}  // namespace epmoe::fused
