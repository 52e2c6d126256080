// Internal access to a DispatchHandle's kernel parameters (not public API): the fused layer path
// runs the dispatch and combine phases inside its own kernel and needs exactly the parameters the
// standalone launches build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device/comm/dispatch_params.h"
#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "epmoe/status.h"

namespace epmoe::detail {

struct DispatchAccess {
  // No checks: the caller has validated the call (validate_call) as dispatch() would.
  static comm::DispatchParams dispatch_params(const DispatchHandle& h, const void* x, const int32_t* topk_idx,
                                              const float* topk_weights, int64_t num_tokens);
  static comm::CombineParams combine_params(const DispatchHandle& h, void* y);
  // The never-arrive test hook (detail::set_debug_never_arrive_rank) names this rank: launch nothing (the fused path must honour it too).
  static bool never_arrive(const DispatchHandle& h);
  // Whether a bounded device wait of this handle's kernels has written its timeout record (mapped
  // host memory: readable without a sync, also after the trap killed the context).
  static bool timeout_recorded(const DispatchHandle& h);
  // The token count that a later combine() is checked against. The fused path dispatches without
  // dispatch(), so it records its own call here (-1: no dispatch this combine could pair with).
  static void set_last_tokens(DispatchHandle& h, int64_t num_tokens);
  // Benchmark only: device array of comm::kCommPhaseCount stamps that the standalone dispatch and
  // combine (and the fused path's comm phases) fill from then on (comm::CommPhase); nullptr: off.
  // The caller zeroes it before each call it wants to read and owns its memory.
  static void set_phase_stamps(DispatchHandle& h, unsigned long long* stamps);
};

// Collective over `comm` (every rank, same n, same order as other collective calls): gathers each
// rank's n words into all[rank * n + i]. Synchronizes the host. Used for create-time agreement.
Status all_gather_words(Communicator& comm, const int64_t* mine, int n, std::vector<int64_t>* all);

// "rank 3" or "ranks 0, 2" for messages.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace epmoe::detail
