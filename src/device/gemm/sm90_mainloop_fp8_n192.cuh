// FP8 e4m3 mainloop of one math warpgroup on the 192-column tile: 64 rows x 192 columns of D over
// the whole K (the FP8 L2 kernel's variant). Promotion as in sm90_mainloop_fp8.cuh, but the whole
// N goes into one scratch accumulator: per K block four m64n192k32 wgmma, one drain, one
// promotion (the 256-column loop drains twice, once per N half).
// Why 192: a 64 x 192 scratch next to the 64 x 192 result takes 192 registers, which fits the
// math budget of 232; 256 would not. Per K block each math warp then issues 96 FFMA for 192
// columns in one pass, where the 256-column loop needs two passes of 64 with a drain each. Its
// stages are 40.5 KB, so five fit.
// Weight scales: the tile's 192 columns start at 192 n_block, which is a multiple of 128 for even
// n_block and 64 past one for odd n_block. So the columns straddle two 128-wide scale blocks, and
// the switch falls after column 128 (even) or 64 (odd) of the tile: 8-column group 16 or 8 of the
// fragment. kOdd makes that a compile-time split, with no select per group.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_desc.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/wgmma.cuh"

namespace epmoe::gemm {

template <int kStages, class Layout>
struct Sm90Fp8MainloopN192 {
  static constexpr int kBlockK = 128;  // e4m3 elements per 128-byte row
  static constexpr int kWgmmaK = 32;
  static constexpr int kTileN = 192;
  static constexpr int kAcc = kTileN / 2;  // accumulator floats per thread
  static_assert(Layout::kTileN == kTileN, "the smem layout holds 192-row weight tiles");
  static_assert(kBlockK == kScaleBlock, "promotion happens once per 128-wide scale block of K");
  using Pipe = pipeline::TmaPipeline<kStages>;
  using State = pipeline::PipelineState<kStages>;

  // As Sm90Fp8Mainloop::run. b_scale[0]: the scale block of the tile's first columns, b_scale[1]:
  // the next one (nullptr when it lies past N: those columns are computed and never stored).
  // odd: n_block is odd (the scale switch falls after column 64, else after 128).
  template <bool kKeepLast = false>
  __device__ static bool run(float (&acc)[kAcc], const Pipe& pipe, State& st, int num_k_blocks,
                             const float* const (&b_scale)[2], int wg, bool idle, bool odd) {
    return odd ? run_impl<kKeepLast, true>(acc, pipe, st, num_k_blocks, b_scale, wg, idle)
               : run_impl<kKeepLast, false>(acc, pipe, st, num_k_blocks, b_scale, wg, idle);
  }

 private:
  template <bool kKeepLast, bool kOdd>
  __device__ static bool run_impl(float (&acc)[kAcc], const Pipe& pipe, State& st, int num_k_blocks,
                                  const float* const (&b_scale)[2], int wg, bool idle) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    if (idle) return pass_through(pipe, st, num_k_blocks, lane, kKeepLast);
    constexpr int kSwitchGroup = kOdd ? 8 : 16;  // first 8-column group of the second scale block
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;  // this thread's first row in the tile
    // 32-bit shared-window addresses from one base; the warpgroup and, per K block, the stage
    // index broadcast from lane 0 (uniform-register descriptors); the stage wait in one asm block
    // with its timeout carried, not returned from: all as in Sm90Fp8Mainloop::run, and why.
    const uint32_t smem_s = __shfl_sync(0xffffffffu, dyn_smem_base_s(), 0);
    wg = __shfl_sync(0xffffffffu, wg, 0);
    static_assert(Layout::a_offset(1) - Layout::a_offset(0) == Layout::kTileA, "A stages are contiguous");
    static_assert(Layout::b_offset(1) - Layout::b_offset(0) == Layout::kTileB, "B stages are contiguous");
    static_assert(Layout::sa_offset(1) - Layout::sa_offset(0) == Layout::kScaleA, "scale stages are contiguous");
    const uint32_t bars_s = smem_s + Layout::kBarOffset;
    const uint32_t a_lo0 =
        smem_desc_lo_sw128(smem_s + Layout::a_offset(0) + uint32_t(wg) * (kWarpgroupM * Layout::kRowBytes));
    const uint32_t b_lo0 = smem_desc_lo_sw128(smem_s + Layout::b_offset(0));
    const uint32_t sa0 = smem_s + Layout::sa_offset(0) + uint32_t(r0) * 4u;
    const float* const sp0 = b_scale[0];
    const float* const sp1 = b_scale[1] != nullptr ? b_scale[1] : b_scale[0];
    float tmp[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    const State st0 = st;
    uint32_t failed = 0;
    int failed_kb = 0;

    for (int kb = 0; kb < num_k_blocks; ++kb) {
      st.index = __shfl_sync(0xffffffffu, st.index, 0);
      // Why before the wait: the scale loads' latency hides behind the barrier wait.
      const float sb0 = ptx::ld_nc_f32(sp0 + kb);
      const float sb1 = ptx::ld_nc_f32(sp1 + kb);
      const uint32_t was = failed;
      failed = pipe.consumer_wait_flag(bars_s, st, failed);
      failed_kb = failed > was ? kb : failed_kb;
      const float sa_lo = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA);
      const float sa_hi = ptx::ld_shared_f32(sa0 + st.index * Layout::kScaleA + 32u);
      const uint32_t a_lo = a_lo0 + st.index * (Layout::kTileA >> 4);
      const uint32_t b_lo = b_lo0 + st.index * (Layout::kTileB >> 4);
      ptx::fence_operands(tmp);
      ptx::wgmma_fence_sync_aligned();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k)
        ptx::wgmma_m64n192k32_f32_e4m3_e4m3(tmp, smem_desc_from_lo(a_lo + uint32_t(k * kWgmmaK / 16)),
                                            smem_desc_from_lo(b_lo + uint32_t(k * kWgmmaK / 16)), k > 0 ? 1u : 0u);
      ptx::wgmma_commit_group_sync_aligned();
      ptx::wgmma_wait_group_sync_aligned<0>();
      ptx::fence_operands(tmp);
      // The scales are in registers and the tensor cores are done with the stage: hand it back
      // before the promotion (the __syncwarp: see Sm90Fp8Mainloop).
      __syncwarp();
      if (lane == 0 && (!kKeepLast || kb + 1 < num_k_blocks)) pipe.consumer_release(bars_s, st);

      const float s00 = sa_lo * sb0, s10 = sa_hi * sb0;  // first scale block, rows r0 and r0 + 8
      const float s01 = sa_lo * sb1, s11 = sa_hi * sb1;  // second scale block
#pragma unroll
      for (int i = 0; i < kAcc / 4; ++i) {
        const float s0 = i < kSwitchGroup ? s00 : s01;
        const float s1 = i < kSwitchGroup ? s10 : s11;
        acc[4 * i + 0] += tmp[4 * i + 0] * s0;
        acc[4 * i + 1] += tmp[4 * i + 1] * s0;
        acc[4 * i + 2] += tmp[4 * i + 2] * s1;
        acc[4 * i + 3] += tmp[4 * i + 3] * s1;
      }
      ++st;
    }
    if (failed) {
      st = st0;
      for (int kb = 0; kb < failed_kb; ++kb) ++st;
      return false;
    }
    return true;
  }

  __device__ static bool pass_through(const Pipe& pipe, State& st, int num_k_blocks, int lane, bool keep_last) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      if (!pipe.consumer_wait(st)) return false;
      __syncwarp();
      if (lane == 0 && (!keep_last || kb + 1 < num_k_blocks)) pipe.consumer_release(st);
      ++st;
    }
    return true;
  }
};

}  // namespace epmoe::gemm
