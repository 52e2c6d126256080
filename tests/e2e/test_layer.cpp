// The MoE layer end to end on 2+ GPUs against tests/reference (SPEC.md), one process per rank.
#include <gtest/gtest.h>

#include <cstdio>

#include "e2e/layer_case.h"
#include "mgpu/mgpu_util.h"
#include "reference/data.h"

namespace epmoe::e2e {
namespace {

using ref::DType;
using ref::Routing;

void run_case(LayerCase c, int ranks = 2, double timeout_s = 240) {
  EPMOE_REQUIRE_RANKS(ranks);
  if (c.tokens.empty()) c.tokens.assign(ranks, 256);
  const uint64_t seed = ref::fresh_seed();
  std::printf("[e2e] %s seed=%llu\n", c.describe().c_str(), static_cast<unsigned long long>(seed));
  mgpu::run_on_ranks(ranks, [&](const RankContext& ctx) { return run_layer_case(ctx, c, seed); }, timeout_s);
}

LayerCase make(Shape s, DType d, Routing r, std::vector<int> t = {}) {
  LayerCase c;
  c.shape = s;
  c.dtype = d;
  c.routing = r;
  c.tokens = std::move(t);
  return c;
}

// ---- Shapes x dtypes --------------------------------------------------------------------------
TEST(LayerE2E, Dsv3Fp8) {
  LayerCase c = make(kDsv3, DType::kFP8, Routing::kUniform, {512, 384});
  c.sample_per_rank = 12;
  run_case(c);
}
TEST(LayerE2E, Dsv3Bf16) {
  LayerCase c = make(kDsv3, DType::kBF16, Routing::kUniform, {384, 512});
  c.sample_per_rank = 12;
  run_case(c);
}
TEST(LayerE2E, Qwen3Fp8) { run_case(make(kQwen3, DType::kFP8, Routing::kUniform, {1024, 777})); }
TEST(LayerE2E, Qwen3Bf16) { run_case(make(kQwen3, DType::kBF16, Routing::kUniform, {1024, 777})); }
TEST(LayerE2E, Top2Fp8) { run_case(make(kTop2, DType::kFP8, Routing::kUniform, {500, 300})); }
TEST(LayerE2E, Top2Bf16) { run_case(make(kTop2, DType::kBF16, Routing::kUniform, {300, 500})); }

// ---- Routing cases (Qwen3-like shape, both dtypes where cheap) ---------------------------------
TEST(LayerE2E, ZipfFp8) { run_case(make(kQwen3, DType::kFP8, Routing::kZipf, {1024, 1024})); }
TEST(LayerE2E, ZipfBf16) { run_case(make(kQwen3, DType::kBF16, Routing::kZipf, {1024, 1024})); }
TEST(LayerE2E, AllTokensToOneExpert) { run_case(make(kQwen3, DType::kFP8, Routing::kOneExpert, {700, 600})); }
TEST(LayerE2E, AllTokensToOneRank) { run_case(make(kQwen3, DType::kFP8, Routing::kOneRank, {512, 512})); }
TEST(LayerE2E, MaskedSlots) { run_case(make(kQwen3, DType::kFP8, Routing::kMasked, {512, 300})); }
TEST(LayerE2E, MaskedSlotsBf16) { run_case(make(kTop2, DType::kBF16, Routing::kMasked, {512, 300})); }
TEST(LayerE2E, DuplicateRanks) { run_case(make(kQwen3, DType::kFP8, Routing::kDuplicateRanks, {256, 256})); }
TEST(LayerE2E, ExpertNamedTwiceInOneToken) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 256});
  c.duplicate_experts = true;
  run_case(c);
}
TEST(LayerE2E, ZeroTokensOnOneRank) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {0, 333});
  c.max_tokens = 512;
  run_case(c);
}
TEST(LayerE2E, ZeroTokensEverywhere) {
  LayerCase c = make(kTop2, DType::kBF16, Routing::kUniform, {0, 0});
  c.max_tokens = 64;
  run_case(c);
}
TEST(LayerE2E, UnequalTokens) { run_case(make(kTop2, DType::kFP8, Routing::kZipf, {1, 999})); }
TEST(LayerE2E, ClampAndPow2Scales) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 200});
  c.clamp = 0.5f;  // gate and up are O(1) here, so the clamp is active on a good share of them
  c.pow2_scales = true;
  run_case(c);
}

// ---- Repetition and graphs ----------------------------------------------------------------------
TEST(LayerE2E, ThousandCallsFreshRouting) {
  LayerCase c = make(kTop2, DType::kFP8, Routing::kZipf, {96, 64});
  c.shape = Shape{"small", 8, 512, 256, 4};
  c.calls = 1000;
  c.check_every = 100;
  c.sample_per_rank = 96;
  run_case(c, 2, 400);
}
TEST(LayerE2E, CudaGraphReplay) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 192});
  c.calls = 4;
  c.graph = true;
  run_case(c);
}

// ---- Bad input ---------------------------------------------------------------------------------
TEST(LayerE2E, BadInputGetsClearErrors) {
  EPMOE_REQUIRE_RANKS(2);
  const uint64_t seed = ref::fresh_seed();
  mgpu::run_on_ranks(2, [&](const RankContext& ctx) { return run_bad_input_case(ctx, seed); }, 180);
}

}  // namespace
}  // namespace epmoe::e2e
