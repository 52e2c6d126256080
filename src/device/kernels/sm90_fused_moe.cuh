// The fused MoE megakernel (v1): one persistent cooperative launch per layer call.
//
//   dispatch (comm/dispatch_phases.cuh, megakernel mode) -> per block, as soon as its own pull is
//   done: L1 + SwiGLU tiles and L2 tiles as one tile sequence, each L1 tile once its rows arrived
//   (per-m-block arrival counters), each L2 tile once its m-block's L1 tiles are stored (per-m-block
//   readiness counters) -> grid barrier -> dispatch's phase 4 (block 0) and combine
//   (comm/combine_phases.cuh)
//
// Every stage is the standalone kernels' own device code, so y is bitwise the pipeline's.
// Block = the GEMM's 3 warpgroups (384 threads: producer + 2 math): the comm phases run on all 12
// warps at the entry budget of 168 registers per thread (their results do not depend on the
// split); for the GEMMs each warpgroup switches to its role's budget (producer 40, math 232) and
// back to 168 before the next grid barrier (fused_gemm_tiles).
// One smem ring and one set of mbarriers serve L1 and L2: the L2 tiles continue from the
// pipeline states where L1 stopped, so no barrier is re-initialised mid-phase.
// The dispatch's scratch ((R + 1) * E_loc + 1 ints, <= 37 KB) lives in the ring's A tiles,
// which TMA first writes after the block's own dispatch (and a __syncthreads).
//
// Memory ordering between stages (all inside one kernel, so no kernel boundary helps):
// - dispatch's pullers write x_pool / x_scale / row_weight with generic stores and L1 reads the
//   rows through TMA (async proxy): every lane of a pull unit issues fence.proxy.async.global, the
//   warp meets at __syncwarp, each slot lane adds 1 to arrive[its row's m-block] with
//   red.release.gpu; the L1 producer acquires arrive[m] >= valid rows x pull slices (ld.acquire.gpu,
//   bounded wait), issues fence.proxy.async.global, then its TMA loads. The L1 epilogue reads
//   row_weight with ld.global.cg; it is ordered after the pullers' release through the producer's
//   acquire, its mbarrier arrive (release, CTA scope) and the math thread's mbarrier wait (acquire).
// - the GEMM schedulers read each block's own segment layout (the dispatch's smem scratch, copied
//   into the scheduler tables before the roles start) and the last source's counts in this rank's
//   symmetric buffer, which the block acquired in the dispatch's phase 2. The pool's expert
//   counts / offsets (and recv_tokens), written by the last block right after its layout, are read
//   only after the grid barrier below.
// - the L1 epilogue writes a_pool / a_scale that L2 reads through TMA on any SM: every writing
//   thread issues fence.proxy.async.global, the math warpgroup meets at a named barrier, one
//   thread adds to ready[m-block] with red.release.gpu; the L2 producer acquires the count
//   (ld.acquire.gpu, bounded wait), issues fence.proxy.async.global, then its TMA loads.
// - the smem scratch of dispatch is read with generic loads, then overwritten by TMA:
//   fence.proxy.async.shared::cta, then __syncthreads.
// - L2's generic o_pool stores -> combine's generic loads: the grid barrier alone. The same
//   barrier orders every block's pull (its reads of the sources' staging) before block 0 tells the
//   sources that their staging is free (dispatch_finish_reread: st.release.sys).
// - arrive[] and ready[] restart from 0 every call: after the grid barrier (no GEMM load is
//   pending) the blocks zero the counters of the m-blocks this call used; block 0 zeroes the two
//   tile claim counters (every claim returned before its block reached the barrier).
//
// Why no printf anywhere: a call in a kernel that issues wgmma serializes all wgmma (C7510),
// hence EPMOE_COMM_WAIT_NO_PRINTF. Every wait, comm and GEMM alike, is bounded by the layer's
// timeout_seconds and reports in the same host-mapped record, then traps.
#pragma once

#ifndef EPMOE_COMM_WAIT_NO_PRINTF
#define EPMOE_COMM_WAIT_NO_PRINTF 1
#endif
// Why: see gemm::epilogue_tid (this kernel spilled the L2 epilogue's offsets once per tile).
#ifndef EPMOE_GEMM_EPILOGUE_TID_PER_TILE
#define EPMOE_GEMM_EPILOGUE_TID_PER_TILE 1
#endif

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "device/comm/combine_phases.cuh"
#include "device/comm/dispatch_phases.cuh"
#include "device/comm/grid_barrier.h"
#include "device/comm/wait.h"
#include "device/debug/diag_trace.cuh"
#include "device/kernels/sm90_fused_launch.h"
#include "device/kernels/sm90_grouped_gemm.cuh"
#include "device/ptx/fence.cuh"
#include "epmoe/config.h"

namespace epmoe::fused {

static_assert(gemm::kEpilogueTidPerTile,
              "a GEMM header was included before this one: EPMOE_GEMM_EPILOGUE_TID_PER_TILE must be defined first");

// kDeferred: the throughput variant. Full L2 tiles (and full L1 tiles in FP8) go out through the
// deferred epilogues' storer thread (TMA stores; gemm/sm90_epilogue_deferred.cuh), as in the
// standalone kernels. The decode variant (false) keeps the math warpgroups' inline stores: with
// the deferred store this kernel spills more at tile boundaries and decode, whose tiles are all
// partial and so never deferred, was 10 us slower at 128 tokens (docs/DESIGN.md). The host picks
// one per call from the token count (docs/MEGAKERNEL.md, Configuration per call).
template <bool kFp8, bool kDeferred>
struct FusedMoeConfig {
  // Why 4 stages: as in the standalone GEMMs (4 x 48.5 KB fills the 227 KB of smem).
  using L1 = gemm::Sm90GroupedGemmConfig<
      kFp8, (kDeferred && kFp8) ? gemm::Sm90Epilogue::kSwiGLUDeferred : gemm::Sm90Epilogue::kSwiGLU, 4>;
  using L2 = gemm::Sm90GroupedGemmConfig<
      kFp8, kDeferred ? gemm::Sm90Epilogue::kStoreBf16Deferred : gemm::Sm90Epilogue::kStoreBf16, 4>;
  static constexpr bool kHasStorer = L2::kHasStorer;
  static_assert(!L1::kHasStorer || kHasStorer, "one storer serves L1 and L2");
  using Layout = typename L1::Layout;
  using Mainloop = typename L1::Mainloop;
  static_assert(std::is_same_v<Layout, typename L2::Layout>, "L1 and L2 share one smem ring");
  static_assert(std::is_same_v<typename Mainloop::State, typename L2::Mainloop::State> &&
                    std::is_same_v<typename Mainloop::Pipe, typename L2::Mainloop::Pipe>,
                "L2 continues L1's pipeline state");
  static constexpr int kThreads = gemm::kNumThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSmemBytes = int(Layout::kAllocBytes);
  // The dispatch scratch sits in the A tiles of the ring: (R + 1) * E_loc + 1 ints at most.
  static constexpr int kDispatchScratchBytes =
      ((Limits::kMaxRanks + 1) * Limits::kMaxExpertsPerRank + 1) * int(sizeof(int));
  static_assert(kDispatchScratchBytes <= int(Layout::b_offset(0)), "dispatch scratch must fit in the A tiles");
  // The arrival and readiness counters count 128 pool rows each; the layer's pool aligns every
  // expert segment to the GEMM's BLOCK_M (gemm::row_align), so a counter never mixes two experts.
  static_assert(gemm::kBlockM == layout::CommLocalLayout::kReadyBlockRows,
                "one arrival / readiness counter per GEMM m-block");
};

// Named barrier on which the math warpgroups (arrive, 256 threads) release the producer
// warpgroup (sync, 128) once they gave their registers back; 1 and 2 are the math warpgroups'
// (gemm::kMathBarrierBase).
inline constexpr uint32_t kRolesDoneBarrier = 3;

// L1 then L2 as one tile sequence per block, without a grid barrier between them: the producer
// starts an L2 tile once every L1 tile of its pool m-block is stored (ready[m] counts the math
// warpgroups' releases, kMathWarpgroups per L1 tile), so the L1 tail of some blocks overlaps the
// first L2 tiles of others. Each role sets its register budget once for both GEMMs.
// Which tiles a block runs: with `claim` (FusedMoeParams::claim_tiles, above) the producer thread runs
// tile b of each GEMM first and then takes each next linear tile from a grid-wide counter
// (claim[0] L1, claim[1] L2, offset by the grid), so blocks that left the dispatch late, or that a
// static order would give one tile more, take fewer tiles; without it, the static order
// (block b: b, b + grid, ...).
// With claims, and always in the throughput variant (from_slots below), the producer publishes
// each tile to the math warpgroups through the stage that carries its first K block, then an end
// mark per GEMM (gemm::Sm90TmaProducer::run).
// Deadlock-free: an L1 tile waits only for rows that every block pulls before its first tile, and
// on its own smem ring; every block is resident (cooperative launch); a producer only waits on
// L1 tiles, and a block runs every L1 tile it took (claimed or static) before any L2 tile, so each
// L1 tile an L2 tile waits on is taken and will complete. A math warpgroup defers each L1 tile's
// release until its next L1 mainloop has run (whose loads the producer issued before any wait on
// a counter) and flushes the last one when its L1 loop ends (at the end mark, which the producer
// publishes before its first L2 wait), so every release still happens.
// The throughput variant's storer (thread 32, producer warpgroup) takes the block's deferred L1
// tiles, then its deferred L2 tiles, in the order the math warpgroups stage them; it adds the
// L1 tiles' readiness counts itself once their TMA stores completed.
template <class L1, class L2>
__device__ __forceinline__ void fused_gemm_tiles(const CUtensorMap* a1, const CUtensorMap* a1_64, const CUtensorMap* b1,
                                                 const CUtensorMap* d1, const gemm::GroupedGemmParams& p1,
                                                 const CUtensorMap* a2, const CUtensorMap* a2_64,
                                                 const CUtensorMap* b2, const CUtensorMap* d2,
                                                 const gemm::GroupedGemmParams& p2,
                                                 const typename L1::Mainloop::Pipe& pipe, uint8_t* smem,
                                                 const uint32_t* arrive, uint32_t pull_slices, uint32_t* ready,
                                                 uint32_t* claim, bool b_first, bool l1_release_at_once,
                                                 unsigned long long* phase_ts, const CUtensorMap* b1_64 = nullptr,
                                                 const gemm::SplitExchange* split = nullptr) {
  // Every math warpgroup of every L1 tile (of both halves of a split one) counts once.
  const uint32_t target =
      uint32_t(gemm::kMathWarpgroups * ((p1.n + gemm::kBlockN - 1) / gemm::kBlockN) * (split ? 2 : 1));
  // Whether the producer publishes the tiles and the math warpgroups read them from the slots: with
  // claims, and always in the throughput variant. Why always there: a run-time choice cost that
  // variant 7-43 us at 1024-4096 tokens (R = 1, same call); its calls are never tiny, so they claim
  // tiles anyway (with EPMOE_FUSED_CLAIM=0 it reads the static order from the slots). Without
  // claims (tiny calls) the decode variant's roles walk the static order each, with no end marks.
  const bool from_slots = L2::kHasStorer || claim != nullptr;
  // Split L1 units take the static order (Sm90EpilogueSwiGLU::run_split: why); L2 claims as before.
  uint32_t* const claim_l1 = split ? nullptr : claim;
  const bool from_slots_l1 = L2::kHasStorer || claim_l1 != nullptr;
  typename L1::Mainloop::State st{};
  if (threadIdx.x / 128 == gemm::kProducerWarpgroup) {
    ptx::setmaxnreg_dec<gemm::kProducerRegs>();
    if (threadIdx.x == 0) {
      // An L1 tile's rows are loaded once the dispatch's pullers wrote all of them (arrive[m-block]
      // = valid rows x pull slices); the producer fences the proxies after each acquire.
      gemm::sm90_producer_tiles<L1>(a1, a1_64, b1, p1, pipe, smem, st, arrive, 0u, pull_slices, b_first,
                                    from_slots_l1, claim_l1, b1_64, split != nullptr);
      diag::trace(diag::kFusedProdL1);
      gemm::sm90_producer_tiles<L2>(a2, a2_64, b2, p2, pipe, smem, st, ready, target, 0u, b_first, from_slots,
                                    claim ? claim + 1 : nullptr);
      diag::trace(diag::kFusedProdL2);
    }
    if constexpr (L2::kHasStorer) {
      if (threadIdx.x == 32) {
        uint32_t phase = 0, count = 0;
        if (!gemm::Sm90EpilogueDeferredBf16::drain_fused<typename L2::Layout, L2::kStages, L1::kHasStorer>(
                p1, d1, p2, d2, ready, uint32_t(gemm::kMathWarpgroups), uint32_t(gemm::kMathWarpgroups * 4), phase,
                count))
          pipeline::report_timeout(pipeline::WaitSite::kStorerStaged, 0, phase, int(count));
      }
    }
    __syncwarp();
    // Why the named barrier first: setmaxnreg.inc retries in a loop (USETMAXREG.TRY_ALLOC +
    // branch) until the math warpgroups gave their registers back; spinning there through the
    // whole GEMM would take issue slots from the math warps. bar.sync waits without issuing.
    ptx::named_barrier_sync(kRolesDoneBarrier, gemm::kNumThreads);
    ptx::setmaxnreg_inc<gemm::kEntryRegs>();
    return;
  }
  ptx::setmaxnreg_inc<gemm::kMathRegs>();
  const int wg = threadIdx.x / 128 - 1;
  // L1 sends the storer no end mark: its L2 tiles follow in the same sequence.
  // The FP8 decode variant: the K loop in N quarters, and the idle warpgroup of small tiles runs
  // each GEMM's epilogue code once beside the first warpgroup's mainloop (sm90_math_tiles,
  // kIdleWarm).
  constexpr bool kIdleWarm = L1::kFp8 && !L2::kHasStorer;
  gemm::MathTilesResult r = gemm::sm90_math_tiles<L1, false, false, kIdleWarm>(
      p1, pipe, st, wg, ready, 0u, from_slots_l1, l1_release_at_once, L1::kSplitN ? split : nullptr);
  if (threadIdx.x % 128 == 0) comm::stamp_phase(phase_ts, kPhaseL1Done);
  diag::trace(diag::kFusedMathL1, 128);
  if (r.ok)
    r = gemm::sm90_math_tiles<L2, true, false, kIdleWarm>(p2, pipe, st, wg, nullptr, r.tiles_staged, from_slots);
  if (threadIdx.x % 128 == 0) comm::stamp_phase(phase_ts, kPhaseL2Done);
  diag::trace(diag::kFusedMathL2, 128);
  // Why: the warps of a warpgroup must meet between two setmaxnreg (PTX ISA), and a block without
  // L1 tiles (decode) has had no other barrier since its inc.
  ptx::named_barrier_sync(gemm::kMathBarrierBase + uint32_t(wg), 128);
  ptx::setmaxnreg_dec<gemm::kEntryRegs>();
  ptx::named_barrier_arrive(kRolesDoneBarrier, gemm::kNumThreads);
  if (!r.ok) {
    if constexpr (L1::kSplitN) {
      if (r.site == pipeline::WaitSite::kSplitAmax)
        pipeline::report_counter_timeout(r.site, int(r.stage), 2u, r.phase, r.tile);
    }
    pipeline::report_timeout(r.site, r.stage, r.phase, r.tile);
  }
}

// map_d1 / map_d2: the L1 and L2 output pools as the deferred epilogues store them (used by the
// throughput variant only).
template <bool kFp8, bool kDeferred>
__global__ void __launch_bounds__(gemm::kNumThreads, 1)
    sm90_fused_moe_kernel(const __grid_constant__ CUtensorMap map_a1, const __grid_constant__ CUtensorMap map_b1,
                          const __grid_constant__ CUtensorMap map_a2, const __grid_constant__ CUtensorMap map_b2,
                          const __grid_constant__ CUtensorMap map_a1_64, const __grid_constant__ CUtensorMap map_a2_64,
                          const __grid_constant__ CUtensorMap map_d1, const __grid_constant__ CUtensorMap map_d2,
                          const __grid_constant__ CUtensorMap map_b1_64, const __grid_constant__ FusedMoeParams p) {
  using Cfg = FusedMoeConfig<kFp8, kDeferred>;
  using Layout = typename Cfg::Layout;
  using Mainloop = typename Cfg::Mainloop;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Layout::kBarOffset);
  const typename Mainloop::Pipe pipe = Mainloop::Pipe::at(bars, gemm::dyn_smem_base_s() + Layout::kBarOffset);
  diag::trace_reset();
  diag::tile_trace_reset(0);
  diag::tile_trace_reset(1);
  diag::trace(diag::kFusedEntry);
  if (threadIdx.x == 0) {
    if constexpr (Cfg::kHasStorer) {
      ptx::mbarrier_init(reinterpret_cast<uint64_t*>(smem + Layout::kStagedBarOffset),
                         gemm::Sm90EpilogueDeferredBf16::kStagedArrivals);
      ptx::mbarrier_init(reinterpret_cast<uint64_t*>(smem + Layout::kDrainedBarOffset),
                         gemm::Sm90EpilogueDeferredBf16::kStorerThreads);
    }
    // One arrive per math warp (its fence covers the two above). The watchdog (bound and record)
    // is the layer's, the same for L1 and L2.
    pipe.init(gemm::kMathWarpgroups * 4, p.l1.watchdog);
  }
  __syncthreads();
  diag::trace(diag::kFusedInit);

  const layout::CommOffsets& loc = p.dispatch.off;
  uint32_t* status = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.status_offset());
  uint32_t* barrier_word = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.grid_barrier_offset());
  uint32_t* ready = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.mblock_ready_offset());
  uint32_t* arrive = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.mblock_arrive_offset());
  uint32_t* claim = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.tile_claim_offset());
  const comm::WaitSite site{p.dispatch.rank, p.dispatch.timeout_ns, status, p.dispatch.timeout_record};

  if (threadIdx.x == 0) comm::stamp_phase(p.phase_ts, kPhaseStart, true);

  // Dispatch: tokens from every source into this rank's expert pool. Once the expert segments
  // are known, each block asks L2 for the first K blocks of its first L1 weight tile in the static
  // order (with claims, the first grid's worth of tiles as a set), so HBM streams weights while
  // the pull moves tokens (decode is weight-bound; the pull is not). Off by default. (With split L1
  // units it names the block's whole static tile, not its half unit: only a hint either way.)
  const auto prefetch_first_weights = [&](const auto& segment_rows) {
    if (p.prefetch_k_blocks <= 0) return;  // the default (docs/MEGAKERNEL.md): no walk for nothing
    using Sched = typename Cfg::L1::Scheduler;
    const int n_tiles = (p.l1.n + gemm::kBlockN - 1) / gemm::kBlockN;
    int local = int(blockIdx.x);
    for (int e = 0; e < p.l1.num_groups; ++e) {
      // Exact: the layer's pool aligns segments to 128 rows, so a segment holds ceil(count / 128)
      // m-blocks.
      const int m_blocks = (segment_rows(e) + gemm::kBlockM - 1) / gemm::kBlockM;
      if (local >= m_blocks * n_tiles) {
        local -= m_blocks * n_tiles;
        continue;
      }
      int m_block = 0, n_block = 0;
      Sched::locate(local, m_blocks, n_tiles, m_block, n_block);
      const int k_blocks = min(p.prefetch_k_blocks, p.l1.k / Cfg::L1::kBlockK);
      for (int kb = 0; kb < k_blocks; ++kb)
        ptx::tma_prefetch_2d_l2(&map_b1, kb * Cfg::L1::kBlockK, e * p.l1.n + n_block * gemm::kBlockN);
      return;
    }
  };
  const int* layout_scratch = reinterpret_cast<int*>(smem);
  comm::dispatch_phases<kFp8, Cfg::kWarps, /*kMegakernel=*/true>(p.dispatch, reinterpret_cast<int*>(smem),
                                                                 prefetch_first_weights);
  // No grid barrier: this block's GEMM tiles start from its own copy of the segment layout (every
  // block computed the same one in its smem scratch) and, tile by tile, once their rows arrived
  // (the L1 producer waits on arrive[]). The scheduler tables of both GEMMs (one pool) come from
  // that copy; the scratch was read with generic loads and is overwritten by TMA next.
  const int E_loc = p.dispatch.shape.experts_per_rank();
  scheduler::fill_tile_tables(
      gemm::tile_tables<typename Cfg::L1>(),
      [&](int e) { return comm::segment_rows_used(p.dispatch, layout_scratch, e); },
      [&](int e) { return layout_scratch[p.dispatch.shape.num_ranks * E_loc + e]; }, E_loc, gemm::kBlockM);
  ptx::fence_proxy_async_shared_cta();
  __syncthreads();
  // Claims by the tile count (kClaimBeyondGrid, decode calls): the static order fits a call whose
  // L1 tiles fit one wave; beyond it, the blocks that the static order gives a second L1 tile also
  // get the most L2 tiles, and claims spread them (docs/MEGAKERNEL.md, Configuration per call).
  // Every block reads the same count from its own copy of the layout, so all agree.
  const int l1_tiles = gemm::make_scheduler<typename Cfg::L1>(p.l1).num_tiles();
  const bool claims = p.claim_tiles == kClaimAlways || (p.claim_tiles == kClaimBeyondGrid && l1_tiles > int(gridDim.x));
  // The decode variant releases each L1 tile's readiness right after its epilogue in calls of at
  // most four L1 tiles per block, otherwise after the block's next L1 mainloop (sm90_math_tiles).
  // Why four: at once gained at 1-2 tiles per block (one and two DSV3 tokens, 128 Qwen3-like ones)
  // and at ~4 (128 DSV3 tokens), and cost 4 us at ~6 (512 DSV3 tokens, R = 2; docs/DESIGN.md).
  const bool l1_release_at_once = l1_tiles <= 4 * int(gridDim.x);
  // Split L1 units (the FP8 decode variant, FusedMoeParams::l1_split, which the host sets for layers
  // with H >= 4096): each L1 tile runs as two halves of 64 channels on two blocks, so that a call of
  // up to two waves of L1 tiles streams its weights from up to twice as many SMs
  // (docs/MEGAKERNEL.md). Every block decides from its own copy of the layout, so all agree. A grid
  // of one block would hold both halves of a pair (deadlock). (Recomputed after the GEMMs from the
  // same tables rather than held across them.)
  const auto split_call = [&](int tiles) {
    constexpr bool kCanSplit = Cfg::L1::kSplitN && !Cfg::kHasStorer;
    // Even K blocks: a split unit of at most 64 rows takes two per stage.
    return kCanSplit && p.l1_split != 0 && gridDim.x >= 2 && tiles <= 2 * int(gridDim.x) &&
           tiles <= layout::CommLocalLayout::kSplitMaxPairs && (p.l1.k / 128) % 2 == 0;
  };
  const bool split = split_call(l1_tiles);
  const gemm::SplitExchange split_x{
      reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.split_exchange_offset()),
      reinterpret_cast<float*>(p.dispatch.local_ws + loc.split_exchange_offset() +
                               layout::CommLocalLayout::split_counter_bytes())};
  if (threadIdx.x == 0) comm::stamp_phase(p.phase_ts, kPhaseDispatchDone);
  diag::trace(diag::kFusedBarrier1);

  // L1 (x_pool W1'^T -> SwiGLU -> a_pool) and L2 (a_pool W2^T -> o_pool) on one ring.
  fused_gemm_tiles<typename Cfg::L1, typename Cfg::L2>(
      &map_a1, &map_a1_64, &map_b1, &map_d1, p.l1, &map_a2, &map_a2_64, &map_b2, &map_d2, p.l2, pipe, smem, arrive,
      uint32_t(comm::dispatch_detail::pull_slices(p.dispatch.shape)), ready, claims ? claim : nullptr, p.b_first != 0,
      l1_release_at_once, p.phase_ts, &map_b1_64, split ? &split_x : nullptr);
  diag::trace(diag::kFusedGemm);
  comm::grid_barrier(barrier_word, site);
  if (threadIdx.x == 0) comm::stamp_phase(p.phase_ts, kPhaseCombineStart);
  diag::trace(diag::kFusedBarrier2);

  // Every block has pulled: the sources' staging is free (dispatch's phase 4).
  if (blockIdx.x == 0) comm::dispatch_finish_reread(p.dispatch);

  // Every L2 tile has been loaded: reset the arrival and ready counters this call used (the pool's
  // expert_offset[E_loc] rows), so the next call starts from 0 without a memset launch.
  {
    // L1-cached: every thread of the grid reads this word here (ptx::ld_ca_s32).
    const int used_rows = ptx::ld_ca_s32(p.l1.expert_offset + p.l1.num_groups);
    // Why the clamp: counts from peers that disagree with this pool must not make us write past
    // the counters (the dispatch drops such rows and reports them).
    const int used = min(int(loc.mblock_ready_count()),
                         (used_rows + layout::CommLocalLayout::kReadyBlockRows - 1) / layout::CommLocalLayout::kReadyBlockRows);
    for (int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x); i < used; i += int(gridDim.x * blockDim.x)) {
      ready[i] = 0;
      arrive[i] = 0;
    }
    // Every claim (one per tile after the block's first, and one past the end, per block and GEMM)
    // returned before the barrier.
    if (blockIdx.x == 0 && threadIdx.x < 2) claim[threadIdx.x] = 0;
    // The split exchange's counters: one per L1 tile and math warpgroup.
    const int tiles = gemm::make_scheduler<typename Cfg::L1>(p.l1).num_tiles();
    if (split_call(tiles)) {
      uint32_t* ctr = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.split_exchange_offset());
      for (int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x); i < 2 * tiles;
           i += int(gridDim.x * blockDim.x))
        ctr[i] = 0;
    }
  }
  diag::trace(diag::kFusedReset);

  // Combine: partial sums to the source ranks, y at home.
  if (p.combine.shape.partial_bytes == 4) {
    comm::combine_phases<4, Cfg::kWarps>(p.combine);
  } else {
    comm::combine_phases<2, Cfg::kWarps>(p.combine);
  }
  if (p.phase_ts) {
    __syncthreads();
    if (threadIdx.x == 0) comm::stamp_phase(p.phase_ts, kPhaseEnd);
  }
  diag::trace(diag::kFusedEnd);
}

}  // namespace epmoe::fused
