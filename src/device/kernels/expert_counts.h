// The per-call expert counts (ForwardArgs::expert_counts / expert_counts_total): one tiny launch
// after a forward call copies the pool's expert counts out and adds them to a running sum.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epmoe::kernels {

// counts_out[e] = pool_counts[e] (if set); totals[e] += pool_counts[e] (if set), e < num_experts.
cudaError_t launch_expert_counts(const int32_t* pool_counts, int num_experts, int32_t* counts_out, int64_t* totals,
                                 cudaStream_t stream);

}  // namespace epmoe::kernels
