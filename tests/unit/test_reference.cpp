// The CPU reference layer (tests/reference/reference.h) on cases worked out by
// hand, edge cases of routing and shape, and input validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/data.h"
#include "reference/numeric.h"
#include "reference/reference.h"

namespace epmoe::ref {
namespace {

// ---- A case small enough to do by hand -----------------------------------------
// R = 2, E = 2 (one expert per rank), H = I = 128, K = 2. Almost every weight
// is 0, so each output channel is one product chain:
//   expert 0: gate row 0 = 2 * x[0], up row 0 = 0.5 * x[1];  W2[0][0] = 1, W2[5][0] = -2
//   expert 1: gate row 3 = -1 * x[1], up row 3 = 4 * x[0];   W2[0][3] = 2, W2[7][3] = 1
// With x[0] = 1, x[1] = 2 (all else 0): expert 0 has gate 2, up 1; expert 1
// has gate -2, up 4. Every other gate and up is 0, so a = silu(0) * 0 = 0.
//   silu(2)  =  2 / (1 + e^-2) =  1.76159416
//   silu(-2) = -2 / (1 + e^2)  = -0.23840584
// Rank 0 token 0: slots (0, w 0.5), (1, w 0.25). Token 1: both slots -1.
// Rank 1 token 0: slots (1, w 2.0), (-1, w 9.0: must be ignored).

struct HandCase {
  Problem p;
  std::vector<RankInput> in;
  std::vector<RankWeights> w;
};

HandCase make_hand_case(DType dtype) {
  HandCase c;
  c.p.R = 2; c.p.E = 2; c.p.H = 128; c.p.I = 128; c.p.K = 2; c.p.T_max = 4;
  c.p.dtype = dtype;
  c.p.pow2_scales = true;  // makes every FP8 scale a power of two: the arithmetic stays exact
  const int H = 128, I = 128;
  std::vector<std::vector<float>> w1(2, std::vector<float>(2 * I * H, 0.0f));
  std::vector<std::vector<float>> w2(2, std::vector<float>(H * I, 0.0f));
  w1[0][0 * H + 0] = 2.0f;
  w1[0][(I + 0) * H + 1] = 0.5f;
  w2[0][0 * I + 0] = 1.0f;
  w2[0][5 * I + 0] = -2.0f;
  w1[1][3 * H + 1] = -1.0f;
  w1[1][(I + 3) * H + 0] = 4.0f;
  w2[1][0 * I + 3] = 2.0f;
  w2[1][7 * I + 3] = 1.0f;
  c.w.resize(2);
  for (int r = 0; r < 2; ++r) {
    RankWeights& rw = c.w[r];
    if (dtype == DType::kFP8) {
      rw.w1_q.resize(2 * I * H); rw.w1_s.resize(2);
      rw.w2_q.resize(H * I);     rw.w2_s.resize(1);
      quantize_128x128(w1[r].data(), 2 * I, H, true, rw.w1_q.data(), rw.w1_s.data());
      quantize_128x128(w2[r].data(), H, I, true, rw.w2_q.data(), rw.w2_s.data());
    } else {
      for (float v : w1[r]) rw.w1_bf16.push_back(bf16_from_float(v));
      for (float v : w2[r]) rw.w2_bf16.push_back(bf16_from_float(v));
    }
  }
  auto token = [&](RankInput& in) {
    std::vector<uint16_t> x(H, 0);
    x[0] = bf16_from_float(1.0f);
    x[1] = bf16_from_float(2.0f);
    in.x.insert(in.x.end(), x.begin(), x.end());
    ++in.T;
  };
  c.in.resize(2);
  token(c.in[0]);
  c.in[0].topk_idx.insert(c.in[0].topk_idx.end(), {0, 1});
  c.in[0].topk_w.insert(c.in[0].topk_w.end(), {0.5f, 0.25f});
  token(c.in[0]);
  c.in[0].topk_idx.insert(c.in[0].topk_idx.end(), {-1, -1});
  c.in[0].topk_w.insert(c.in[0].topk_w.end(), {0.5f, 0.5f});
  token(c.in[1]);
  c.in[1].topk_idx.insert(c.in[1].topk_idx.end(), {1, -1});
  c.in[1].topk_w.insert(c.in[1].topk_w.end(), {2.0f, 9.0f});
  return c;
}

// Row t of y as floats, with every channel not named in want required to be 0.
void expect_row(const std::vector<uint16_t>& y, int t, int H, const std::vector<std::pair<int, float>>& want) {
  for (int i = 0; i < H; ++i) {
    float expect = 0.0f;
    for (const auto& [ch, v] : want)
      if (ch == i) expect = v;
    EXPECT_EQ(bf16_to_float(y[int64_t(t) * H + i]), expect) << "token " << t << " channel " << i;
  }
}

TEST(ReferenceHand, BF16) {
  const HandCase c = make_hand_case(DType::kBF16);
  const auto y = forward(c.p, c.in, c.w);
  ASSERT_EQ(y.size(), 2u);
  ASSERT_EQ(y[0].size(), 2u * 128);
  ASSERT_EQ(y[1].size(), 1u * 128);
  // Rank 0 token 0.
  //  expert 0: a0 = silu(2) * 1 * 0.5 = 0.88079708; bf16 step 2^-8: 225.48 -> 225/256 = 0.87890625
  //            o[0] = 0.87890625, o[5] = -2 * 0.87890625 = -1.7578125
  //  expert 1: a3 = silu(-2) * 4 * 0.25 = -0.23840584; bf16 step 2^-10: 244.13 -> -244/1024 = -0.23828125
  //            o[0] = 2 * a3 = -0.4765625, o[7] = -0.23828125
  //  y[0] = 0.87890625 - 0.4765625 = 103/256 = 0.40234375 (exact in bf16)
  expect_row(y[0], 0, 128, {{0, 0.40234375f}, {5, -1.7578125f}, {7, -0.23828125f}});
  // Rank 0 token 1: no valid slot.
  expect_row(y[0], 1, 128, {});
  // Rank 1 token 0: expert 1 with w 2: a3 = -1.90724675; bf16 step 2^-7: 244.13 -> -244/128 = -1.90625
  //  o[0] = -3.8125, o[7] = -1.90625; the masked slot's weight 9 is ignored.
  expect_row(y[1], 0, 128, {{0, -3.8125f}, {7, -1.90625f}});
}

TEST(ReferenceHand, FP8Pow2) {
  const HandCase c = make_hand_case(DType::kFP8);
  // Weight scales by hand: a block's s = 2^ceil(log2(amax / 448)), which puts
  // every nonzero weight on code +-256 (0x78 / 0xF8).
  //  expert 0 W1 gate block amax 2 -> 2^-7; up block amax 0.5 -> 2^-9; W2 amax 2 -> 2^-7
  //  expert 1 W1 gate block amax 1 -> 2^-8; up block amax 4 -> 2^-6;   W2 amax 2 -> 2^-7
  EXPECT_EQ(c.w[0].w1_s[0], 0x1p-7f);
  EXPECT_EQ(c.w[0].w1_s[1], 0x1p-9f);
  EXPECT_EQ(c.w[1].w1_s[0], 0x1p-8f);
  EXPECT_EQ(c.w[1].w1_s[1], 0x1p-6f);
  EXPECT_EQ(c.w[1].w2_s[0], 0x1p-7f);
  EXPECT_EQ(c.w[0].w1_q[0], 0x78);
  EXPECT_EQ(c.w[1].w1_q[3 * 128 + 1], 0xF8);

  // Step 1: amax(x) = 2 -> s = 2^-7, x / s = 128, 256: codes 0x70, 0x78, exact.
  // Step 5, rank 0 token 0:
  //  expert 0: a0 = 0.88079708, s = 2^ceil(log2(a0 / 448)) = 2^-8, a0 / s = 225.48;
  //            e4m3 step 16 in [128, 256): 224 -> a^ = 224 * 2^-8 = 0.875
  //            o[0] = 0.875, o[5] = -1.75
  //  expert 1: a3 = -0.23840584, s = 2^-10, a3 / s = -244.13 -> -240 -> a^ = -0.234375
  //            o[0] = -0.46875, o[7] = -0.234375
  //  y[0] = 0.875 - 0.46875 = 0.40625
  ExpertTrace tr;
  std::vector<uint16_t> o(128);
  expert_forward_one(c.p, c.w[0], 0, c.in[0].x.data(), 0.5f, o.data(), &tr);
  EXPECT_EQ(tr.x_q[0], 0x70);
  EXPECT_EQ(tr.x_q[1], 0x78);
  EXPECT_EQ(tr.x_q[2], 0x00);
  EXPECT_EQ(tr.x_s[0], 0x1p-7f);
  EXPECT_EQ(tr.h[0], 2.0f);    // gate 0
  EXPECT_EQ(tr.h[128], 1.0f);  // up 0
  EXPECT_EQ(tr.a_q[0], 0x76);  // 224
  EXPECT_EQ(tr.a_s[0], 0x1p-8f);
  EXPECT_EQ(tr.a_hat[0], 0.875);
  EXPECT_EQ(bf16_to_float(o[0]), 0.875f);
  EXPECT_EQ(bf16_to_float(o[5]), -1.75f);

  const auto y = forward(c.p, c.in, c.w);
  expect_row(y[0], 0, 128, {{0, 0.40625f}, {5, -1.75f}, {7, -0.234375f}});
  expect_row(y[0], 1, 128, {});
  // Rank 1 token 0: a3 = -1.90724675, s = 2^-7, a3 / s = -244.13 -> -240 -> a^ = -1.875
  expect_row(y[1], 0, 128, {{0, -3.75f}, {7, -1.875f}});
}

TEST(ReferenceHand, ClampChangesTheHandCase) {
  HandCase c = make_hand_case(DType::kBF16);
  // c = 1.5: expert 0 gate 2 -> 1.5 (up 1 untouched); expert 1 up 4 -> 1.5 (gate -2 untouched).
  c.p.clamp = 1.5f;
  const auto y = forward(c.p, c.in, c.w);
  const float a0 = bf16_to_float(bf16_from_float(silu(1.5f) * 1.0f * 0.5f));
  const float a3 = bf16_to_float(bf16_from_float(silu(-2.0f) * 1.5f * 0.25f));
  const float y0 = bf16_to_float(bf16_from_float(a0 + 2.0f * a3));
  expect_row(y[0], 0, 128, {{0, y0}, {5, -2.0f * a0}, {7, a3}});
}

TEST(ReferenceHand, SampleListingATokenTwice) {
  const HandCase c = make_hand_case(DType::kBF16);
  const std::vector<std::vector<int>> sample = {{0, 0, 0}, {}};
  const auto full = forward(c.p, c.in, c.w);
  const auto part = forward(c.p, c.in, c.w, &sample);
  expect_row(part[0], 0, 128, {{0, 0.40234375f}, {5, -1.7578125f}, {7, -0.23828125f}});
  expect_row(part[1], 0, 128, {});  // rank 1 not sampled: left 0
  EXPECT_NE(full[1], part[1]);
}

// ---- Edge cases on random data ------------------------------------------------------

Problem small_problem(DType dtype) {
  Problem p;
  p.R = 4; p.E = 8; p.H = 256; p.I = 384; p.K = 3; p.T_max = 12;
  p.dtype = dtype;
  p.clamp = 2.0f;
  return p;
}

class ReferenceRandom : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    trace_ = std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, "EPMOE_SEED=" + std::to_string(seed_));
  }
  uint64_t seed_ = 0;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

TEST_P(ReferenceRandom, EmptyRanksAndMaskedTokens) {
  const Problem p = small_problem(GetParam());
  const std::vector<int> T = {7, 0, 12, 0};
  const auto in = make_problem_inputs(p, Routing::kMasked, T, seed_);
  const auto w = make_problem_weights(p, seed_);
  const auto y = forward(p, in, w);
  ASSERT_EQ(y.size(), 4u);
  EXPECT_TRUE(y[1].empty());
  EXPECT_TRUE(y[3].empty());
  int masked = 0, live = 0;
  for (int r : {0, 2}) {
    ASSERT_EQ(y[r].size(), size_t(T[r]) * p.H);
    for (int t = 0; t < T[r]; ++t) {
      bool any_slot = false;
      for (int k = 0; k < p.K; ++k) any_slot |= in[r].topk_idx[t * p.K + k] >= 0;
      int nonzero = 0;
      for (int i = 0; i < p.H; ++i) {
        ASSERT_TRUE(std::isfinite(bf16_to_float(y[r][int64_t(t) * p.H + i])));
        nonzero += (y[r][int64_t(t) * p.H + i] & 0x7FFF) != 0;
      }
      if (any_slot) {
        ++live;
        EXPECT_GT(nonzero, p.H / 2) << "rank " << r << " token " << t;
      } else {
        ++masked;
        EXPECT_EQ(nonzero, 0) << "rank " << r << " token " << t;
      }
    }
  }
  EXPECT_GT(masked, 0);  // the generator forces one fully masked token per rank with T >= 4
  EXPECT_GT(live, 0);
}

TEST_P(ReferenceRandom, AllRanksEmpty) {
  const Problem p = small_problem(GetParam());
  const auto in = make_problem_inputs(p, Routing::kUniform, {0, 0, 0, 0}, seed_);
  const auto y = forward(p, in, make_problem_weights(p, seed_));
  for (const auto& yr : y) EXPECT_TRUE(yr.empty());
}

TEST_P(ReferenceRandom, SampleEqualsFullOnSampledTokens) {
  const Problem p = small_problem(GetParam());
  const std::vector<int> T = {9, 3, 0, 12};
  const auto in = make_problem_inputs(p, Routing::kDuplicateRanks, T, seed_);
  const auto w = make_problem_weights(p, seed_);
  const auto full = forward(p, in, w);
  const auto sample = sample_tokens(T, 4, mix_seed(seed_, 99));
  const auto part = forward(p, in, w, &sample);
  for (int r = 0; r < p.R; ++r) {
    ASSERT_EQ(part[r].size(), full[r].size());
    for (int t = 0; t < T[r]; ++t) {
      const bool sampled = std::find(sample[r].begin(), sample[r].end(), t) != sample[r].end();
      for (int i = 0; i < p.H; ++i) {
        const int64_t j = int64_t(t) * p.H + i;
        if (sampled) ASSERT_EQ(part[r][j], full[r][j]) << "rank " << r << " token " << t << " ch " << i;
        else ASSERT_EQ(part[r][j], 0) << "unsampled rank " << r << " token " << t << " ch " << i;
      }
    }
  }
  const Compare cmp = compare_bf16_sampled(part, full, p.H, sample);
  EXPECT_EQ(cmp.rel_l2, 0.0);
  EXPECT_EQ(cmp.n, int64_t(4 + 3 + 0 + 4) * p.H);
}

TEST_P(ReferenceRandom, RepeatableAcrossCalls) {
  const Problem p = small_problem(GetParam());
  const std::vector<int> T = {12, 5, 8, 1};
  const auto in = make_problem_inputs(p, Routing::kZipf, T, seed_);
  const auto w = make_problem_weights(p, seed_);
  EXPECT_EQ(forward(p, in, w), forward(p, in, w));
}

// One valid slot: y is that expert's o row unchanged, and the row is what
// expert_forward_one gives for the owner rank's local expert.
TEST_P(ReferenceRandom, SingleSlotTokenIsExpertOutput) {
  Problem p = small_problem(GetParam());
  const std::vector<int> T = {3, 2, 1, 4};
  auto in = make_problem_inputs(p, Routing::kUniform, T, seed_);
  const auto w = make_problem_weights(p, seed_);
  for (int r = 0; r < p.R; ++r)
    for (int t = 0; t < T[r]; ++t)
      for (int k = 1; k < p.K; ++k) in[r].topk_idx[t * p.K + k] = -1;
  const auto y = forward(p, in, w);
  std::vector<uint16_t> o(p.H);
  for (int r = 0; r < p.R; ++r)
    for (int t = 0; t < T[r]; ++t) {
      const int e = in[r].topk_idx[t * p.K];
      expert_forward_one(p, w[e / p.E_loc()], e % p.E_loc(), in[r].x.data() + int64_t(t) * p.H,
                         in[r].topk_w[t * p.K], o.data());
      for (int i = 0; i < p.H; ++i) ASSERT_EQ(y[r][int64_t(t) * p.H + i], o[i]) << "rank " << r << " token " << t;
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ReferenceRandom, ::testing::Values(DType::kFP8, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- Validation ---------------------------------------------------------------------

// Runs f, requires std::invalid_argument, and returns its message.
template <class F>
std::string invalid_message(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no std::invalid_argument thrown";
  return {};
}

TEST(ReferenceValidation, IndexOutOfRange) {
  for (int bad : {2, -2, 1000}) {
    HandCase c = make_hand_case(DType::kBF16);
    c.in[1].topk_idx[1] = bad;
    const std::string msg = invalid_message([&] { forward(c.p, c.in, c.w); });
    EXPECT_NE(msg.find("topk_idx"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
  }
}

TEST(ReferenceValidation, Shapes) {
  {
    HandCase c = make_hand_case(DType::kFP8);
    c.p.H = 100;
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("multiple"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    c.p.E = 3;  // not a multiple of R = 2
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("E = 3"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    c.p.T_max = 1;  // rank 0 has 2 tokens
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("T_max"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    c.in[0].x.pop_back();
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("x of rank 0"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kFP8);
    c.w[1].w2_s.clear();
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("w2_s of rank 1"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    c.in.pop_back();
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w); }).find("inputs"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    const std::vector<std::vector<int>> sample = {{0}, {1}};  // rank 1 has one token
    EXPECT_NE(invalid_message([&] { forward(c.p, c.in, c.w, &sample); }).find("sample"), std::string::npos);
  }
  {
    HandCase c = make_hand_case(DType::kBF16);
    std::vector<uint16_t> o(128);
    EXPECT_NE(invalid_message([&] { expert_forward_one(c.p, c.w[0], 1, c.in[0].x.data(), 1.0f, o.data()); })
                  .find("local expert"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace epmoe::ref
