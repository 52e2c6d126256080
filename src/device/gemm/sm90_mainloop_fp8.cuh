// FP8 e4m3 mainloop of one math warpgroup: 64 rows x 256 columns of D over the whole K.
// Scales: activation 1x128 (per row, per 128-wide K block), weight 128x128. As in DeepSeek-V3
// inference on Hopper, each 128-wide K block is accumulated by the tensor cores into a scratch
// accumulator and then "promoted": added into the fp32 result times a_scale[row] * b_scale.
// Why promotion: the FP8 tensor-core accumulator keeps fewer mantissa bits than fp32, so long
// K sums drift; 128-deep partial sums stay exact enough, and the scales must be applied per
// K block anyway.
// Why two N halves of 128: a 64 x 256 scratch accumulator next to the 64 x 256 result would
// need 256 registers per thread; one 64 x 128 scratch, reused for both halves, fits in 232.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_desc.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/ld_st.cuh"
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

  // idle: none of this warpgroup's 64 rows is valid (a tile of <= 64 tokens, common in decode):
  // take and release every stage without issuing wgmma, which leaves the tensor pipe to the
  // other warpgroup. acc is not written; the epilogue stores no row of it.
  // b_scale[h]: the weight scales of N half h, one float per K block; nullptr when the half lies
  // past N (it is still computed, its result is unused).
  // Returns false when a stage never arrived (the bounded
  // wait expired); st then names it.
  __device__ static bool run(float (&acc)[128], const Pipe& pipe, State& st, uint8_t* smem, int num_k_blocks,
                             const float* const (&b_scale)[2], int wg, bool idle) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    if (idle) return pass_through(pipe, st, num_k_blocks, lane);
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;  // this thread's first row in the tile
    float tmp[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

    for (int kb = 0; kb < num_k_blocks; ++kb) {
      // Why before the wait: the scale loads' latency hides behind the barrier wait.
      const float sb0 = b_scale[0] != nullptr ? ptx::ld_nc_f32(b_scale[0] + kb) : 0.0f;
      const float sb1 = b_scale[1] != nullptr ? ptx::ld_nc_f32(b_scale[1] + kb) : 0.0f;
      if (!pipe.consumer_wait(st)) return false;
      const float* sa = reinterpret_cast<const float*>(smem + Layout::sa_offset(st.index));
      const float sa0 = sa[r0];
      const float sa1 = sa[r0 + 8];
      const uint64_t da =
          smem_desc_kmajor_sw128(smem + Layout::a_offset(st.index) + wg * kWarpgroupM * Layout::kRowBytes);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint64_t db =
            smem_desc_kmajor_sw128(smem + Layout::b_offset(st.index) + h * kHalfN * Layout::kRowBytes);
        ptx::fence_operands(tmp);
        ptx::wgmma_fence_sync_aligned();
#pragma unroll
        for (int k = 0; k < kBlockK / kWgmmaK; ++k)
          ptx::wgmma_m64n128k32_f32_e4m3_e4m3(tmp, smem_desc_advance_k(da, k * kWgmmaK),
                                              smem_desc_advance_k(db, k * kWgmmaK), k > 0 ? 1u : 0u);
        ptx::wgmma_commit_group_sync_aligned();
        ptx::wgmma_wait_group_sync_aligned<0>();
        ptx::fence_operands(tmp);
        // The scales are in registers and the tensor cores are done with the stage: hand it
        // back before the last promotion so the producer refills it sooner.
        if (h == 1 && lane == 0) pipe.consumer_release(st);

        const float sb = h == 0 ? sb0 : sb1;
        const float s0 = sa0 * sb;
        const float s1 = sa1 * sb;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          acc[64 * h + 4 * i + 0] += tmp[4 * i + 0] * s0;
          acc[64 * h + 4 * i + 1] += tmp[4 * i + 1] * s0;
          acc[64 * h + 4 * i + 2] += tmp[4 * i + 2] * s1;
          acc[64 * h + 4 * i + 3] += tmp[4 * i + 3] * s1;
        }
      }
      ++st;
    }
    return true;
  }

  __device__ static bool pass_through(const Pipe& pipe, State& st, int num_k_blocks, int lane) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      if (!pipe.consumer_wait(st)) return false;
      if (lane == 0) pipe.consumer_release(st);
      ++st;
    }
    return true;
  }
};

}  // namespace epmoe::gemm
