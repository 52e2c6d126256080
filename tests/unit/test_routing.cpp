// Invariants of the routing and data generators (tests/reference/data.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "reference/data.h"
#include "reference/numeric.h"

namespace epmoe::ref {
namespace {

Problem routing_problem() {
  Problem p;
  p.R = 4; p.E = 32; p.H = 128; p.I = 128; p.K = 6; p.T_max = 4096;
  return p;
}

// Shared by every routing: range, distinct valid experts, positive weights
// summing to ~1.
void check_common(const Problem& p, const Routed& rt, int T) {
  ASSERT_EQ(rt.topk_idx.size(), size_t(T) * p.K);
  ASSERT_EQ(rt.topk_w.size(), size_t(T) * p.K);
  for (int t = 0; t < T; ++t) {
    std::set<int> seen;
    float sum = 0.0f;
    for (int k = 0; k < p.K; ++k) {
      const int e = rt.topk_idx[t * p.K + k];
      ASSERT_GE(e, -1) << "token " << t;
      ASSERT_LT(e, p.E) << "token " << t;
      if (e >= 0) {
        ASSERT_TRUE(seen.insert(e).second) << "expert " << e << " twice in token " << t;
      }
      const float w = rt.topk_w[t * p.K + k];
      ASSERT_GT(w, 0.0f);
      sum += w;
    }
    ASSERT_NEAR(sum, 1.0f, 1e-5f) << "token " << t;
  }
}

class RoutingTest : public ::testing::TestWithParam<Routing> {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    trace_ = std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, "EPMOE_SEED=" + std::to_string(seed_));
  }
  uint64_t seed_ = 0;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

TEST_P(RoutingTest, CommonInvariants) {
  const Problem p = routing_problem();
  for (int rank = 0; rank < p.R; ++rank) check_common(p, make_routing(p, GetParam(), rank, 2000, seed_), 2000);
}

TEST_P(RoutingTest, SeededAndPerRank) {
  const Problem p = routing_problem();
  const Routed a = make_routing(p, GetParam(), 1, 300, seed_);
  const Routed b = make_routing(p, GetParam(), 1, 300, seed_);
  EXPECT_EQ(a.topk_idx, b.topk_idx);
  EXPECT_EQ(a.topk_w, b.topk_w);
  const Routed c = make_routing(p, GetParam(), 2, 300, seed_);
  EXPECT_NE(a.topk_w, c.topk_w);  // ranks draw from their own streams
}

TEST_P(RoutingTest, SmallAndEmpty) {
  Problem p = routing_problem();
  EXPECT_TRUE(make_routing(p, GetParam(), 0, 0, seed_).topk_idx.empty());
  // K = E: every expert in each token (where the routing allows it).
  p.R = 2; p.E = 4; p.K = 4;
  check_common(p, make_routing(p, GetParam(), 1, 50, seed_), 50);
}

INSTANTIATE_TEST_SUITE_P(All, RoutingTest, ::testing::ValuesIn(kAllRoutings),
                         [](const auto& info) { return std::string(routing_name(info.param)); });

std::vector<int> expert_counts(const Problem& p, const Routed& rt) {
  std::vector<int> n(p.E, 0);
  for (int e : rt.topk_idx)
    if (e >= 0) ++n[e];
  return n;
}

TEST(Routing, UniformFillsEverySlotEvenly) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  const Problem p = routing_problem();
  const int T = 4096;
  const Routed rt = make_routing(p, Routing::kUniform, 0, T, seed);
  EXPECT_EQ(std::count(rt.topk_idx.begin(), rt.topk_idx.end(), -1), 0);
  // Mean load T*K/E = 768 per expert, sd ~ 27: a 25% band is > 7 sd wide.
  for (int n : expert_counts(p, rt)) {
    EXPECT_GT(n, 576);
    EXPECT_LT(n, 960);
  }
}

TEST(Routing, ZipfIsSkewedAndSharedAcrossRanks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  const Problem p = routing_problem();
  const Routed r0 = make_routing(p, Routing::kZipf, 0, 4096, seed);
  const Routed r3 = make_routing(p, Routing::kZipf, 3, 4096, seed);
  EXPECT_EQ(std::count(r0.topk_idx.begin(), r0.topk_idx.end(), -1), 0);
  std::vector<int> n0 = expert_counts(p, r0), n3 = expert_counts(p, r3);
  const int hot0 = int(std::max_element(n0.begin(), n0.end()) - n0.begin());
  const int hot3 = int(std::max_element(n3.begin(), n3.end()) - n3.begin());
  EXPECT_EQ(hot0, hot3);  // one popularity order for the whole model
  std::vector<int> sorted = n0;
  std::sort(sorted.begin(), sorted.end());
  // With K = 6 of 32 distinct, the top expert is in most tokens and the
  // coldest in a few percent: far from uniform's 768 each.
  EXPECT_GT(sorted.back(), 2000);
  EXPECT_LT(sorted.front(), 400);
  EXPECT_GT(sorted.back(), 5 * sorted.front());
}

TEST(Routing, OneExpert) {
  const uint64_t seed = fresh_seed();
  const Problem p = routing_problem();
  const Routed rt = make_routing(p, Routing::kOneExpert, 2, 500, seed);
  for (int t = 0; t < 500; ++t) {
    EXPECT_EQ(rt.topk_idx[t * p.K], 0);
    for (int k = 1; k < p.K; ++k) EXPECT_EQ(rt.topk_idx[t * p.K + k], -1);
  }
}

TEST(Routing, OneRankHitsOnlyRankZero) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Problem p = routing_problem();  // E_loc = 8 >= K = 6
  for (int rank = 0; rank < p.R; ++rank) {
    const Routed rt = make_routing(p, Routing::kOneRank, rank, 500, seed);
    for (int e : rt.topk_idx) {
      EXPECT_GE(e, 0);
      EXPECT_LT(e, p.E_loc());
    }
  }
  // E_loc = 2 < K: two distinct experts of rank 0, the rest -1.
  p.R = 16;
  const Routed rt = make_routing(p, Routing::kOneRank, 5, 200, seed);
  check_common(p, rt, 200);
  for (int t = 0; t < 200; ++t) {
    int valid = 0;
    for (int k = 0; k < p.K; ++k) {
      const int e = rt.topk_idx[t * p.K + k];
      if (e < 0) continue;
      ++valid;
      EXPECT_LT(e, 2);
    }
    EXPECT_EQ(valid, 2);
  }
}

TEST(Routing, MaskedFractionAndFullyMaskedTokens) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  const Problem p = routing_problem();
  const int T = 4000;
  for (int rank = 0; rank < p.R; ++rank) {
    const Routed rt = make_routing(p, Routing::kMasked, rank, T, seed);
    const double frac = double(std::count(rt.topk_idx.begin(), rt.topk_idx.end(), -1)) / (T * p.K);
    EXPECT_GT(frac, 0.20);
    EXPECT_LT(frac, 0.30);
    int full = 0, partial = 0;
    for (int t = 0; t < T; ++t) {
      const int masked = int(std::count(rt.topk_idx.begin() + t * p.K, rt.topk_idx.begin() + (t + 1) * p.K, -1));
      full += masked == p.K;
      partial += masked > 0 && masked < p.K;
    }
    EXPECT_GT(full, T / 20);
    EXPECT_GT(partial, T / 5);
  }
  // Even a handful of tokens has one fully masked.
  for (int T_small : {4, 5, 9}) {
    const Routed rt = make_routing(p, Routing::kMasked, 0, T_small, seed);
    bool any_full = false;
    for (int t = 0; t < T_small; ++t)
      any_full |= std::count(rt.topk_idx.begin() + t * p.K, rt.topk_idx.begin() + (t + 1) * p.K, -1) == p.K;
    EXPECT_TRUE(any_full) << "T = " << T_small;
  }
}

TEST(Routing, DuplicateRanks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  const Problem p = routing_problem();
  const int T = 1000;
  const Routed rt = make_routing(p, Routing::kDuplicateRanks, 1, T, seed);
  std::vector<int> first_slot_rank(p.R, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<int> per_rank(p.R, 0);
    for (int k = 0; k < p.K; ++k) {
      const int e = rt.topk_idx[t * p.K + k];
      ASSERT_GE(e, 0);
      ++per_rank[e / p.E_loc()];
    }
    EXPECT_GE(*std::max_element(per_rank.begin(), per_rank.end()), 3) << "token " << t;  // K/2 = 3 share a rank
    ++first_slot_rank[rt.topk_idx[t * p.K] / p.E_loc()];
  }
  // The shared rank varies and is not pinned to slot 0's position.
  for (int n : first_slot_rank) EXPECT_GT(n, T / 10);
}

TEST(Routing, RejectsImpossibleRequests) {
  Problem p = routing_problem();
  p.E = 4; p.R = 2; p.K = 5;
  EXPECT_THROW(make_routing(p, Routing::kUniform, 0, 3, 1), std::invalid_argument);
  EXPECT_THROW(make_routing(p, Routing::kZipf, 0, 3, 1), std::invalid_argument);
  EXPECT_NO_THROW(make_routing(p, Routing::kOneExpert, 0, 3, 1));
}

// ---- Inputs, weights, samples -------------------------------------------------------------

TEST(Data, InputsHaveNoZerosAndVaryByGroup) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Problem p = routing_problem();
  p.H = 512;
  const auto in = make_problem_inputs(p, Routing::kUniform, {64, 0, 3, 17}, seed);
  ASSERT_EQ(in.size(), 4u);
  EXPECT_EQ(in[1].T, 0);
  EXPECT_TRUE(in[1].x.empty());
  double sum2 = 0;
  int64_t n = 0;
  for (const RankInput& r : in) {
    ASSERT_EQ(r.x.size(), size_t(r.T) * p.H);
    for (uint16_t v : r.x) {
      const float f = bf16_to_float(v);
      ASSERT_TRUE(std::isfinite(f));
      ASSERT_NE(f, 0.0f);
      sum2 += double(f) * f;
      ++n;
    }
  }
  const double rms = std::sqrt(sum2 / n);
  EXPECT_GT(rms, 0.7);
  EXPECT_LT(rms, 1.8);
  // Group scales differ, so a kernel that reuses one group's scale fails.
  const int64_t n0 = int64_t(in[0].T) * p.H;
  std::vector<uint8_t> q(n0);
  std::vector<float> s(n0 / 128);
  std::vector<float> xf(n0);
  for (int64_t i = 0; i < n0; ++i) xf[i] = bf16_to_float(in[0].x[i]);
  quantize_1x128(xf.data(), n0, false, q.data(), s.data());
  EXPECT_GT(*std::max_element(s.begin(), s.end()), 2.0f * *std::min_element(s.begin(), s.end()));
  EXPECT_THROW(make_problem_inputs(p, Routing::kUniform, {1, 2, 3}, seed), std::invalid_argument);
  EXPECT_THROW(make_problem_inputs(p, Routing::kUniform, {1, 2, 3, 5000}, seed), std::invalid_argument);
}

TEST(Data, WeightsPerRankAndMode) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  Problem p;
  p.R = 2; p.E = 4; p.H = 256; p.I = 128; p.K = 2;
  for (DType d : {DType::kFP8, DType::kBF16}) {
    p.dtype = d;
    const auto w = make_problem_weights(p, seed);
    ASSERT_EQ(w.size(), 2u);
    for (int r = 0; r < 2; ++r) EXPECT_NO_THROW(check_rank_weights(p, w[r], r));
    // A rank's process builds the same bytes alone.
    const RankWeights w1 = make_rank_weights(p, 1, seed);
    EXPECT_EQ(w1.w1_q, w[1].w1_q);
    EXPECT_EQ(w1.w2_s, w[1].w2_s);
    EXPECT_EQ(w1.w1_bf16, w[1].w1_bf16);
    if (d == DType::kBF16) {
      EXPECT_NE(w[0].w1_bf16, w[1].w1_bf16);
      // std of W1 ~ 1/sqrt(H) times the block factors (mean square 1.3).
      double s2 = 0;
      for (uint16_t v : w[0].w1_bf16) s2 += std::pow(bf16_to_float(v), 2);
      const double rms = std::sqrt(s2 / w[0].w1_bf16.size()) * std::sqrt(double(p.H));
      EXPECT_GT(rms, 0.6);
      EXPECT_LT(rms, 1.8);
    } else {
      EXPECT_NE(w[0].w1_q, w[1].w1_q);
      // Block scales differ within an expert.
      const auto [lo, hi] = std::minmax_element(w[0].w1_s.begin(), w[0].w1_s.begin() + 4);
      EXPECT_GT(*hi, *lo);
    }
  }
}

TEST(Data, SampleTokens) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("EPMOE_SEED=" + std::to_string(seed));
  const std::vector<int> T = {100, 0, 3, 1000};
  const auto s = sample_tokens(T, 10, seed);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].size(), 10u);
  EXPECT_TRUE(s[1].empty());
  EXPECT_EQ(s[2], (std::vector<int>{0, 1, 2}));
  for (size_t r = 0; r < T.size(); ++r) {
    EXPECT_TRUE(std::is_sorted(s[r].begin(), s[r].end()));
    EXPECT_EQ(std::adjacent_find(s[r].begin(), s[r].end()), s[r].end());
    for (int t : s[r]) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, T[r]);
    }
  }
  EXPECT_EQ(sample_tokens(T, 10, seed), s);
  EXPECT_NE(sample_tokens(T, 10, seed + 1)[3], s[3]);
}

}  // namespace
}  // namespace epmoe::ref
