#include "reference/numeric.h"

#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace epmoe::ref {

namespace {

// Why hand-rolled: std::nearbyint follows the current FP rounding mode, and a
// test harness that changed it would silently change every code.
int round_half_even(float v) {  // 0 <= v < 2^23
  int i = static_cast<int>(v);  // truncation is floor for v >= 0
  const float frac = v - static_cast<float>(i);  // exact for v < 2^23
  if (frac > 0.5f || (frac == 0.5f && (i & 1))) ++i;
  return i;
}

float pow2f(int e) { return std::bit_cast<float>(static_cast<uint32_t>(127 + e) << 23); }  // normal range only

}  // namespace

uint16_t bf16_from_float(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return kE4M3NaN;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  // Why >= and not >: 448 itself is finite; everything above either rounds to
  // 448 or would round to 480, which E4M3 lacks, so satfinite clamps it.
  if (a >= kE4M3Max) return sign | 0x7E;
  int code;
  if (a < 0x1p-6f) {
    // Subnormal grid of step 2^-9. Code m is m * 2^-9, and rounding up to 8
    // lands exactly on the smallest normal (code 0x08), so no special case.
    code = round_half_even(a * 0x1p9f);
  } else {
    // Why bits and not frexp/ldexp: this runs once per weight when test data
    // is built, and libm calls made that the slow part. a is a normal float here.
    const int e = static_cast<int>(std::bit_cast<uint32_t>(a) >> 23) - 127;  // -6 .. 8
    const int m = round_half_even(a * pow2f(3 - e));                          // 8 .. 16, exact scaling
    // m == 16 carries into the next binade; the code is monotone, so adding
    // works. a < 448 keeps the result at most 0x7E.
    code = ((e + 7) << 3) + (m - 8);
  }
  return static_cast<uint8_t>(sign | code);
}

float e4m3_to_float(uint8_t q) {
  if ((q & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const int e = (q >> 3) & 0xF;
  const int m = q & 0x7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(static_cast<float>(8 + m), e - 10);
  return (q & 0x80) ? -mag : mag;
}

const double* e4m3_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

float quant_scale(float amax, bool pow2) {
  const float s = std::fmax(amax, kMinAmax) / kE4M3Max;
  if (!pow2 || !std::isfinite(s)) return s;
  int ex;
  const float f = std::frexp(s, &ex);  // s = f * 2^ex, f in [0.5, 1)
  return f == 0.5f ? s : std::ldexp(1.0f, ex);
}

void quantize_1x128(const float* x, int64_t n, bool pow2, uint8_t* q, float* s) {
  if (n < 0 || n % kQuantGroup != 0)
    throw std::invalid_argument("quantize_1x128: n = " + std::to_string(n) +
                                " is not a multiple of 128");
  for (int64_t g = 0; g < n / kQuantGroup; ++g) {
    const float* xg = x + g * kQuantGroup;
    float amax = 0.0f;
    for (int j = 0; j < kQuantGroup; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
    const float sg = quant_scale(amax, pow2);
    s[g] = sg;
    for (int j = 0; j < kQuantGroup; ++j) q[g * kQuantGroup + j] = e4m3_from_float(xg[j] / sg);
  }
}

void quantize_128x128(const float* w, int rows, int cols, bool pow2, uint8_t* q, float* s) {
  if (rows < 0 || cols < 0 || rows % kQuantGroup != 0 || cols % kQuantGroup != 0)
    throw std::invalid_argument("quantize_128x128: shape " + std::to_string(rows) + "x" +
                                std::to_string(cols) + " is not made of 128x128 blocks");
  const int bcols = cols / kQuantGroup;
  for (int br = 0; br < rows / kQuantGroup; ++br) {
    for (int bc = 0; bc < bcols; ++bc) {
      float amax = 0.0f;
      for (int i = br * kQuantGroup; i < (br + 1) * kQuantGroup; ++i)
        for (int j = bc * kQuantGroup; j < (bc + 1) * kQuantGroup; ++j)
          amax = std::fmax(amax, std::fabs(w[int64_t(i) * cols + j]));
      const float sb = quant_scale(amax, pow2);
      s[int64_t(br) * bcols + bc] = sb;
      for (int i = br * kQuantGroup; i < (br + 1) * kQuantGroup; ++i)
        for (int j = bc * kQuantGroup; j < (bc + 1) * kQuantGroup; ++j)
          q[int64_t(i) * cols + j] = e4m3_from_float(w[int64_t(i) * cols + j] / sb);
    }
  }
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace epmoe::ref
