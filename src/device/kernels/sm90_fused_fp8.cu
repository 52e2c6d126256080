// The fused MoE megakernel, FP8 instantiation (sm90_fused_moe.cuh has the kernel).
#include "device/kernels/sm90_fused_host.cuh"
#include "device/debug/diag_dump.h"
#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
#include "device/debug/diag_dump_impl.h"
#endif

namespace epmoe::fused {

cudaError_t configure_sm90_fused_moe_fp8(int device, int* grid) { return configure_fused<true>(device, grid); }

cudaError_t launch_sm90_fused_moe_fp8(const FusedMoeMaps& maps, const FusedMoeParams& p, bool deferred, int grid,
                                      cudaStream_t stream) {
  return launch_fused<true>(maps, p, deferred, grid, stream);
}

}  // namespace epmoe::fused

#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
void epmoe::diag::dump_fused_trace(std::FILE* out) { detail::dump(out, "FP8 megakernel", g_trace); }
void epmoe::diag::dump_fused_tiles(std::FILE* out) { detail::dump_tiles(out, "FP8 megakernel", g_tiles); }
#endif
