// SPEC step 1 on the device, bit-exact with tests/reference quantize_1x128.
#pragma once

#include <cstdint>

#include "device/comm/ptx_sync.h"
#include "device/quant/fp8_scale.cuh"

namespace epmoe::comm {

// SPEC's scale rule lives in one place for the whole library.
using quant::scale_1x128;

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Eight bf16 (one 16-byte vector) divided by s into eight e4m3 bytes.
__device__ __forceinline__ uint2 quantize8_e4m3(const uint4& v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t a = w[2 * i], b = w[2 * i + 1];
    const uint16_t lo = cvt_rn_satfinite_e4m3x2(__fdiv_rn(bf16_bits_to_float(a & 0xFFFFu), s),
                                                __fdiv_rn(bf16_bits_to_float(a >> 16), s));
    const uint16_t hi = cvt_rn_satfinite_e4m3x2(__fdiv_rn(bf16_bits_to_float(b & 0xFFFFu), s),
                                                __fdiv_rn(bf16_bits_to_float(b >> 16), s));
    out[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  return make_uint2(out[0], out[1]);
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

}  // namespace epmoe::comm
