// The FP8 kernel-consistent predicates (tests/reference/kernel_check.h) on hand-made
// rows: exact codes pass, a flip next to a rounding midpoint passes, a flip far from one or a code
// two steps off fails, a scale 1% off fails, the power-of-two scale one step off passes only next
// to the power; and a simulated GPU whose GEMM errs within the window passes on every row.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "reference/data.h"
#include "reference/kernel_check.h"
#include "reference/numeric.h"
#include "reference/reference.h"

namespace epmoe::ref {
namespace {

// A 128-group whose amax is 448 * s exactly, with the element under test at index 5.
struct Row {
  std::vector<float> a = std::vector<float>(128, 0.25f);
  std::vector<double> da = std::vector<double>(128, 0.0);
  std::vector<uint8_t> q = std::vector<uint8_t>(128);
  float s = 0.0f;
  explicit Row(bool pow2 = false) {
    a[0] = 448.0f * 0.01f;  // amax 4.48: s = 0.01
    std::vector<float> sv(1);
    quantize_1x128(a.data(), 128, pow2, q.data(), sv.data());
    s = sv[0];
  }
  RequantCheck run(bool pow2 = false) const {
    RequantCheck st;
    check_requant_row(a.data(), da.data(), q.data(), &s, 128, pow2, "row", &st);
    return st;
  }
};

TEST(KernelCheck, ExactCodesPass) {
  const Row r;
  const RequantCheck st = r.run();
  EXPECT_TRUE(st.ok()) << st.first_bad;
  EXPECT_EQ(st.flips, 0);
  EXPECT_EQ(st.codes, 128);
  EXPECT_EQ(st.scales_moved, 0);
}

TEST(KernelCheck, FlipNextToMidpointPasses) {
  Row r;
  // a / s just below the midpoint 25 of the codes 24 and 26 (the e4m3 step is 2 in [16, 32)).
  r.a[5] = float(24.999 * double(r.s));
  r.q[5] = e4m3_from_float(float(double(r.a[5]) / r.s));
  ASSERT_EQ(e4m3_to_float(r.q[5]), 24.0f);
  r.q[5] = e4m3_from_float(26.0f);  // the GPU rounded the other way
  r.da[5] = 0.01 * r.s;             // its a may be off by 0.01 code units
  const RequantCheck st = r.run();
  EXPECT_TRUE(st.ok()) << st.first_bad;
  EXPECT_EQ(st.flips, 1);
  EXPECT_GT(st.max_window_used, 0.05);
  EXPECT_LE(st.max_window_used, 1.0);
}

TEST(KernelCheck, FlipFarFromMidpointFails) {
  Row r;
  r.a[5] = float(24.5 * double(r.s));  // a quarter step from the midpoint 25
  r.q[5] = e4m3_from_float(26.0f);
  r.da[5] = 0.01 * r.s;
  const RequantCheck st = r.run();
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.bad_codes, 1);
  EXPECT_NE(st.first_bad.find("channel 5"), std::string::npos) << st.first_bad;
}

TEST(KernelCheck, CodeTwoStepsOffFails) {
  Row r;
  r.a[5] = float(24.999 * double(r.s));
  r.q[5] = e4m3_from_float(28.0f);  // 24 -> 26 -> 28: two steps
  r.da[5] = 0.01 * r.s;
  EXPECT_EQ(r.run().bad_codes, 1);
}

TEST(KernelCheck, NaNCodeFails) {
  Row r;
  r.q[7] = 0x7F;
  EXPECT_EQ(r.run().bad_codes, 1);
}

TEST(KernelCheck, ScaleOnePercentOffFails) {
  Row r;
  for (double& d : r.da) d = 1e-4 * 4.48;  // a window of 1e-4 of amax
  r.s *= 1.01f;
  const RequantCheck st = r.run();
  EXPECT_EQ(st.bad_scales, 1);
  EXPECT_NE(st.first_bad.find("scale"), std::string::npos) << st.first_bad;
}

TEST(KernelCheck, ScaleInsideWindowPasses) {
  Row r;
  for (double& d : r.da) d = 1e-4 * 4.48;
  r.s = std::nextafter(r.s, 1.0f);  // one ulp: an amax within the window gives it
  const RequantCheck st = r.run();
  EXPECT_EQ(st.bad_scales, 0) << st.first_bad;
  EXPECT_EQ(st.scales_moved, 1);
}

TEST(KernelCheck, Pow2ScaleOneStepOffOnlyAtThePower) {
  // amax / 448 a hair above 2^-7: the reference rounds up to 2^-6; a GPU amax a hair lower gives 2^-7.
  Row r(true);
  r.a[0] = float(448.0 * 0x1p-7 * (1.0 + 1e-6));
  std::vector<float> sv(1);
  quantize_1x128(r.a.data(), 128, true, r.q.data(), sv.data());
  ASSERT_EQ(sv[0], 0x1p-6f);
  r.s = 0x1p-7f;
  for (int i = 0; i < 128; ++i) r.q[i] = e4m3_from_float(r.a[i] / r.s);
  for (double& d : r.da) d = 1e-4 * 448.0 * 0x1p-7;
  RequantCheck st = r.run(true);
  EXPECT_EQ(st.bad_scales, 0) << st.first_bad;
  EXPECT_EQ(st.scales_moved, 1);
  // Far from the power (amax / 448 = 1.5 * 2^-7), the power below is wrong.
  r.a[0] = float(448.0 * 1.5 * 0x1p-7);
  r.q[0] = e4m3_from_float(r.a[0] / r.s);
  st = r.run(true);
  EXPECT_EQ(st.bad_scales, 1);
}

TEST(KernelCheck, Bf16Within) {
  const uint16_t one = bf16_from_float(1.0f), next = bf16_from_float(1.0078125f);  // one bf16 ulp above 1
  EXPECT_TRUE(bf16_within(one, 1.0, 0.0));
  EXPECT_FALSE(bf16_within(next, 1.0, 0.0));
  EXPECT_TRUE(bf16_within(next, 1.0039, 1e-4));   // just below the midpoint 1.00390625
  EXPECT_FALSE(bf16_within(next, 1.0030, 1e-4));
  EXPECT_FALSE(bf16_within(0x7FC0, 1.0, 1.0));    // NaN
}

// A simulated GPU: h off by up to gamma * h_abs, then SwiGLU, SPEC's step 5 and step 6 on its own
// a^. Every row must pass, and some codes must flip (else the case would test nothing).
TEST(KernelCheck, SimulatedGemmErrorInsideWindowPasses) {
  Problem p;
  p.R = 1; p.E = 2; p.H = 512; p.I = 256; p.K = 1; p.T_max = 64;
  const RankWeights w = make_rank_weights(p, 0, 34);
  const std::vector<uint16_t> x = random_x(p.T_max, p.H, 35);
  Rng rng(36);
  RequantCheck total;
  for (int t = 0; t < p.T_max; ++t) {
    std::vector<double> x_hat(p.H), h_abs(2 * p.I), da(p.I);
    std::vector<float> h(2 * p.I), h_gpu(2 * p.I), a(p.I), a_gpu(p.I), s(p.I / 128);
    std::vector<uint8_t> q(p.I);
    dequant_input_row(p, &x[size_t(t) * p.H], x_hat.data());
    const int e = t % p.E;
    gemm1_row_abs(p, w, e, x_hat.data(), h.data(), h_abs.data());
    for (int i = 0; i < 2 * p.I; ++i)
      h_gpu[i] = float(h[i] + kGemmAccumError * h_abs[i] * rng.uniform(-1.0, 1.0));
    swiglu_row(h.data(), p.I, 0.0f, 0.4f, a.data());
    swiglu_row(h_gpu.data(), p.I, 0.0f, 0.4f, a_gpu.data());
    quantize_1x128(a_gpu.data(), p.I, false, q.data(), s.data());
    act_error_bound(h.data(), h_abs.data(), p.I, 0.0f, 0.4f, kGemmAccumError, da.data());
    check_requant_row(a.data(), da.data(), q.data(), s.data(), p.I, false, "token " + std::to_string(t), &total);
  }
  EXPECT_TRUE(total.ok()) << total.first_bad;
  EXPECT_GT(total.flips, 0);
  EXPECT_LE(total.max_window_used, 1.0);
}

}  // namespace
}  // namespace epmoe::ref
