// FP8 e4m3 mainloop of one math warpgroup: 64 rows x 256 columns of D over the whole K.
// Scales: activation 1x128 (per row, per 128-wide K block), weight 128x128. As in DeepSeek-V3
// inference on Hopper, each 128-wide K block is accumulated by the tensor cores into a scratch
// accumulator and then "promoted": added into the fp32 result times a_scale[row] * b_scale.
// Why promotion: the FP8 tensor-core accumulator keeps fewer mantissa bits than fp32, so long
// K sums drift; 128-deep partial sums stay exact enough, and the scales must be applied per
// K block anyway.
// Why two N halves of 128: a 64 x 256 scratch accumulator next to the 64 x 256 result would
// need 256 registers per thread; one 64 x 128 scratch, reused for both halves, fits in 232. The
// megakernel's decode variant splits the same 64 scratch registers into two 64 x 64 quarters
// (block_math_quarters).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_desc.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/math.cuh"
#include "device/ptx/warp.cuh"
#include "device/ptx/wgmma.cuh"

namespace epmoe::gemm {

template <int kStages, class Layout>
struct Sm90Fp8Mainloop {
  static constexpr int kBlockK = 128;  // e4m3 elements per 128-byte row
  static constexpr int kWgmmaK = 32;
  static_assert(kBlockK == kScaleBlock, "promotion happens once per 128-wide scale block of K");
  static_assert(kBlockN == 2 * kHalfN && kHalfN == kScaleBlock, "each N half has exactly one weight scale block");
  using Pipe = pipeline::TmaPipeline<kStages>;
  using State = pipeline::PipelineState<kStages>;

  // The math of one K block whose stage has landed: two N halves of four wgmma each, each promoted
  // into acc with its scales (activation sa_lo / sa_hi for this thread's two rows; the weight scale
  // of half h at shared-window address sb + 4 h, in the stage). release() hands the stage back.
  // Each half loads its weight scale before its batch, so that one scale register is live at a time
  // in a loop that runs at its register budget.
  struct Nothing {
    __device__ __forceinline__ void operator()() const {}
  };
  // acc[kBase + j] += scratch[j] * (x < 2 ? s0 : s1) for the n-wide fragment scratch (x = j % 4:
  // columns 0, 1 on this thread's first row, 2, 3 on its second).
  template <int kBase, int kN>
  __device__ __forceinline__ static void promote(float (&acc)[128], const float (&scratch)[kN], float s0, float s1) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i) {
      acc[kBase + 4 * i + 0] += scratch[4 * i + 0] * s0;
      acc[kBase + 4 * i + 1] += scratch[4 * i + 1] * s0;
      acc[kBase + 4 * i + 2] += scratch[4 * i + 2] * s1;
      acc[kBase + 4 * i + 3] += scratch[4 * i + 3] * s1;
    }
  }
  template <class Release, class AfterRelease = Nothing>
  __device__ __forceinline__ static void block_math(float (&acc)[128], float (&tmp)[64], uint32_t a_lo, uint32_t b_lo,
                                                    float sa_lo, float sa_hi, uint32_t sb,
                                                    const Release& release, const AfterRelease& after_release = {}) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t bh_lo = b_lo + uint32_t(h) * ((kHalfN * Layout::kRowBytes) >> 4);
      const float sb_h = ptx::ld_shared_f32(sb + 4u * uint32_t(h));
      ptx::fence_operands(tmp);
      ptx::wgmma_fence_sync_aligned();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k)
        ptx::wgmma_m64n128k32_f32_e4m3_e4m3(tmp, smem_desc_from_lo(a_lo + uint32_t(k * kWgmmaK / 16)),
                                            smem_desc_from_lo(bh_lo + uint32_t(k * kWgmmaK / 16)), k > 0 ? 1u : 0u);
      ptx::wgmma_commit_group_sync_aligned();
      ptx::wgmma_wait_group_sync_aligned<0>();
      ptx::fence_operands(tmp);
      // The scales are in registers and the tensor cores are done with the stage: hand it back
      // before the last promotion so the producer refills it sooner. One lane arrives for the
      // warp after a __syncwarp, which orders every lane's scale loads from the stage before the
      // arrival. compute-sanitizer racecheck still reports the refill's bulk copy against these
      // loads (it does not count the warp barrier; with one arrival per lane it reports none).
      if (h == 1) {
        release();
        after_release();
      }

      const float s0 = sa_lo * sb_h;
      const float s1 = sa_hi * sb_h;
      if (h == 0)
        promote<0>(acc, tmp, s0, s1);
      else
        promote<64>(acc, tmp, s0, s1);
    }
  }
  // One 64-column quarter of a K block: four m64n64k32 wgmma into the scratch q, committed as one
  // group (B rows 64 quarter.. of the stage at b_lo, A at a_lo; descriptor units).
  __device__ __forceinline__ static void issue_quarter(float (&q)[32], uint32_t a_lo, uint32_t b_lo, int quarter) {
    constexpr uint32_t kQuarterDesc = (kHalfN / 2 * Layout::kRowBytes) >> 4;  // 64 rows of 128 bytes
    const uint32_t bq_lo = b_lo + uint32_t(quarter) * kQuarterDesc;
    ptx::fence_operands(q);
    ptx::wgmma_fence_sync_aligned();
#pragma unroll
    for (int k = 0; k < kBlockK / kWgmmaK; ++k)
      ptx::wgmma_m64n64k32_f32_e4m3_e4m3(q, smem_desc_from_lo(a_lo + uint32_t(k * kWgmmaK / 16)),
                                         smem_desc_from_lo(bq_lo + uint32_t(k * kWgmmaK / 16)), k > 0 ? 1u : 0u);
    ptx::wgmma_commit_group_sync_aligned();
  }
  // block_math for the megakernel's decode K loop (run with kCoverIdle): the same wgmma products
  // and promotions in four N quarters of 64 columns on two 32-register scratches, so that one
  // quarter's batch runs while the one before it is promoted: Q0 and Q1 issued, then per quarter
  // wait for the older batch, promote it, issue the next into its scratch. Why: with halves each K
  // block waits for two whole wgmma batches and promotes each with the tensor pipe idle, and a
  // decode tile's K loop is bound by that and by instruction fetch, not by its loads (ncu, one
  // H200, R = 1, one Qwen3-like token, the halves loop: of the L1 loop's stall samples 37% on the
  // wgmma waits, 23% on fetch, 3% on the stage waits). Same scratch registers as halves (two
  // 32-float scratches for one 64-float one); both weight scales are live at once. The same acc
  // bit for bit (the e2e cases compare the two layer paths): each output element's wgmma sum over
  // the K block and its promotion are those of block_math, an n64 wgmma's column being computed as
  // the n128 one's.
  template <class Release, class AfterRelease = Nothing>
  __device__ __forceinline__ static void block_math_quarters(float (&acc)[128], float (&q0)[32], float (&q1)[32],
                                                             uint32_t a_lo, uint32_t b_lo, float sa_lo, float sa_hi,
                                                             uint32_t sb, const Release& release,
                                                             const AfterRelease& after_release = {}) {
    const auto issue = [&](float (&q)[32], int quarter) { issue_quarter(q, a_lo, b_lo, quarter); };
    // Quarter q holds columns 64 q + 8 i + ..., i.e. acc[32 q + 4 i + x].
    const float sb_0 = ptx::ld_shared_f32(sb);
    issue(q0, 0);
    issue(q1, 1);
    const float sb_1 = ptx::ld_shared_f32(sb + 4u);
    const float s00 = sa_lo * sb_0, s01 = sa_hi * sb_0;
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q0);
    promote<0>(acc, q0, s00, s01);
    issue(q0, 2);
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q1);
    promote<32>(acc, q1, s00, s01);
    issue(q1, 3);
    const float s10 = sa_lo * sb_1, s11 = sa_hi * sb_1;
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q0);
    promote<64>(acc, q0, s10, s11);
    ptx::wgmma_wait_group_sync_aligned<0>();
    // As in block_math: the scales are in registers and the tensor cores are done with the stage.
    release();
    after_release();
    ptx::fence_operands(q1);
    promote<96>(acc, q1, s10, s11);
  }
  // block_math for a split unit of the megakernel's decode L1 (run with `split`): the stage's B
  // tile holds 64 gate rows (B rows 0-63) and the 64 matching up rows (64-127) of one half of an
  // L1 tile's 128-channel group (Sm90TmaProducer, kSplitN). Gate goes to acc[0..31], up to
  // acc[64..95], where a whole tile's first quarter of each half would be, so that the SwiGLU
  // pairing acc[i] with acc[64 + i] holds; acc[32..63] and acc[96..127] stay 0. Each output element
  // gets the same wgmma sum and promotion as in block_math_quarters: the same bits.
  template <class Release>
  __device__ __forceinline__ static void block_math_split(float (&acc)[128], float (&q0)[32], float (&q1)[32],
                                                          uint32_t a_lo, uint32_t b_lo, float sa_lo, float sa_hi,
                                                          uint32_t sb, const Release& release) {
    const auto issue = [&](float (&q)[32], int quarter) { issue_quarter(q, a_lo, b_lo, quarter); };
    const float sb_0 = ptx::ld_shared_f32(sb);
    const float sb_1 = ptx::ld_shared_f32(sb + 4u);
    issue(q0, 0);
    issue(q1, 1);
    const float s00 = sa_lo * sb_0, s01 = sa_hi * sb_0;
    const float s10 = sa_lo * sb_1, s11 = sa_hi * sb_1;
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q0);
    promote<0>(acc, q0, s00, s01);
    ptx::wgmma_wait_group_sync_aligned<0>();
    release();
    ptx::fence_operands(q1);
    promote<64>(acc, q1, s10, s11);
  }
  // block_math_split for a stage that carries two K blocks of a split unit of at most 64 rows
  // (`dbl`, Sm90TmaProducer::k_step): A rows 0-63 and B rows 0-127 hold K block kb, A rows 64-127
  // and B rows 128-255 K block kb + 1; the activation scales of kb + 1 are 64 rows further on
  // (sa_lo1 / sa_hi1) and the weight scales are (gate, up) of kb, then of kb + 1. Each accumulator
  // takes kb's promotion before kb + 1's, as one K block per stage would give it.
  template <class Release>
  __device__ __forceinline__ static void block_math_split2(float (&acc)[128], float (&q0)[32], float (&q1)[32],
                                                           uint32_t a_lo, uint32_t b_lo, float sa_lo0, float sa_hi0,
                                                           float sa_lo1, float sa_hi1, uint32_t sb,
                                                           const Release& release) {
    constexpr uint32_t kAHalfDesc = (kWarpgroupM * Layout::kRowBytes) >> 4;
    const auto issue = [&](float (&q)[32], uint32_t aq_lo, int quarter) { issue_quarter(q, aq_lo, b_lo, quarter); };
    issue(q0, a_lo, 0);
    issue(q1, a_lo, 1);
    const float sb_0 = ptx::ld_shared_f32(sb);
    const float sb_1 = ptx::ld_shared_f32(sb + 4u);
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q0);
    promote<0>(acc, q0, sa_lo0 * sb_0, sa_hi0 * sb_0);
    issue(q0, a_lo + kAHalfDesc, 2);
    const float sb_2 = ptx::ld_shared_f32(sb + 8u);
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q1);
    promote<64>(acc, q1, sa_lo0 * sb_1, sa_hi0 * sb_1);
    issue(q1, a_lo + kAHalfDesc, 3);
    const float sb_3 = ptx::ld_shared_f32(sb + 12u);
    ptx::wgmma_wait_group_sync_aligned<1>();
    ptx::fence_operands(q0);
    promote<0>(acc, q0, sa_lo1 * sb_2, sa_hi1 * sb_2);
    ptx::wgmma_wait_group_sync_aligned<0>();
    release();
    ptx::fence_operands(q1);
    promote<64>(acc, q1, sa_lo1 * sb_3, sa_hi1 * sb_3);
  }
  // f(std::integral_constant<uint32_t, s>{}) for s = 0, 1, ..., in order.
  template <class F, uint32_t... kS>
  __device__ __forceinline__ static void stage_each(const F& f, std::integer_sequence<uint32_t, kS...>) {
    (f(std::integral_constant<uint32_t, kS>{}), ...);
  }

  // idle: none of this warpgroup's 64 rows is valid (a tile of <= 64 tokens, common in decode):
  // take and release every stage without issuing wgmma, which leaves the tensor pipe to the
  // other warpgroup. acc is not written; the epilogue stores no row of it.
  // The weight scales of each K block come with its stage (Layout::sb_offset, stored by the
  // producer thread): a load from global memory here stalled the next wgmma batch at its fence
  // whenever it missed L1 (WARPGROUP.ARRIVE waits for every load in flight to a register).
  // kKeepLast: the stage of the last K block is not released (the deferred L2 epilogue stages the
  // tile's output there; its storer releases it). A template parameter: as a runtime flag it cost
  // the K loop 12 SASS instructions.
  // Returns false when a stage never arrived (the bounded
  // wait expired); st then names it.
  // kPairK: two K blocks per loop trip (the standalone kernels); the fused kernel, at its register
  // cap, keeps one per trip.
  // kCoverIdle (the megakernel's decode variant, no kept stage): every K block in four N quarters
  // (block_math_quarters); and in a `covered` tile (the second
  // warpgroup idle, more K blocks than stages; sm90_math_tiles decides), the idle warpgroup takes
  // and releases only the tile's first stage (it read the tile's slot there) and skips the
  // others, which the first warpgroup's warps release for both (two arrivals each). Why: the idle
  // warpgroup is then free during the mainloop (sm90_math_tiles runs its epilogue's code there once,
  // so that the working warpgroup finds it in the instruction cache), and nothing it does can hold
  // a stage. Why the first stage stays shared: its slot names the tile, and a stage released for
  // the idle warpgroup before it read the slot could be refilled under it.
  // split (kCoverIdle only): the tile is a split unit of the megakernel's decode L1
  // (block_math_split instead of block_math_quarters); dbl: and its stages carry two K blocks each
  // (block_math_split2; num_k_blocks / 2 stages).
  template <bool kKeepLast = false, bool kPairK = false, bool kCoverIdle = false>
  __device__ static bool run(float (&acc)[128], const Pipe& pipe, State& st, int num_k_blocks, int wg, bool idle,
                             bool covered = false, bool split = false, bool dbl = false) {
    static_assert(!kCoverIdle || (!kKeepLast && !kPairK), "the covered release is for the fused decode loop");
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    if (idle) {
      if constexpr (kCoverIdle) {
        const int stages = dbl ? num_k_blocks / 2 : num_k_blocks;
        if (covered) return skip_through(pipe, st, stages, lane);
        return pass_through(pipe, st, stages, lane, false);
      }
      return pass_through(pipe, st, num_k_blocks, lane, kKeepLast);
    }
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;  // this thread's first row in the tile
    // Why 32-bit shared-window addresses from one live base: with generic pointers the loop
    // converted them on every K block (S2R of the shared window base, 64-bit math) on the path
    // between the wgmma batches; ncu put that overhead next to the wgmma waits. Each K block
    // derives the stage's addresses from the base with integer adds.
    // The stage ring starts at the aligned dynamic smem base (dyn_smem_base_s) and its barriers at
    // Layout::kBarOffset from it, in both kernels that run this loop.
    const uint32_t smem_s = __shfl_sync(0xffffffffu, dyn_smem_base_s(), 0);
    // Why the broadcast from lane 0: it tells ptxas that the warpgroup (so every wgmma descriptor
    // input) is the same in every lane; it then builds the descriptors in uniform registers.
    wg = __shfl_sync(0xffffffffu, wg, 0);
    static_assert(Layout::a_offset(1) - Layout::a_offset(0) == Layout::kTileA, "A stages are contiguous");
    static_assert(Layout::b_offset(1) - Layout::b_offset(0) == Layout::kTileB, "B stages are contiguous");
    static_assert(Layout::sa_offset(1) - Layout::sa_offset(0) == Layout::kScaleA, "scale stages are contiguous");
    static_assert(Layout::sb_offset(1) - Layout::sb_offset(0) == Layout::kScaleB, "scale stages are contiguous");
    const uint32_t bars_s = smem_s + Layout::kBarOffset;
    const uint32_t a_lo0 =
        smem_desc_lo_sw128(smem_s + Layout::a_offset(0) + uint32_t(wg) * (kWarpgroupM * Layout::kRowBytes));
    const uint32_t b_lo0 = smem_desc_lo_sw128(smem_s + Layout::b_offset(0));
    const uint32_t sa0 = smem_s + Layout::sa_offset(0) + uint32_t(r0) * 4u;
    const uint32_t sb0 = smem_s + Layout::sb_offset(0);
    // The scratch: one 64-float half (block_math) or two 32-float quarters (block_math_quarters).
    float tmp[64];
    float q0[32], q1[32];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

    // Why the wait's result is carried instead of returned from: an exit from inside the loop on a
    // per-lane value makes the loop divergent for ptxas, which then wraps every wait in
    // divergence bookkeeping on the path between two wgmma batches (ncu: branch-resolving stalls
    // at the loop head, ~60 instructions per K block). A timed-out loop skips its later waits,
    // computes garbage it never stores, and returns false naming the first stage that expired.
    const State st0 = st;
    uint32_t failed = 0;
    int failed_kb = 0;
    // One K block: wait for its stage, two N halves (kCoverIdle: four quarters) of four wgmma each,
    // promotion.
    const auto k_block = [&](int kb, auto split_const) {
      // Why the broadcast: the stage index is then provably the same in every lane, and ptxas
      // steps the wgmma descriptors in uniform registers (without it: 32 R2UR per K block).
      st.index = __shfl_sync(0xffffffffu, st.index, 0);
      const uint32_t was = failed;
      failed = pipe.consumer_wait_flag(bars_s, st, failed);
      failed_kb = failed > was ? kb : failed_kb;
      const float sa_lo = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA);
      const float sa_hi = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA + 32u);
      constexpr int kMode = decltype(split_const)::value;
      const uint32_t a_lo = a_lo0 + st.index * (Layout::kTileA >> 4);
      const uint32_t b_lo = b_lo0 + st.index * (Layout::kTileB >> 4);
      const auto release = [&] {
        // Why __syncwarp: lane 0 arrives for the whole warp, so every lane's scale loads from the
        // stage must be ordered before its arrival (see block_math).
        __syncwarp();
        if constexpr (kCoverIdle) {
          if (lane == 0) pipe.consumer_release(bars_s, st, covered && kb > 0 ? 2u : 1u);
        } else {
          if (lane == 0 && (!kKeepLast || kb + 1 < num_k_blocks)) pipe.consumer_release(bars_s, st);
        }
      };
      if constexpr (kCoverIdle && kMode == 2) {
        // The second K block's activation scales: 64 rows further on.
        const float sa_lo1 = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA + 4u * kWarpgroupM);
        const float sa_hi1 = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA + 4u * kWarpgroupM + 32u);
        block_math_split2(acc, q0, q1, a_lo, b_lo, sa_lo, sa_hi, sa_lo1, sa_hi1, sb0 + st.index * Layout::kScaleB,
                          release);
      } else if constexpr (kCoverIdle && kMode == 1)
        block_math_split(acc, q0, q1, a_lo, b_lo, sa_lo, sa_hi, sb0 + st.index * Layout::kScaleB, release);
      else if constexpr (kCoverIdle)
        block_math_quarters(acc, q0, q1, a_lo, b_lo, sa_lo, sa_hi, sb0 + st.index * Layout::kScaleB, release);
      else
        block_math(acc, tmp, a_lo, b_lo, sa_lo, sa_hi, sb0 + st.index * Layout::kScaleB, release);
      ++st;
    };
    using Whole = std::integral_constant<int, 0>;
    int kb = 0;
    if constexpr (kPairK) {
      for (; kb + 1 < num_k_blocks; kb += 2) {
        k_block(kb, Whole{});
        k_block(kb + 1, Whole{});
      }
      if (kb < num_k_blocks) k_block(kb, Whole{});
    } else if constexpr (kCoverIdle) {
      if (split && dbl) {
        // kb counts stages here (two K blocks each), as the release and a timeout's stage do.
        for (; kb < num_k_blocks / 2; ++kb) k_block(kb, std::integral_constant<int, 2>{});
      } else if (split) {
        for (; kb < num_k_blocks; ++kb) k_block(kb, std::integral_constant<int, 1>{});
      } else {
        for (; kb < num_k_blocks; ++kb) k_block(kb, Whole{});
      }
    } else {
      for (; kb < num_k_blocks; ++kb) k_block(kb, Whole{});
    }
    if (failed) {
      st = st0;
      for (int kb = 0; kb < failed_kb; ++kb) ++st;
      return false;
    }
    return true;
  }

  // run for the standalone kernels when every tile's K blocks fill whole rings (num_k_blocks a
  // multiple of kStages, e.g. K = 2048 and 7168): each tile then starts at stage 0, and the loop
  // runs one ring per trip with every stage index a compile-time constant, so the barrier, tile
  // and scale addresses are constant offsets from one base and the parity flips once per trip.
  // Why: the per-K-block stage arithmetic (the broadcast stage index, the address products, the
  // wrap test, the lane test rebuilt from the thread index at the loop head) cost ~25 SASS
  // instructions per K block on the path between two wgmma batches. Same operations, same order,
  // same results as run<kKeepLast, true>.
  template <bool kKeepLast>
  __device__ static bool run_rings(float (&acc)[128], const Pipe& pipe, State& st, int num_k_blocks, int wg,
                                   bool idle) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    if (idle) return pass_through(pipe, st, num_k_blocks, lane, kKeepLast);
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;
    const uint32_t smem_s = __shfl_sync(0xffffffffu, dyn_smem_base_s(), 0);
    wg = __shfl_sync(0xffffffffu, wg, 0);
    const uint32_t bars_s = smem_s + Layout::kBarOffset;
    const uint32_t a_lo0 =
        smem_desc_lo_sw128(smem_s + Layout::a_offset(0) + uint32_t(wg) * (kWarpgroupM * Layout::kRowBytes));
    const uint32_t b_lo0 = smem_desc_lo_sw128(smem_s + Layout::b_offset(0));
    const uint32_t sa0 = smem_s + Layout::sa_offset(0) + uint32_t(r0) * 4u;
    const uint32_t sb0 = smem_s + Layout::sb_offset(0);
    float tmp[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

    // failed: 0, or 1 + the K block whose wait expired first (see run for why it is carried).
    uint32_t failed = 0;
    uint32_t phase = st.phase;
    // ready: the early test of the next stage's phase, made once the current stage's wgmma are
    // done and before its last promotion, saw it complete (the wait at the next stage's top then
    // probes nothing). Why: the probe's round trip then overlaps the promotion's FFMA instead of
    // sitting between the promotion and the next wgmma batch.
    uint32_t ready = 0;
    for (int kb = 0; kb < num_k_blocks; kb += kStages) {
      const bool last_ring = kb + kStages >= num_k_blocks;
      // Why opaque, then a broadcast, once per ring: with the stage constant, the 32 descriptors
      // of a ring are loop invariants, and ptxas hoisted them out of the loop into ordinary
      // registers, which spilled the accumulators. Made opaque here, they are rebuilt each ring
      // from one value; the broadcast from lane 0 keeps them in uniform registers.
      uint32_t a_lo = a_lo0, b_lo = b_lo0;
      ptx::opaque(a_lo);
      ptx::opaque(b_lo);
      a_lo = __shfl_sync(0xffffffffu, a_lo, 0);
      b_lo = __shfl_sync(0xffffffffu, b_lo, 0);
      const auto stage = [&](auto s_const) {
        constexpr uint32_t s = decltype(s_const)::value;
        failed = Pipe::template consumer_wait_tested_at<s>(bars_s, phase, failed, ready, uint32_t(kb) + s + 1u);
        const float sa_lo = ptx::ld_shared_f32(sa0 + s * Layout::kScaleA);
        const float sa_hi = ptx::ld_shared_f32(sa0 + s * Layout::kScaleA + 32u);
        block_math(acc, tmp, a_lo + s * (Layout::kTileA >> 4), b_lo + s * (Layout::kTileB >> 4), sa_lo, sa_hi,
                   sb0 + s * Layout::kScaleB, [&] {
                     __syncwarp();
                     const bool keep = kKeepLast && s + 1 == uint32_t(kStages) && last_ring;
                     if (!keep && ptx::elect_one_sync()) Pipe::template consumer_release_at<s>(bars_s);
                   },
                   [&] {
                     constexpr uint32_t sn = (s + 1) % uint32_t(kStages);
                     ready = Pipe::template consumer_test_at<sn>(bars_s, sn == 0 ? phase ^ 1u : phase);
                   });
      };
      stage_each(stage, std::make_integer_sequence<uint32_t, kStages>{});
      phase ^= 1u;
    }
    // The tile used whole rings: the index is back at 0 (st.index == 0 on entry) and the parity
    // flipped once per ring.
    if (failed) {
      for (uint32_t kb = 0; kb + 1 < failed; ++kb) ++st;
      return false;
    }
    st.phase = phase;
    return true;
  }

  __device__ static bool pass_through(const Pipe& pipe, State& st, int num_k_blocks, int lane, bool keep_last) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      if (!pipe.consumer_wait(st)) return false;
      // Why __syncwarp: lane 0 releases for the whole warp, and in the fused kernel every lane read
      // the stage's tile slot before (sm90_math_tiles); the producer rewrites it once released.
      __syncwarp();
      if (lane == 0 && (!keep_last || kb + 1 < num_k_blocks)) pipe.consumer_release(st);
      ++st;
    }
    return true;
  }

  // The idle warpgroup's side of kCoverIdle (see run): the tile's first stage, then past the rest.
  __device__ static bool skip_through(const Pipe& pipe, State& st, int num_k_blocks, int lane) {
    if (!pipe.consumer_wait(st)) return false;
    __syncwarp();
    if (lane == 0) pipe.consumer_release(st);
    for (int kb = 0; kb < num_k_blocks; ++kb) ++st;
    return true;
  }
};

}  // namespace epmoe::gemm
