// Configuration and call validation: every rejected field gets a message naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "epmoe/config.h"

namespace {

epmoe::LayerConfig good() {
  epmoe::LayerConfig c;
  c.num_ranks = 2;
  c.num_experts = 64;
  c.hidden = 7168;
  c.intermediate = 2048;
  c.topk = 8;
  c.max_tokens_per_rank = 4096;
  return c;
}

void expect_invalid(const epmoe::LayerConfig& c, const std::string& field) {
  epmoe::Status s = epmoe::validate(c);
  ASSERT_FALSE(s.ok()) << "expected a rejection naming " << field;
  EXPECT_EQ(s.code(), epmoe::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(Validate, AcceptsDeepSeekSlice) { EXPECT_TRUE(epmoe::validate(good()).ok()); }

TEST(Validate, AcceptsSmallestShapes) {
  auto c = good();
  c.num_ranks = 1;
  c.num_experts = 1;
  c.topk = 1;
  c.hidden = 128;
  c.intermediate = 128;
  c.max_tokens_per_rank = 1;
  c.dtype = epmoe::DType::kBF16;
  EXPECT_TRUE(epmoe::validate(c).ok()) << epmoe::validate(c).to_string();
}

TEST(Validate, HiddenMustBeMultipleOf128) {
  for (int h : {0, -128, 100, 7000, 129, 40000}) {
    auto c = good();
    c.hidden = h;
    expect_invalid(c, "hidden=" + std::to_string(h));
  }
}

TEST(Validate, IntermediateMustBeMultipleOf128) {
  for (int i : {0, 64, 2047, 1 << 20}) {
    auto c = good();
    c.intermediate = i;
    expect_invalid(c, "intermediate=" + std::to_string(i));
  }
}

TEST(Validate, ExpertsDivisibleByRanks) {
  auto c = good();
  c.num_experts = 63;
  expect_invalid(c, "divisible by num_ranks");
  c.num_experts = 0;
  expect_invalid(c, "num_experts=0");
}

TEST(Validate, RankCountInRange) {
  for (int r : {0, -1, 9, 16}) {
    auto c = good();
    c.num_ranks = r;
    expect_invalid(c, "num_ranks=" + std::to_string(r));
  }
}

TEST(Validate, TopKInRange) {
  for (int k : {0, -3, 65, 33}) {
    auto c = good();
    c.topk = k;
    expect_invalid(c, "topk=" + std::to_string(k));
  }
  auto c = good();
  c.num_experts = 4;
  c.topk = 5;
  expect_invalid(c, "topk=5");
}

TEST(Validate, MaxTokensInRange) {
  auto c = good();
  c.max_tokens_per_rank = 0;
  expect_invalid(c, "max_tokens_per_rank=0");
}

TEST(Validate, DTypeMustBeKnown) {
  auto c = good();
  c.dtype = static_cast<epmoe::DType>(7);
  expect_invalid(c, "dtype=7");
}

TEST(Validate, ClampMustBeFinite) {
  auto c = good();
  c.activation_clamp = std::numeric_limits<float>::infinity();
  expect_invalid(c, "activation_clamp");
  c.activation_clamp = std::nanf("");
  expect_invalid(c, "activation_clamp");
  c.activation_clamp = 10.f;
  EXPECT_TRUE(epmoe::validate(c).ok());
}

TEST(ValidateCall, TokenCountAgainstTmax) {
  auto c = good();
  alignas(16) static int dummy[4] = {};
  EXPECT_TRUE(epmoe::validate_call(c, 0, nullptr, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(epmoe::validate_call(c, 4096, dummy, dummy, dummy, dummy).ok());
  auto s = epmoe::validate_call(c, 4097, dummy, dummy, dummy, dummy);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("num_tokens=4097"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("max_tokens_per_rank=4096"), std::string::npos) << s.message();
  EXPECT_FALSE(epmoe::validate_call(c, -1, dummy, dummy, dummy, dummy).ok());
}

TEST(ValidateCall, NullPointersWithTokens) {
  auto c = good();
  int d = 0;
  EXPECT_NE(epmoe::validate_call(c, 3, nullptr, &d, &d, &d).message().find("x is null"), std::string::npos);
  EXPECT_NE(epmoe::validate_call(c, 3, &d, nullptr, &d, &d).message().find("topk_idx"), std::string::npos);
  EXPECT_NE(epmoe::validate_call(c, 3, &d, &d, nullptr, &d).message().find("topk_weights"), std::string::npos);
  EXPECT_NE(epmoe::validate_call(c, 3, &d, &d, &d, nullptr).message().find("y is null"), std::string::npos);
}

TEST(ValidateCall, AlignmentOfPointers) {
  auto c = good();
  alignas(16) static char buf[256];
  EXPECT_TRUE(epmoe::validate_call(c, 2, buf, buf, buf, buf).ok());
  auto s = epmoe::validate_call(c, 2, buf + 8, buf, buf, buf);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("x="), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("16-byte"), std::string::npos) << s.message();
  EXPECT_NE(epmoe::validate_call(c, 2, buf, buf, buf, buf + 4).message().find("y="), std::string::npos);
  EXPECT_NE(epmoe::validate_call(c, 2, buf, buf + 2, buf, buf).message().find("topk_idx="), std::string::npos);
  EXPECT_NE(epmoe::validate_call(c, 2, buf, buf, buf + 1, buf).message().find("topk_weights="), std::string::npos);
  EXPECT_TRUE(epmoe::validate_call(c, 2, buf, buf + 4, buf + 8, buf + 32).ok());
}

TEST(Validate, TimeoutInRange) {
  auto c = good();
  for (double t : {0.0, -1.0, 1e9, std::nan("")}) {
    c.timeout_seconds = t;
    expect_invalid(c, "timeout_seconds");
  }
  c.timeout_seconds = 0.5;
  EXPECT_TRUE(epmoe::validate(c).ok());
}

TEST(ValidateRouting, IndexOutOfRangeNamed) {
  auto c = good();
  std::vector<int32_t> idx(3 * 8, 1);
  idx[2 * 8 + 5] = -1;
  EXPECT_TRUE(epmoe::validate_routing_host(c, 3, idx.data()).ok());
  idx[1 * 8 + 4] = 64;
  auto s = epmoe::validate_routing_host(c, 3, idx.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("topk_idx[1][4]=64"), std::string::npos) << s.message();
  idx[1 * 8 + 4] = -2;
  EXPECT_FALSE(epmoe::validate_routing_host(c, 3, idx.data()).ok());
}

TEST(Status, ToStringCarriesCodeAndMessage) {
  epmoe::Status s(epmoe::StatusCode::kTimeout, "rank 1 block 3 waited on flag 7");
  EXPECT_EQ(s.to_string(), "Timeout: rank 1 block 3 waited on flag 7");
  EXPECT_EQ(epmoe::Status::Ok().to_string(), "Ok");
}

}  // namespace

TEST(Validate, CombinePartialsKnownValues) {
  epmoe::LayerConfig c = good();
  c.combine_partials = epmoe::PartialPrecision::kBFloat16;
  EXPECT_TRUE(epmoe::validate(c).ok());
  c.combine_partials = static_cast<epmoe::PartialPrecision>(7);
  expect_invalid(c, "combine_partials");
}
