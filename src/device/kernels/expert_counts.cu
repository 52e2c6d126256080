// The per-call expert counts: see expert_counts.h.
#include "device/kernels/expert_counts.h"

namespace epmoe::kernels {
namespace {

// Why a kernel and not a copy: the running sum is an add, and one launch does both. The pool's
// counts were written by this call's dispatch, earlier on the same stream.
__global__ void expert_counts_kernel(const int32_t* __restrict__ pool_counts, int num_experts,
                                     int32_t* __restrict__ counts_out, long long* __restrict__ totals) {
  for (int e = int(blockIdx.x * blockDim.x + threadIdx.x); e < num_experts; e += int(gridDim.x * blockDim.x)) {
    const int32_t c = pool_counts[e];
    if (counts_out) counts_out[e] = c;
    if (totals) totals[e] += c;
  }
}

}  // namespace

cudaError_t launch_expert_counts(const int32_t* pool_counts, int num_experts, int32_t* counts_out, int64_t* totals,
                                 cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int blocks = (num_experts + kThreads - 1) / kThreads;
  expert_counts_kernel<<<blocks, kThreads, 0, stream>>>(pool_counts, num_experts, counts_out,
                                                        reinterpret_cast<long long*>(totals));
  return cudaGetLastError();
}

}  // namespace epmoe::kernels
