// Dispatch and combine against the reference semantics on 2 GPUs, over every routing the SPEC names.
#include <gtest/gtest.h>

#include <cstdio>

#include "mgpu/case_runner.h"
#include "mgpu/mgpu_util.h"
#include "reference/data.h"

namespace epmoe::mgpu {
namespace {

using ref::Routing;

std::vector<RoutingCase> all_routings(int T_max) {
  return {
      {"uniform", Routing::kUniform, {}},
      {"zipf", Routing::kZipf, {}},
      {"one_expert", Routing::kOneExpert, {}},
      {"one_rank", Routing::kOneRank, {}},
      {"masked", Routing::kMasked, {}},
      {"duplicate_ranks", Routing::kDuplicateRanks, {}},
      {"zero_tokens_rank1", Routing::kUniform, {T_max, 0}},
      {"zero_tokens_rank0", Routing::kZipf, {0, T_max}},
      {"unequal_tokens", Routing::kUniform, {T_max, T_max / 3 + 1}},
      {"all_zero", Routing::kUniform, {0, 0}},
      {"duplicate_experts", Routing::kUniform, {}, Duplicates::kSome},
      {"all_slots_one_expert", Routing::kOneExpert, {}, Duplicates::kAllSlots},
      {"duplicates_masked", Routing::kMasked, {T_max, T_max / 2}, Duplicates::kAllSlots},
      {"uniform_again", Routing::kUniform, {}},
  };
}

uint64_t seed_for_test() {
  const uint64_t s = ref::fresh_seed();
  std::printf("[epmoe] seed %llu (replay with EPMOE_SEED)\n", (unsigned long long)s);
  return s;
}

void run_shape(const CaseShape& shape) {
  const uint64_t seed = seed_for_test();
  const int ranks = test_ranks(2);  // EPMOE_TEST_RANKS overrides it (mgpu_util.h)
  EPMOE_REQUIRE_RANKS(ranks);
  run_on_ranks(ranks, [&](const RankContext& ctx) { return run_cases(ctx, shape, all_routings(shape.T_max), seed); });
}

TEST(DispatchCombine, Fp8AllRoutings) {  // run_shape checks the GPU count
  run_shape(CaseShape{});
}

TEST(DispatchCombine, Fp8Pow2ScalesOddGroupsRowAlign1) {  // run_shape checks the GPU count
  CaseShape s;
  s.H = 640;  // 5 scale groups: a half-warp sits idle in the last pair
  s.pow2 = true;
  s.row_align = 1;
  s.K = 6;
  s.E = 32;
  run_shape(s);
}

TEST(DispatchCombine, Bf16AllRoutings) {  // run_shape checks the GPU count
  CaseShape s;
  s.dtype = DType::kBF16;
  s.row_align = 128;
  run_shape(s);
}

TEST(DispatchCombine, Bf16PartialsAllRoutings) {  // run_shape checks the GPU count
  CaseShape s;
  s.partials = PartialPrecision::kBFloat16;
  run_shape(s);
}

TEST(DispatchCombine, LargeHiddenManyTokensTopK8) {
  EPMOE_REQUIRE_RANKS(2);
  CaseShape s;
  s.E = 64;
  s.H = 7168;
  s.K = 8;
  s.T_max = 300;
  s.row_align = 128;
  const uint64_t seed = seed_for_test();
  run_on_ranks(2, [&](const RankContext& ctx) {
    return run_cases(ctx, s,
                     {{"uniform", Routing::kUniform, {}},
                      {"zipf", Routing::kZipf, {}},
                      {"unequal", Routing::kMasked, {300, 17}},
                      {"duplicate_experts", Routing::kZipf, {}, Duplicates::kSome}},
                     seed);
  });
}

TEST(DispatchCombine, KEqualsOneAndKLargerThanLocalExperts) {
  EPMOE_REQUIRE_RANKS(2);
  const uint64_t seed = seed_for_test();
  CaseShape a;
  a.K = 1;
  a.E = 2;  // one expert per rank
  CaseShape b;
  b.K = 8;
  b.E = 8;  // E_loc = 4 < K
  run_on_ranks(2, [&](const RankContext& ctx) {
    std::unique_ptr<Communicator> comm;
    RANK_OK(make_comm(ctx, &comm));
    // Two handles on one communicator, created one after the other.
    RANK_OK(run_cases(ctx, *comm, a, {{"k1", Routing::kUniform, {}}, {"k1_unequal", Routing::kUniform, {5, 96}}}, seed));
    // K = 8 rows of one token on one rank (all in one expert) while E_loc = 4: the pool bound is K
    // rows per token, not min(K, E_loc).
    return run_cases(ctx, *comm, b,
                     {{"k8_eloc4", Routing::kUniform, {}},
                      {"k8_masked", Routing::kMasked, {}},
                      {"k8_all_slots_one_expert", Routing::kOneExpert, {}, Duplicates::kAllSlots},
                      {"k8_duplicate_experts", Routing::kUniform, {}, Duplicates::kSome}},
                     seed);
  });
}

}  // namespace
}  // namespace epmoe::mgpu
