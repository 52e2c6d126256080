// BF16 mainloop of one math warpgroup: 64 rows x 256 columns of D over the whole K, accumulated
// in fp32 by the tensor cores directly (no scales, no promotion), one m64n256k16 per K step.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_desc.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/math.cuh"
#include "device/ptx/wgmma.cuh"

namespace epmoe::gemm {

template <int kStages, class Layout>
struct Sm90Bf16Mainloop {
  static constexpr int kBlockK = 64;  // bf16 elements per 128-byte row
  static constexpr int kWgmmaK = 16;
  static_assert(kBlockN == 256, "one m64n256 wgmma covers the tile's N");
  using Pipe = pipeline::TmaPipeline<kStages>;
  using State = pipeline::PipelineState<kStages>;

  // Returns false when a stage never arrived (the bounded
  // wait expired); st then names it.
  // kKeepLast: see the FP8 mainloop.
  // kPairK: accepted for the FP8 loop's interface; this loop runs one K block per trip.
  template <bool kKeepLast = false, bool kPairK = false>
  __device__ static bool run(float (&acc)[128], const Pipe& pipe, State& st, int num_k_blocks, int wg, bool idle) {
    constexpr bool keep_last = kKeepLast;
    const int lane = threadIdx.x % 32;
    if (idle) {
      // None of this warpgroup's rows is valid: release every stage without wgmma (see the FP8
      // mainloop).
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        if (!pipe.consumer_wait(st)) return false;
        __syncwarp();  // see the FP8 mainloop's pass_through
        if (lane == 0 && (!keep_last || kb + 1 < num_k_blocks)) pipe.consumer_release(st);
        ++st;
      }
      return true;
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    ptx::fence_operands(acc);

    // Why a one-behind release: wait_group<1> lets block kb's wgmmas run while this warp
    // already waits for stage kb+1; stage kb-1 is then known to be read and goes back.
    // 32-bit shared-window addresses from one live base (see the FP8 mainloop).
    // The stage ring and its barriers as in the FP8 mainloop.
    uint32_t smem_s = dyn_smem_base_s();
    const uint32_t zero = uint32_t(num_k_blocks) >> 31;  // see the FP8 mainloop
    static_assert(Layout::a_offset(1) - Layout::a_offset(0) == Layout::kTileA, "A stages are contiguous");
    static_assert(Layout::b_offset(1) - Layout::b_offset(0) == Layout::kTileB, "B stages are contiguous");
    State prev = st;
    uint32_t bars_s = smem_s + Layout::kBarOffset;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      // The loop-carried add keeps the base in a register (see the FP8 mainloop).
      smem_s = ptx::add_u32_volatile(smem_s, zero);
      bars_s = smem_s + Layout::kBarOffset;
      const uint32_t a_lo0 =
          smem_desc_lo_sw128(smem_s + Layout::a_offset(0) + uint32_t(wg) * (kWarpgroupM * Layout::kRowBytes));
      const uint32_t b_lo0 = smem_desc_lo_sw128(smem_s + Layout::b_offset(0));
      if (!pipe.consumer_wait(bars_s, st)) {
        ptx::wgmma_wait_group_sync_aligned<0>();
        return false;
      }
      const uint32_t a_lo = a_lo0 + st.index * (Layout::kTileA >> 4);
      const uint32_t b_lo = b_lo0 + st.index * (Layout::kTileB >> 4);
      ptx::wgmma_fence_sync_aligned();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k)
        ptx::wgmma_m64n256k16_f32_bf16_bf16(acc, smem_desc_from_lo(a_lo + uint32_t(k * kWgmmaK * 2 / 16)),
                                            smem_desc_from_lo(b_lo + uint32_t(k * kWgmmaK * 2 / 16)), 1u);
      ptx::wgmma_commit_group_sync_aligned();
      ptx::wgmma_wait_group_sync_aligned<1>();
      if (kb > 0) {
        if (lane == 0) pipe.consumer_release(bars_s, prev);
        ++prev;
      }
      ++st;
    }
    ptx::wgmma_wait_group_sync_aligned<0>();
    ptx::fence_operands(acc);
    if (num_k_blocks > 0 && !keep_last) {
      if (lane == 0) pipe.consumer_release(bars_s, prev);
    }
    return true;
  }
};

}  // namespace epmoe::gemm
