// Standalone dispatch: every rank stages its tokens once (FP8-quantized or bf16) in its symmetric
// buffer, then every rank PULLS from each source the tokens routed to its local experts and writes
// them straight into its expert-major pool, one row per (token, slot) routed to a local expert.
// Why pull: a token crosses NVLink once per destination rank, and the destination fans it out to
// all its local experts from registers, so no second local pass over the pool is needed.
//
// Phases (docs/COMM.md has the full protocol):
//   -- last block: tell every expert rank we are done reading the last combine's partials (the
//      combine's phase C when that combine deferred it; a repeat is harmless)
//   0  wait until every destination finished pulling our previous staging (epoch - 1)
//   1  mask out-of-range experts, take row positions per (this source, expert), quantize/stage tokens
//   -- grid barrier; block 0 publishes per-destination counts and T, then flags dispatch_ready
//   2  wait for every source's counts; lay out expert segments (aligned to row_align)
//   3  pull tokens, write x_pool / x_scale / row_weight / row_source / token_rows
//   4  last block: tell every source we are done reading, reset cursors, advance the epoch
#include <cuda_runtime.h>

#include "device/comm/dispatch_phases.cuh"
#include "device/debug/diag_dump.h"
#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
#include "device/debug/diag_dump_impl.h"
#endif
#include "device/kernels/launch_cooperative.h"

namespace epmoe::comm {
namespace {

template <bool kFp8>
__global__ void __launch_bounds__(kCommThreads, 1) sm90_dispatch_kernel(DispatchParams p) {
  extern __shared__ int smem[];
  diag::trace_reset();
  dispatch_phases<kFp8, kCommThreads / 32>(p, smem);
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  const size_t smem = size_t(dispatch_smem_ints(p.shape)) * sizeof(int);
  if (p.shape.fp8) return launch_cooperative(sm90_dispatch_kernel<true>, num_blocks, kCommThreads, smem, stream, p);
  return launch_cooperative(sm90_dispatch_kernel<false>, num_blocks, kCommThreads, smem, stream, p);
}

}  // namespace epmoe::comm

#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
void epmoe::diag::dump_dispatch_trace(std::FILE* out) { detail::dump(out, "dispatch kernel", g_trace); }
#endif
