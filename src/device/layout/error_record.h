// What the kernels report to the host without a synchronization: one DeviceErrorRecord per
// DispatchHandle (so per layer), in mapped pinned host memory. Two parts:
// - TimeoutRecord: the first bounded wait of this rank's kernels to expire (comm flags, grid and
//   cross-rank barriers, GEMM pipeline mbarriers, readiness counters) writes who waited on what,
//   then traps. Host memory stays readable after the trap has killed the CUDA context.
// - RoutingRecord: the first out-of-range expert index of a call (dispatch masks the slot and
//   goes on). A seqlock: only the device writes it; the host remembers the last sequence it
//   reported, so it never writes device-visible state and needs no launch to clear it.
// The host reads both with plain loads before each forward (MoELayer::forward) and after a failed
// sync (check_device_error). Plain data plus the device writers (under __CUDACC__), so host-only
// translation units, comm/ and pipeline/ all include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#ifdef __CUDACC__
#include "device/ptx/fence.cuh"
#endif

namespace epmoe::layout {

// The warp role whose wait expired.
enum class WaitRole : uint32_t { kComm = 0, kProducer = 1, kMath = 2, kStorer = 3 };
// What kind of word it waited on: a flag or counter that must reach `expected`, or an mbarrier
// phase of parity `expected` that never completed.
enum class WaitKind : uint32_t { kFlag = 0, kCounter = 1, kMbarrier = 2 };

// The GEMM pipelines' waits, by number (pipeline::WaitSite is this enum): the kernels store the
// number, the host names it, so no string is copied on the device (every report site is inlined
// into wgmma kernels, where a call would serialize the wgmma). kNone: the name is in `what`.
enum class GemmWait : uint32_t {
  kNone = 0,
  kProducerEmpty = 1,    // mbarrier empty[stage]: the producer waits for the consumers' release
  kConsumerFull = 2,     // mbarrier full[stage]: a math warpgroup waits for a stage's TMA loads
  kProducerReady = 3,    // counter mblock_ready[m]: the fused L2 producer waits for L1's tiles
  kEpilogueDrained = 4,  // mbarrier epilogue_drained: a math warpgroup waits for the storer
  kStorerStaged = 5,     // mbarrier epilogue_staged: the storer waits for a tile's output
  kProducerArrive = 6,   // counter mblock_arrive[m]: the fused L1 producer waits for pulled rows
  kSplitAmax = 7,        // counter split_exchange[pair]: a split L1 unit waits for its other half's amax
};

inline const char* gemm_wait_name(uint32_t site) {
  switch (GemmWait(site)) {
    case GemmWait::kProducerEmpty: return "empty";
    case GemmWait::kConsumerFull: return "full";
    case GemmWait::kProducerReady: return "mblock_ready";
    case GemmWait::kEpilogueDrained: return "epilogue_drained";
    case GemmWait::kStorerStaged: return "epilogue_staged";
    case GemmWait::kProducerArrive: return "mblock_arrive";
    case GemmWait::kSplitAmax: return "split_amax";
    default: return "unknown";
  }
}

inline constexpr int kWaitNameBytes = 32;
// The status word's bit that elects the one reporter of a timeout (atomics on mapped host memory
// are not atomic over PCIe, so the arbitration happens in device memory).
inline constexpr uint32_t kTimeoutClaimBit = 1u << 1;

struct TimeoutRecord {
  // 0 until the reporting thread has written every field below; then 1 (written last, after a
  // system-scope fence, so a host that sees 1 sees the whole record).
  uint32_t valid;
  uint32_t printed;  // 1: the kernel also printed the line (kernels that may printf)
  int32_t rank, block, thread, index;
  uint32_t role;  // WaitRole
  uint32_t kind;  // WaitKind
  int32_t tile;   // GEMM waits: the linear tile of the role; -1 otherwise
  uint32_t site;  // GemmWait; kNone: the name is in `what`
  uint64_t expected, seen, waited_ns, timeout_ns;
  char what[kWaitNameBytes];  // the word's name, NUL-terminated (truncated if longer)
};

struct RoutingRecord {
  // Odd while the device writes, even when complete; +2 per report.
  uint32_t seq;
  int32_t rank;
  int32_t token, slot, value, num_experts;
  uint64_t call;  // the dispatch epoch: 1 for the handle's first call
};

struct DeviceErrorRecord {
  TimeoutRecord timeout;
  RoutingRecord routing;
};

// What a GEMM kernel's watchdog needs (GroupedGemmParams::watchdog): the bound of its waits and
// where to report. Zero-initialised: the default bound, no record (trap only).
struct WatchdogParams {
  uint64_t timeout_ns;     // 0: pipeline::kDefaultWaitTimeoutNs
  TimeoutRecord* record;   // mapped host memory; null: trap without a record
  uint32_t* status;        // the device status word that elects the reporter; may be null
  int32_t rank;
#ifdef EPMOE_TEST_HOOKS
  // Test builds only: the TMA producer issues nothing, so the math warpgroups' (and the
  // storer's) stage waits expire (detail::set_debug_stall_gemm_rank).
  int32_t debug_stall;
#endif
};

inline const char* wait_role_name(uint32_t role) {
  switch (WaitRole(role)) {
    case WaitRole::kComm: return "comm";
    case WaitRole::kProducer: return "GEMM producer";
    case WaitRole::kMath: return "GEMM math";
    case WaitRole::kStorer: return "GEMM storer";
  }
  return "unknown role";
}

// One line; the kernels' printf (comm/wait.h) uses the same words, so logs and Status messages
// read alike: "[epmoe] TIMEOUT rank 1 block 3 thread 0 (comm): flag dispatch_ready[0] expected >=
// 42, seen 41 after 10000 ms (timeout 10000 ms)".
inline int format_timeout_record(const TimeoutRecord& r, char* out, size_t size) {
  char what[kWaitNameBytes];
  for (int i = 0; i < kWaitNameBytes; ++i) what[i] = r.what[i];
  what[kWaitNameBytes - 1] = '\0';
  if (GemmWait(r.site) != GemmWait::kNone) std::snprintf(what, sizeof(what), "%s", gemm_wait_name(r.site));
  char tile[32] = "";
  if (r.tile >= 0) std::snprintf(tile, sizeof(tile), " (tile %d)", int(r.tile));
  const auto ms = [](uint64_t ns) { return static_cast<unsigned long long>(ns / 1000000ull); };
  if (WaitKind(r.kind) == WaitKind::kMbarrier)
    return std::snprintf(out, size,
                         "[epmoe] TIMEOUT rank %d block %d thread %d (%s): mbarrier %s[%d]%s: the phase of parity "
                         "%llu never completed after %llu ms (timeout %llu ms)",
                         int(r.rank), int(r.block), int(r.thread), wait_role_name(r.role), what, int(r.index), tile,
                         static_cast<unsigned long long>(r.expected), ms(r.waited_ns), ms(r.timeout_ns));
  return std::snprintf(out, size,
                       "[epmoe] TIMEOUT rank %d block %d thread %d (%s): %s %s[%d]%s expected >= %llu, seen %llu "
                       "after %llu ms (timeout %llu ms)",
                       int(r.rank), int(r.block), int(r.thread), wait_role_name(r.role),
                       WaitKind(r.kind) == WaitKind::kCounter ? "counter" : "flag", what, int(r.index), tile,
                       static_cast<unsigned long long>(r.expected), static_cast<unsigned long long>(r.seen),
                       ms(r.waited_ns), ms(r.timeout_ns));
}

inline int format_routing_record(const RoutingRecord& r, char* out, size_t size) {
  return std::snprintf(out, size,
                       "rank %d: forward call %llu had topk_idx[%d][%d]=%d outside [-1, %d) (the first bad slot of "
                       "that call; its bad slots were treated as masked)",
                       int(r.rank), static_cast<unsigned long long>(r.call), int(r.token), int(r.slot), int(r.value),
                       int(r.num_experts));
}

#ifdef __CUDACC__
// How long a thread that timed out second gives the first one to finish its record (and line)
// before trapping. Why bounded: the reporter may itself be stuck behind a dead PCIe link.
inline constexpr uint64_t kReportGraceNs = 200ull * 1000 * 1000;

// True for the first thread of this rank's kernels to time out (status null: every caller).
__device__ __forceinline__ bool claim_timeout_report(uint32_t* status) {
  if (!status) return true;
  return (atomicOr(status, kTimeoutClaimBit) & kTimeoutClaimBit) == 0;
}

// Everything but `valid` and `printed`, then `valid` after a system-scope fence. The name: `site`
// (GEMM waits), else the string `what` (comm waits).
__device__ __forceinline__ void write_timeout_record(volatile TimeoutRecord* r, int rank, WaitRole role,
                                                     WaitKind kind, GemmWait site, const char* what, int index,
                                                     int tile, uint64_t expected, uint64_t seen, uint64_t waited_ns,
                                                     uint64_t timeout_ns) {
  r->rank = rank;
  r->block = int(blockIdx.x);
  r->thread = int(threadIdx.x);
  r->index = index;
  r->role = uint32_t(role);
  r->kind = uint32_t(kind);
  r->tile = tile;
  r->site = uint32_t(site);
  r->expected = expected;
  r->seen = seen;
  r->waited_ns = waited_ns;
  r->timeout_ns = timeout_ns;
  int i = 0;
  // Why not unrolled: this is inlined at every wait site of the fused kernel (cold code).
#pragma unroll 1
  for (; what && i < kWaitNameBytes - 1 && what[i]; ++i) r->what[i] = what[i];
  r->what[i] = '\0';
  // Why the fence before `valid`: a host that reads valid == 1 must see every field.
  __threadfence_system();
  r->valid = 1u;
  __threadfence_system();
}

// A thread that lost the claim waits (bounded) until the reporter has set *done, so that its own
// trap does not tear the grid down while the record is half written.
__device__ __forceinline__ void wait_for_reporter(const volatile uint32_t* done) {
  const uint64_t start = ptx::globaltimer_ns();
  while (*done == 0u && ptx::globaltimer_ns() - start < kReportGraceNs) {
  }
}

// The first bad slot of a call: the seqlock's writer. Calls of one handle never overlap (the
// stream orders them, and the layer serializes streams), and one thread per call writes.
__device__ __forceinline__ void write_routing_record(volatile RoutingRecord* r, int rank, uint64_t call, int token,
                                                     int slot, int value, int num_experts) {
  const uint32_t seq = r->seq;
  r->seq = seq | 1u;
  __threadfence_system();
  r->rank = rank;
  r->call = call;
  r->token = token;
  r->slot = slot;
  r->value = value;
  r->num_experts = num_experts;
  __threadfence_system();
  r->seq = (seq | 1u) + 1u;
  __threadfence_system();
}
#endif  // __CUDACC__

}  // namespace epmoe::layout
