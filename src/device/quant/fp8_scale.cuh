// The FP8 scale rule of SPEC steps 1 and 5, shared by the dispatch quantizer and the L1 epilogue
// so the bit-exact rule exists once.
#pragma once

#include <cstdint>

namespace epmoe::quant {

// s = max(amax, 1e-4) / 448 with an IEEE division; pow2 rounds s up to a power of two, exactly.
__device__ __forceinline__ float scale_1x128(float amax, bool pow2) {
  float s = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  if (pow2) {
    // Why the bit trick is exact: s is a positive normal float; a non-zero mantissa means the next
    // power of two is one exponent step up with the mantissa cleared.
    uint32_t b = __float_as_uint(s);
    if (b & 0x007FFFFFu) b = (b & 0xFF800000u) + 0x00800000u;
    s = __uint_as_float(b);
  }
  return s;
}

}  // namespace epmoe::quant
