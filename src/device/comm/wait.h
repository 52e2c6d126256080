// Bounded spin-waits. A peer that never arrives must not hang the job: after the timeout the waiter
// prints who waited on what (rank, block, thread, flag, expected, seen, how long) and traps.
// Why trap and not return: the other blocks and ranks are spinning on this one; unwinding them all
// cleanly is not possible, and a hang is worse than a dead context. The trap is fatal to the CUDA
// context: the host sees it as the launch's CUDA error at its next synchronization (check_errors
// says that a device-side wait may have timed out), and the printed line says which wait.
#pragma once

#include <cstdint>
#include <cstdio>

#include "device/comm/ptx_sync.h"
#include "device/comm/status_bits.h"

namespace epmoe::comm {

// Who is waiting: carried into the diagnostic.
struct WaitSite {
  int rank;
  uint64_t timeout_ns;
  uint32_t* status;  // the device status word; may be null
};

#ifndef EPMOE_COMM_WAIT_NO_PRINTF
[[noreturn]] __device__ __noinline__ inline void wait_timed_out(const WaitSite& site, const char* flag, int index,
                                                                 uint64_t expected, uint64_t seen,
                                                                 uint64_t waited_ns) {
  if (site.status) red_or_relaxed_gpu(site.status, kStatusTimeout);
  printf("[epmoe] TIMEOUT rank %d block %d thread %d: flag %s[%d] expected >= %llu, seen %llu after %llu ms "
         "(timeout %llu ms). Trapping: this CUDA context is lost. Likely a peer rank stalled, died, or issued "
         "dispatch/combine calls in a different order.\n",
         site.rank, int(blockIdx.x), int(threadIdx.x), flag, index, (unsigned long long)expected,
         (unsigned long long)seen, (unsigned long long)(waited_ns / 1000000ull),
         (unsigned long long)(site.timeout_ns / 1000000ull));
  // Why the fence: the printf record must be in memory before the trap tears the grid down.
  __threadfence_system();
  trap();
  __builtin_unreachable();
}
#else
// Kernels that also issue wgmma (the fused megakernel) define EPMOE_COMM_WAIT_NO_PRINTF before
// including this header. Why: any call in such a kernel, printf included, makes ptxas serialize
// every wgmma (warning C7510). The record goes to a device global (one per translation unit, as
// in pipeline/sm90_watchdog.cuh) that a debugger or core dump shows, then the grid traps.
struct CommTimeoutRecord {
  int rank, block, thread, index;
  unsigned long long expected, seen, waited_ns;
};
static __device__ CommTimeoutRecord g_comm_timeout;

[[noreturn]] __device__ __forceinline__ void wait_timed_out(const WaitSite& site, const char*, int index,
                                                            uint64_t expected, uint64_t seen, uint64_t waited_ns) {
  if (site.status) red_or_relaxed_gpu(site.status, kStatusTimeout);
  volatile CommTimeoutRecord* r = &g_comm_timeout;
  r->rank = site.rank;
  r->block = int(blockIdx.x);
  r->thread = int(threadIdx.x);
  r->index = index;
  r->expected = expected;
  r->seen = seen;
  r->waited_ns = waited_ns;
  __threadfence_system();
  trap();
  __builtin_unreachable();
}
#endif

// Waits until *p >= expected with system-scope acquire (the writer is on another GPU).
// Why relaxed polling: an acquire on every iteration orders (and stalls) the waiting SM's other
// memory traffic; polling relaxed and acquiring once when the value has arrived does not. Flags
// only grow, so the final acquire load still sees >= expected.
__device__ __forceinline__ uint64_t wait_geq_acquire_sys(const WaitSite& site, const uint64_t* p, uint64_t expected,
                                                         const char* flag, int index) {
  uint64_t seen = ld_acquire_sys(p);
  if (seen >= expected) return seen;
  const uint64_t start = globaltimer_ns();
  while ((seen = ld_relaxed_sys(p)) < expected) {
    const uint64_t waited = globaltimer_ns() - start;
    if (waited > site.timeout_ns) wait_timed_out(site, flag, index, expected, seen, waited);
  }
  return ld_acquire_sys(p);
}

}  // namespace epmoe::comm
