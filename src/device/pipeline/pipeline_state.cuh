// Position in a ring of kStages smem stages: the stage index and the mbarrier phase parity.
// Why one type: the parity flips exactly when the index wraps, and nobody flips it by hand.
#pragma once

#include <cstdint>

namespace epmoe::pipeline {

template <int kStages>
struct PipelineState {
  static_assert(kStages >= 2, "a pipeline needs at least two stages to overlap load and compute");
  uint32_t index = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ PipelineState& operator++() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
    return *this;
  }
};

}  // namespace epmoe::pipeline
