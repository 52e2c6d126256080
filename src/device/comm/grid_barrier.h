// A barrier across all blocks of a co-resident (cooperatively launched) grid.
#pragma once

#include <cstdint>

#include "device/comm/wait.h"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"

namespace epmoe::comm {

// `counter` is one zero-initialised word per kernel that uses it, never reset afterwards.
// Why the flip bit: block 0 adds 0x80000000 - (n - 1) and every other block adds 1, so the top bit
// flips exactly when all n blocks have arrived and the low bits return to where they were. No reset
// is needed between barriers or between calls, and grids of different sizes may share the word.
__device__ __forceinline__ void grid_barrier(uint32_t* counter, const WaitSite& site) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t n = gridDim.x;
    const uint32_t add = blockIdx.x == 0 ? 0x80000000u - (n - 1) : 1u;
    // Why sys: a later release by one block towards a peer GPU must cover the writes of every block.
    ptx::fence_acq_rel_sys();
    const uint32_t old = ptx::atom_add_acq_rel_gpu(counter, add);
    uint32_t seen = ptx::ld_acquire_gpu(counter);
    if (((seen ^ old) & 0x80000000u) == 0) {
      const uint64_t start = ptx::globaltimer_ns();
      while ((((seen = ptx::ld_acquire_gpu(counter)) ^ old) & 0x80000000u) == 0) {
        const uint64_t waited = ptx::globaltimer_ns() - start;
        // Reported as grid_barrier[grid size]: expected = the top bit it waits for, seen = the word.
        if (waited > site.timeout_ns)
          wait_timed_out(site, "grid_barrier", int(n), (old & 0x80000000u) ? 0 : 0x80000000u, seen, waited);
      }
    }
  }
  __syncthreads();
}

// The last block to call this (per kernel launch) gets true; the counter is left at zero for the next
// launch. Every block's earlier writes, remote ones included, are visible to the last block.
// One phase stamp (comm::CommPhase, the megakernel's FusedPhase), if stamps are on (ts non-null):
// %globaltimer into ts[phase] with atomicMax, so the latest caller's time stays; `first` stores
// the complement instead, which keeps the earliest caller's.
__device__ __forceinline__ void stamp_phase(unsigned long long* ts, int phase, bool first = false) {
  if (!ts) return;
  const unsigned long long t = ptx::globaltimer_ns();
  atomicMax(ts + phase, first ? ~t : t);
}

__device__ __forceinline__ bool arrive_is_last_block(uint32_t* counter) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();
    const uint32_t old = ptx::atom_add_acq_rel_gpu(counter, 1u);
    is_last = old == gridDim.x - 1;
    if (is_last) *counter = 0;  // Why plain: every other block has arrived and will not touch it again
  }
  __syncthreads();
  return is_last;
}

}  // namespace epmoe::comm
