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
  uint64_t evict_first = ptx::l2_policy_evict_first();  // see load_b

  // Loads every K block of every tile of this block, in the order the math warpgroups consume
  // them; each load waits (bounded) until the consumers released its stage.
  // `ready` (optional, the fused kernel): before a tile's first load, wait until
  // ready[tile.row0 / BLOCK_M] >= target + per_row x tile.rows_valid. The fused L2 passes its
  // L1 readiness counters (target: every L1 tile of those pool rows is stored, per_row 0), the
  // fused L1 the dispatch's arrival counters (target 0, per_row: the pull slices of one row).
  // b_first (with `ready`): when a tile's rows are not ready at the first look, its weights go
  // first: B of its first K blocks (up to one per stage) into stages as the consumers release them,
  // announced on each stage's full barrier without arriving; then the wait; then the stage's one
  // arrival with the rest of its bytes, and A (and the scales). Why the arrival after the wait:
  // the math threads' wait on that barrier is then ordered after this thread's acquire of the
  // rows, and so after what the writers released with them (the fused L1 epilogue reads the
  // pullers' row weights with plain loads). Why B-first at all: the weight stream (a decode call's
  // critical path) then starts while the rows arrive.
  __device__ void run(const uint32_t* ready = nullptr, uint32_t target = 0, uint32_t per_row = 0,
                      bool b_first = false) {
    ptx::prefetch_tensormap(tmap_a);
    ptx::prefetch_tensormap(tmap_b);
    const int num_k_blocks = p->k / kBlockK;
    scheduler::GemmTile tile;
    while (sched.next(tile)) {
      int kb = 0;
      if (ready) {
        const uint32_t* w = ready + tile.row0 / Scheduler::kTileM;
        const uint32_t need = target + per_row * uint32_t(tile.rows_valid);
        if (b_first && !is_ready(w, need)) {
          const pipeline::PipelineState<kStages> first = st;
          const int ahead = min(kStages, num_k_blocks);
          for (; kb < ahead; ++kb) issue_b(tile, kb);
          wait_or_report(w, need);
          pipeline::PipelineState<kStages> s = first;
          for (int j = 0; j < ahead; ++j, ++s) {
            uint64_t* full = pipe.producer_barrier(s);
            ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes - Layout::kTileB);
            issue_a(tile, j, full, s.index);
          }
        } else {
          wait_or_report(w, need);
        }
      }
      for (; kb < num_k_blocks; ++kb) issue(tile, kb);
    }
  }

 private:
  // Why a signed difference: see wait_ready.
  __device__ static bool is_ready(const uint32_t* w, uint32_t target) {
    return int32_t(ptx::ld_acquire_gpu(w) - target) >= 0;
  }
  __device__ void wait_or_report(const uint32_t* w, uint32_t target) {
    if (!wait_ready(w, target))
      pipeline::report_timeout(pipeline::WaitSite::kProducerReady, st.index, st.phase, sched.next_linear);
    // Why: the rows were written with generic stores and are read next by TMA (async proxy).
    ptx::fence_proxy_async_global();
  }

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

  // Loads K block kb of the tile into the next stage, once the consumers have released it.
  // Why not issue_a then load_b: that order (A, scales, B) changed the standalone kernels' SASS.
  __device__ void issue(const scheduler::GemmTile& tile, int kb) {
    uint64_t* full = take_stage();
    ptx::tma_load_2d(smem + Layout::a_offset(st.index), tmap_a, full, kb * kBlockK, tile.row0);
    load_b(tile, kb, full, st.index);
    if constexpr (kFp8)
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(st.index), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
    ++st;
  }
  // The same in two halves (b_first): B into the next stage now (its bytes announced, no arrival),
  // the arrival and A later.
  __device__ void issue_b(const scheduler::GemmTile& tile, int kb) {
    static_assert(Layout::kTxBytes > Layout::kTileB, "a stage holds more than its B tile");
    if (!pipe.producer_acquire(st))
      pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_expect_tx_relaxed_cta(full, Layout::kTileB);
    load_b(tile, kb, full, st.index);
    ++st;
  }
  __device__ uint64_t* take_stage() {
    if (!pipe.producer_acquire(st))
      pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes);
    return full;
  }
  __device__ void issue_a(const scheduler::GemmTile& tile, int kb, uint64_t* full, uint32_t stage) {
    ptx::tma_load_2d(smem + Layout::a_offset(stage), tmap_a, full, kb * kBlockK, tile.row0);
    if constexpr (kFp8)
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(stage), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
  }
  // The evict-first hint (p->weights_evict_first, set per call by the host) for an expert of one
  // m-block: its weight tile is read by this tile only, once. Why: in a one-token call the default
  // policy's weight stream pushed the data read again within microseconds (the GEMM outputs, the
  // L1 -> L2 rows) out of L2; with the hint the layer took 6 (pipeline) and 12 us (megakernel)
  // less at R = 1. Why not in every decode call: at 8-128 tokens it cost 2-8 us (docs/GEMM.md note 30).
  __device__ void load_b(const scheduler::GemmTile& tile, int kb, uint64_t* full, uint32_t stage) {
    const int32_t row = tile.expert * p->n + tile.n_block * kBlockN;
    if (p->weights_evict_first && sched.expert_m_blocks == 1)
      ptx::tma_load_2d_hint(smem + Layout::b_offset(stage), tmap_b, full, kb * kBlockK, row, evict_first);
    else
      ptx::tma_load_2d(smem + Layout::b_offset(stage), tmap_b, full, kb * kBlockK, row);
  }
};

}  // namespace epmoe::gemm
