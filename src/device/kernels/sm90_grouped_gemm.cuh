// The sm90 persistent, TMA-pipelined grouped GEMM: D[rows][n] = A[rows][k] * B[e][n][k]^T per
// expert e of the expert-major pool, with an FP8 (promoted, block-scaled) or BF16 mainloop and
// a plain-bf16 (L2) or SwiGLU (L1) epilogue. Only roles live here; the pieces are in
// device/{pipeline,scheduler,gemm}.
//
// Block = 3 warpgroups (384 threads): warpgroup 0 is the producer (its thread 0 issues every TMA
// load; in the L2 kernel its thread 32 is the deferred epilogue's storer; the other threads only
// give their registers away), warpgroups 1 and 2 are the math
// warpgroups, each running wgmma on 64 rows x 256 columns of the 128 x 256 tile and then the
// epilogue of those rows. Register budgets per role with setmaxnreg: producer 40, math 232
// (40 + 2 x 232 = 3 x 168, the whole register file at one block per SM).
// Why a separate producer: with the producer inside a math warp (the first version), the refill of
// a stage waited for the other warpgroup's release of the same stage, so the two math warpgroups
// ran in lock step and promoted at the same time, leaving the tensor pipe idle (ncu: ~50% busy).
// Decoupled, one warpgroup's promotion overlaps the other's wgmma.
// Why 232 is enough: the FP8 math thread holds 128 accumulators plus a 64-float promotion scratch;
// ptxas honours the setmaxnreg budget because __launch_bounds__(384, 1) fixes the entry count.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "device/debug/diag_trace.cuh"
#include "device/gemm/sm90_epilogue_deferred.cuh"
#include "device/gemm/sm90_epilogue_store.cuh"
#include "device/gemm/sm90_epilogue_swiglu.cuh"
#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_mainloop_bf16.cuh"
#include "device/gemm/sm90_mainloop_fp8.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/gemm/sm90_tma_producer.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/math.cuh"
#include "device/ptx/tma.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"
#include "epmoe/config.h"

namespace epmoe::gemm {

// kStoreBf16: plain bf16 store by the math warpgroups (the fused kernel's L2); kStoreBf16Deferred:
// the same output, full tiles stored with TMA by one storer thread of the producer warpgroup
// (sm90_epilogue_deferred.cuh; the standalone L2 kernel); kSwiGLU: L1 with the math warpgroups'
// own stores (the fused kernel's BF16 L1 and decode variant); kSwiGLUDeferred: L1 whose full tiles
// the storer writes (the standalone L1 kernels; FP8 codes and scales through the staging tiles,
// BF16 activations through the kept ring stage, as L2).
enum class Sm90Epilogue { kStoreBf16, kStoreBf16Deferred, kSwiGLU, kSwiGLUDeferred };

inline constexpr int kNumThreads = 384;
inline constexpr int kMathWarpgroups = 2;
inline constexpr int kProducerWarpgroup = 0;  // warpgroups 1.. are the math warpgroups
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kMathRegs = 232;
inline constexpr uint32_t kEntryRegs = 65536 / kNumThreads / 8 * 8;  // what __launch_bounds__(384, 1) gives
static_assert(kProducerRegs + kMathWarpgroups * kMathRegs <= kEntryRegs * (kMathWarpgroups + 1),
              "setmaxnreg budgets must fit the registers the block was launched with");
inline constexpr int kRasterGroupN = 8;
// Named barriers kMathBarrierBase + w (w = math warpgroup) synchronise one math warpgroup; id 0
// is __syncthreads'.
inline constexpr uint32_t kMathBarrierBase = 1;
// 3 is the fused kernel's roles-done barrier; 4 is the deferred epilogue's, for both math
// warpgroups (256 threads).
inline constexpr uint32_t kBothMathBarrier = 4;
// 5: the first math warpgroup's mainloop is done, for the idle second one (sm90_math_tiles with
// kIdleWarm; 256 threads).
inline constexpr uint32_t kCoverBarrier = 5;

template <bool kFp8_, Sm90Epilogue kEpi, int kStages_>
struct Sm90GroupedGemmConfig {
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSwiGLU = kEpi == Sm90Epilogue::kSwiGLU || kEpi == Sm90Epilogue::kSwiGLUDeferred;
  // Full tiles through a kept ring stage (L2; BF16 L1, whose 32 KB tile does not fit the staging
  // tiles) or through the staging tiles (FP8 L1: 16 KB of codes plus row scales).
  static constexpr bool kDeferredStore =
      kEpi == Sm90Epilogue::kStoreBf16Deferred || (kEpi == Sm90Epilogue::kSwiGLUDeferred && !kFp8_);
  static constexpr bool kDeferredL1 = kEpi == Sm90Epilogue::kSwiGLUDeferred && kFp8_;
  static constexpr bool kHasStorer = kDeferredStore || kDeferredL1;
  // Slabs of 64 x 64 bf16 per math warpgroup in a kept-stage tile (Sm90EpilogueDeferredBf16::drain).
  static constexpr int kSlabsPerWg = kSwiGLU ? 2 : 4;
  static constexpr bool kL2Out = !kSwiGLU;  // output columns = weight rows (see store_kept_tile)
  using Layout = Sm90SmemLayout<kFp8_, kStages_>;
  using Mainloop = std::conditional_t<kFp8_, Sm90Fp8Mainloop<kStages_, Layout>, Sm90Bf16Mainloop<kStages_, Layout>>;
  static constexpr int kBlockK = Mainloop::kBlockK;
  using Scheduler = scheduler::GroupedTileScheduler<kBlockM, kRasterGroupN>;
  // Split units (Sm90TmaProducer, kSplitN): compiled into the megakernel's FP8 decode L1 only, the
  // one configuration with FP8 and the inline SwiGLU epilogue.
  static constexpr bool kSplitN = kFp8_ && kEpi == Sm90Epilogue::kSwiGLU;
  // The halves of a split tile are scheduler tiles 2 j and 2 j + 1 (n_block 2 j' and 2 j' + 1 of one
  // m-block): an even raster group keeps every expert's unit count and the group spans even
  // (Sm90EpilogueSwiGLU::run_split pairs by the linear index, the producer by n_block).
  static_assert(!kSplitN || kRasterGroupN % 2 == 0, "split units pair adjacent scheduler tiles");
  using Producer = Sm90TmaProducer<kFp8_, kStages_, kBlockK, Layout, Scheduler, kSplitN>;
  static constexpr uint32_t kEmptyArrivals = kMathWarpgroups * 4;  // math warps releasing a stage
  static_assert(kMathWarpgroups * kWarpgroupM == kBlockM, "the math warpgroups split the tile's M");
  static_assert((kMathWarpgroups + 1) * 128 == kNumThreads, "one producer warpgroup plus the math warpgroups");
};

// Role loops of the persistent grouped GEMM on an initialised pipeline. `st` is where the ring
// stands for the calling role; it comes back advanced by the K blocks loaded (producer) or
// consumed (math), which are equal, plus one end-mark stage where the producer publishes its
// tiles (the fused kernel). Why carried states: the fused kernel runs L1 and then L2 on
// the same ring and barriers, so L2 continues at the phase L1 stopped at.

// The scheduler tables of this block (scheduler::TileTables), filled by fill_tile_tables_for at the
// start of each GEMM.
template <class Cfg>
__device__ __forceinline__ scheduler::TileTables tile_tables() {
  static_assert(Cfg::Layout::kMaxGroups >= uint32_t(Limits::kMaxExpertsPerRank), "the scheduler tables hold every expert");
  return scheduler::TileTables{dyn_smem_base_s() + Cfg::Layout::kTableOffset, Cfg::Layout::kMaxGroups};
}
// n_units: scheduler tiles per N tile (2: the split units of the megakernel's decode L1).
template <class Cfg>
__device__ __forceinline__ typename Cfg::Scheduler make_scheduler(const GroupedGemmParams& p, int n_units = 1) {
  return typename Cfg::Scheduler(tile_tables<Cfg>(), p.num_groups, (p.n + kBlockN - 1) / kBlockN * n_units);
}
// Every thread of the block, before any role schedules a tile of `p`.
template <class Cfg>
__device__ __forceinline__ void fill_tile_tables_for(const GroupedGemmParams& p) {
  // ld.global.ca: see ptx::ld_ca_s32 (the arrays were written by an earlier kernel).
  scheduler::fill_tile_tables(
      tile_tables<Cfg>(), [&](int e) { return ptx::ld_ca_s32(p.expert_count + e); },
      [&](int e) { return ptx::ld_ca_s32(p.expert_offset + e); }, p.num_groups, kBlockM);
}

// Thread 0 only, at the producer budget. `ready`/`target`: see Sm90TmaProducer::run.
template <class Cfg>
__device__ __forceinline__ void sm90_producer_tiles(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a64,
                                                    const CUtensorMap* tmap_b, const GroupedGemmParams& p,
                                                    const typename Cfg::Mainloop::Pipe& pipe, uint8_t* smem,
                                                    typename Cfg::Mainloop::State& st,
                                                    const uint32_t* ready = nullptr, uint32_t target = 0,
                                                    uint32_t per_row = 0, bool b_first = false,
                                                    bool publish_tiles = false, uint32_t* claim = nullptr,
                                                    const CUtensorMap* tmap_b64 = nullptr, bool split = false) {
  typename Cfg::Producer producer{tmap_a, tmap_b, tmap_a64, &p, pipe, smem, make_scheduler<Cfg>(p, split ? 2 : 1)};
  if constexpr (Cfg::kSplitN) {
    producer.tmap_b64 = tmap_b64;
    producer.split = split;
  }
  producer.st = st;
  producer.run(ready, target, per_row, b_first, publish_tiles, claim);
  st = producer.st;
}

// Where a math role stopped: ok, or the stage and tile whose bounded wait expired.
struct MathTilesResult {
  bool ok = true;
  uint32_t stage = 0, phase = 0;
  int tile = 0;
  pipeline::WaitSite site = pipeline::WaitSite::kConsumerFull;
  uint32_t tiles_staged = 0;  // deferred tiles handed to the storer so far (with the caller's start)

  // The deferred epilogue's "drained" barrier never completed for the tile after `tile_count`
  // staged ones (its parity), waiting on behalf of ring stage `stage` (0 where none is kept).
  __device__ static MathTilesResult drain_timeout(uint32_t stage, uint32_t tile_count, int tile) {
    return MathTilesResult{false, stage, (tile_count & 1u) ^ 1u, tile, pipeline::WaitSite::kEpilogueDrained};
  }
};

// Every thread of the math warpgroup `wg` (0 or 1), at the math budget. `done` (optional, the
// fused kernel's L1): once a tile's epilogue stored its rows, the warpgroup adds 1 to
// done[tile.row0 / BLOCK_M] with a gpu-scope release, so an m-block is complete at
// kMathWarpgroups x n_tiles. The release of a tile is deferred until the next tile's mainloop has
// run (or the loop ends): its proxy fence then finds the epilogue's stores drained instead of
// waiting for them with the tensor cores idle (measured ~60 us per call at 4096 tokens per rank
// when it followed each epilogue). Without a storer (the megakernel's decode variant) and with
// `release_at_once` (calls of few L1 tiles per block) each tile is released right after its
// epilogue instead. Why: a deferred release held every expert's L2 tiles until the last L1 tile of
// a block with two had run its mainloop (the per-tile trace, Qwen3-like shape at 128 tokens: L2
// started ~15 us after most L1 tiles were done), while with many tiles per block the fences cost
// more than the early L2 starts gain (docs/DESIGN.md, "The megakernel's schedule"). Why no trap in
// here: see sm90_grouped_gemm_tiles.
// Deferred tiles (Cfg::kHasStorer): `first_tile_count` is how many this block's storer has been
// handed before (the fused kernel's L2 continues its L1's count), and kEndStorer whether the
// storer's end mark follows the last tile. With `done`, a deferred L1 tile is counted by the
// storer once its stores completed (Sm90EpilogueDeferredBf16::drain_fused), not here.
// kIdleWarm (the megakernel's decode variant, FP8): the K loop in N quarters (Sm90Fp8Mainloop::run
// with kCoverIdle, block_math_quarters); and in a tile of <= 64 rows of a GEMM with more K
// blocks than ring stages, the idle second math warpgroup takes only the tile's first stage
// (Sm90Fp8Mainloop::run with kCoverIdle), and in the first such tile of each GEMM it runs the
// inline epilogue's code on rows it does not store, while the first warpgroup runs the mainloop.
// Why: a block's first epilogue of each GEMM waited for its instructions (ncu, one H200, Qwen3-like
// shape at 128 tokens: 64% of the L1 epilogue's stall samples "no instruction"; the trace build: a
// first L1 epilogue ~7-9 us against ~3 for later ones, a first L2 epilogue ~4.5 against ~1.1). Run
// by the same warpgroup before its first tile, that fetch only moved ahead of the mainloop
// (DESIGN.md, "A warm epilogue pass"). The idle warpgroup then waits on kCoverBarrier until the
// first one's mainloop is done: only then has every stage it skipped landed, so that its next stage
// wait (by parity) cannot match a stale phase. Why more K blocks than stages: the first warpgroup
// then cannot finish its next tile's mainloop (nor, in L2, its first one after L1's end mark)
// before the idle one released that tile's first stage (or the end mark), which it does after its
// barrier wait; so the first warpgroup never arrives twice on kCoverBarrier before the idle one
// waited once. With <= kStages K blocks (K <= 512 in FP8: an H or I of at most 512) it could, so
// there both warpgroups take every stage as in the other variants.
// split (kIdleWarm with Cfg::kSplitN, the megakernel's FP8 decode L1; nullptr: off): the scheduler's
// tiles are split units, each half of an L1 tile's 128-channel group, whose two halves exchange
// their row maxima (Sm90EpilogueSwiGLU::run_split); the caller passes split units in the static
// order only.
// from_slots (the fused kernel): the producer publishes the tile sequence
// (Sm90TmaProducer::run with publish_tiles; its blocks may claim tiles from a grid-wide counter)
// and each tile's index is read from the claim slot of the stage that carries its first K block,
// after the wait for that stage (which the mainloop's own first wait then finds complete); the
// producer's end mark (kNoMoreTiles) ends the loop, and its stage is released at once. Without
// from_slots both roles walk the static order, as in the standalone kernels.
template <class Cfg, bool kEndStorer = true, bool kPairK = false, bool kIdleWarm = false>
__device__ __forceinline__ MathTilesResult sm90_math_tiles(const GroupedGemmParams& p,
                                                           const typename Cfg::Mainloop::Pipe& pipe,
                                                           typename Cfg::Mainloop::State& st, int wg,
                                                           uint32_t* done = nullptr, uint32_t first_tile_count = 0,
                                                           bool from_slots = false, bool release_at_once = false,
                                                           const SplitExchange* split = nullptr) {
  using Mainloop = typename Cfg::Mainloop;
  const int num_k_blocks = p.k / Cfg::kBlockK;
  const bool rings = num_k_blocks % Cfg::kStages == 0;
  static_assert(!Cfg::kSplitN || kIdleWarm, "split units are the decode variant's");
  typename Cfg::Scheduler sched = make_scheduler<Cfg>(p, Cfg::kSplitN && split ? 2 : 1);
  scheduler::GemmTile tile;
  float acc[128];
  int pending = -1;  // `done` index of the last stored tile whose release is deferred
  // Deferred tiles staged so far (the deferred epilogue's barrier phases): partial tiles, which
  // take the inline store, must not count, or the parities would no longer match the storer's.
  uint32_t tile_count = first_tile_count;
  // The next reader is a TMA (async proxy) on another SM: proxy fence per writing thread, the
  // warpgroup's barrier, then one cumulative release.
  const auto release_pending = [&] {
    ptx::fence_proxy_async_global();
    ptx::named_barrier_sync(kMathBarrierBase + uint32_t(wg), 128);
    if (threadIdx.x % 128 == 0) ptx::red_add_release_gpu(done + pending, 1);
    pending = -1;
  };
  constexpr int kTraceGemm = Cfg::kSwiGLU ? 0 : 1;
  int trace_slot = 0;
  static_assert(!kIdleWarm || (Cfg::kFp8 && !Cfg::kHasStorer && !kPairK),
                "the idle warpgroup's warm pass is for the FP8 decode variant's inline epilogues");
  bool warmed = false;  // kIdleWarm: this GEMM's epilogue code has run once on this warpgroup
  for (;;) {
    // from_slots: the tile is known only from its slot. Otherwise the producer walks the static
    // order without publishing it, and so does this, as the standalone kernels do (the tile's first
    // weight scales then load before its stage lands: read from the slot, that load's latency was
    // exposed once per tile, ~1 us per tile in decode calls at R = 1).
    if (from_slots) {
      if (!pipe.consumer_wait(st)) return MathTilesResult{false, st.index, st.phase, sched.next_linear};
      const uint32_t id = ptx::ld_shared_u32(dyn_smem_base_s() + Cfg::Layout::claim_slot(st.index));
      if (id == kNoMoreTiles) {
        __syncwarp();
        if (threadIdx.x % 32 == 0) pipe.consumer_release(st);
        ++st;
        break;
      }
      sched.seek(int(id), tile);
    } else if (!sched.next(tile)) {
      break;
    }
    diag::tile_trace(kTraceGemm, trace_slot, 0);
    // Why: in decode most tiles hold <= 64 tokens, and the second warpgroup's wgmma on padding
    // rows would take tensor time from the first one's.
    const bool idle = wg * kWarpgroupM >= tile.rows_valid;
    // kIdleWarm: the second warpgroup is idle and takes only the first stage; the first warpgroup
    // releases the others for both.
    // Split units of at most 64 rows carry two K blocks per stage (Sm90TmaProducer::k_step).
    const bool dbl = Cfg::kSplitN && split != nullptr && tile.rows_valid <= kWarpgroupM;
    const bool covered = kIdleWarm && (dbl ? num_k_blocks / 2 : num_k_blocks) > Cfg::kStages &&
                         tile.rows_valid <= kWarpgroupM;
    // A timeout leaves a deferred release unsent: other blocks' L2 producers may then report
    // their own timeout first; the trap ends the grid either way (fatal path only).
    // Why only full tiles through the deferred store: its TMA stores write whole 64-row slabs, and
    // rows past an expert's count must stay untouched; an expert's last, partial m-block takes the
    // math warpgroups' own store below (which also keeps decode, all partial tiles, as it was).
    const bool deferred = Cfg::kDeferredStore && tile.rows_valid >= kBlockM;
    bool ok;
    if constexpr (kPairK) {
      // Whole rings per tile (see Sm90Fp8Mainloop::run_rings): every tile of this GEMM has the same
      // K, so each one starts at stage 0.
      if (rings)
        ok = deferred ? Mainloop::template run_rings<Cfg::kDeferredStore>(acc, pipe, st, num_k_blocks, wg, idle)
                      : Mainloop::template run_rings<false>(acc, pipe, st, num_k_blocks, wg, idle);
      else
        ok = deferred ? Mainloop::template run<Cfg::kDeferredStore, true>(acc, pipe, st, num_k_blocks, wg, idle)
                      : Mainloop::template run<false, true>(acc, pipe, st, num_k_blocks, wg, idle);
    } else if constexpr (kIdleWarm) {
      ok = Mainloop::template run<false, false, true>(acc, pipe, st, num_k_blocks, wg, idle, covered,
                                                      Cfg::kSplitN && split != nullptr, dbl);
      if (ok && covered && !idle) ptx::named_barrier_arrive(kCoverBarrier, 256);
    } else {
      ok = deferred ? Mainloop::template run<Cfg::kDeferredStore, false>(acc, pipe, st, num_k_blocks, wg, idle)
                    : Mainloop::template run<false, false>(acc, pipe, st, num_k_blocks, wg, idle);
    }
    if (!ok) return MathTilesResult{false, st.index, st.phase, sched.next_linear};
    diag::tile_trace(kTraceGemm, trace_slot++, 1);
    if constexpr (Cfg::kDeferredStore) {
      if (deferred) {
        // The stage of the last K block, kept by the mainloop: the one before st.
        const uint32_t kept = (st.index + uint32_t(Cfg::kStages) - 1u) % uint32_t(Cfg::kStages);
        bool staged;
        if constexpr (Cfg::kSwiGLU) {
          // BF16 L1: the activations first (no smem touched), then the handoff.
          float a[64];
          Sm90EpilogueSwiGLU<false>::values(acc, p, tile, Sm90EpilogueSwiGLU<false>::first_row(wg), a);
          staged = Sm90EpilogueDeferredBf16::stage_swiglu_bf16<typename Cfg::Layout>(
              a, tile, wg, !idle, dyn_smem_base_s(), kept, tile_count, kBothMathBarrier);
        } else {
          staged = Sm90EpilogueDeferredBf16::stage<typename Cfg::Layout>(acc, p, tile, wg, !idle, dyn_smem_base_s(),
                                                                         kept, tile_count, kBothMathBarrier);
        }
        if (!staged)
          return MathTilesResult::drain_timeout(kept, tile_count, sched.next_linear);
        ++tile_count;
        diag::tile_trace(kTraceGemm, trace_slot - 1, 2);
        continue;
      }
      // L2: the staging tiles below are slabs 6-7 of the last deferred tile: wait until they drained.
      // (BF16 L1's inline store uses no staging tile; the wait, once per partial tile, is harmless.)
      if (!Sm90EpilogueDeferredBf16::wait_drained<typename Cfg::Layout>(dyn_smem_base_s(), tile_count))
        return MathTilesResult::drain_timeout(0, tile_count, sched.next_linear);
    }
    if (done && pending >= 0) release_pending();
    // An idle warpgroup has no row to store (and acc was not computed); the readiness signal
    // below still counts it.
    if constexpr (Cfg::kDeferredL1) {
      if (tile.rows_valid >= kBlockM) {
        const uint32_t smem_s = dyn_smem_base_s();
        if (!Sm90EpilogueDeferredBf16::begin_l1<typename Cfg::Layout>(tile, wg, smem_s, tile_count))
          return MathTilesResult::drain_timeout(0, tile_count, sched.next_linear);
        Sm90EpilogueSwiGLU<true, true>::run(acc, p, tile, wg, smem_s + Cfg::Layout::epi_offset(uint32_t(wg)),
                                            smem_s + Cfg::Layout::kEpiScaleOffset);
        Sm90EpilogueDeferredBf16::end_l1<typename Cfg::Layout>(smem_s);
        ++tile_count;
        diag::tile_trace(kTraceGemm, trace_slot - 1, 2);
        continue;
      }
    }
    // kIdleWarm: the idle warpgroup's warm pass stores nothing (no row of its 64 is valid; the L1
    // epilogue's `dry` keeps its stores off, the L2 one writes only this warpgroup's staging tile).
    const bool warm = covered && idle && !warmed;
    if (!idle || warm) {
      if constexpr (Cfg::kSplitN) {
        if (split) {
          uint32_t seen = 0;
          int slot = 0;
          if (!Sm90EpilogueSwiGLU<true>::run_split(acc, p, tile, wg, sched.next_linear, *split,
                                                   kMathBarrierBase + uint32_t(wg), warm, &seen, &slot,
                                                   trace_slot - 1))
            return MathTilesResult{false, uint32_t(slot), seen, sched.next_linear, pipeline::WaitSite::kSplitAmax};
        } else {
          Sm90EpilogueSwiGLU<Cfg::kFp8>::run(acc, p, tile, wg, 0, 0, trace_slot - 1, warm);
        }
      } else if constexpr (Cfg::kSwiGLU) {
        Sm90EpilogueSwiGLU<Cfg::kFp8>::run(acc, p, tile, wg, 0, 0, trace_slot - 1, warm);
      } else {
        Sm90EpilogueStoreBf16::run(acc, p, tile, wg, dyn_smem_base_s() + Cfg::Layout::epi_offset(uint32_t(wg)),
                                   kMathBarrierBase + uint32_t(wg));
      }
    }
    warmed = warmed || warm;
    diag::tile_trace(kTraceGemm, trace_slot - 1, 3);
    if (done) {
      pending = tile.row0 / kBlockM;
      if constexpr (!Cfg::kHasStorer) {
        if (release_at_once) release_pending();
      }
    }
    if constexpr (kIdleWarm) {
      if (covered && idle) ptx::named_barrier_sync(kCoverBarrier, 256);
    }
    diag::tile_trace(kTraceGemm, trace_slot - 1, 2);
  }
  if (done && pending >= 0) release_pending();
  diag::tile_trace_end(kTraceGemm);
  if constexpr (Cfg::kHasStorer && kEndStorer) {
    if (!Sm90EpilogueDeferredBf16::finish<typename Cfg::Layout>(wg, dyn_smem_base_s(), tile_count))
      return MathTilesResult::drain_timeout(0, tile_count, sched.next_linear);
  }
  MathTilesResult done_result;
  done_result.tiles_staged = tile_count;
  return done_result;
}

// The deferred epilogue's storer role: lane 0 of warp 1 of the producer warpgroup, at the producer
// budget.
template <class Cfg>
__device__ __forceinline__ void sm90_storer_tiles(const GroupedGemmParams& p, const CUtensorMap* map_d) {
  uint32_t phase = 0, tile_count = 0;
  bool ok;
  if constexpr (Cfg::kDeferredL1)
    ok = Sm90EpilogueDeferredBf16::drain_l1<typename Cfg::Layout>(p, map_d, phase, tile_count);
  else
    ok = Sm90EpilogueDeferredBf16::drain<typename Cfg::Layout, Cfg::kStages, Cfg::kSlabsPerWg, Cfg::kL2Out>(
        p, map_d, kMathWarpgroups * 4, phase, tile_count);
  if (!ok) pipeline::report_timeout(pipeline::WaitSite::kStorerStaged, 0, phase, int(tile_count));
}

// The persistent tile loop of the standalone grouped GEMM kernel: every thread of the block calls
// it, at the entry register budget (kEntryRegs), as the kernel's last step.
// Each role runs at its own budget (setmaxnreg). Why inside the role branches and not around the
// call: code after a merge of a 40-register and a 232-register path is allocated for the smaller
// budget, so ptxas drops both setmaxnreg (C7507) and the math code spills.
// Why the producer warpgroup exits instead of taking its registers back: setmaxnreg.inc is a
// retry loop (USETMAXREG.TRY_ALLOC + branch), and three warps spinning in it for the whole GEMM
// take issue slots from the math warps on every SM sub-partition.
// Why the timeout report after the math loop: a trap inside the 232-register region makes ptxas
// allocate that whole region for the entry budget of 168 (measured: 58 spilled accumulator slots).
template <class Cfg>
__device__ __forceinline__ void sm90_grouped_gemm_tiles(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a64,
                                                        const CUtensorMap* tmap_b, const CUtensorMap* tmap_d,
                                                        const GroupedGemmParams& p,
                                                        const typename Cfg::Mainloop::Pipe& pipe, uint8_t* smem) {
  typename Cfg::Mainloop::State st{};
  if (threadIdx.x / 128 == kProducerWarpgroup) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) sm90_producer_tiles<Cfg>(tmap_a, tmap_a64, tmap_b, p, pipe, smem, st);
    if constexpr (Cfg::kHasStorer) {
      if (threadIdx.x == 32) sm90_storer_tiles<Cfg>(p, tmap_d);
    }
    return;
  }
  ptx::setmaxnreg_inc<kMathRegs>();
  const MathTilesResult r = sm90_math_tiles<Cfg, true, Cfg::kFp8>(p, pipe, st, threadIdx.x / 128 - 1);
  if (!r.ok) {
    ptx::setmaxnreg_dec<kEntryRegs>();
    pipeline::report_timeout(r.site, r.stage, r.phase, r.tile);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_a64,
                             const __grid_constant__ CUtensorMap tmap_b, const __grid_constant__ CUtensorMap tmap_d,
                             const GroupedGemmParams p) {
  using Layout = typename Cfg::Layout;
  using Mainloop = typename Cfg::Mainloop;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Layout::kBarOffset);
  const typename Mainloop::Pipe pipe = Mainloop::Pipe::at(bars, dyn_smem_base_s() + Layout::kBarOffset);
  if (threadIdx.x == 0) {
    if constexpr (Cfg::kHasStorer) {
      ptx::mbarrier_init(reinterpret_cast<uint64_t*>(smem + Layout::kStagedBarOffset),
                         Sm90EpilogueDeferredBf16::kStagedArrivals);
      ptx::mbarrier_init(reinterpret_cast<uint64_t*>(smem + Layout::kDrainedBarOffset),
                         Sm90EpilogueDeferredBf16::kStorerThreads);
    }
    // One arrive per math warp (its fence covers the two above).
    pipe.init(Cfg::kEmptyArrivals, p.watchdog);
  }
  diag::tile_trace_reset(Cfg::kSwiGLU ? 0 : 1);
  // Its __syncthreads also publish the barriers' initialization.
  fill_tile_tables_for<Cfg>(p);
  sm90_grouped_gemm_tiles<Cfg>(&tmap_a, &tmap_a64, &tmap_b, &tmap_d, p, pipe, smem);
}

}  // namespace epmoe::gemm
