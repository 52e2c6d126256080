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
  // `ready` (optional, the fused kernel's L2): before a tile's first load, wait until
  // ready[tile.row0 / BLOCK_M] >= target, i.e. every L1 tile of those pool rows is stored.
  __device__ void run(const uint32_t* ready = nullptr, uint32_t target = 0) {
    ptx::prefetch_tensormap(tmap_a);
    ptx::prefetch_tensormap(tmap_b);
    const int num_k_blocks = p->k / kBlockK;
    scheduler::GemmTile tile;
    while (sched.next(tile)) {
      if (ready) {
        if (!wait_ready(ready + tile.row0 / Scheduler::kTileM, target))
          pipeline::report_timeout(pipeline::WaitSite::kProducerReady, st.index, st.phase, sched.next_linear);
        // Why: the rows were written with generic stores and are read next by TMA (async proxy).
        ptx::fence_proxy_async_global();
      }
      for (int kb = 0; kb < num_k_blocks; ++kb) issue(tile, kb);
    }
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
};

}  // namespace epmoe::gemm
