// The TMA producer of the grouped GEMM: walks the tile sequence on its own scheduler copy and
// fills the stage ring one K block at a time. One thread owns it: thread 0 of the block, the only
// working thread of the producer warpgroup (sm90_grouped_gemm.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/tma.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

template <bool kFp8, int kStages, int kBlockK, class Layout, class Scheduler>
struct Sm90TmaProducer {
  using Pipe = pipeline::TmaPipeline<kStages>;
  const CUtensorMap* tmap_a;
  const CUtensorMap* tmap_b;
  const GroupedGemmParams* p;
  Pipe pipe;
  uint8_t* smem;
  Scheduler sched;
  pipeline::PipelineState<kStages> st{};

  // Loads every K block of every tile of this block, in the order the math warpgroups consume
  // them; each load waits (bounded) until the consumers released its stage.
  // `ready` (optional, the fused kernel's L2): before a tile's first A load, wait until
  // ready[tile.row0 / BLOCK_M] >= target, i.e. every L1 tile of those pool rows is stored. While
  // that count is short, the tile's weights (B), which do not depend on it, already go into the
  // stages as they free up (at most kStages K blocks), and its A tiles follow once the count is
  // there: the weight stream does not wait for the L1 tail of other blocks.
  // `preissued_b` (the fused kernel's L1): the first tile's first K blocks whose stage was already
  // taken and whose B load was issued during the dispatch (preissue_b); only A (and the FP8
  // scales) are loaded for them here.
  __device__ void run(const uint32_t* ready = nullptr, uint32_t target = 0, int preissued_b = 0) {
    ptx::prefetch_tensormap(tmap_a);
    ptx::prefetch_tensormap(tmap_b);
    const int num_k_blocks = p->k / kBlockK;
    scheduler::GemmTile tile;
    bool first = true;
    while (sched.next(tile)) {
      pipeline::PipelineState<kStages> st_b = st;  // where this tile's early B loads went
      int pre = first ? min(preissued_b, num_k_blocks) : 0;
      first = false;
      if (pre > 0) {
        for (int kb = 0; kb < pre; ++kb) ++st;
      }
      if (ready) {
        const uint32_t* w = ready + tile.row0 / Scheduler::kTileM;
        // Why one check per K block: once the rows are there, A must not wait behind further B loads.
        while (pre < min(num_k_blocks, kStages) && !is_ready(w, target)) issue_b(tile, pre++);
        if (!wait_ready(w, target))
          pipeline::report_timeout(pipeline::WaitSite::kProducerReady, st.index, st.phase, sched.next_linear);
        // Why: the rows were written with generic stores and are read next by TMA (async proxy).
        ptx::fence_proxy_async_global();
      }
      for (int kb = 0; kb < pre; ++kb) {
        issue_a(tile, kb, st_b);
        ++st_b;
      }
      for (int kb = pre; kb < num_k_blocks; ++kb) issue(tile, kb);
    }
  }

  // The fused kernel's L1, during the dispatch (the ring's B tiles are unused until then): takes
  // the first `count` stages of a fresh ring and loads K blocks 0..count-1 of the B tile at
  // weight row b_row into them; the full barrier of each expects the whole stage (A and the scales
  // follow in run(), which is told preissued_b = count). Returns false on a timeout.
  __device__ bool preissue_b(int b_row, int count) {
    for (int kb = 0; kb < count; ++kb) {
      if (!pipe.producer_acquire(st)) return false;
      uint64_t* full = pipe.producer_barrier(st);
      ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes);
      ptx::tma_load_2d(smem + Layout::b_offset(st.index), tmap_b, full, kb * kBlockK, b_row);
      ++st;
    }
    return true;
  }

 private:
  __device__ static bool wait_ready(const uint32_t* w, uint32_t target) {
    // Why a signed difference: the counters restart from 0 every call, but this stays right
    // even if they were ever allowed to wrap.
    if (int32_t(ptx::ld_acquire_gpu(w) - target) >= 0) return true;
    const uint64_t start = ptx::globaltimer_ns();
    while (int32_t(ptx::ld_acquire_gpu(w) - target) < 0) {
      if (ptx::globaltimer_ns() - start > pipeline::kWaitTimeoutNs) return false;
      // Why: this thread shares its SM sub-partition with math warps, and up to a grid of
      // producers polls counters that the math warpgroups' releases also hit.
      ptx::nanosleep(64);
    }
    return true;
  }

  __device__ static bool is_ready(const uint32_t* w, uint32_t target) {
    return int32_t(ptx::ld_acquire_gpu(w) - target) >= 0;
  }

  // Loads K block kb of the tile into the next stage, once the consumers have released it.
  __device__ void issue(const scheduler::GemmTile& tile, int kb) {
    if (!pipe.producer_acquire(st))
      pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes);
    ptx::tma_load_2d(smem + Layout::a_offset(st.index), tmap_a, full, kb * kBlockK, tile.row0);
    ptx::tma_load_2d(smem + Layout::b_offset(st.index), tmap_b, full, kb * kBlockK,
                     tile.expert * p->n + tile.n_block * kBlockN);
    if constexpr (kFp8)
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(st.index), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
    ++st;
  }
  // The first part of issue(): the stage, its whole expected byte count, and B.
  __device__ void issue_b(const scheduler::GemmTile& tile, int kb) {
    if (!pipe.producer_acquire(st))
      pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes);
    ptx::tma_load_2d(smem + Layout::b_offset(st.index), tmap_b, full, kb * kBlockK,
                     tile.expert * p->n + tile.n_block * kBlockN);
    ++st;
  }
  // The second part: A (and the FP8 scales) into a stage that issue_b or preissue_b opened.
  __device__ void issue_a(const scheduler::GemmTile& tile, int kb, const pipeline::PipelineState<kStages>& at) {
    load_a(tile, kb, at.index, pipe.producer_barrier(at));
  }
  __device__ void load_a(const scheduler::GemmTile& tile, int kb, uint32_t stage, uint64_t* full) {
    ptx::tma_load_2d(smem + Layout::a_offset(stage), tmap_a, full, kb * kBlockK, tile.row0);
    if constexpr (kFp8)
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(stage), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
  }
};

}  // namespace epmoe::gemm
