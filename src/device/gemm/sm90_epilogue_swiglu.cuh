// L1 epilogue: gate/up -> clamp -> silu(gate) * up * routing weight -> FP8 1x128 requant (or bf16).
//
// The block's B rows are [gate block j | up block j] (see docs/GEMM.md, the W1 interleave), so
// every thread holds gate (acc[0..63]) and the matching up values (acc[64..127]) of the same
// channels; a quad of lanes holds one row's whole 128-channel group, which is quantized with a
// single scale, bit-for-bit the rule of SPEC step 5.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/ptx/ld_st.cuh"
#include "device/quant/fp8_scale.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

// Why the accurate expf and a true division (not __expf / __fdividef): the activation feeds an
// FP8 requant whose rounding boundaries amplify last-bit differences; this keeps the kernel
// within an ulp of the reference's libm silu.
__device__ __forceinline__ float silu_f32(float g) { return __fdiv_rn(g, 1.0f + expf(-g)); }

template <bool kFp8>
struct Sm90EpilogueSwiGLU {
  __device__ static void run(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                             int wg) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int r0 = wg * kWarpgroupM + warp * 16 + lane / 4;
    const bool valid0 = r0 < t.rows_valid;
    const bool valid1 = r0 + 8 < t.rows_valid;
    // Padding rows may hold NaN weights; they are never stored, so any value does.
    const float w0 = valid0 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0) : 0.0f;
    const float w1 = valid1 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0 + 8) : 0.0f;
    const float c = p.clamp;

    float a[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      float g = acc[i];
      float u = acc[64 + i];
      if (c > 0.0f) {
        u = fminf(fmaxf(u, -c), c);
        g = fminf(g, c);
      }
      a[i] = silu_f32(g) * u * ((i & 2) ? w1 : w0);
    }

    const int64_t out_col = int64_t(t.n_block) * kHalfN + 2 * (lane % 4);
    if constexpr (kFp8) {
      float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        amax0 = fmaxf(amax0, fmaxf(fabsf(a[4 * i + 0]), fabsf(a[4 * i + 1])));
        amax1 = fmaxf(amax1, fmaxf(fabsf(a[4 * i + 2]), fabsf(a[4 * i + 3])));
      }
      // The four lanes of a quad hold the 128 channels of the same two rows.
#pragma unroll
      for (int m = 1; m <= 2; m <<= 1) {
        amax0 = fmaxf(amax0, __shfl_xor_sync(0xFFFFFFFFu, amax0, m));
        amax1 = fmaxf(amax1, __shfl_xor_sync(0xFFFFFFFFu, amax1, m));
      }
      const bool pow2 = p.pow2_scales != 0;
      const float s[2] = {quant::scale_1x128(amax0, pow2), quant::scale_1x128(amax1, pow2)};
      uint8_t* out = static_cast<uint8_t*>(p.out);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        if (r >= t.rows_valid) continue;
        uint8_t* row = out + int64_t(t.row0 + r) * p.out_ld + out_col;
#pragma unroll
        for (int i = 0; i < 16; ++i)
          *reinterpret_cast<uint16_t*>(row + 8 * i) = ptx::cvt_rn_satfinite_e4m3x2(
              __fdiv_rn(a[4 * i + 2 * half], s[half]), __fdiv_rn(a[4 * i + 2 * half + 1], s[half]));
        if (lane % 4 == 0) p.out_scale[int64_t(t.n_block) * p.scale_stride + t.row0 + r] = s[half];
      }
    } else {
      uint16_t* out = static_cast<uint16_t*>(p.out);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        if (r >= t.rows_valid) continue;
        uint16_t* row = out + int64_t(t.row0 + r) * p.out_ld + out_col;
#pragma unroll
        for (int i = 0; i < 16; ++i)
          *reinterpret_cast<uint32_t*>(row + 8 * i) =
              ptx::cvt_rn_bf16x2(a[4 * i + 2 * half], a[4 * i + 2 * half + 1]);
      }
    }
  }
};

}  // namespace epmoe::gemm
