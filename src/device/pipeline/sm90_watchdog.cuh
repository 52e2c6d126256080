// What a bounded pipeline wait does when it expires: record who waited on what in the layer's
// host-visible layout::TimeoutRecord (the same record, and the same first-reporter election, as
// the comm waits), then trap. The bound and the record come from the launch's
// layout::WatchdogParams, which thread 0 copies into shared memory before the block's first
// barrier (TmaPipeline::init); waits read it only once their first probe failed.
//
// Why no printf by default: any function call (printf is one) in a kernel that issues wgmma
// makes ptxas serialize the whole wgmma pipeline (warning C7510), at any position in the kernel.
// The host prints the record (the next forward or check_device_error). Build with
// -DEPMOE_GEMM_TIMEOUT_PRINTF to also print it from the kernel (slower kernels, for debugging).
#pragma once

#include <cstdint>
#include <cstdio>

#include "device/layout/error_record.h"
#include "device/ptx/fence.cuh"

namespace epmoe::pipeline {

// The bound when the launch gives none (WatchdogParams::timeout_ns == 0: the standalone gemm::
// calls). Why 10 s: a healthy stage turns over in microseconds; only a bug (a lost arrive, a TMA
// that faults) waits this long, and trapping beats hanging the GPU for everyone.
inline constexpr uint64_t kDefaultWaitTimeoutNs = 10ull * 1000 * 1000 * 1000;

// Where a pipeline wait waits: layout::GemmWait (the record stores the number).
using WaitSite = layout::GemmWait;

// The block's copy of its launch's WatchdogParams.
struct Watchdog {
  uint64_t timeout_ns;
  layout::TimeoutRecord* record;
  uint32_t* status;
  int32_t rank;
  int32_t stall;  // test builds: the producer issues nothing (WatchdogParams::debug_stall)
};
// One per kernel that uses it (whole-program compilation); 32 bytes of static smem.
static __shared__ Watchdog s_watchdog;

// Thread 0, before the block's first barrier.
__device__ __forceinline__ void watchdog_init(const layout::WatchdogParams& w) {
  s_watchdog.timeout_ns = w.timeout_ns ? w.timeout_ns : kDefaultWaitTimeoutNs;
  s_watchdog.record = w.record;
  s_watchdog.status = w.status;
  s_watchdog.rank = w.rank;
#ifdef EPMOE_TEST_HOOKS
  s_watchdog.stall = w.debug_stall;
#else
  s_watchdog.stall = 0;
#endif
}

// Volatile: read where the slow path needs it, never hoisted into a wait's fast path.
__device__ __forceinline__ uint64_t watchdog_timeout_ns() {
  return *static_cast<const volatile uint64_t*>(&s_watchdog.timeout_ns);
}
// Test builds: whether the producers of this launch must issue nothing.
__device__ __forceinline__ bool watchdog_stall() {
#ifdef EPMOE_TEST_HOOKS
  return *static_cast<const volatile int32_t*>(&s_watchdog.stall) != 0;
#else
  return false;
#endif
}

namespace watchdog_detail {

__device__ __forceinline__ layout::WaitRole role_of(WaitSite site) {
  switch (site) {
    case WaitSite::kProducerEmpty:
    case WaitSite::kProducerReady:
    case WaitSite::kProducerArrive: return layout::WaitRole::kProducer;
    case WaitSite::kStorerStaged: return layout::WaitRole::kStorer;
    default: return layout::WaitRole::kMath;
  }
}

[[noreturn]] __device__ __forceinline__ void report(WaitSite site, layout::WaitKind kind, int index, int tile,
                                                    uint64_t expected, uint64_t seen) {
  const Watchdog w = *const_cast<const Watchdog*>(static_cast<volatile Watchdog*>(&s_watchdog));
  volatile layout::TimeoutRecord* r = w.record;
  const bool reporter = layout::claim_timeout_report(w.status);
  if (r) {
    if (reporter)
      layout::write_timeout_record(r, w.rank, role_of(site), kind, site, nullptr, index, tile, expected, seen,
                                   w.timeout_ns, w.timeout_ns);
    else
      layout::wait_for_reporter(&r->valid);
  }
#ifdef EPMOE_GEMM_TIMEOUT_PRINTF
  printf("[epmoe] TIMEOUT rank %d block %d thread %d (%s): %s[%d] (tile %d) expected %llu, seen %llu after %llu ms\n",
         int(w.rank), int(blockIdx.x), int(threadIdx.x), layout::wait_role_name(uint32_t(role_of(site))),
         layout::gemm_wait_name(uint32_t(site)), index, tile, (unsigned long long)expected, (unsigned long long)seen,
         (unsigned long long)(w.timeout_ns / 1000000ull));
#endif
  __threadfence_system();
  ptx::trap();
  __builtin_unreachable();
}

}  // namespace watchdog_detail

// An mbarrier wait that expired: the phase of `parity` of barrier `stage` at `site` never
// completed while the role worked on linear tile `tile`.
__device__ __forceinline__ void report_timeout(WaitSite site, uint32_t stage, uint32_t parity, int tile) {
  watchdog_detail::report(site, layout::WaitKind::kMbarrier, int(stage), tile, parity, parity ^ 1u);
}

// A counter wait that expired: counter site[index] stayed below `expected` (last seen `seen`).
__device__ __forceinline__ void report_counter_timeout(WaitSite site, int index, uint64_t expected, uint64_t seen,
                                                       int tile) {
  watchdog_detail::report(site, layout::WaitKind::kCounter, index, tile, expected, seen);
}

}  // namespace epmoe::pipeline
