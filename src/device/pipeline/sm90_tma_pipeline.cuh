// The smem pipeline between one TMA producer thread and the math warps: per stage a "full"
// mbarrier (TMA transactions land on it) and an "empty" mbarrier (each consumer warp arrives
// once it no longer reads the stage). Every wait is bounded by the launch's watchdog bound; a
// timeout is reported by sm90_watchdog.cuh.
#pragma once

#include <cstdint>
#include <cstdio>

#include "device/layout/error_record.h"
#include "device/pipeline/pipeline_state.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/mbarrier.cuh"

namespace epmoe::pipeline {

// Waits for one mbarrier phase for at most the watchdog's bound (watchdog_timeout_ns); false on
// timeout.
// bar: the barrier's 32-bit shared-window address.
// kSuspendNs > 0, for waits that usually last long (a producer ahead of its consumers, the
// deferred epilogue's storer waiting for the next tile): each try suspends the thread for up to
// that long, so the waiting warp takes almost no issue slots from the math warps on its
// sub-partition. 0: each try returns at once (waits that are usually short).
inline constexpr uint32_t kSuspendHintNs = 20000;
template <uint32_t kSuspendNs>
__device__ __forceinline__ bool mbarrier_try_wait_once_s(uint32_t bar, uint32_t parity) {
  if constexpr (kSuspendNs > 0) return ptx::mbarrier_try_wait_parity_suspend_s(bar, parity, kSuspendNs);
  return ptx::mbarrier_try_wait_parity_acquire_cta_s(bar, parity);
}
template <uint32_t kSuspendNs = 0>
__device__ __forceinline__ bool mbarrier_wait_bounded_s(uint32_t bar, uint32_t parity) {
  if (mbarrier_try_wait_once_s<kSuspendNs>(bar, parity)) return true;
  const uint64_t start = ptx::globaltimer_ns();
  const uint64_t limit = watchdog_timeout_ns();
  while (!mbarrier_try_wait_once_s<kSuspendNs>(bar, parity)) {
    if (ptx::globaltimer_ns() - start > limit) return false;
  }
  return true;
}
__device__ __forceinline__ bool mbarrier_wait_bounded(uint64_t* bar, uint32_t parity) {
  return mbarrier_wait_bounded_s(ptx::smem_u32(bar), parity);
}

// The byte offset from the ring's barrier block (full[0]) of a u64 copy of the watchdog's bound,
// which init() writes: the K loops' wait (consumer_wait_flag) reads it at [bars_s + this], an
// immediate offset from an address the loop already holds, so the bound costs the loop's fast path
// nothing. Layouts keep these 8 bytes free (Sm90SmemLayout::kWatchdogOffset).
inline constexpr uint32_t kWatchdogBoundFromBars = 256;

template <int kStages>
struct TmaPipeline {
  static_assert(2 * kStages * 8 <= int(kWatchdogBoundFromBars), "the ring's barriers overlap the watchdog's bound");
  using State = PipelineState<kStages>;
  uint64_t* full;   // [kStages]
  uint64_t* empty;  // [kStages]
  uint32_t full_s;   // shared-window addresses of full[0] and empty[0] (the consumer side uses
  uint32_t empty_s;  // these: no generic-to-shared conversion in the math loop)

  // The ring whose 2 x kStages barriers start at `bars` (full, then empty); bars_s is the same
  // address in the shared window. Why passed in: callers derive it from dyn_smem_base_s (a
  // link-time constant plus the CTA's window bits), cheaper than a conversion of `bars`.
  __device__ __forceinline__ static TmaPipeline at(uint64_t* bars, uint32_t bars_s) {
    return TmaPipeline{bars, bars + kStages, bars_s, bars_s + uint32_t(kStages) * 8u};
  }

  // One thread, before the CTA-wide barrier that precedes any use. `watchdog`: the bound of every
  // wait of this launch and where a timeout reports (zero: the default bound, no record).
  __device__ void init(uint32_t consumer_arrivals, const layout::WatchdogParams& watchdog = {}) const {
    watchdog_init(watchdog);
    *reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(full) + kWatchdogBoundFromBars) = watchdog_timeout_ns();
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);  // the producer's arrive.expect_tx
      ptx::mbarrier_init(&empty[s], consumer_arrivals);
    }
    ptx::fence_mbarrier_init_release_cluster();
  }

  // Producer: wait until the consumers released the stage. A fresh barrier counts as released
  // for the parity before its first phase, hence phase ^ 1.
  // Returns false on timeout (see sm90_watchdog.cuh).
  __device__ __forceinline__ bool producer_acquire(const State& st) const {
    return mbarrier_wait_bounded_s<kSuspendHintNs>(ptx::smem_u32(&empty[st.index]), st.phase ^ 1u);
  }
  __device__ __forceinline__ uint64_t* producer_barrier(const State& st) const { return &full[st.index]; }

  // Returns false on timeout (see sm90_watchdog.cuh).
  __device__ __forceinline__ bool consumer_wait(const State& st) const { return consumer_wait(full_s, st); }
  // The same two consumer operations with the barrier block's shared-window address supplied by
  // the caller (the bars_s given to at()), for loops that keep that address live themselves.
  __device__ __forceinline__ bool consumer_wait(uint32_t bars_s, const State& st) const {
    return mbarrier_wait_bounded_s(bars_s + st.index * 8u, st.phase);
  }
  // The convergent form for K loops: returns 1 on timeout, and skips the wait when
  // `failed` is already set (ptx::mbarrier_wait_parity_acquire_cta_bounded_s).
  __device__ __forceinline__ uint32_t consumer_wait_flag(uint32_t bars_s, const State& st, uint32_t failed) const {
    return ptx::mbarrier_wait_parity_acquire_cta_bounded_s(bars_s + st.index * 8u, st.phase,
                                                           bars_s + kWatchdogBoundFromBars, failed);
  }
  // The same two with the stage known at compile time (the FP8 K loop over whole rings): the
  // barrier addresses are constant offsets from bars_s. `mark` (nonzero) is what a wait that
  // expires returns.
  template <uint32_t kStage>
  __device__ __forceinline__ static uint32_t consumer_wait_flag_at(uint32_t bars_s, uint32_t phase, uint32_t failed,
                                                                   uint32_t mark) {
    static_assert(kStage < uint32_t(kStages), "stage index within the ring");
    return ptx::mbarrier_wait_parity_acquire_cta_bounded_s(bars_s + kStage * 8u, phase, bars_s + kWatchdogBoundFromBars,
                                                           failed, mark);
  }
  // The wait of consumer_wait_flag_at after an early test (consumer_test_at) of the same phase.
  template <uint32_t kStage>
  __device__ __forceinline__ static uint32_t consumer_wait_tested_at(uint32_t bars_s, uint32_t phase, uint32_t failed,
                                                                    uint32_t ready, uint32_t mark) {
    static_assert(kStage < uint32_t(kStages), "stage index within the ring");
    return ptx::mbarrier_wait_parity_acquire_cta_bounded_tested_s(bars_s + kStage * 8u, phase,
                                                                  bars_s + kWatchdogBoundFromBars, failed, ready, mark);
  }
  template <uint32_t kStage>
  __device__ __forceinline__ static uint32_t consumer_test_at(uint32_t bars_s, uint32_t phase) {
    static_assert(kStage < uint32_t(kStages), "stage index within the ring");
    return ptx::mbarrier_test_wait_parity_acquire_cta_s(bars_s + kStage * 8u, phase);
  }
  template <uint32_t kStage>
  __device__ __forceinline__ static void consumer_release_at(uint32_t bars_s) {
    static_assert(kStage < uint32_t(kStages), "stage index within the ring");
    ptx::mbarrier_arrive_release_cta_s(bars_s + (uint32_t(kStages) + kStage) * 8u);
  }
  __device__ __forceinline__ void consumer_release(uint32_t bars_s, const State& st) const {
    ptx::mbarrier_arrive_release_cta_s(bars_s + uint32_t(kStages) * 8u + st.index * 8u);
  }
  // `count` arrivals at once: a warp that releases the stage for itself and for a warp of the other
  // math warpgroup which skips it (Sm90Fp8Mainloop::run with kCoverIdle).
  __device__ __forceinline__ void consumer_release(uint32_t bars_s, const State& st, uint32_t count) const {
    ptx::mbarrier_arrive_count_release_cta_s(bars_s + uint32_t(kStages) * 8u + st.index * 8u, count);
  }
  // Called by one lane of each consumer warp once the warp's reads of the stage are complete.
  __device__ __forceinline__ void consumer_release(const State& st) const {
    ptx::mbarrier_arrive_release_cta_s(empty_s + st.index * 8u);
  }
};

}  // namespace epmoe::pipeline
