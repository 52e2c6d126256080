// Standalone combine: each expert rank sums, per (source token), the rows of its local experts in
// slot order in fp32 and PUSHES that one partial sum to the source rank (fp32 or bf16); the source
// adds the partials of the expert ranks in rank order and writes y in bf16.
// Why pre-reduce: a token with k experts on one rank sends one row instead of k.
//
// Phases:
//   0  wait until every source finished reading the partials we pushed last call (epoch - 1)
//   A  partial sums -> source ranks' symmetric buffers; last block flags combine_ready and
//      advances the epoch
//   B  wait for every expert rank's partials; y[t] = bf16(sum over ranks with a valid slot)
//   C  last block: tell every expert rank we are done reading (skipped in the layer's calls:
//      the next dispatch does it, CombineParams::defer_done)
#include <cuda_runtime.h>

#include "device/comm/combine_phases.cuh"
#include "device/debug/diag_dump.h"
#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
#include "device/debug/diag_dump_impl.h"
#endif
#include "device/kernels/launch_cooperative.h"

namespace epmoe::comm {
namespace {

template <int kPartialBytes>
__global__ void __launch_bounds__(kCombineThreads, 1) sm90_combine_kernel(CombineParams p) {
  diag::trace_reset();
  combine_phases<kPartialBytes, kCombineThreads / 32>(p);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream) {
  const auto kernel = p.shape.partial_bytes == 4 ? sm90_combine_kernel<4> : sm90_combine_kernel<2>;
  return launch_cooperative(kernel, num_blocks, kCombineThreads, 0, stream, p);
}

}  // namespace epmoe::comm

#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
void epmoe::diag::dump_combine_trace(std::FILE* out) { detail::dump(out, "combine kernel", g_trace); }
#endif
