// FP8 e4m3 grouped GEMM kernels: L1 (SwiGLU + requant epilogue) and L2 (bf16 store).
#include "device/kernels/sm90_gemm_host.cuh"

namespace epmoe::gemm::detail {

cudaError_t configure_sm90_grouped_gemm_fp8(GemmStage stage, int device) {
  return configure_stage<true>(stage, device);
}

cudaError_t launch_sm90_grouped_gemm_fp8(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_a64,
                                         const CUtensorMap& map_b, const CUtensorMap& map_d,
                                         const GroupedGemmParams& p, int grid, cudaStream_t stream) {
  return launch_stage<true>(stage, map_a, map_a64, map_b, map_d, p, grid, stream);
}

}  // namespace epmoe::gemm::detail

#include "device/debug/diag_dump.h"
#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
#include "device/debug/diag_dump_impl.h"
void epmoe::diag::dump_gemm_tiles(std::FILE* out) { detail::dump_tiles(out, "FP8 GEMM kernels", g_tiles); }
#endif
