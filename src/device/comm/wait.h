// Bounded spin-waits. A peer that never arrives must not hang the job: after the timeout the first
// waiter of this rank to give up writes who waited on what (rank, block, thread, flag, expected,
// seen, how long) into the handle's layout::TimeoutRecord, which lives in mapped pinned host
// memory, and traps. Kernels that may printf also print the line.
// Why trap and not return: the other blocks and ranks are spinning on this one; unwinding them all
// cleanly is not possible, and a hang is worse than a dead context. The trap is fatal to the CUDA
// context, but host memory stays readable: the next forward (or check_errors) finds the record and
// returns it as a kTimeout Status (docs/COMM.md, "Errors and timeouts").
#pragma once

#include <cstdint>
#include <cstdio>

#include "device/comm/status_bits.h"
#include "device/layout/comm_layout.h"
#include "device/layout/error_record.h"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"

namespace epmoe::comm {

// Who is waiting: carried into the diagnostic. An aggregate: {rank, timeout, status} and
// {rank, timeout, status, record} both work.
struct WaitSite {
  int rank;
  uint64_t timeout_ns;
  uint32_t* status;                      // the device status word (CommLocalLayout); may be null
  layout::TimeoutRecord* record = nullptr;  // host-mapped; null: the one next to `status`, if any
};

namespace wait_detail {

__device__ __forceinline__ layout::TimeoutRecord* record_of(const WaitSite& site) {
  if (site.record || !site.status) return site.record;
  // Why: a site built from (rank, timeout, status) alone, as the fused kernel's grid barriers do,
  // still reaches the record: status points at the control words of the local workspace, whose
  // timeout_record slot the handle filled at create.
  const layout::CommLocalLayout loc{};
  const char* ws = reinterpret_cast<const char*>(site.status) - loc.status_offset();
  return *reinterpret_cast<layout::TimeoutRecord* const*>(ws + loc.timeout_record_offset());
}

}  // namespace wait_detail

#ifndef EPMOE_COMM_WAIT_NO_PRINTF
[[noreturn]] __device__ __noinline__ inline void wait_timed_out(const WaitSite& site, const char* flag, int index,
                                                                 uint64_t expected, uint64_t seen,
                                                                 uint64_t waited_ns) {
  volatile layout::TimeoutRecord* r = wait_detail::record_of(site);
  const bool reporter = layout::claim_timeout_report(site.status);
  if (r && !reporter) {
    layout::wait_for_reporter(&r->printed);
    ptx::trap();
    __builtin_unreachable();
  }
  if (r)
    layout::write_timeout_record(r, site.rank, layout::WaitRole::kComm, layout::WaitKind::kFlag,
                                 layout::GemmWait::kNone, flag, index, -1,
                                 expected, seen, waited_ns, site.timeout_ns);
  printf("[epmoe] TIMEOUT rank %d block %d thread %d (comm): flag %s[%d] expected >= %llu, seen %llu after %llu ms "
         "(timeout %llu ms). Trapping: this CUDA context is lost. Likely a peer rank stalled, died, or issued "
         "dispatch/combine calls in a different order.\n",
         site.rank, int(blockIdx.x), int(threadIdx.x), flag, index, (unsigned long long)expected,
         (unsigned long long)seen, (unsigned long long)(waited_ns / 1000000ull),
         (unsigned long long)(site.timeout_ns / 1000000ull));
  // Why the fence: the printf record must be in memory before the trap tears the grid down.
  __threadfence_system();
  if (r) {
    r->printed = 1u;
    __threadfence_system();
  }
  ptx::trap();
  __builtin_unreachable();
}
#else
// Kernels that also issue wgmma (the fused megakernel) define EPMOE_COMM_WAIT_NO_PRINTF before
// including this header. Why: any call in such a kernel, printf included, makes ptxas serialize
// every wgmma (warning C7510). So everything here is inlined and the record is the only output;
// the host prints it (check_errors).
[[noreturn]] __device__ __forceinline__ void wait_timed_out(const WaitSite& site, const char* flag, int index,
                                                            uint64_t expected, uint64_t seen, uint64_t waited_ns) {
  volatile layout::TimeoutRecord* r = wait_detail::record_of(site);
  const bool reporter = layout::claim_timeout_report(site.status);
  if (r) {
    if (reporter)
      layout::write_timeout_record(r, site.rank, layout::WaitRole::kComm, layout::WaitKind::kFlag,
                                 layout::GemmWait::kNone, flag, index, -1,
                                   expected, seen, waited_ns, site.timeout_ns);
    else
      layout::wait_for_reporter(&r->valid);
  }
  __threadfence_system();
  ptx::trap();
  __builtin_unreachable();
}
#endif

// Waits until *p >= expected with an acquire at system scope (kSys: the writer is on another
// GPU) or gpu scope (the writer is on this GPU).
// Why relaxed polling: an acquire on every iteration orders (and stalls) the waiting SM's other
// memory traffic; polling relaxed and acquiring once when the value has arrived does not. Flags
// only grow, so the final acquire load still sees >= expected.
template <bool kSys>
__device__ __forceinline__ uint64_t wait_geq_acquire(const WaitSite& site, const uint64_t* p, uint64_t expected,
                                                     const char* flag, int index) {
  const auto acquire = [p] { return kSys ? ptx::ld_acquire_sys(p) : ptx::ld_acquire_gpu_u64(p); };
  uint64_t seen = acquire();
  if (seen >= expected) return seen;
  const uint64_t start = ptx::globaltimer_ns();
  while ((seen = kSys ? ptx::ld_relaxed_sys(p) : ptx::ld_relaxed_gpu(p)) < expected) {
    const uint64_t waited = ptx::globaltimer_ns() - start;
    if (waited > site.timeout_ns) wait_timed_out(site, flag, index, expected, seen, waited);
  }
  return acquire();
}
__device__ __forceinline__ uint64_t wait_geq_acquire_sys(const WaitSite& site, const uint64_t* p, uint64_t expected,
                                                         const char* flag, int index) {
  return wait_geq_acquire<true>(site, p, expected, flag, index);
}
__device__ __forceinline__ uint64_t wait_geq_acquire_gpu(const WaitSite& site, const uint64_t* p, uint64_t expected,
                                                         const char* flag, int index) {
  return wait_geq_acquire<false>(site, p, expected, flag, index);
}

}  // namespace epmoe::comm
