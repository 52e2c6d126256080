// Deferred epilogues (the standalone L2 kernel's and both standalone L1 kernels' full tiles): the
// math warpgroups hand a tile's output to one storer thread through shared memory and go straight
// back to wgmma; the storer writes it with TMA stores. L2 and BF16 L1 tiles go through the kept
// ring stage described below (BF16 L1: the SwiGLU activations, 128 x 128 bf16 = four slabs); FP8
// L1 tiles through the staging tiles (further down).
//
//   math warpgroups (256 threads)                     storer (lane 0 of warp 1, producer warpgroup)
//   mainloop, keeping the last K block's stage        wait "staged" (phase = tile count, sleeping)
//   wait "drained" of the previous tile               read the tile's description; stop at the end mark
//   meet at a 256-thread barrier (both are done       one TMA store per 64 x 64 slab (8 KB)
//     reading the kept stage)                         commit; wait until the TMA unit has read them
//   stmatrix fp32 -> bf16 into the eight slabs;       release the kept stage (empty barrier, one
//     one thread writes the tile's description          arrival per math warp)
//   proxy fence; arrive on "staged"                   arrive on "drained"
//   after the last tile: wait "drained", write the end mark, arrive on "staged"
//
// Only tiles with 128 valid rows come here: a TMA store writes whole 64-row slabs, and rows past
// an expert's count must stay untouched (docs/GEMM.md, contract with the pool); an expert's last,
// partial m-block (and so every decode tile) keeps the math warpgroups' own store
// (sm90_epilogue_store.cuh), after the last deferred tile has drained (both use the staging tiles).
//
// Why (docs/DESIGN.md): the plain epilogue's smem reads and global stores cost ~10% of the
// FP8 L2 kernel at K = 2048 with the tensor cores idle. Why a whole tile at once: one 8 KB staging
// tile per warpgroup would make the math warpgroups wait for each quarter's drain; the stage the
// last K block used is free once its wgmma completed, and with the staging tiles it holds the
// 128 x 256 bf16 tile (Sm90SmemLayout::out_slab). The producer refills that stage only after the
// storer released it: the next tile's first three K blocks load meanwhile.
// Why TMA stores and not storer warps copying with 16-byte loads and stores (measured):
// those copies ran at the SM's store rate, so the kept stage came back late and the next tile's
// fourth K block starved the math warpgroups (11% slower than the inline store); the TMA unit
// reads the 64 KB from smem quickly and writes global memory on its own.
// Why stmatrix: 16 instructions per thread and tile instead of 64 4-byte smem stores.
// Why the description in smem instead of a second scheduler walk: the storer runs at the
// producer's 40 registers, and the scheduler's state spilled there.
//
// Ordering. staged: each math thread's arrive (release) follows its own smem writes and its
// fence.proxy.async.shared::cta (the TMA store reads them through the async proxy; TMA loads
// overwrite the kept stage later); the storer's wait acquires them. drained: a math warpgroup waits
// for the previous tile's drain before it writes the staging tiles again, which also keeps the
// arrivals of two tiles on "staged" apart (no thread arrives for tile t + 1 before every arrival of
// tile t has completed the phase). The storer releases the kept stage only after
// cp.async.bulk.wait_group.read, and waits for the stores' completion before it exits.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/gemm/sm90_epilogue_tid.cuh"
#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/mbarrier.cuh"
#include "device/ptx/tma.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

struct Sm90EpilogueDeferredBf16 {
  static constexpr uint32_t kStorerThreads = 1;       // lane 0 of warp 1 of the producer warpgroup
  static constexpr uint32_t kStagedArrivals = 256;    // every math thread

  // Math side: every thread of math warpgroup `wg` after a mainloop that kept the stage `kept`.
  // write: whether this warpgroup writes its slabs; with full tiles only (the caller's rule) both
  // always do, and the storer stores every slab. `tile_count`: deferred tiles this block staged
  // before this one (partial tiles do not count). smem_s: the aligned dynamic smem base.
  // write_slabs(): this warpgroup's smem writes of the tile. Returns false if the previous tile
  // never drained (bounded wait).
  template <class Layout, class WriteSlabs>
  __device__ static bool stage_tile(const scheduler::GemmTile& t, int wg, bool write, uint32_t smem_s, uint32_t kept,
                                    uint32_t tile_count, uint32_t both_math_barrier, const WriteSlabs& write_slabs) {
    if (!wait_drained<Layout>(smem_s, tile_count)) return false;
    // Why: the kept stage's B tile is read by both warpgroups' wgmma; neither may overwrite it
    // before the other's last batch completed.
    ptx::named_barrier_sync(both_math_barrier, 256);
    if (wg == 0 && threadIdx.x % 128 == 0)
      ptx::st_shared_v4(smem_s + Layout::kTileInfoOffset,
                        make_uint4(uint32_t(t.row0), uint32_t(t.rows_valid), uint32_t(t.n_block), kept));
    if (write) {
      write_slabs();
      // Why: TMA (async proxy) overwrites the kept stage next; these generic writes must not land
      // after it.
      ptx::fence_proxy_async_shared_cta();
    }
    ptx::mbarrier_arrive_release_cta_s(smem_s + Layout::kStagedBarOffset);
    return true;
  }

  // Quarter `quarter` (64 columns) of an N half `v` (one n128 accumulator fragment: v[4 i .. 4 i + 3]
  // hold columns 8 i + 2 (lane % 4) + {0, 1} of rows r0 and r0 + 8) as bf16 into the 64 x 64 slab at
  // slab_s (rows and 16-byte chunks as in the staging tiles), four stmatrix per thread.
  __device__ static void stmatrix_quarter(const float* v, int quarter, uint32_t slab_s) {
    const int tid = int(epilogue_tid() % 128u);
    const int warp = tid / 32, lane = tid % 32;
    const int m = lane / 8;  // the matrix whose row this lane addresses
    const uint32_t r = uint32_t(warp * 16 + (m & 1) * 8 + lane % 8);
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
      const float* a = v + 4 * (quarter * 8 + 2 * pair);  // 8-column group within the N half
      const uint32_t c = uint32_t(2 * pair + (m >> 1));
      ptx::stmatrix_x4(slab_s + r * 128u + ((c ^ (r & 7u)) * 16u), ptx::cvt_rn_bf16x2(a[0], a[1]),
                       ptx::cvt_rn_bf16x2(a[2], a[3]), ptx::cvt_rn_bf16x2(a[4], a[5]), ptx::cvt_rn_bf16x2(a[6], a[7]));
    }
  }

  // The L2 tile: 64 x 256 fp32 per warpgroup -> four slabs (wg * 4 + quarter).
  template <class Layout>
  __device__ static bool stage(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                               int wg, bool write, uint32_t smem_s, uint32_t kept, uint32_t tile_count,
                               uint32_t both_math_barrier) {
    return stage_tile<Layout>(t, wg, write, smem_s, kept, tile_count, both_math_barrier, [&] {
#pragma unroll
      for (int quarter = 0; quarter < 4; ++quarter) {
        if (t.n_block * kBlockN + quarter * 64 >= p.n) continue;  // N is a multiple of 128
        stmatrix_quarter(acc + 64 * (quarter / 2), quarter % 2,
                         smem_s + Layout::out_slab(uint32_t(wg * 4 + quarter), kept));
      }
    });
  }

  // The BF16 L1 tile: the SwiGLU activations of the warpgroup's 64 rows x 128 channels (computed by
  // the caller, Sm90EpilogueSwiGLU::values) -> two slabs (wg * 2 + quarter), 32 KB per tile in the
  // kept stage's A tile and half its B tile. Why the kept stage: a BF16 L1 tile is twice the FP8
  // one and does not fit the 16 KB of staging tiles.
  template <class Layout>
  __device__ static bool stage_swiglu_bf16(const float (&a)[64], const scheduler::GemmTile& t, int wg, bool write,
                                           uint32_t smem_s, uint32_t kept, uint32_t tile_count,
                                           uint32_t both_math_barrier) {
    return stage_tile<Layout>(t, wg, write, smem_s, kept, tile_count, both_math_barrier, [&] {
#pragma unroll
      for (int quarter = 0; quarter < 2; ++quarter)
        stmatrix_quarter(a, quarter, smem_s + Layout::out_slab(uint32_t(wg * 2 + quarter), kept));
    });
  }

  // Math side: until the last deferred tile (tile_count tiles staged so far) has drained.
  template <class Layout>
  __device__ static bool wait_drained(uint32_t smem_s, uint32_t tile_count) {
    return pipeline::mbarrier_wait_bounded_s(smem_s + Layout::kDrainedBarOffset, (tile_count & 1u) ^ 1u);
  }

  // Math side, after the last tile: every math thread, with the number of tiles staged. Tells the
  // storer to stop. Returns false if the last tile never drained.
  template <class Layout>
  __device__ static bool finish(int wg, uint32_t smem_s, uint32_t tile_count) {
    if (!wait_drained<Layout>(smem_s, tile_count)) return false;
    if (wg == 0 && threadIdx.x % 128 == 0)
      ptx::st_shared_v4(smem_s + Layout::kTileInfoOffset, make_uint4(0, ~0u, 0, 0));  // rows_valid = -1
    ptx::mbarrier_arrive_release_cta_s(smem_s + Layout::kStagedBarOffset);
    return true;
  }

  // Storer side: one thread (lane 0 of warp 1 of the producer warpgroup), until the end mark.
  // Only full tiles (128 valid rows) come here: each slab goes out as one TMA store (map_d: the
  // output pool, 64 x 64 boxes, 128-byte swizzle, which is the slabs' layout). The kept stage and the staging
  // tiles are handed back once the TMA unit has read them (bulk wait_group.read), not when the
  // global writes land. empty_arrivals: what the ring's empty barriers count (one per math warp).
  // Returns false on a bounded-wait timeout; `phase` and `tile_count` then name it.
  // kSlabsPerWg: 4 for L2 tiles (256 output columns), 2 for BF16 L1 tiles (128 channels).
  // kL2: see store_kept_tile.
  template <class Layout, int kStages, int kSlabsPerWg = 4, bool kL2 = kSlabsPerWg == 4>
  __device__ static bool drain(const GroupedGemmParams& p, const CUtensorMap* map_d, uint32_t empty_arrivals,
                               uint32_t& phase, uint32_t& tile_count) {
    const uint32_t smem_s = dyn_smem_base_s();
    ptx::prefetch_tensormap(map_d);
    for (tile_count = 0;; ++tile_count) {
      phase = tile_count & 1u;
      if (!wait_staged<Layout>(smem_s, phase)) return false;
      const uint4 info = ptx::ld_shared_v4(smem_s + Layout::kTileInfoOffset);
      const int row0 = int(info.x), rows_valid = int(info.y), n_block = int(info.z);
      const uint32_t kept = info.w;
      if (rows_valid < 0) break;
      store_kept_tile<Layout, kStages, kSlabsPerWg, kL2>(p, map_d, smem_s, row0, n_block, kept, empty_arrivals);
    }
    // Why: the stores must have landed before the kernel ends; the proxy fence would matter to a
    // reader in the same kernel (none today: the fused kernel keeps its inline store).
    ptx::bulk_wait_group_0();
    ptx::fence_proxy_async_global();
    return true;
  }

  // ---- The same handoff for the FP8 L1 (SwiGLU) kernel's full tiles. ----------------------------
  // Its output is small (128 rows x 128 e4m3 channels = 16 KB plus 128 row scales), so it fits the
  // staging tiles and the scale buffer (Layout::kEpiScaleOffset) and no ring stage is kept. The math
  // warpgroups compute SwiGLU and the requantization as before and write codes and scales to smem
  // (Sm90EpilogueSwiGLU<true, true>) instead of 32 two-byte global stores per thread and tile.

  // Math side, every thread, before writing the staging tiles: wait until the previous deferred
  // tile drained; one thread writes this tile's description. Returns false on timeout.
  template <class Layout>
  __device__ static bool begin_l1(const scheduler::GemmTile& t, int wg, uint32_t smem_s, uint32_t tile_count) {
    if (!wait_drained<Layout>(smem_s, tile_count)) return false;
    if (wg == 0 && threadIdx.x % 128 == 0)
      ptx::st_shared_v4(smem_s + Layout::kTileInfoOffset,
                        make_uint4(uint32_t(t.row0), uint32_t(t.rows_valid), uint32_t(t.n_block), kL1Tile));
    return true;
  }
  // Math side, every thread, after its smem writes: hand the tile to the storer.
  template <class Layout>
  __device__ static void end_l1(uint32_t smem_s) {
    ptx::fence_proxy_async_shared_cta();  // the TMA unit reads these writes
    ptx::mbarrier_arrive_release_cta_s(smem_s + Layout::kStagedBarOffset);
  }

  // Storer side for L1: two TMA stores of 64 x 128-byte e4m3 boxes (map_d: the activation pool
  // [rows][I] e4m3, 128-byte swizzle) and one bulk copy of the 128 row scales to
  // out_scale[n_block][row0 ..] (512 contiguous bytes of the MN-major scales).
  template <class Layout>
  __device__ static bool drain_l1(const GroupedGemmParams& p, const CUtensorMap* map_d, uint32_t& phase,
                                  uint32_t& tile_count) {
    const uint32_t smem_s = dyn_smem_base_s();
    ptx::prefetch_tensormap(map_d);
    for (tile_count = 0;; ++tile_count) {
      phase = tile_count & 1u;
      if (!wait_staged<Layout>(smem_s, phase)) return false;
      const uint4 info = ptx::ld_shared_v4(smem_s + Layout::kTileInfoOffset);
      const int row0 = int(info.x), rows_valid = int(info.y), n_block = int(info.z);
      if (rows_valid < 0) break;
      store_l1_tile<Layout>(p, map_d, smem_s, row0, n_block);
    }
    ptx::bulk_wait_group_0();
    ptx::fence_proxy_async_global();
    return true;
  }

  // ---- The fused kernel's storer: its L1 and L2 tiles in one sequence. ---------------------------
  // The math warpgroups stage the block's deferred L1 tiles, then its deferred L2 tiles, counting
  // both in one tile_count, and send the end mark once after L2; the description's last word tells
  // the two apart (kL1Tile, or the kept stage of an L2 tile). An L1 tile's rows are read next by
  // L2 TMA loads on any SM, which wait until ready[row0 / 128] reaches kMathWarpgroups x n_tiles
  // (sm90_grouped_gemm.cuh): the math warpgroups count their inline-stored (partial) tiles, and
  // the storer counts a deferred tile with `l1_arrivals` once its stores have completed
  // (wait_group 0, not .read), after a proxy fence, with one gpu-scope release.
  // kL1Deferred: whether L1 tiles come at all (FP8; the fused kernel's BF16 L1 keeps the inline
  // store, and a kept-stage L1 tile would need its readiness counted here too).
  template <class Layout, int kStages, bool kL1Deferred>
  __device__ static bool drain_fused(const GroupedGemmParams& p1, const CUtensorMap* map_d1,
                                     const GroupedGemmParams& p2, const CUtensorMap* map_d2, uint32_t* ready,
                                     uint32_t l1_arrivals, uint32_t empty_arrivals, uint32_t& phase,
                                     uint32_t& tile_count) {
    const uint32_t smem_s = dyn_smem_base_s();
    if constexpr (kL1Deferred) ptx::prefetch_tensormap(map_d1);  // not encoded otherwise
    ptx::prefetch_tensormap(map_d2);
    for (tile_count = 0;; ++tile_count) {
      phase = tile_count & 1u;
      if (!wait_staged<Layout>(smem_s, phase)) return false;
      const uint4 info = ptx::ld_shared_v4(smem_s + Layout::kTileInfoOffset);
      const int row0 = int(info.x), rows_valid = int(info.y), n_block = int(info.z);
      if (rows_valid < 0) break;
      if (kL1Deferred && info.w == kL1Tile) {
        store_l1_tile<Layout>(p1, map_d1, smem_s, row0, n_block);
        // Why wait for completion here and not batch it: the next tile is staged a whole mainloop
        // later, and an L2 producer elsewhere may be waiting for exactly these rows.
        ptx::bulk_wait_group_0();
        ptx::fence_proxy_async_global();
        ptx::red_add_release_gpu(ready + row0 / kBlockM, l1_arrivals);
      } else {
        store_kept_tile<Layout, kStages>(p2, map_d2, smem_s, row0, n_block, info.w, empty_arrivals);
      }
    }
    ptx::bulk_wait_group_0();
    ptx::fence_proxy_async_global();
    return true;
  }

  // An L1 tile's description word (an L2 tile's holds its kept stage, < kStages).
  static constexpr uint32_t kL1Tile = ~0u;

 private:
  // One full tile kept in a ring stage: 2 x kSlabsPerWg TMA stores of 64 x 64 slabs (L2: eight,
  // from the kept stage and the staging tiles; BF16 L1: four, from the kept stage, whose p.n counts
  // weight rows, twice its output channels); hands them back once the TMA unit has read them.
  // kL2: the output has p.n columns (L2 tiles); otherwise p.n / 2 (BF16 L1).
  template <class Layout, int kStages, int kSlabsPerWg = 4, bool kL2 = kSlabsPerWg == 4>
  __device__ static void store_kept_tile(const GroupedGemmParams& p, const CUtensorMap* map_d, uint32_t smem_s, int row0,
                                       int n_block, uint32_t kept, uint32_t empty_arrivals) {
    static_assert(kSlabsPerWg == 4 || kSlabsPerWg == 2, "256 or 128 output columns per tile");
    const int n_out = kL2 ? p.n : p.n / 2;
#pragma unroll
    for (int j = 0; j < 2 * kSlabsPerWg; ++j) {
      const int col = n_block * (kSlabsPerWg * 64) + (j % kSlabsPerWg) * 64;
      if (col < n_out)
        ptx::tma_store_2d(map_d, smem_s + Layout::out_slab(uint32_t(j), kept), col,
                          row0 + (j / kSlabsPerWg) * kWarpgroupM);
    }
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read_0();
    const uint32_t empty = smem_s + Layout::kBarOffset + uint32_t(kStages) * 8u + kept * 8u;
    ptx::mbarrier_arrive_count_release_cta_s(empty, empty_arrivals);
    ptx::mbarrier_arrive_release_cta_s(smem_s + Layout::kDrainedBarOffset);
  }

  // One full FP8 L1 tile: two TMA stores of the e4m3 codes, one bulk copy of the row scales; hands
  // the staging tiles back once the TMA unit has read them.
  template <class Layout>
  __device__ static void store_l1_tile(const GroupedGemmParams& p, const CUtensorMap* map_d, uint32_t smem_s, int row0,
                                       int n_block) {
#pragma unroll
    for (int w = 0; w < 2; ++w)
      ptx::tma_store_2d(map_d, smem_s + Layout::epi_offset(uint32_t(w)), n_block * kHalfN, row0 + w * kWarpgroupM);
    ptx::bulk_copy_s2g(p.out_scale + int64_t(n_block) * p.scale_stride + row0, smem_s + Layout::kEpiScaleOffset,
                       kBlockM * 4);
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read_0();
    ptx::mbarrier_arrive_release_cta_s(smem_s + Layout::kDrainedBarOffset);
  }

  // Storer side: the next tile's "staged" phase. Why a suspending wait: the storer waits through a
  // whole mainloop per tile, and a polling warp takes issue slots from the math warps on its
  // sub-partition.
  template <class Layout>
  __device__ static bool wait_staged(uint32_t smem_s, uint32_t phase) {
    return pipeline::mbarrier_wait_bounded_s<pipeline::kSuspendHintNs>(smem_s + Layout::kStagedBarOffset, phase);
  }
};

}  // namespace epmoe::gemm
