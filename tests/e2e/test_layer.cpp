// The MoE layer end to end on 2+ GPUs against tests/reference (SPEC.md), one process per rank.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "e2e/layer_case.h"
#include "mgpu/mgpu_util.h"
#include "reference/data.h"

namespace epmoe::e2e {
namespace {

using ref::DType;
using ref::Routing;

// Every case runs on mgpu::test_ranks(2) ranks (EPMOE_TEST_RANKS overrides 2; at N = 1 no NVLink
// traffic, but every kernel, the megakernel's in-block and cross-block ordering included). Each
// case's per-rank token counts repeat cyclically over extra ranks; at N = 1 the first rank's count
// is used.
using mgpu::test_ranks;

// EPMOE_E2E_REPEATS=N (default 1): run_case runs its case N times in the same rank processes
// (one NCCL bootstrap, a new layer per repeat), repeat i with its own seed from the printed one.
constexpr const char* kRepeatsEnv = "EPMOE_E2E_REPEATS";

int e2e_repeats() {
  if (const char* env = std::getenv(kRepeatsEnv)) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return 1;
}

// Repeat i's seed. Why the base seed itself at N = 1: then EPMOE_SEED=<a repeat's seed> with one
// repeat replays exactly that repeat's inputs.
uint64_t repeat_seed(uint64_t seed, int repeats, int i) {
  return repeats == 1 ? seed : ref::mix_seed(seed, 0x7e9ea7, uint64_t(i));
}

// The command line that replays the running test with `seed` on `ranks` ranks: EPMOE_SEED fixes
// every input of every call (tests/reference/data.h), EPMOE_TEST_RANKS the rank count (and with it
// the per-rank token counts); the environment variables that change what a case runs come along.
// `repeats` > 0 sets EPMOE_E2E_REPEATS (1: a failing repeat on its own, with its seed).
std::string replay_command(uint64_t seed, int ranks, int repeats = 0) {
  std::ostringstream os;
  os << "EPMOE_SEED=" << seed << " EPMOE_TEST_RANKS=" << ranks;
  const std::string n = std::to_string(repeats);
  for (const char* v : {"EPMOE_FUSED_EPILOGUE", "EPMOE_FUSED_PREFETCH", "EPMOE_FUSED_B_FIRST", "EPMOE_FUSED_CLAIM",
                        "EPMOE_FUSED_L1_SPLIT", "EPMOE_AUTO_FUSED_MAX", "EPMOE_TEST_TIMEOUT_S", "EPMOE_EVIDENCE_CALLS", kRepeatsEnv}) {
    const char* val = repeats > 0 && std::strcmp(v, kRepeatsEnv) == 0 ? n.c_str() : std::getenv(v);
    if (val) os << " " << v << "=" << val;
  }
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  os << " " << (len > 0 ? std::string(exe, size_t(len)) : std::string("epmoe_mgpu_tests"));
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info()) {
    const std::string name = info->name();
    os << " --gtest_filter=" << info->test_suite_name() << "." << name;
    if (name.rfind("DISABLED_", 0) == 0) os << " --gtest_also_run_disabled_tests";
  }
  return os.str();
}

// Each rank's progress through the repeats, in memory the forked ranks share with this process:
// after a crash or a timeout (no Status message) it still names the repeat to replay.
class RepeatProgress {
 public:
  explicit RepeatProgress(int ranks) : ranks_(ranks) {
    void* m = mmap(nullptr, sizeof(int) * 2 * size_t(ranks), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    slots_ = static_cast<volatile int*>(m);
    for (int r = 0; r < ranks; ++r) slots_[2 * r + 1] = -1;
  }
  ~RepeatProgress() {
    if (slots_) munmap(const_cast<int*>(slots_), sizeof(int) * 2 * size_t(ranks_));
  }
  RepeatProgress(const RepeatProgress&) = delete;
  RepeatProgress& operator=(const RepeatProgress&) = delete;

  // In a rank: repeats [0, n) passed; repeat i failed.
  void passed(int rank, int n) { if (slots_) slots_[2 * rank] = n; }
  void failed(int rank, int i) { if (slots_) slots_[2 * rank + 1] = i; }
  // After the launch: the earliest repeat a rank reported failing, else the earliest one that some
  // rank did not finish (its crash or hang); -1 when every rank passed every repeat.
  int failing(int repeats) const {
    if (!slots_) return -1;
    int failed = -1, unfinished = repeats;
    for (int r = 0; r < ranks_; ++r) {
      const int f = slots_[2 * r + 1];
      if (f >= 0 && (failed < 0 || f < failed)) failed = f;
      unfinished = std::min(unfinished, int(slots_[2 * r]));
    }
    if (failed >= 0) return failed;
    return unfinished < repeats ? unfinished : -1;
  }

 private:
  int ranks_;
  volatile int* slots_ = nullptr;
};

// `c` EPMOE_E2E_REPEATS = repeats (> 1) times in one launch. Every rank runs the same repeats in
// the same order on one Communicator and stops at its first failing one, whose index and seed its
// message and the replay line name. Why release the Communicator then: its destruction may wait
// for peers that have gone on to the next repeat's collective create; the failing rank must exit,
// so that the launcher kills them (as a failing call does without repeats).
void run_repeats(const LayerCase& c, uint64_t seed, int ranks, int repeats, double timeout_s) {
  std::printf("[e2e] %d repeats in one launch (%s)\n", repeats, kRepeatsEnv);
  std::vector<LayerCase> cases(size_t(repeats), c);
  for (int i = 0; i < repeats; ++i) cases[i].replay = replay_command(repeat_seed(seed, repeats, i), ranks, 1);
  RepeatProgress progress(ranks);
  const auto body = [&](const RankContext& ctx) -> Status {
    std::unique_ptr<Communicator> comm;
    RANK_OK(mgpu::make_comm(ctx, &comm));
    for (int i = 0; i < repeats; ++i) {
      const uint64_t s = repeat_seed(seed, repeats, i);
      if (ctx.rank == 0) {
        std::printf("[e2e] repeat %d of %d seed=%llu\n", i, repeats, static_cast<unsigned long long>(s));
        std::fflush(stdout);
      }
      const Status st = run_layer_case(*comm, cases[i], s);
      if (!st.ok()) {
        progress.failed(ctx.rank, i);
        (void)comm.release();
        return Status(st.code(), "repeat " + std::to_string(i) + " of " + std::to_string(repeats) + " (seed " +
                                     std::to_string(s) + "): " + st.message());
      }
      progress.passed(ctx.rank, i + 1);
    }
    return Status::Ok();
  };
  // Why no per-repeat bound: the launcher has one deadline for the whole launch.
  mgpu::run_on_ranks(ranks, body, timeout_s * repeats);
  if (!::testing::Test::HasFailure()) return;
  const int i = progress.failing(repeats);
  if (i < 0) {
    std::printf("[e2e] FAILED; replay: %s\n", c.replay.c_str());
  } else {
    std::printf("[e2e] FAILED in repeat %d of %d (seed=%llu); replay: %s\n", i, repeats,
                static_cast<unsigned long long>(repeat_seed(seed, repeats, i)), cases[i].replay.c_str());
  }
}

void run_case(LayerCase c, int ranks = 2, double timeout_s = 240) {
  ranks = test_ranks(ranks);
  EPMOE_REQUIRE_RANKS(ranks);
  if (c.tokens.empty()) c.tokens.assign(ranks, 256);
  for (size_t r = c.tokens.size(), n0 = c.tokens.size(); r < size_t(ranks); ++r) c.tokens.push_back(c.tokens[r % n0]);
  c.tokens.resize(size_t(ranks));
  const uint64_t seed = ref::fresh_seed();
  c.replay = replay_command(seed, ranks);
  std::printf("[e2e] %s seed=%llu\n", c.describe().c_str(), static_cast<unsigned long long>(seed));
  if (const int repeats = e2e_repeats(); repeats > 1) return run_repeats(c, seed, ranks, repeats, timeout_s);
  mgpu::run_on_ranks(ranks, [&](const RankContext& ctx) { return run_layer_case(ctx, c, seed); }, timeout_s);
  // Every failure of the case (a rank's check, a timeout, a crash) gets the line that replays it.
  if (::testing::Test::HasFailure()) std::printf("[e2e] FAILED; replay: %s\n", c.replay.c_str());
}

LayerCase make(Shape s, DType d, Routing r, std::vector<int> t = {}) {
  LayerCase c;
  c.shape = s;
  c.dtype = d;
  c.routing = r;
  c.tokens = std::move(t);
  return c;
}

// Each case runs on both paths: LayerE2E.<name> (the pipeline) and LayerE2EFused.<name> (the
// megakernel, which also checks that its y is bitwise the pipeline's and bitwise repeatable).
// Cases marked kPipelineOnly run on the pipeline only (the fused suite keeps the mgpu run within
// its time budget and covers the same code paths through the other cases).
enum Paths { kBothPaths, kPipelineOnly };

LayerCase fused(LayerCase c) {
  c.path = Path::kFused;
  return c;
}

#define E2E_CASE(Name, paths, timeout_s, ...)                                                       \
  LayerCase Name##_case() { __VA_ARGS__ }                                                            \
  TEST(LayerE2E, Name) { run_case(Name##_case(), 2, timeout_s); }                                     \
  TEST(LayerE2EFused, Name) {                                                                         \
    if (paths == kPipelineOnly) GTEST_SKIP() << "pipeline-only case";                                \
    run_case(fused(Name##_case()), 2, timeout_s);                                                     \
  }

// ---- Shapes x dtypes --------------------------------------------------------------------------
E2E_CASE(Dsv3Fp8, kBothPaths, 240, {
  LayerCase c = make(kDsv3, DType::kFP8, Routing::kUniform, {512, 384});
  c.sample_per_rank = 16;  // 16 x 8 slots x 16 groups = N_min (tests/e2e/fp8_check.h)
  return c;
})
E2E_CASE(Dsv3Bf16, kPipelineOnly, 240, {
  LayerCase c = make(kDsv3, DType::kBF16, Routing::kUniform, {384, 512});
  c.sample_per_rank = 12;
  return c;
})
E2E_CASE(Qwen3Fp8, kBothPaths, 240, { return make(kQwen3, DType::kFP8, Routing::kUniform, {1024, 777}); })
E2E_CASE(Qwen3Bf16, kBothPaths, 240, { return make(kQwen3, DType::kBF16, Routing::kUniform, {1024, 777}); })
E2E_CASE(Top2Fp8, kPipelineOnly, 240, { return make(kTop2, DType::kFP8, Routing::kUniform, {500, 300}); })
E2E_CASE(Top2Bf16, kBothPaths, 240, { return make(kTop2, DType::kBF16, Routing::kUniform, {300, 500}); })

// ---- Routing cases (Qwen3-like shape, both dtypes where cheap) ---------------------------------
E2E_CASE(ZipfFp8, kBothPaths, 240, { return make(kQwen3, DType::kFP8, Routing::kZipf, {1024, 1024}); })
E2E_CASE(ZipfBf16, kPipelineOnly, 240, { return make(kQwen3, DType::kBF16, Routing::kZipf, {1024, 1024}); })
E2E_CASE(AllTokensToOneExpert, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kOneExpert, {700, 600});
  c.sample_per_rank = 384;  // one slot of 6 groups per token: 2304 groups >= N_min (tests/e2e/fp8_check.h)
  return c;
})
E2E_CASE(AllTokensToOneRank, kBothPaths, 240, { return make(kQwen3, DType::kFP8, Routing::kOneRank, {512, 512}); })
E2E_CASE(MaskedSlots, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kMasked, {512, 300});
  c.sample_per_rank = 96;  // ~6 valid slots of 6 groups: ~3400 groups >= N_min (tests/e2e/fp8_check.h)
  return c;
})
E2E_CASE(MaskedSlotsBf16, kPipelineOnly, 240, { return make(kTop2, DType::kBF16, Routing::kMasked, {512, 300}); })
E2E_CASE(DuplicateRanks, kPipelineOnly, 240, { return make(kQwen3, DType::kFP8, Routing::kDuplicateRanks, {256, 256}); })
E2E_CASE(ExpertNamedTwiceInOneToken, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 256});
  c.duplicate_experts = true;
  return c;
})
E2E_CASE(ZeroTokensOnOneRank, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {0, 333});
  c.max_tokens = 512;
  return c;
})
E2E_CASE(ZeroTokensEverywhere, kBothPaths, 240, {
  LayerCase c = make(kTop2, DType::kBF16, Routing::kUniform, {0, 0});
  c.max_tokens = 64;
  return c;
})
E2E_CASE(UnequalTokens, kBothPaths, 240, { return make(kTop2, DType::kFP8, Routing::kZipf, {1, 999}); })
// ---- Paths per rank ------------------------------------------------------------------------------
// The ranks of one call on different paths (one comm protocol): y must pass the reference checks,
// equal bitwise what the pipeline on every rank gives, and repeat bitwise.
TEST(LayerE2E, MixedPathsPerRank) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {64, 200, 1, 333});
  c.rank_paths = {Path::kFused, Path::kPipeline};
  c.calls = 2;
  run_case(c, 2, 240);
}
TEST(LayerE2E, MixedPathsPerRankZeroTokensBf16) {
  LayerCase c = make(kTop2, DType::kBF16, Routing::kUniform, {300, 0});
  c.max_tokens = 512;
  c.rank_paths = {Path::kPipeline, Path::kFused};
  run_case(c, 2, 240);
}
// Path::kAuto: each rank chooses from its own T (checked through last_path()), on either side of a
// lowered threshold, and at the library's own threshold (512 tokens: the megakernel, 513: the
// pipeline).
TEST(LayerE2E, AutoPathAcrossItsThreshold) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kZipf, {8, 300, 0, 100});
  c.max_tokens = 512;
  c.path = Path::kAuto;
  c.auto_fused_max_tokens = 100;
  c.calls = 2;
  run_case(c, 2, 240);
}
TEST(LayerE2E, AutoPathAtTheLibraryThreshold) {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {512, 513});
  c.path = Path::kAuto;
  run_case(c, 2, 240);
}

E2E_CASE(ClampAndPow2Scales, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 200});
  c.clamp = 0.5f;  // gate and up are O(1) here, so the clamp is active on a good share of them
  c.pow2_scales = true;
  return c;
})

// bf16 combine partials: the DSV3 slice (K = 8: about four experts of a token on each rank, whose
// outputs are added before the one bf16 rounding) in both dtypes, against SPEC's bounds.
E2E_CASE(Dsv3Fp8Bf16Partials, kBothPaths, 240, {
  LayerCase c = make(kDsv3, DType::kFP8, Routing::kUniform, {384, 512});
  c.sample_per_rank = 16;  // 16 x 8 slots x 16 groups = N_min (tests/e2e/fp8_check.h)
  c.bf16_partials = true;
  return c;
})
E2E_CASE(Qwen3Bf16Bf16Partials, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kBF16, Routing::kZipf, {777, 1024});
  c.bf16_partials = true;
  return c;
})

// ---- The megakernel's epilogue variants (docs/MEGAKERNEL.md) -------------------------------------
// Each forces one variant on a routing with both full and partial tiles (Zipf: a few experts far
// above 128 rows, many below), so the throughput variant's storer takes full L1 and L2 tiles while
// the math warpgroups store the partial ones, and the L2 producers wait on readiness counts from
// both. The fused result must still be bitwise the pipeline's.
E2E_CASE(FusedDeferredEpilogueFp8, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kZipf, {1024, 900});
  c.fused_epilogue = "deferred";
  return c;
})
E2E_CASE(FusedDeferredEpilogueBf16, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kBF16, Routing::kZipf, {900, 1024});
  c.fused_epilogue = "deferred";
  return c;
})
// The inline (decode) variant where the per-call choice would take the deferred one.
E2E_CASE(FusedInlineEpilogueManyTokens, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {2100, 2048});
  c.fused_epilogue = "inline";
  return c;
})
// The per-call choice at a throughput token count (DSV3 slice, 1024+ tokens: deferred).
E2E_CASE(Dsv3Fp8ManyTokens, kBothPaths, 240, {
  LayerCase c = make(kDsv3, DType::kFP8, Routing::kUniform, {1100, 1024});
  c.sample_per_rank = 16;  // 16 x 8 slots x 16 groups = N_min (tests/e2e/fp8_check.h)
  return c;
})

// ---- Repetition and graphs ----------------------------------------------------------------------
E2E_CASE(ThousandCallsFreshRouting, kBothPaths, 400, {
  LayerCase c = make(kSmall, DType::kFP8, Routing::kZipf, {96, 64});
  c.calls = 1000;
  c.check_every = 100;
  c.sample_per_rank = 96;
  return c;
})
// The same with enough tokens that the fused path picks its throughput variant (small shape:
// 8 experts per rank, K = 4, so 512+ tokens per rank average 256+ rows per expert).
E2E_CASE(ThousandCallsFreshRoutingManyTokens, kBothPaths, 400, {
  LayerCase c = make(kSmall, DType::kFP8, Routing::kZipf, {640, 512});
  c.calls = 1000;
  c.check_every = 100;
  c.sample_per_rank = 256;  // 8 groups per token: N_min (tests/e2e/fp8_check.h)
  return c;
})
// Sanitizer-sized (tools/gpu_all.sh sanitize: compute-sanitizer slows every kernel many times, and
// the kernels' bounded waits must not expire): the small shape with the megakernel's throughput
// variant and tile claims (640 tokens: 320 rows per expert), its decode variant with claims (8
// tokens: 4 rows per expert), and a tiny call (2 tokens: no claims), two calls each. The decode
// and tiny calls are below N_min (tests/e2e/fp8_check.h): their rel_l2 against the float64
// reference is printed, and the kernel-consistent checks gate them (at 8 tokens SPEC's
// statistic exceeds 1e-2 in ~2% of calls on a correct kernel).
E2E_CASE(SmallThroughputTwoCalls, kBothPaths, 240, {
  LayerCase c = make(kSmall, DType::kFP8, Routing::kZipf, {640, 512});
  c.calls = 2;
  c.sample_per_rank = 256;  // 8 groups per token: N_min (tests/e2e/fp8_check.h)
  return c;
})
E2E_CASE(SmallBf16ThroughputTwoCalls, kBothPaths, 240, {
  LayerCase c = make(kSmall, DType::kBF16, Routing::kUniform, {512, 640});
  c.calls = 2;
  return c;
})
E2E_CASE(SmallDecodeTwoCalls, kBothPaths, 240, {
  LayerCase c = make(kSmall, DType::kFP8, Routing::kUniform, {8, 6});
  c.calls = 2;
  return c;
})
E2E_CASE(SmallTinyTwoCalls, kBothPaths, 240, {
  LayerCase c = make(kSmall, DType::kFP8, Routing::kUniform, {2, 2});
  c.calls = 2;
  return c;
})
E2E_CASE(CudaGraphReplay, kBothPaths, 240, {
  LayerCase c = make(kQwen3, DType::kFP8, Routing::kUniform, {256, 192});
  c.calls = 4;
  c.graph = true;
  return c;
})

// The megakernel's soak: 10,000 fused calls with fresh random routing each call, y checked against the
// reference (and bitwise against the pipeline) every 2,000 calls. Its own suite so that the quick
// GPU run can leave it out (tools/gpu_all.sh runs it in full mode).
TEST(LayerSoak, FusedTenThousandCallsFreshRouting) {
  EPMOE_REQUIRE_RANKS(test_ranks(2));
  LayerCase c = fused(make(kSmall, DType::kFP8, Routing::kZipf, {96, 64}));
  c.calls = 10000;
  c.check_every = 2000;
  c.sample_per_rank = 64;
  run_case(c, 2, 500);
}

// The same soak on the pipeline path (dispatch, two GEMM kernels, combine per call).
TEST(LayerSoak, PipelineTenThousandCallsFreshRouting) {
  EPMOE_REQUIRE_RANKS(test_ranks(2));
  LayerCase c = make(kSmall, DType::kFP8, Routing::kZipf, {96, 64});
  c.calls = 10000;
  c.check_every = 2000;
  c.sample_per_rank = 64;
  run_case(c, 2, 500);
}

// The soak of ranks on different paths: every call each rank switches its path, and in every call
// half of the ranks run the megakernel and half the pipeline (the transitions Path::kAuto makes when
// T crosses its threshold), 10,000 calls, checked against the reference and bitwise against the
// pipeline on every rank every 2,000 calls.
TEST(LayerSoak, MixedPathsTenThousandCallsFreshRouting) {
  EPMOE_REQUIRE_RANKS(test_ranks(2));
  LayerCase c = make(kSmall, DType::kFP8, Routing::kZipf, {96, 64});
  c.rank_paths = {Path::kFused, Path::kPipeline};
  c.rotate_paths = true;
  c.calls = 10000;
  c.check_every = 2000;
  c.sample_per_rank = 64;
  run_case(c, 2, 500);
}

// Calls alternate between the paths on one layer: both share the dispatch/combine epochs and the
// pool, so a fused call right after a pipeline call (and back) must see consistent state.
TEST(LayerE2EFused, AlternatingPaths) {
  EPMOE_REQUIRE_RANKS(test_ranks(2));
  LayerCase c = fused(make(kSmall, DType::kFP8, Routing::kUniform, {200, 150}));
  c.calls = 6;
  c.check_every = 1;  // every call: fused, then pipeline and fused again inside the check
  run_case(c);
}

// ---- Bad input ---------------------------------------------------------------------------------
// The case depends on no rank count (EPMOE_TEST_RANKS=1 runs it on one GPU).
TEST(LayerE2E, BadInputGetsClearErrors) {
  const int ranks = test_ranks(2);
  EPMOE_REQUIRE_RANKS(ranks);
  const uint64_t seed = ref::fresh_seed();
  mgpu::run_on_ranks(ranks, [&](const RankContext& ctx) { return run_bad_input_case(ctx, seed); }, 180);
  if (::testing::Test::HasFailure()) std::printf("[e2e] FAILED; replay: %s\n", replay_command(seed, ranks).c_str());
}

// ---- The FP8 small-sample evidence (disabled by default) -------------------------------------
// One layer, N calls with fresh inputs, every call checked on both paths (fused, then the pipeline
// and a second fused call on the same inputs, bitwise); each rank prints the distributions of the
// full-reference and kernel-consistent rel_l2, the step-5 flips, and a bootstrap of rel_l2 over
// n-token samples. Fails only on a kernel-consistent or bitwise failure. N from
// EPMOE_EVIDENCE_CALLS (default 300 for the small shape, 20 for the large ones). Run:
//   EPMOE_TEST_RANKS=1 epmoe_mgpu_tests --gtest_also_run_disabled_tests --gtest_filter='LayerE2EEvidence.*'
int evidence_calls(int fallback) {
  if (const char* env = std::getenv("EPMOE_EVIDENCE_CALLS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return fallback;
}

LayerCase evidence_case(LayerCase c, int calls) {
  c = fused(c);
  c.calls = calls;
  c.evidence = true;
  return c;
}

// The small-sample case: 8 tokens of the small shape (64 requantization groups per call).
TEST(LayerE2EEvidence, DISABLED_SmallDecode) {
  run_case(evidence_case(make(kSmall, DType::kFP8, Routing::kUniform, {8, 6}), evidence_calls(300)), 2, 580);
}
// 2 tokens of the small shape (16 groups).
TEST(LayerE2EEvidence, DISABLED_SmallTiny) {
  run_case(evidence_case(make(kSmall, DType::kFP8, Routing::kUniform, {2, 2}), evidence_calls(300)), 2, 580);
}
TEST(LayerE2EEvidence, DISABLED_Qwen3) {
  run_case(evidence_case(make(kQwen3, DType::kFP8, Routing::kUniform, {256, 256}), evidence_calls(20)), 2, 580);
}
TEST(LayerE2EEvidence, DISABLED_Top2) {
  run_case(evidence_case(make(kTop2, DType::kFP8, Routing::kUniform, {256, 256}), evidence_calls(20)), 2, 580);
}
TEST(LayerE2EEvidence, DISABLED_Dsv3) {
  LayerCase c = make(kDsv3, DType::kFP8, Routing::kUniform, {256, 256});
  c.sample_per_rank = 16;  // 16 x 8 slots x 16 groups = N_min (tests/e2e/fp8_check.h)
  run_case(evidence_case(c, evidence_calls(20)), 2, 580);
}

}  // namespace
}  // namespace epmoe::e2e
