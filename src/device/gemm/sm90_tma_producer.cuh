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

// kSplitN (the megakernel's FP8 decode L1 only): with `split`, each tile of the scheduler is half of
// an L1 tile (a split unit: scheduler n_block 2 j + h is half h of tile j): its stages carry 64 gate
// rows (W1 rows 256 j + 64 h ..., B rows 0-63 of the stage) and the 64 matching up rows (256 j + 128
// + 64 h ..., B rows 64-127), loaded as two 64-row boxes of tmap_b64, and tile j's weight scales.
// A split unit of at most 64 rows carries two K blocks per stage (k_step): kb in A rows 0-63, B rows
// 0-127 and activation scale rows 0-63, kb + 1 in A rows 64-127, B rows 128-255 and scale rows
// 64-127, the weight scales (gate, up) of kb then kb + 1; a stage then lands a whole stage's bytes.
// Why: with one K block per stage a half unit's stage carried 24 KB instead of a tile's 40, and the
// layer was slower at every point measured (docs/DESIGN.md); a block's weight stream follows its
// bytes in flight. A split unit of more than 64 rows (both math warpgroups) keeps one K block per
// stage: its A rows fill the stage.
template <bool kFp8, int kStages, int kBlockK, class Layout, class Scheduler, bool kSplitN = false>
struct Sm90TmaProducer {
  using Pipe = pipeline::TmaPipeline<kStages>;
  const CUtensorMap* tmap_a;
  const CUtensorMap* tmap_b;
  // The activations with a 64-row box: a tile of at most 64 valid rows loads only its first 64 A
  // rows. Why that is enough: the second math warpgroup skips such a tile (sm90_math_tiles: idle),
  // so rows 64-127 of the stage are never read; the 128-byte swizzle repeats every 8 rows, so the
  // 64 rows land where the 128-row box puts them.
  const CUtensorMap* tmap_a64;
  const GroupedGemmParams* p;
  Pipe pipe;
  uint8_t* smem;
  Scheduler sched;
  pipeline::PipelineState<kStages> st{};
  uint64_t evict_first = ptx::l2_policy_evict_first();  // see load_b
  // Claimed tiles (run): the counter, the last index taken, the K block at which the next is taken
  // (-1: none); and a published tile's index until its first stage carries it.
  uint32_t* claim_ctr = nullptr;
  int claimed = 0;
  int claim_kb = -1;
  uint32_t publish = kNoMoreTiles;
  // kSplitN: W1 with 64-row boxes, and whether this call's L1 runs split units (see above).
  const CUtensorMap* tmap_b64 = nullptr;
  bool split = false;

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
  // `publish_tiles` (the fused kernel): the tile sequence is this thread's to choose, and the math
  // warpgroups learn it from the claim slots: each tile's linear index goes into the slot of the
  // stage that carries its first K block (written after the stage was acquired, published by the
  // stage's arrival), and after the last tile one more stage carries kNoMoreTiles and no bytes
  // (sm90_math_tiles with from_slots). The sequence is the static order (block b: tiles b,
  // b + grid, ...) unless `claim` is given: then block b's first tile is still tile b, and each
  // later one is grid + the next value of that grid-wide counter. The next claim is taken while the
  // current tile's K block num_k_blocks - kStages is issued, when the ring holds about one ring of
  // work for the math warpgroups: late enough that a block does not commit to a tile long before it
  // can start it, early enough that the atomic's latency hides behind the ring. Why claims: a block
  // that left the dispatch late, or would have had one tile more in the static order, no longer
  // ends the GEMMs late. Why the first tile static: when every block claimed its first tile, the
  // grid's atomics on one word at the same moment cost a one-token call ~4 us (measured at R = 1).
  __device__ void run(const uint32_t* ready = nullptr, uint32_t target = 0, uint32_t per_row = 0,
                      bool b_first = false, bool publish_tiles = false, uint32_t* claim = nullptr) {
    // Test builds: the stall hook issues nothing, so this block's consumers time out.
    if (pipeline::watchdog_stall()) return;
    ptx::prefetch_tensormap(tmap_a);
    ptx::prefetch_tensormap(tmap_a64);
    ptx::prefetch_tensormap(tmap_b);
    if constexpr (kSplitN) {
      if (split) ptx::prefetch_tensormap(tmap_b64);
    }
    const int num_k_blocks = p->k / kBlockK;
    scheduler::GemmTile tile;
    claim_ctr = claim;
    if (claim) claimed = int(blockIdx.x);
    while (claim ? sched.seek(claimed, tile) : sched.next(tile)) {
      if (publish_tiles) publish = uint32_t(sched.next_linear);
      if (claim) claim_kb = max(0, num_k_blocks - kStages);
      int kb = 0;
      if (ready) {
        const uint32_t* w = ready + tile.row0 / Scheduler::kTileM;
        const uint32_t need = target + per_row * uint32_t(tile.rows_valid);
        if (b_first && !is_ready(w, need)) {
          const pipeline::PipelineState<kStages> first = st;
          const int step = k_step(tile);
          const int ahead = min(kStages, num_k_blocks / step);
          for (int j = 0; j < ahead; ++j, kb += step) issue_b(tile, kb);
          wait_or_report(ready, w, need, per_row);
          pipeline::PipelineState<kStages> s = first;
          for (int j = 0; j < ahead; ++j, ++s) {
            uint64_t* full = pipe.producer_barrier(s);
            store_weight_scales(tile, j * step, s.index);
            ptx::mbarrier_arrive_expect_tx_release_cta(full, Layout::kTxBytes - Layout::kTileB - a_bytes_skipped(tile));
            issue_a(tile, j * step, full, s.index);
          }
        } else {
          wait_or_report(ready, w, need, per_row);
        }
      }
      if constexpr (kSplitN) {
        if (k_step(tile) == 2) {
          for (; kb < num_k_blocks; kb += 2) issue(tile, kb);
          continue;
        }
      }
      for (; kb < num_k_blocks; ++kb) issue(tile, kb);
    }
    if (publish_tiles) {
      // The end mark: a stage with no bytes whose slot says so; the math warpgroups release it.
      // Why not acquire_stage: its publish check here changed the fused kernels' scheduling
      // elsewhere (the L1 epilogue), 0.3-0.6% slower at 4096-8192 tokens in one call.
      if (!pipe.producer_acquire(st))
        pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
      ptx::st_shared_u32(smem_s() + Layout::claim_slot(st.index), kNoMoreTiles);
      ptx::mbarrier_arrive_release_cta_s(ptx::smem_u32(pipe.producer_barrier(st)));
      ++st;
    }
  }

 private:
  // Why a signed difference: see wait_ready.
  __device__ static bool is_ready(const uint32_t* w, uint32_t target) {
    return int32_t(ptx::ld_acquire_gpu(w) - target) >= 0;
  }
  // w: ready + the tile's m-block (reported as its index); per_row > 0: the dispatch's arrival
  // counters (fused L1), else L1's readiness counters (fused L2).
  __device__ void wait_or_report(const uint32_t* ready, const uint32_t* w, uint32_t target, uint32_t per_row) {
    if (!wait_ready(w, target))
      pipeline::report_counter_timeout(per_row ? pipeline::WaitSite::kProducerArrive : pipeline::WaitSite::kProducerReady,
                                       int(w - ready), target, ptx::ld_acquire_gpu(w), sched.next_linear);
    // Why: the rows were written with generic stores and are read next by TMA (async proxy).
    ptx::fence_proxy_async_global();
  }

  __device__ static bool wait_ready(const uint32_t* w, uint32_t target) {
    // Why a signed difference: the counters restart from 0 every call, but this stays right
    // even if they were ever allowed to wrap.
    if (is_ready(w, target)) return true;
    const uint64_t start = ptx::globaltimer_ns();
    const uint64_t limit = pipeline::watchdog_timeout_ns();
    while (!is_ready(w, target)) {
      if (ptx::globaltimer_ns() - start > limit) return false;
      // Why: this thread shares its SM sub-partition with math warps, and up to a grid of
      // producers polls counters that the math warpgroups' releases also hit.
      ptx::nanosleep(64);
    }
    return true;
  }

  // Loads K block kb of the tile into the next stage, once the consumers have released it.
  // Why not issue_a then load_b: that order (A, scales, B) changed the standalone kernels' SASS.
  // FP8: the bytes are announced first, the stage's one arrival comes last, after the weight scales
  // were stored (its release makes them visible to the math threads' acquire of the phase).
  __device__ void issue(const scheduler::GemmTile& tile, int kb) {
    claim_next(kb);
    uint64_t* full;
    if constexpr (kFp8) {
      acquire_stage();
      full = pipe.producer_barrier(st);
      ptx::mbarrier_expect_tx_relaxed_cta(full, Layout::kTxBytes - a_bytes_skipped(tile) - b_bytes_skipped(tile));
    } else {
      full = take_stage(Layout::kTxBytes - a_bytes_skipped(tile));
    }
    if constexpr (kSplitN) {
      if (k_step(tile) == 2) {
        issue_a(tile, kb, full, st.index);
        load_b(tile, kb, full, st.index);
        store_weight_scales(tile, kb, st.index);
        ptx::mbarrier_arrive_release_cta_s(ptx::smem_u32(full));
        ++st;
        return;
      }
    }
    ptx::tma_load_2d(smem + Layout::a_offset(st.index), map_a(tile), full, kb * kBlockK, tile.row0);
    load_b(tile, kb, full, st.index);
    if constexpr (kFp8) {
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(st.index), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
      store_weight_scales(tile, kb, st.index);
      ptx::mbarrier_arrive_release_cta_s(ptx::smem_u32(full));
    }
    ++st;
  }
  // FP8: the weight scales of K block kb for the tile's two 128-column halves, into the stage's
  // scale slot (a half past N, L2 with N an odd multiple of 128, takes the first half's; its
  // result is never stored). Why the producer and not the math threads: a load from global memory
  // in the K loop stalls the next wgmma batch at its fence (WARPGROUP.ARRIVE waits for loads in
  // flight to registers) whenever it misses L1; this thread's loads only delay the stage's
  // arrival, which the ring keeps ahead of the math.
  __device__ void store_weight_scales(const scheduler::GemmTile& tile, int kb, uint32_t stage) {
    if constexpr (kFp8) {
      static_assert(Layout::kTileN == 2 * kScaleBlock, "two weight scale blocks per tile");
      static_assert(kBlockK == kScaleBlock, "one weight scale per K block: num_k_blocks is k / 128");
      // Why opaque: the math warpgroups derive the same values from the same parameters; shared,
      // they were computed before the role split and held across it, and ptxas then spilled
      // accumulators in the math warpgroups' whole-ring K loop (~600 bytes of stack traffic).
      int n = p->n, k = p->k;
      ptx::opaque(n);
      ptx::opaque(k);
      const int n_blocks128 = n / kScaleBlock;
      const int nb0 = tile_n_block(tile) * 2;
      const int nb1 = nb0 + 1 < n_blocks128 ? nb0 + 1 : nb0;
      const int num_k_blocks = k / kBlockK;
      // A 32-bit index: < 2^27 by the limits E_loc <= 1024, N <= 65536, K <= 32768.
      const float* row = p->b_scale + ((tile.expert * n_blocks128 + nb0) * num_k_blocks + kb);
      const float s0 = ptx::ld_nc_f32(row);
      const float s1 = ptx::ld_nc_f32(row + (nb1 - nb0) * num_k_blocks);
      if constexpr (kSplitN) {
        if (k_step(tile) == 2) {
          static_assert(Layout::kScaleB >= 16, "a two-K-block stage holds four weight scales");
          const float s2 = ptx::ld_nc_f32(row + 1);
          const float s3 = ptx::ld_nc_f32(row + (nb1 - nb0) * num_k_blocks + 1);
          ptx::st_shared_v2_f32(ptx::smem_u32(smem + Layout::sb_offset(stage)), s0, s1);
          ptx::st_shared_v2_f32(ptx::smem_u32(smem + Layout::sb_offset(stage)) + 8u, s2, s3);
          return;
        }
      }
      ptx::st_shared_v2_f32(ptx::smem_u32(smem + Layout::sb_offset(stage)), s0, s1);
    }
  }
  // The same in two halves (b_first): B into the next stage now (its bytes announced, no arrival),
  // the arrival and A later.
  __device__ void issue_b(const scheduler::GemmTile& tile, int kb) {
    static_assert(Layout::kTxBytes > Layout::kTileB, "a stage holds more than its B tile");
    claim_next(kb);
    acquire_stage();
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_expect_tx_relaxed_cta(full, Layout::kTileB - b_bytes_skipped(tile));
    load_b(tile, kb, full, st.index);
    ++st;
  }
  __device__ uint64_t* take_stage(uint32_t bytes) {
    acquire_stage();
    uint64_t* full = pipe.producer_barrier(st);
    ptx::mbarrier_arrive_expect_tx_release_cta(full, bytes);
    return full;
  }
  // The A box of a tile and the A bytes its stages do not carry (see tmap_a64).
  __device__ static bool half_a(const scheduler::GemmTile& tile) { return tile.rows_valid <= Scheduler::kTileM / 2; }
  __device__ const CUtensorMap* map_a(const scheduler::GemmTile& tile) const { return half_a(tile) ? tmap_a64 : tmap_a; }
  __device__ uint32_t a_bytes_skipped(const scheduler::GemmTile& tile) const {
    if constexpr (kSplitN) {
      if (split) return 0u;  // two K blocks of 64 rows, or a unit of more than 64 rows
    }
    return half_a(tile) ? Layout::kTileA / 2 : 0u;
  }
  // kSplitN: K blocks per stage of a tile (see the struct's comment).
  __device__ int k_step(const scheduler::GemmTile& tile) const {
    if constexpr (kSplitN) return split && half_a(tile) ? 2 : 1;
    return 1;
  }
  // kSplitN: a split unit's stage of one K block carries half of the B tile.
  __device__ uint32_t b_bytes_skipped(const scheduler::GemmTile& tile) const {
    if constexpr (kSplitN) return split && !half_a(tile) ? Layout::kTileB / 2 : 0u;
    return 0u;
  }
  // The L1 tile of a scheduler tile (a split unit's n_block counts halves).
  __device__ int tile_n_block(const scheduler::GemmTile& tile) const {
    if constexpr (kSplitN) return split ? tile.n_block >> 1 : tile.n_block;
    return tile.n_block;
  }
  // The block's next tile, once per tile at K block claim_kb (see run). Exactly one of issue and
  // issue_b sees each K block.
  __device__ void claim_next(int kb) {
    if (kb == claim_kb) claimed = int(gridDim.x) + int(atomicAdd(claim_ctr, 1u));
  }
  // Waits (bounded) until the consumers released the next stage, then writes a published tile's
  // index into its slot if this stage carries the tile's first K block. The stage's arrival,
  // release at CTA scope, publishes it (in B-first, the arrival after the wait).
  __device__ void acquire_stage() {
    if (!pipe.producer_acquire(st))
      pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
    if (publish != kNoMoreTiles) {
      ptx::st_shared_u32(smem_s() + Layout::claim_slot(st.index), publish);
      publish = kNoMoreTiles;
    }
  }
  __device__ static uint32_t smem_s() { return dyn_smem_base_s(); }
  __device__ void issue_a(const scheduler::GemmTile& tile, int kb, uint64_t* full, uint32_t stage) {
    if constexpr (kSplitN) {
      if (k_step(tile) == 2) {
        constexpr uint32_t kHalfA = Layout::kTileA / 2, kHalfScale = Layout::kScaleA / 2;
        for (int j = 0; j < 2; ++j) {
          ptx::tma_load_2d(smem + Layout::a_offset(stage) + uint32_t(j) * kHalfA, tmap_a64, full, (kb + j) * kBlockK,
                           tile.row0);
          ptx::bulk_copy_g2s(smem + Layout::sa_offset(stage) + uint32_t(j) * kHalfScale,
                             p->a_scale + int64_t(kb + j) * p->scale_stride + tile.row0, kHalfScale, full);
        }
        return;
      }
    }
    ptx::tma_load_2d(smem + Layout::a_offset(stage), map_a(tile), full, kb * kBlockK, tile.row0);
    if constexpr (kFp8)
      ptx::bulk_copy_g2s(smem + Layout::sa_offset(stage), p->a_scale + int64_t(kb) * p->scale_stride + tile.row0,
                         Layout::kScaleA, full);
  }
  // The evict-first hint (p->weights_evict_first, set per call by the host) for an expert of one
  // m-block: its weight tile is read by this tile only, once. Why: in a one-token call the default
  // policy's weight stream pushed the data read again within microseconds (the GEMM outputs, the
  // L1 -> L2 rows) out of L2; with the hint the layer took 6 (pipeline) and 12 us (megakernel)
  // less at R = 1. Why not in every decode call: at 8-128 tokens it cost 2-8 us (docs/DESIGN.md).
  __device__ void load_b(const scheduler::GemmTile& tile, int kb, uint64_t* full, uint32_t stage) {
    if constexpr (kSplitN) {
      if (split) {
        // Gate rows 64 h.. of tile j into B rows 0-63, the matching up rows (128 further) into 64-127.
        constexpr uint32_t kBox = Layout::kTileN / 4;
        const int32_t gate = tile.expert * p->n + (tile.n_block >> 1) * Layout::kTileN + (tile.n_block & 1) * int(kBox);
        const bool hint = p->weights_evict_first && sched.expert_m_blocks == 1;
        // Boxes in B row order: gate kb, up kb (, gate kb + 1, up kb + 1).
        const int boxes = 2 * k_step(tile);
        for (int j = 0; j < boxes; ++j) {
          uint8_t* dst = smem + Layout::b_offset(stage) + uint32_t(j) * kBox * Layout::kRowBytes;
          const int32_t row = gate + (j & 1) * int(2 * kBox);
          const int k = (kb + (j >> 1)) * kBlockK;
          if (hint)
            ptx::tma_load_2d_hint(dst, tmap_b64, full, k, row, evict_first);
          else
            ptx::tma_load_2d(dst, tmap_b64, full, k, row);
        }
        return;
      }
    }
    const int32_t row = tile.expert * p->n + tile.n_block * Layout::kTileN;
    if (p->weights_evict_first && sched.expert_m_blocks == 1)
      ptx::tma_load_2d_hint(smem + Layout::b_offset(stage), tmap_b, full, kb * kBlockK, row, evict_first);
    else
      ptx::tma_load_2d(smem + Layout::b_offset(stage), tmap_b, full, kb * kBlockK, row);
  }
};

}  // namespace epmoe::gemm
