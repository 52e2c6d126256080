// BF16 grouped GEMM kernels: L1 (SwiGLU epilogue, bf16 activations) and L2 (bf16 store).
#include "device/kernels/sm90_gemm_host.cuh"

namespace epmoe::gemm::detail {

cudaError_t configure_sm90_grouped_gemm_bf16(GemmStage stage, int device) {
  return configure_stage<false>(stage, device);
}

cudaError_t launch_sm90_grouped_gemm_bf16(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_a64,
                                         const CUtensorMap& map_b, const CUtensorMap& map_d,
                                         const GroupedGemmParams& p, int grid, cudaStream_t stream) {
  return launch_stage<false>(stage, map_a, map_a64, map_b, map_d, p, grid, stream);
}

}  // namespace epmoe::gemm::detail
