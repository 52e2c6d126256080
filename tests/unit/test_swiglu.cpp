// Steps 3-4 of SPEC.md: clamp, silu(gate) * up * routing weight, in fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "reference/numeric.h"
#include "reference/reference.h"

namespace epmoe::ref {
namespace {

// Within n fp32 ulps of a double-precision value.
void expect_near_ulps(float got, double want, int n) {
  const double ulp = std::nextafter(static_cast<float>(want), INFINITY) - static_cast<float>(want);
  EXPECT_LE(std::fabs(got - want), n * std::fabs(ulp)) << "got " << got << " want " << want;
}

TEST(Silu, Values) {
  EXPECT_EQ(silu(0.0f), 0.0f);
  expect_near_ulps(silu(1.0f), 0.7310585786300049, 2);    // 1 / (1 + e^-1)
  expect_near_ulps(silu(-1.0f), -0.2689414213699951, 2);  // -1 / (1 + e)
  expect_near_ulps(silu(2.0f), 1.7615941559557649, 2);
  expect_near_ulps(silu(-2.0f), -0.23840584404423515, 2);
  expect_near_ulps(silu(-20.0f), -20.0 / (1.0 + std::exp(20.0)), 4);
  EXPECT_EQ(silu(30.0f), 30.0f);  // 1 + e^-30 == 1 in fp32
}

TEST(Silu, LargeNegativeIsFiniteZero) {
  for (float g : {-88.0f, -100.0f, -1e4f, -1e30f}) {
    const float s = silu(g);
    EXPECT_TRUE(std::isfinite(s)) << g;
    EXPECT_LE(std::fabs(s), 1e-35f) << g;
  }
}

TEST(SwiGLU, ClampRules) {
  const float c = 7.0f;
  EXPECT_EQ(swiglu(10.0f, 1.0f, c, 1.0f), silu(7.0f));            // gate capped from above
  EXPECT_EQ(swiglu(-50.0f, 1.0f, c, 1.0f), silu(-50.0f));         // gate has no lower clamp
  EXPECT_EQ(swiglu(1.0f, 10.0f, c, 1.0f), silu(1.0f) * 7.0f);     // up capped above
  EXPECT_EQ(swiglu(1.0f, -10.0f, c, 1.0f), silu(1.0f) * -7.0f);   // and below
  EXPECT_EQ(swiglu(3.0f, -2.0f, c, 1.0f), silu(3.0f) * -2.0f);    // inside: untouched
  EXPECT_EQ(swiglu(7.0f, 7.0f, c, 1.0f), silu(7.0f) * 7.0f);      // on the edge
}

TEST(SwiGLU, ClampOffWhenNotPositive) {
  for (float c : {0.0f, -1.0f}) {
    EXPECT_EQ(swiglu(10.0f, 10.0f, c, 1.0f), silu(10.0f) * 10.0f) << c;
    EXPECT_EQ(swiglu(1.0f, -100.0f, c, 1.0f), silu(1.0f) * -100.0f) << c;
  }
}

TEST(SwiGLU, RoutingWeightAppliedInFp32) {
  EXPECT_EQ(swiglu(1.5f, 3.0f, 0.0f, 0.5f), silu(1.5f) * 3.0f * 0.5f);
  EXPECT_EQ(swiglu(1.5f, 3.0f, 0.0f, 0.0f), 0.0f);
  const float w = 0.3f;
  const float su = silu(-0.7f) * 2.5f;
  EXPECT_EQ(swiglu(-0.7f, 2.5f, 0.0f, w), su * w);
  // The weight must not be clamped with up: 5 * 3 would exceed c = 4.
  EXPECT_EQ(swiglu(1.0f, 3.0f, 4.0f, 5.0f), silu(1.0f) * 3.0f * 5.0f);
}

TEST(SwiGLU, RowTakesGateThenUp) {
  const int I = 4;
  // gate = h[0:4], up = h[4:8]; distinct values so a swap or offset shows.
  const std::vector<float> h = {1.0f, -2.0f, 8.0f, 0.5f, 3.0f, 9.0f, -1.5f, -0.25f};
  std::vector<float> a(I);
  swiglu_row(h.data(), I, 6.0f, 0.75f, a.data());
  EXPECT_EQ(a[0], silu(1.0f) * 3.0f * 0.75f);
  EXPECT_EQ(a[1], silu(-2.0f) * 6.0f * 0.75f);   // up 9 clamped to 6
  EXPECT_EQ(a[2], silu(6.0f) * -1.5f * 0.75f);   // gate 8 clamped to 6
  EXPECT_EQ(a[3], silu(0.5f) * -0.25f * 0.75f);
}

}  // namespace
}  // namespace epmoe::ref
