// The device state that a Workspace holds and that every layer and dispatch handle on it shares
// (not public API): the symmetric window, the local comm workspace (epochs, flags' partners,
// counters), the expert pool, the error record the kernels write, and the event that serializes
// calls issued on different streams.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "device/layout/comm_layout.h"
#include "device/layout/error_record.h"
#include "epmoe/comm.h"
#include "epmoe/status.h"

namespace epmoe::detail {

// What one state is allocated for. The region offsets follow `capacity` (layout::CommCapacity),
// so every shape laid out with it finds each region at the same place.
struct WorkspaceSpec {
  layout::CommShape shape;  // R, T_max and the largest shape (with shape.cap filled in)
  int64_t pool_bytes = 0;   // the expert pool; ignored when external_pool is set
  void* external_pool = nullptr;
  int num_blocks = 0;       // cap on the comm kernels' blocks (0: one per SM)
  double timeout_seconds = 10.0;
};

struct WorkspaceState {
  std::unique_ptr<Communicator> comm;  // a share of the caller's (CommAccess::share)
  layout::CommShape shape{};
  double timeout_seconds = 10.0;
  SymmetricBuffer* sym = nullptr;
  char* local_ws = nullptr;
  int64_t local_bytes = 0;
  char* pool = nullptr;
  int64_t pool_bytes = 0;
  bool owns_pool = false;
  int num_blocks = 0;           // blocks of the persistent comm kernels (at most one per SM)
  bool never_arrive = false;    // the never-arrive test hook names this rank, read once at create
  // What the kernels report without a sync (layout/error_record.h): mapped pinned host memory.
  layout::DeviceErrorRecord* record = nullptr;
  layout::DeviceErrorRecord* record_dev = nullptr;
  uint32_t routing_seq_reported = 0;
  bool timeout_printed = false;
  // Calls on this state are serialized: every call waits for the previous one's end.
  cudaEvent_t done_event = nullptr;
  bool has_last = false;
  // Layers alive on this state (each also holds shares through its dispatch handle, so the
  // shared_ptr's count is not the number of layers). Workspace::close refuses while it is > 0.
  std::atomic<int> num_layers{0};

  // Collective (frees the symmetric window with a bounded barrier).
  ~WorkspaceState();

  int64_t device_bytes() const { return int64_t(sym ? sym->bytes : 0) + local_bytes + (owns_pool ? pool_bytes : 0); }
  uint64_t timeout_ns() const { return uint64_t(timeout_seconds * 1e9); }
  uint32_t* status_word() const;
  std::string timeout_line();
  bool timeout_recorded() const;
  uint32_t take_routing(layout::RoutingRecord* out);
  // kTimeout with the record's line, else (with `routing`) the routing report not yet returned,
  // else Ok (no sync).
  Status take_device_error(bool routing = true);
  // Orders a call on `stream` after the previous call on this state (an event; external event
  // nodes under stream capture), and records the end of a call. `capturing`: whether `stream` is
  // capturing a graph (forward asks once per call).
  Status serialize(cudaStream_t stream, bool capturing);
  Status mark_end(cudaStream_t stream, bool capturing);
};

// Collective over `comm`: allocates what `spec` asks for (local allocations first, agreed across
// ranks; the symmetric window last) and zero-fills it. Every rank fails together.
Status create_workspace_state(Communicator& comm, const WorkspaceSpec& spec, std::shared_ptr<WorkspaceState>* out);

}  // namespace epmoe::detail

namespace epmoe {
class Workspace;
struct WorkspaceConfig;
namespace detail {
struct WorkspaceAccess {
  // Null once the workspace was closed.
  static const std::shared_ptr<WorkspaceState>& state(const Workspace& ws);
  // A Workspace over an existing state (the CPU tests build one with no device buffers behind it).
  static std::unique_ptr<Workspace> wrap(const WorkspaceConfig& cfg, std::shared_ptr<WorkspaceState> state);
};
// The room of a workspace of this config (layout::CommCapacity filled in) and its pool's bytes.
layout::CommShape workspace_shape(const WorkspaceConfig& c);
int64_t workspace_pool_bytes(const WorkspaceConfig& c);
}  // namespace detail
}  // namespace epmoe
