// Plain epilogue (L2): one warpgroup's 64 x 256 fp32 block -> bf16 rows of the output pool.
// Rows past the expert's count are padding and are not written.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/ptx/ld_st.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

struct Sm90EpilogueStoreBf16 {
  __device__ static void run(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                             int wg) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;
    uint16_t* out = static_cast<uint16_t*>(p.out);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col_base = t.n_block * kBlockN + h * kHalfN;
      if (col_base >= p.n) continue;  // N is a multiple of 128: a half is all in or all out
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        if (r >= t.rows_valid) continue;
        uint16_t* row = out + int64_t(t.row0 + r) * p.out_ld + col_base + 2 * (lane % 4);
#pragma unroll
        for (int i = 0; i < 16; ++i)
          *reinterpret_cast<uint32_t*>(row + 8 * i) =
              ptx::cvt_rn_bf16x2(acc[64 * h + 4 * i + 2 * half], acc[64 * h + 4 * i + 2 * half + 1]);
      }
    }
  }
};

}  // namespace epmoe::gemm
