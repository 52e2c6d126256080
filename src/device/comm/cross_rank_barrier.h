// A barrier across ranks through symmetric memory, driven by a monotonically increasing epoch.
// Why an epoch instead of a counter that is reset: a fast rank entering call n+1 can never be
// confused with a slow rank still leaving call n, since each slot only ever grows.
#pragma once

#include <cstdint>

#include "device/comm/peers.h"
#include "device/comm/wait.h"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"

namespace epmoe::comm {

// Slot r of the array at `slots_offset` (R u64 in every rank's symmetric buffer) holds the last
// epoch rank r announced. Call from one whole block; every rank passes the same epoch sequence
// (1, 2, 3, ...). Writes made by this block before the call are visible to every peer after it.
__device__ __forceinline__ void cross_rank_barrier(const PeerPtrs& peers, int64_t slots_offset, int rank,
                                                   int num_ranks, uint64_t epoch, const WaitSite& site) {
  __syncthreads();
  const int r = threadIdx.x;
  if (r < num_ranks) {
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys(peers.at<uint64_t>(r, slots_offset) + rank, epoch);
    wait_geq_acquire_sys(site, peers.at<uint64_t>(rank, slots_offset) + r, epoch, "cross_rank_barrier", r);
  }
  __syncthreads();
}

}  // namespace epmoe::comm
