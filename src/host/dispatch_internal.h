// Internal access to a DispatchHandle's kernel parameters (not public API): the fused layer path
// runs the dispatch and combine phases inside its own kernel and needs exactly the parameters the
// standalone launches build.
#pragma once

#include <cstdint>

#include "device/comm/dispatch_params.h"
#include "epmoe/dispatch.h"

namespace epmoe::detail {

struct DispatchAccess {
  // No checks: the caller has validated the call (validate_call) as dispatch() would.
  static comm::DispatchParams dispatch_params(const DispatchHandle& h, const void* x, const int32_t* topk_idx,
                                              const float* topk_weights, int64_t num_tokens);
  static comm::CombineParams combine_params(const DispatchHandle& h, void* y);
};

}  // namespace epmoe::detail
