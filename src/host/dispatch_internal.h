// Internal access to a DispatchHandle's kernel parameters (not public API): the fused layer path
// runs the dispatch and combine phases inside its own kernel and needs exactly the parameters the
// standalone launches build.
#pragma once

#include <cstdint>
#include <memory>

#include "device/comm/dispatch_params.h"
#include "device/layout/error_record.h"
#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "epmoe/status.h"
#include "host/workspace_internal.h"

namespace epmoe::detail {

struct DispatchAccess {
  // DispatchHandle::create with the checks a wrapper ran before it (the C ABI's conversion of its
  // config struct): `caller` joins create's first agreement, so a rank whose wrapper rejected its
  // arguments fails together with its peers, naming itself, instead of returning alone.
  static Status create(Communicator& comm, const DispatchConfig& cfg, const Status& caller,
                       std::unique_ptr<DispatchHandle>* out, void* external_pool = nullptr);
  // No checks: the caller has validated the call (validate_call) as dispatch() would.
  static comm::DispatchParams dispatch_params(const DispatchHandle& h, const void* x, const void* topk_idx,
                                              IndexType idx_type, const float* topk_weights, int64_t num_tokens);
  // DispatchHandle::dispatch with an int32 or int64 topk_idx.
  static Status dispatch_typed(DispatchHandle& h, const void* x, const void* topk_idx, IndexType idx_type,
                               const float* topk_weights, int64_t num_tokens, cudaStream_t stream);
  static comm::CombineParams combine_params(const DispatchHandle& h, void* y);
  // DispatchHandle::combine; defer_done (the layer, whose calls are ordered on the device): the done
  // flags are released by the next dispatch (comm::CombineParams::defer_done).
  static Status combine(DispatchHandle& h, void* y, int64_t num_tokens, cudaStream_t stream, bool defer_done);
  // Test builds: the never-arrive hook (detail::set_debug_never_arrive_rank) names this rank:
  // launch nothing (the fused path must honour it too). Always false in other builds.
  static bool never_arrive(const DispatchHandle& h);
  // Whether a bounded device wait of this handle's kernels has written its timeout record (mapped
  // host memory: readable without a sync, also after the trap killed the context).
  static bool timeout_recorded(const DispatchHandle& h);
  // What the kernels reported since the last call, read from host memory without a sync: kTimeout
  // with the record's line (the context is lost), else kInvalidArgument naming the first
  // out-of-range expert index of the latest call that had one (returned once), else Ok. With
  // `routing` false the routing report is left for a later call (only a timeout is returned).
  static Status take_device_error(DispatchHandle& h, bool routing = true);
  // The GEMM kernels' watchdog: this handle's timeout, error record, status word and rank, so a
  // pipeline wait reports where the comm waits do.
  static layout::WatchdogParams watchdog(const DispatchHandle& h);
  // The token count that a later combine() is checked against. The fused path dispatches without
  // dispatch(), so it records its own call here (-1: no dispatch this combine could pair with).
  static void set_last_tokens(DispatchHandle& h, int64_t num_tokens);
  // Benchmark only: device array of comm::kCommPhaseCount stamps that the standalone dispatch and
  // combine (and the fused path's comm phases) fill from then on (comm::CommPhase); nullptr: off.
  // The caller zeroes it before each call it wants to read and owns its memory.
  static void set_phase_stamps(DispatchHandle& h, unsigned long long* stamps);
  // A handle over an existing state (a Workspace's): allocates nothing on the device. The shape is
  // laid out with the state's capacity and T_max; the caller has checked that `cfg` fits it.
  // collective: first agree on `cfg` across ranks and validate it (every rank fails together).
  static Status create_on(std::shared_ptr<WorkspaceState> ws, const DispatchConfig& cfg,
                          std::unique_ptr<DispatchHandle>* out, bool collective);
  static const std::shared_ptr<WorkspaceState>& state(const DispatchHandle& h);
};

}  // namespace epmoe::detail
