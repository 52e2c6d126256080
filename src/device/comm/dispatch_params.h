// Kernel parameters of the standalone dispatch and combine, shared by the host launcher and the
// kernels, plus the launch entry points (defined next to each kernel).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "device/comm/peers.h"
#include "device/layout/comm_layout.h"
#include "device/layout/error_record.h"
#include "device/layout/expert_pool.h"

namespace epmoe::comm {

// Optional phase stamps of the standalone kernels (benchmark only: DispatchParams / CombineParams
// ::phase_ts, nullptr otherwise): %globaltimer in ns, the start stored as ~t so that atomicMax keeps
// the earliest block's, every other stamp the latest block's (or warp's).
enum CommPhase : int {
  kDispatchStart,    // first block enters
  kDispatchStaged,   // last block past the phase-1 grid barrier (routing + staging done everywhere)
  kDispatchCounts,   // last block holding every source's counts (the cross-rank handshake)
  kDispatchPulled,   // last warp done pulling
  kCombineStart,
  kCombinePartials,  // last warp done with phase A (partials pushed)
  kCombineReady,     // last block holding every expert rank's combine_ready
  kCombineEnd,       // last warp done with phase B
  kCommPhaseCount
};

// Rows of the pool that no (token, slot) fills (segment padding) carry this source word.
inline constexpr uint32_t kInvalidRowSource = 0xFFFFFFFFu;

struct DispatchParams {
  layout::CommShape shape;
  int rank;
  const uint16_t* x;         // [T][H] bf16
  const void* topk_idx;      // [T][K] int32 or int64 (topk_idx_bytes)
  int topk_idx_bytes;        // 4 or 8
  const float* topk_w;       // [T][K]
  int num_tokens;            // T of this rank
  char* pool;                // laid out by pool_layout
  layout::ExpertPoolLayout pool_layout;
  layout::CommOffsets off;   // layout::comm_offsets(shape, pool_layout) (once, at create): what the kernels read
  PeerPtrs sym;              // the symmetric allocation on every rank (sym.ptr[rank] is ours)
  char* local_ws;            // CommLocalLayout
  bool pow2_scales;
  uint64_t timeout_ns;
  // Mapped pinned host memory (layout/error_record.h): where a wait that expires reports, and
  // where the first out-of-range expert index of a call is reported.
  layout::TimeoutRecord* timeout_record;
  layout::RoutingRecord* routing_record;
  unsigned long long* phase_ts;       // optional, [kCommPhaseCount] (see CommPhase)
};

struct CombineParams {
  layout::CommShape shape;
  int rank;
  const char* pool;          // reads o_pool
  layout::ExpertPoolLayout pool_layout;
  layout::CommOffsets off;   // layout::comm_offsets(shape, pool_layout)
  uint16_t* y;               // [T][H] bf16, T of the matching dispatch
  PeerPtrs sym;
  char* local_ws;
  uint64_t timeout_ns;
  layout::TimeoutRecord* timeout_record;  // the same record as the dispatch's
  unsigned long long* phase_ts;       // optional, [kCommPhaseCount] (see CommPhase)
  // 1: no phase C. The "done reading your partials" flags of this call are released by the next
  // dispatch on this workspace (at its start: the kernel boundary orders this call's reads before
  // it), so the kernel ends one arrival and one round of system-scope stores earlier. Only for
  // calls whose next call is ordered after them on the device: the layer's (it serializes its
  // calls), never the standalone combine().
  int defer_done;
};

inline constexpr int kCommThreads = 512;
// The standalone combine: 12 warps at up to 168 registers, because phase A keeps kRowsInFlight
// rows' loads in flight per warp (at 16 warps the 128-register cap spilled them).
inline constexpr int kCombineThreads = 384;

// Both launch cooperatively (every block co-resident: the kernels spin on each other).
cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream);

}  // namespace epmoe::comm
