// The reference layer against a second, deliberately plain implementation of
// SPEC.md written here: whole weight matrices dequantized element by element
// with the scale indexed directly, owner rank and local expert derived from
// the global index, no shared helpers beyond the scalar formats and
// quantize_1x128 (tested in test_fp8.cpp). Also the comparison helpers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/data.h"
#include "reference/numeric.h"
#include "reference/reference.h"

namespace epmoe::ref {
namespace {

// W of one expert as double, from the SPEC layout of its owner rank.
std::vector<double> dequant(const Problem& p, const RankWeights& w, int le, bool first) {
  const int rows = first ? 2 * p.I : p.H, cols = first ? p.H : p.I;
  std::vector<double> d(int64_t(rows) * cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const int64_t at = int64_t(le) * rows * cols + int64_t(i) * cols + j;
      if (p.dtype == DType::kBF16) {
        d[int64_t(i) * cols + j] = bf16_to_float((first ? w.w1_bf16 : w.w2_bf16)[at]);
      } else {
        const int64_t blocks = int64_t(rows / 128) * (cols / 128);
        const float s = (first ? w.w1_s : w.w2_s)[le * blocks + (i / 128) * (cols / 128) + j / 128];
        d[int64_t(i) * cols + j] = double(e4m3_to_float((first ? w.w1_q : w.w2_q)[at])) * s;
      }
    }
  return d;
}

// FP8: dequant(quant_1x128(v)); BF16: bf16 round trip.
std::vector<double> round_trip(const Problem& p, const std::vector<float>& v) {
  std::vector<double> out(v.size());
  if (p.dtype == DType::kBF16) {
    for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(bf16_from_float(v[i]));
    return out;
  }
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(v.size() / 128);
  quantize_1x128(v.data(), int64_t(v.size()), p.pow2_scales, q.data(), s.data());
  for (size_t i = 0; i < v.size(); ++i) out[i] = double(e4m3_to_float(q[i])) * s[i / 128];
  return out;
}

std::vector<std::vector<uint16_t>> oracle(const Problem& p, const std::vector<RankInput>& in,
                                          const std::vector<RankWeights>& w) {
  std::vector<std::vector<uint16_t>> y(p.R);
  const int H = p.H, I = p.I;
  for (int r = 0; r < p.R; ++r) {
    y[r].assign(int64_t(in[r].T) * H, 0);
    for (int t = 0; t < in[r].T; ++t) {
      std::vector<float> x(H);
      for (int i = 0; i < H; ++i) x[i] = bf16_to_float(in[r].x[int64_t(t) * H + i]);
      const std::vector<double> xh = round_trip(p, x);
      std::vector<float> sum(H, 0.0f);
      bool any = false;
      for (int k = 0; k < p.K; ++k) {
        const int e = in[r].topk_idx[t * p.K + k];
        if (e < 0) continue;
        const int owner = e / p.E_loc(), le = e - owner * p.E_loc();
        const std::vector<double> w1 = dequant(p, w[owner], le, true);
        const std::vector<double> w2 = dequant(p, w[owner], le, false);
        std::vector<float> a(I);
        for (int i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (int j = 0; j < H; ++j) {
            g += w1[int64_t(i) * H + j] * xh[j];
            u += w1[int64_t(I + i) * H + j] * xh[j];
          }
          float gate = float(g), up = float(u);
          if (p.clamp > 0) {
            gate = gate > p.clamp ? p.clamp : gate;
            up = up > p.clamp ? p.clamp : (up < -p.clamp ? -p.clamp : up);
          }
          a[i] = gate / (1.0f + std::exp(-gate)) * up * in[r].topk_w[t * p.K + k];
        }
        const std::vector<double> ah = round_trip(p, a);
        for (int h = 0; h < H; ++h) {
          double o = 0;
          for (int i = 0; i < I; ++i) o += w2[int64_t(h) * I + i] * ah[i];
          const float ob = bf16_to_float(bf16_from_float(float(o)));
          sum[h] = any ? sum[h] + ob : ob;
        }
        any = true;
      }
      for (int h = 0; h < H; ++h) y[r][int64_t(t) * H + h] = any ? bf16_from_float(sum[h]) : 0;
    }
  }
  return y;
}

struct OracleCase {
  DType dtype;
  bool pow2;
  float clamp;
  Routing routing;
};

class ReferenceOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(ReferenceOracle, MatchesPlainImplementation) {
  const OracleCase oc = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Problem p;
  p.R = 4; p.E = 8; p.H = 256; p.I = 384; p.K = 3; p.T_max = 8;
  p.dtype = oc.dtype;
  p.pow2_scales = oc.pow2;
  p.clamp = oc.clamp;
  const std::vector<int> T = {5, 0, 8, 2};
  const auto in = make_problem_inputs(p, oc.routing, T, seed);
  const auto w = make_problem_weights(p, seed);
  const auto y = forward(p, in, w);
  const auto want = oracle(p, in, w);
  // The two differ only in float64 summation order, which can move a rare
  // value across a rounding boundary; any real bug (a scale, an offset, a
  // rank) is orders of magnitude larger.
  const Compare c = compare_bf16(y, want);
  EXPECT_EQ(c.nan_count, 0);
  EXPECT_LE(c.rel_l2, 1e-4);
  int64_t differ = 0;
  for (int r = 0; r < p.R; ++r)
    for (size_t i = 0; i < y[r].size(); ++i) differ += y[r][i] != want[r][i];
  EXPECT_LE(differ, c.n / 100) << differ << " of " << c.n << " elements differ";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReferenceOracle,
    ::testing::Values(OracleCase{DType::kFP8, false, 0.0f, Routing::kUniform},
                      OracleCase{DType::kFP8, true, 1.0f, Routing::kDuplicateRanks},
                      OracleCase{DType::kFP8, false, 0.5f, Routing::kMasked},
                      OracleCase{DType::kBF16, false, 0.0f, Routing::kZipf},
                      OracleCase{DType::kBF16, false, 1.0f, Routing::kOneRank}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// The clamp must actually bite on generated data, or the cases above would
// not test it.
TEST(ReferenceClamp, IsExercisedByGeneratedData) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Problem p;
  p.R = 2; p.E = 2; p.H = 256; p.I = 256; p.K = 1; p.T_max = 4;
  const auto in = make_problem_inputs(p, Routing::kUniform, {4, 4}, seed);
  const auto w = make_problem_weights(p, seed);
  const auto plain = forward(p, in, w);
  p.clamp = 1.0f;
  const auto clamped = forward(p, in, w);
  EXPECT_GT(compare_bf16(clamped, plain).rel_l2, 1e-2);
}

// ---- Comparison helpers ---------------------------------------------------------------

uint16_t b(float v) { return bf16_from_float(v); }

TEST(Compare, RelativeL2AndNonFinite) {
  const std::vector<uint16_t> ref = {b(3.0f), b(4.0f), b(0.0f)};
  EXPECT_EQ(compare_bf16(ref.data(), ref.data(), 3).rel_l2, 0.0);
  const std::vector<uint16_t> y = {b(3.0f), b(4.5f), b(0.0f)};
  const Compare c = compare_bf16(y.data(), ref.data(), 3);
  EXPECT_DOUBLE_EQ(c.rel_l2, 0.5 / 5.0);
  EXPECT_EQ(c.nan_count, 0);
  EXPECT_EQ(c.n, 3);
  const std::vector<uint16_t> bad = {b(3.0f), b(std::numeric_limits<float>::quiet_NaN()), b(INFINITY)};
  const Compare cb = compare_bf16(bad.data(), ref.data(), 3);
  EXPECT_EQ(cb.nan_count, 2);
  EXPECT_FALSE(passes(cb, DType::kFP8));
  const std::vector<uint16_t> zero = {0, 0, 0};
  EXPECT_EQ(compare_bf16(zero.data(), zero.data(), 3).rel_l2, 0.0);
  EXPECT_TRUE(std::isinf(compare_bf16(ref.data(), zero.data(), 3).rel_l2));
}

TEST(Compare, PassesUsesSpecTolerances) {
  EXPECT_EQ(tolerance(DType::kFP8), 1e-2);
  EXPECT_EQ(tolerance(DType::kBF16), 5e-3);
  Compare c;
  c.n = 10;
  c.rel_l2 = 7e-3;
  EXPECT_TRUE(passes(c, DType::kFP8));
  EXPECT_FALSE(passes(c, DType::kBF16));
  c.n = 0;
  c.rel_l2 = 0;
  EXPECT_FALSE(passes(c, DType::kBF16));  // nothing compared is not a pass
}

TEST(Compare, SampledRowsOnly) {
  const int H = 2;
  const std::vector<std::vector<uint16_t>> ref = {{b(1), b(1), b(2), b(2)}, {b(5), b(5)}};
  std::vector<std::vector<uint16_t>> y = ref;
  y[0][0] = b(100);  // token 0 of rank 0: outside the sample below
  y[1][1] = b(6);
  const std::vector<std::vector<int>> sample = {{1}, {0}};
  const Compare c = compare_bf16_sampled(y, ref, H, sample);
  EXPECT_EQ(c.n, 4);
  EXPECT_DOUBLE_EQ(c.rel_l2, 1.0 / std::sqrt(4.0 + 4.0 + 25.0 + 25.0));
  EXPECT_THROW(compare_bf16_sampled(y, ref, H, {{2}, {0}}), std::invalid_argument);
  EXPECT_GT(compare_bf16(y, ref).rel_l2, c.rel_l2);
}

}  // namespace
}  // namespace epmoe::ref
