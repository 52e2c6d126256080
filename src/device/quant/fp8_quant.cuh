// FP8 e4m3 encoding on the device: SPEC step 1 (the dispatch quantizer, codes x / s, bit-exact
// with tests/reference quantize_1x128) and step 5 (the L1 epilogue's requant, codes a * (1 / s)).
// The scale itself is quant/fp8_scale.cuh.
#pragma once

#include <cstdint>

#include "device/ptx/ld_st.cuh"
#include "device/ptx/math.cuh"
#include "device/quant/fp8_scale.cuh"

namespace epmoe::quant {

// Two fp32 -> two e4m3 codes in one 16-bit word (lo = first): round to nearest even, saturating
// to +-448. Every FP8 code the library writes goes through here.
__device__ __forceinline__ uint16_t encode_e4m3x2(float lo, float hi) {
  return ptx::cvt_rn_satfinite_e4m3x2(lo, hi);
}

// SPEC step 5 (the L1 epilogue): a / s as a * (1 / s), one rounded reciprocal per row instead of an
// IEEE division per channel. Exact when s is a power of two; otherwise within an ulp of the quotient.
__device__ __forceinline__ float reciprocal_scale(float s) { return __frcp_rn(s); }
__device__ __forceinline__ uint16_t encode_e4m3x2_times(float lo, float hi, float inv) {
  return encode_e4m3x2(lo * inv, hi * inv);
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Eight bf16 (one 16-byte vector) divided by s into eight e4m3 bytes, one __fdiv_rn per channel:
// the path for lanes with non-finite values or an extreme scale (see GroupDivisor).
inline __device__ __noinline__ uint2 quantize8_e4m3_ieee(uint4 v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t a = w[2 * i], b = w[2 * i + 1];
    const uint16_t lo = encode_e4m3x2(__fdiv_rn(bf16_bits_to_float(a & 0xFFFFu), s),
                                      __fdiv_rn(bf16_bits_to_float(a >> 16), s));
    const uint16_t hi = encode_e4m3x2(__fdiv_rn(bf16_bits_to_float(b & 0xFFFFu), s),
                                      __fdiv_rn(bf16_bits_to_float(b >> 16), s));
    out[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  return make_uint2(out[0], out[1]);
}

// x / s, bit for bit __fdiv_rn(x, s), with the divisor's work done once per 128-channel group.
// Why: __fdiv_rn rebuilds the reciprocal for every element (MUFU.RCP, two FFMA, FCHK and a branch
// to its slow path: ~11 SASS instructions per channel), and FP8 staging divides every channel of
// every token.
// How it stays exact: the compiler's fast path of __fdiv_rn is r = rcp.approx(s) refined once,
// q0 = x * r, e = fma(-q0, s, x), q = fma(r, e, q0), taken whenever its range check (FCHK) passes;
// the same sequence is used here with r computed once. It is taken only where that check cannot
// fail and the quotient is a normal float: s in [2^-64, 2^20] (here s >= |x| / 448, so
// |x| <= 2^29), |x| >= 2^-100 and finite. A lane with a non-finite value, or a scale outside that
// range, takes __fdiv_rn itself (quantize8_e4m3_ieee). For 0 < |x| < 2^-100 the quotient is below
// 2^-78 and its e4m3 code is a signed zero; q0 = x * r has the sign of x and a magnitude far below e4m3's smallest
// subnormal, so it gives the same code (also for x = -0).
// Checked against __fdiv_rn for every finite bf16 value with |x| <= 448 s over a sweep of scales
// (tests/gpu/test_fp8_divide.cu).
struct GroupDivisor {
  float s;
  float r;     // the refined reciprocal of s
  bool fast;   // s in the range above (false for NaN and inf)

  __device__ __forceinline__ static GroupDivisor of(float s) {
    const float r0 = ptx::rcp_approx_ftz_f32(s);
    GroupDivisor d;
    d.s = s;
    d.r = __fmaf_rn(r0, __fmaf_rn(r0, -s, 1.0f), r0);
    d.fast = s >= 0x1p-64f && s <= 0x1p20f;
    return d;
  }
  // Valid when fast and x is finite.
  __device__ __forceinline__ float divide(float x) const {
    const float q0 = __fmul_rn(x, r);
    const float q = __fmaf_rn(r, __fmaf_rn(q0, -s, x), q0);
    return fabsf(x) >= 0x1p-100f ? q : q0;
  }
};

// True when none of the eight bf16 values is inf or NaN (exponent field all ones).
__device__ __forceinline__ bool all_finite8_bf16(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) ok = ok && (w[i] & 0x7F80u) != 0x7F80u && (w[i] & 0x7F800000u) != 0x7F800000u;
  return ok;
}

// Eight bf16 (one 16-byte vector) divided by s into eight e4m3 bytes.
__device__ __forceinline__ uint2 quantize8_e4m3(const uint4& v, float s) {
  const GroupDivisor d = GroupDivisor::of(s);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if (d.fast && all_finite8_bf16(v)) {
    uint32_t out[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t a = w[2 * i], b = w[2 * i + 1];
      const uint16_t lo = encode_e4m3x2(d.divide(bf16_bits_to_float(a & 0xFFFFu)),
                                        d.divide(bf16_bits_to_float(a >> 16)));
      const uint16_t hi = encode_e4m3x2(d.divide(bf16_bits_to_float(b & 0xFFFFu)),
                                        d.divide(bf16_bits_to_float(b >> 16)));
      out[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    return make_uint2(out[0], out[1]);
  }
  return quantize8_e4m3_ieee(v, s);
}

__device__ __forceinline__ float absmax8_bf16(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = fmaxf(m, fabsf(bf16_bits_to_float(w[i] & 0xFFFFu)));
    m = fmaxf(m, fabsf(bf16_bits_to_float(w[i] >> 16)));
  }
  return m;
}

}  // namespace epmoe::quant
