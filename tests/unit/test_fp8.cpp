// Number formats and quantizers of the CPU reference (tests/reference/numeric.h).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference/data.h"
#include "reference/numeric.h"

namespace epmoe::ref {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Nearest finite E4M3 by exhaustive search, ties to the even code, magnitudes
// past 448 clamped: the definition, written independently of the bit-level
// encoder under test.
uint8_t e4m3_oracle(float x) {
  if (std::isnan(x)) return kE4M3NaN;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(static_cast<double>(e4m3_to_float(static_cast<uint8_t>(c))) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(E4M3, DecodeKnownCodes) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x80), 0.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);   // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);   // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x3A), 1.25f);
  EXPECT_EQ(e4m3_to_float(0x77), 240.0f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0xC5), -3.25f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(E4M3, DecodeIsStrictlyIncreasingOverPositiveCodes) {
  for (int c = 1; c <= 0x7E; ++c)
    EXPECT_LT(e4m3_to_float(static_cast<uint8_t>(c - 1)), e4m3_to_float(static_cast<uint8_t>(c))) << "code " << c;
  for (int c = 0; c <= 0x7E; ++c)
    EXPECT_EQ(e4m3_to_float(static_cast<uint8_t>(c | 0x80)), -e4m3_to_float(static_cast<uint8_t>(c)));
}

TEST(E4M3, TableMatchesDecode) {
  const double* t = e4m3_table();
  for (int c = 0; c < 256; ++c) {
    const float f = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(f)) EXPECT_TRUE(std::isnan(t[c]));
    else EXPECT_EQ(t[c], static_cast<double>(f)) << "code " << c;
  }
}

TEST(E4M3, EveryCodeRoundTrips) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float f = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(f)) {
      ++nans;
      EXPECT_EQ(e4m3_from_float(f), kE4M3NaN);
      continue;
    }
    EXPECT_EQ(e4m3_from_float(f), c) << "value " << f;
  }
  EXPECT_EQ(nans, 2);
}

// Worked out by hand: value = 2^(field-7) * (1 + m/8), subnormal m * 2^-9.
TEST(E4M3, HandTable) {
  struct Case { float x; uint8_t code; };
  const Case cases[] = {
      {1.0f, 0x38},    {0.5f, 0x30},   {2.0f, 0x40},
      {0.1f, 0x1D},    // 1.6 * 2^-4: m = 4.8 -> 5, 0.1015625
      {-3.3f, 0xC5},   // 1.65 * 2^1: m = 5.2 -> 5, -3.25
      {0.3f, 0x2A},    // 1.2 * 2^-2: m = 1.6 -> 2, 0.3125
      {240.0f, 0x77},  // 1.875 * 2^7
      {100.0f, 0x6C},  // 1.5625 * 2^6: m = 4.5, tie -> even 4, 96
      {17.0f, 0x58},   // 1.0625 * 2^4: m = 0.5, tie -> 0, 16
      {19.0f, 0x5A},   // 1.1875 * 2^4: m = 1.5, tie -> 2, 20
      {448.0f, 0x7E},  {-448.0f, 0xFE},
      {0x1p-9f, 0x01}, {0x1p-6f, 0x08}, {7 * 0x1p-9f, 0x07},
  };
  for (const Case& c : cases) EXPECT_EQ(e4m3_from_float(c.x), c.code) << "x = " << c.x;
}

TEST(E4M3, TiesToEven) {
  // Normal binades: halfway between m and m+1 goes to the even m.
  EXPECT_EQ(e4m3_from_float(1.0625f), 0x38);   // between 1 (m 0) and 1.125 (m 1)
  EXPECT_EQ(e4m3_from_float(1.1875f), 0x3A);   // between 1.125 (m 1) and 1.25 (m 2)
  EXPECT_EQ(e4m3_from_float(-1.1875f), 0xBA);
  EXPECT_EQ(e4m3_from_float(1.9375f), 0x40);   // between 1.875 (m 7) and 2: carries into the next binade
  EXPECT_EQ(e4m3_from_float(0x1p-6f * 1.0625f), 0x08);  // lowest normal binade
  EXPECT_EQ(e4m3_from_float(216.0f), 0x76);    // between 208 (m 5) and 224 (m 6)
  EXPECT_EQ(e4m3_from_float(200.0f), 0x74);    // between 192 (m 4) and 208 (m 5)
  // Just off a tie rounds to the nearer side.
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.1875f, 0.0f)), 0x39);
  // Subnormal ties, grid 2^-9.
  EXPECT_EQ(e4m3_from_float(0x1p-10f), 0x00);       // 0.5 ulp: to 0
  EXPECT_EQ(e4m3_from_float(-0x1p-10f), 0x80);      // keeps the sign
  EXPECT_EQ(e4m3_from_float(3 * 0x1p-10f), 0x02);   // 1.5 ulp: to 2
  EXPECT_EQ(e4m3_from_float(5 * 0x1p-10f), 0x02);   // 2.5 ulp: to 2
  EXPECT_EQ(e4m3_from_float(15 * 0x1p-10f), 0x08);  // 7.5 ulp: to the smallest normal
  EXPECT_EQ(e4m3_from_float(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(e4m3_from_float(std::nextafter(3 * 0x1p-10f, 0.0f)), 0x01);
}

TEST(E4M3, SaturatesFinite) {
  EXPECT_EQ(e4m3_from_float(500.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(464.0f), 0x7E);  // tie of 448 and the missing 480
  EXPECT_EQ(e4m3_from_float(470.0f), 0x7E);  // would round to 480
  EXPECT_EQ(e4m3_from_float(-1e9f), 0xFE);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(e4m3_from_float(kInf), 0x7E);
  EXPECT_EQ(e4m3_from_float(-kInf), 0xFE);
  EXPECT_EQ(e4m3_from_float(std::nextafter(448.0f, 0.0f)), 0x7E);
}

TEST(E4M3, NaNAndZeros) {
  EXPECT_EQ(e4m3_from_float(kNaN), 0x7F);
  EXPECT_EQ(e4m3_from_float(-kNaN), 0x7F);
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(1e-40f), 0x00);  // fp32 subnormal input
  EXPECT_EQ(e4m3_from_float(-1e-40f), 0x80);
  EXPECT_EQ(e4m3_from_float(1e-20f), 0x00);
}

// Every midpoint between neighbouring codes, and one fp32 ulp either side,
// is exactly where a wrong rounding rule shows.
TEST(E4M3, MatchesOracleAtEveryMidpoint) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_to_float(static_cast<uint8_t>(c));
    const float hi = e4m3_to_float(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);  // exact: 4 significant bits
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e3f), lo, hi}) {
      EXPECT_EQ(e4m3_from_float(x), e4m3_oracle(x)) << "x = " << x;
      EXPECT_EQ(e4m3_from_float(-x), e4m3_oracle(-x)) << "x = " << -x;
    }
  }
}

TEST(E4M3, MatchesOracleOnRandomFloats) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    // Log-uniform magnitude over 2^-14 .. 2^10 covers zero-rounding,
    // subnormals, all normal binades and saturation.
    const float x = static_cast<float>((rng.below(2) ? -1.0 : 1.0) * std::exp2(rng.uniform(-14.0, 10.0)));
    ASSERT_EQ(e4m3_from_float(x), e4m3_oracle(x)) << "x = " << x;
  }
}

// ---- bf16 ------------------------------------------------------------------

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(BF16, RoundNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(from_bits(0x3F808000)), 0x3F80);  // 1 + 2^-8: tie, 0x3F80 is even
  EXPECT_EQ(bf16_from_float(from_bits(0x3F818000)), 0x3F82);  // 1 + 3*2^-8: tie, 0x3F81 is odd
  EXPECT_EQ(bf16_from_float(from_bits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_from_float(from_bits(0x3F807FFF)), 0x3F80);  // just below
  EXPECT_EQ(bf16_from_float(from_bits(0xBF808000)), 0xBF80);  // negative tie
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_float(kInf), 0x7F80);
  EXPECT_EQ(bf16_from_float(-kInf), 0xFF80);
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()), 0x7F80);  // rounds past the top: inf
  EXPECT_EQ(bf16_from_float(from_bits(0x7F7F7FFF)), 0x7F7F);
  EXPECT_EQ(bf16_from_float(from_bits(0x00008000)), 0x0000);  // fp32 subnormal tie to even 0
  EXPECT_EQ(bf16_from_float(from_bits(0x00018000)), 0x0002);
  EXPECT_EQ(bf16_from_float(0.1f), 0x3DCD);  // 0x3DCCCCCD rounds up
}

TEST(BF16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(kNaN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(-kNaN))));
  // A NaN whose payload sits only in the low half must not become infinity.
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(from_bits(0x7F800001)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(from_bits(0xFFFFFFFF)))));
}

TEST(BF16, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const float f = bf16_to_float(static_cast<uint16_t>(c));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), c << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(bf16_from_float(f), c) << "code " << c;
    }
  }
}

// ---- Quantization rules --------------------------------------------------------

TEST(QuantScale, FloorAndExactValues) {
  EXPECT_EQ(quant_scale(0.0f, false), 1e-4f / 448.0f);
  EXPECT_EQ(quant_scale(1e-6f, false), 1e-4f / 448.0f);
  EXPECT_EQ(quant_scale(448.0f, false), 1.0f);
  EXPECT_EQ(quant_scale(224.0f, false), 0.5f);
  EXPECT_EQ(quant_scale(3.0f, false), 3.0f / 448.0f);
}

TEST(QuantScale, Pow2RoundsUp) {
  EXPECT_EQ(quant_scale(448.0f, true), 1.0f);   // already a power of two
  EXPECT_EQ(quant_scale(224.0f, true), 0.5f);
  EXPECT_EQ(quant_scale(std::nextafter(448.0f, 1e9f), true), 2.0f);
  EXPECT_EQ(quant_scale(300.0f, true), 1.0f);
  EXPECT_EQ(quant_scale(2.0f, true), 0x1p-7f);  // 2/448 = 2^-7.8
  EXPECT_EQ(quant_scale(0.0f, true), 0x1p-22f);  // 1e-4/448 = 2.23e-7, 2^-22 = 2.38e-7
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (int i = 0; i < 10000; ++i) {
    const float amax = static_cast<float>(std::exp2(rng.uniform(-20.0, 20.0)));
    const float s = quant_scale(amax, false), p = quant_scale(amax, true);
    int ex;
    ASSERT_EQ(std::frexp(p, &ex), 0.5f) << "not a power of two: " << p;
    ASSERT_GE(p, s);
    ASSERT_LT(p, 2.0f * s);
  }
}

// One group per row of 128, each with its own magnitude.
std::vector<float> grouped_values(Rng& rng, int groups) {
  std::vector<float> x(groups * kQuantGroup);
  for (int g = 0; g < groups; ++g) {
    const double f = std::exp2(rng.uniform(-12.0, 12.0));
    for (int j = 0; j < kQuantGroup; ++j) x[g * kQuantGroup + j] = static_cast<float>(rng.normal() * f);
  }
  x[5] = 0.0f;  // exact zeros stay zero
  return x;
}

TEST(Quantize1x128, ScalesCodesAndErrorBound) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int groups = 64;
  const std::vector<float> x = grouped_values(rng, groups);
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(pow2 ? "pow2" : "plain");
    std::vector<uint8_t> q(x.size());
    std::vector<float> s(groups);
    quantize_1x128(x.data(), static_cast<int64_t>(x.size()), pow2, q.data(), s.data());
    for (int g = 0; g < groups; ++g) {
      float amax = 0.0f;
      int arg = 0;
      for (int j = 0; j < kQuantGroup; ++j)
        if (std::fabs(x[g * kQuantGroup + j]) > amax) amax = std::fabs(x[arg = g * kQuantGroup + j]);
      ASSERT_EQ(s[g], quant_scale(amax, pow2)) << "group " << g;
      // The largest element lands on the top code, or within the top binade with pow2.
      const uint8_t top = q[arg] & 0x7F;
      if (pow2) EXPECT_GE(top, 0x76) << "group " << g;
      else EXPECT_EQ(top, 0x7E) << "group " << g;
      for (int j = 0; j < kQuantGroup; ++j) {
        const int i = g * kQuantGroup + j;
        const double xs = static_cast<double>(x[i]) / s[g];
        const double back = e4m3_to_float(q[i]);
        // Half an ulp of E4M3: 2^-4 relative for normals, 2^-10 absolute below 2^-6.
        const double bound = std::max(std::fabs(xs) * 0x1p-4, 0x1p-10) * (1 + 1e-6);
        ASSERT_LE(std::fabs(back - xs), bound) << "x = " << x[i] << " s = " << s[g];
        ASSERT_EQ(q[i], e4m3_from_float(x[i] / s[g]));
      }
    }
    EXPECT_EQ(q[5], 0x00);
  }
}

// x * (1/s) and x / s differ in the last fp32 bit for some x; near an E4M3
// rounding boundary that changes the code. The reference must take the
// division, like the GPU's __fdiv_rn.
TEST(Quantize1x128, UsesTrueDivision) {
  int found = 0;
  for (int a = 0; a < 2000 && found < 5; ++a) {
    const float amax = 1.0f + 0.000731f * static_cast<float>(a);
    const float s = quant_scale(amax, false);
    for (int c = 0x30; c < 0x70 && found < 5; ++c) {
      const float mid = 0.5f * (e4m3_to_float(static_cast<uint8_t>(c)) + e4m3_to_float(static_cast<uint8_t>(c + 1)));
      float x = mid * s;
      for (int step = 0; step < 4; ++step, x = std::nextafter(x, 1e9f)) {
        if (e4m3_from_float(x / s) == e4m3_from_float(x * (1.0f / s))) continue;
        std::vector<float> g(kQuantGroup, 0.0f);
        g[0] = amax;
        g[1] = x;
        std::vector<uint8_t> q(kQuantGroup);
        float sg;
        quantize_1x128(g.data(), kQuantGroup, false, q.data(), &sg);
        ASSERT_EQ(sg, s);
        EXPECT_EQ(q[1], e4m3_from_float(x / s)) << "x = " << x << " s = " << s;
        ++found;
      }
    }
  }
  EXPECT_GT(found, 0) << "no case found where division and reciprocal differ";
}

TEST(Quantize1x128, RejectsPartialGroup) {
  std::vector<float> x(200, 1.0f);
  std::vector<uint8_t> q(200);
  std::vector<float> s(2);
  EXPECT_THROW(quantize_1x128(x.data(), 200, false, q.data(), s.data()), std::invalid_argument);
}

TEST(Quantize128x128, BlockScalesAndLayout) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int rows = 256, cols = 384, bc = cols / 128;
  std::vector<float> w(rows * cols);
  std::vector<double> f(2 * bc);
  for (double& v : f) v = std::exp2(rng.uniform(-8.0, 8.0));
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) w[i * cols + j] = static_cast<float>(rng.normal() * f[(i / 128) * bc + j / 128]);
  for (bool pow2 : {false, true}) {
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(2 * bc);
    quantize_128x128(w.data(), rows, cols, pow2, q.data(), s.data());
    for (int b = 0; b < 2 * bc; ++b) {
      float amax = 0.0f;
      for (int i = (b / bc) * 128; i < (b / bc + 1) * 128; ++i)
        for (int j = (b % bc) * 128; j < (b % bc + 1) * 128; ++j) amax = std::max(amax, std::fabs(w[i * cols + j]));
      EXPECT_EQ(s[b], quant_scale(amax, pow2)) << "block " << b;
    }
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        ASSERT_EQ(q[i * cols + j], e4m3_from_float(w[i * cols + j] / s[(i / 128) * bc + j / 128])) << i << "," << j;
  }
  std::vector<uint8_t> q(100 * 128);
  std::vector<float> s(1);
  EXPECT_THROW(quantize_128x128(w.data(), 100, 128, false, q.data(), s.data()), std::invalid_argument);
}

}  // namespace
}  // namespace epmoe::ref
