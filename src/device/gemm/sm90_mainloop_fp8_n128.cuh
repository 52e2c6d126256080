// FP8 e4m3 mainloop of one math warpgroup on a 128-column tile: 64 rows x 128 columns of D over
// the whole K, with two scratch accumulators (opt-in FP8 L2 tiles, docs/DESIGN.md).
// Scales and promotion as in Sm90Fp8Mainloop: each 128-wide K block goes through the tensor cores
// into a scratch accumulator, then acc += scratch * a_scale[row] * b_scale[k_block].
// Why two scratches: with one, a warpgroup cannot issue the next K block's wgmma before it has
// promoted the current one, so its tensor stream stops at every promotion and only the other
// warpgroup covers the gap (our 128 x 256 "halves", ~half the SM's rate per warpgroup). With
// two, K block kb + 1 runs on the tensor cores while kb is promoted: one warpgroup alone kept the
// tensor pipe 81% busy in the probe (tools/probes/wgmma_probe.cu, variant 3), two 95% unfed.
// Why 128 columns: 64 accumulators + two 64-float scratches fit the 232-register budget; at 256
// columns the second scratch would not.
// Why chunks of four K blocks that end with nothing in flight: ptxas 13.0 tracks a partial wgmma
// wait only in straight-line code; a group in flight across a loop back edge while the loop reads
// the other scratch makes it serialize every wgmma (C7514). K blocks past a multiple of four run
// one at a time.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_desc.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/wgmma.cuh"

namespace epmoe::gemm {

// kPair: the CTA-pair kernel (Sm90TmaProducer with kPair): a stage is released to both CTAs of the
// cluster (the other CTA's producer multicasts into this CTA's copy of it).
template <int kStages, class Layout, bool kPair = false>
struct Sm90Fp8MainloopN128 {
  static constexpr int kBlockK = 128;  // e4m3 elements per 128-byte row
  static constexpr int kWgmmaK = 32;
  static constexpr int kTileN = 128;
  static_assert(kBlockK == kScaleBlock && kTileN == kScaleBlock, "one weight scale per tile and K block");
  static_assert(Layout::kTileN == kTileN, "the smem layout holds 128-row weight tiles");
  using Pipe = pipeline::TmaPipeline<kStages>;
  using State = pipeline::PipelineState<kStages>;

  // As Sm90Fp8Mainloop::run, for 64 rows x 128 columns: b_scale is the tile's weight scales, one
  // float per K block. Returns false when a stage never arrived (the bounded wait expired); st
  // then names it.
  template <bool kKeepLast = false>
  __device__ static bool run(float (&acc)[64], const Pipe& pipe, State& st, int num_k_blocks, const float* b_scale,
                             int wg, bool idle) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    if (idle) return pass_through(pipe, st, num_k_blocks, lane, kKeepLast);
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;  // this thread's first row in the tile
    // A live 32-bit shared-window base, kept in a register by a loop-carried add of zero: see
    // Sm90Fp8Mainloop.
    uint32_t smem_s = dyn_smem_base_s();
    const uint32_t zero = uint32_t(num_k_blocks) >> 31;
    static_assert(Layout::a_offset(1) - Layout::a_offset(0) == Layout::kTileA, "A stages are contiguous");
    static_assert(Layout::b_offset(1) - Layout::b_offset(0) == Layout::kTileB, "B stages are contiguous");
    static_assert(Layout::sa_offset(1) - Layout::sa_offset(0) == Layout::kScaleA, "scale stages are contiguous");
    float t0[64], t1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    State rel = st;  // the stage of the oldest K block not yet released

    // K block kb into scratch t: wait for its stage, four wgmma, commit. Not waited for here.
    const auto issue = [&](float (&t)[64]) -> bool {
      const uint32_t bars_s = smem_s + Layout::kBarOffset;
      if (!pipe.consumer_wait(bars_s, st)) return false;
      const uint32_t a_lo = smem_desc_lo_sw128(smem_s + Layout::a_offset(0) +
                                               uint32_t(wg) * (kWarpgroupM * Layout::kRowBytes)) +
                            st.index * (Layout::kTileA >> 4);
      const uint32_t b_lo = smem_desc_lo_sw128(smem_s + Layout::b_offset(0)) + st.index * (Layout::kTileB >> 4);
      ptx::fence_operands(t);
      ptx::wgmma_fence_sync_aligned();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k)
        ptx::wgmma_m64n128k32_f32_e4m3_e4m3(t, smem_desc_from_lo(a_lo + uint32_t(k * kWgmmaK / 16)),
                                            smem_desc_from_lo(b_lo + uint32_t(k * kWgmmaK / 16)), k > 0 ? 1u : 0u);
      ptx::wgmma_commit_group_sync_aligned();
      ++st;
      return true;
    };
    // The activation scales of the oldest unreleased K block (its stage is still held) times sb.
    const auto scales = [&](float sb, float& s0, float& s1) {
      const uint32_t sa = smem_s + Layout::sa_offset(0) + rel.index * Layout::kScaleA + uint32_t(r0) * 4u;
      s0 = ptx::ld_shared_f32(sa) * sb;
      s1 = ptx::ld_shared_f32(sa + 32u) * sb;
    };
    // After the wgmma of that K block completed: hand its stage back (lane 0 for the warp, as in
    // Sm90Fp8Mainloop), unless it is the tile's last and kKeepLast keeps it.
    const auto release = [&](int kb) {
      __syncwarp();
      if (lane == 0 && (!kKeepLast || kb + 1 < num_k_blocks)) {
        if constexpr (kPair)
          release_pair(smem_s + Layout::kBarOffset, rel);
        else
          pipe.consumer_release(smem_s + Layout::kBarOffset, rel);
      }
      ++rel;
    };
    const auto promote = [&](const float (&t)[64], float s0, float s1) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        acc[4 * i + 0] += t[4 * i + 0] * s0;
        acc[4 * i + 1] += t[4 * i + 1] * s0;
        acc[4 * i + 2] += t[4 * i + 2] * s1;
        acc[4 * i + 3] += t[4 * i + 3] * s1;
      }
    };
    const auto fail = [&] {
      ptx::wgmma_wait_group_sync_aligned<0>();
      return false;
    };

    // Why the four steps are written out: the same chunk with the retire step (scales, wait, fence,
    // release, promote) as one lambda compiled to 32 more instructions and, in one call, ran at
    // 0.93 / 0.92 of the 256-column kernel against 0.96 / 0.93 for this form: maybe run spread,
    // but this is the form that was measured.
    int kb = 0;
    for (; kb + 4 <= num_k_blocks; kb += 4) {
      asm volatile("add.u32 %0, %0, %1;" : "+r"(smem_s) : "r"(zero));
      // Why before the waits: the weight scales' latency hides behind them.
      const float sb0 = ptx::ld_nc_f32(b_scale + kb);
      const float sb1 = ptx::ld_nc_f32(b_scale + kb + 1);
      const float sb2 = ptx::ld_nc_f32(b_scale + kb + 2);
      const float sb3 = ptx::ld_nc_f32(b_scale + kb + 3);
      float s0, s1;
      if (!issue(t0)) return fail();
      if (!issue(t1)) return fail();
      scales(sb0, s0, s1);
      ptx::wgmma_wait_group_sync_aligned<1>();
      ptx::fence_operands(t0);
      release(kb);
      promote(t0, s0, s1);
      if (!issue(t0)) return fail();
      scales(sb1, s0, s1);
      ptx::wgmma_wait_group_sync_aligned<1>();
      ptx::fence_operands(t1);
      release(kb + 1);
      promote(t1, s0, s1);
      if (!issue(t1)) return fail();
      scales(sb2, s0, s1);
      ptx::wgmma_wait_group_sync_aligned<1>();
      ptx::fence_operands(t0);
      release(kb + 2);
      promote(t0, s0, s1);
      scales(sb3, s0, s1);
      ptx::wgmma_wait_group_sync_aligned<0>();
      ptx::fence_operands(t1);
      release(kb + 3);
      promote(t1, s0, s1);
    }
    for (; kb < num_k_blocks; ++kb) {
      asm volatile("add.u32 %0, %0, %1;" : "+r"(smem_s) : "r"(zero));
      const float sb = ptx::ld_nc_f32(b_scale + kb);
      float s0, s1;
      if (!issue(t0)) return fail();
      scales(sb, s0, s1);
      ptx::wgmma_wait_group_sync_aligned<0>();
      ptx::fence_operands(t0);
      release(kb);
      promote(t0, s0, s1);
    }
    return true;
  }

  __device__ static bool pass_through(const Pipe& pipe, State& st, int num_k_blocks, int lane, bool keep_last) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      if (!pipe.consumer_wait(st)) return false;
      __syncwarp();
      if (lane == 0 && (!keep_last || kb + 1 < num_k_blocks)) {
        if constexpr (kPair)
          release_pair(dyn_smem_base_s() + Layout::kBarOffset, st);
        else
          pipe.consumer_release(st);
      }
      ++st;
    }
    return true;
  }

  // One warp's release of stage st in both CTAs of the pair (bars_s: this CTA's barrier block).
  __device__ static void release_pair(uint32_t bars_s, const State& st) {
    const uint32_t empty = bars_s + uint32_t(kStages) * 8u + st.index * 8u;
    ptx::mbarrier_arrive_count_remote(empty, 1);
    ptx::mbarrier_arrive_count_remote(ptx::mapa_shared(empty, (blockIdx.x % 2) ^ 1u), 1);
  }
};

}  // namespace epmoe::gemm
