// The TMA producer of the grouped GEMM: walks the tile sequence on its own scheduler copy and
// fills the stage ring one K block at a time. One thread owns it: thread 0 of the block, the only
// working thread of the producer warpgroup (sm90_grouped_gemm.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
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
  scheduler::GemmTile tile{};
  int kb = 0;
  bool has_tile = false;

  // Loads every K block of every tile of this block, in the order the math warpgroups consume
  // them; each load waits (bounded) until the consumers released its stage.
  __device__ void run() {
    ptx::prefetch_tensormap(tmap_a);
    ptx::prefetch_tensormap(tmap_b);
    has_tile = sched.next(tile);
    while (has_tile) issue_next();
  }

  // Loads the next K block of the tile sequence into the next stage, once the consumers have
  // released it. Does nothing after the last tile.
  __device__ void issue_next() {
    if (!has_tile) return;
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
    if (++kb == p->k / kBlockK) {
      kb = 0;
      has_tile = sched.next(tile);
    }
  }
};

}  // namespace epmoe::gemm
