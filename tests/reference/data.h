// Seeded test data shared by the CPU and GPU tests.
//
// Every stream is derived from (seed, what, rank, expert) alone, so one rank's
// process can build its own inputs and weights and get exactly the bytes that
// the reference builds for that rank. SPEC.md asks for fresh data each run:
// take the seed from fresh_seed() and print it, so a failure can be replayed
// with EPMOE_SEED.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"

namespace epmoe::ref {

// A seed from std::random_device, or the value of the environment variable
// EPMOE_SEED when set (decimal or 0x-hex).
uint64_t fresh_seed();

// splitmix64 over the parts: independent streams from one seed.
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}
  double uniform() { return static_cast<double>(g_() >> 11) * 0x1p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int below(int n) { return static_cast<int>(g_() % static_cast<uint64_t>(n)); }  // [0, n)
  double normal();  // Box-Muller; standard normal
  std::mt19937_64& engine() { return g_; }

 private:
  std::mt19937_64 g_;
};

// ---- Activations and weights -----------------------------------------------

// x[T][H] bf16: standard normal times a per-(token, 128-group) factor in
// [1/2, 2] (so group scales differ), magnitudes kept >= 0.02 so no element is 0.
std::vector<uint16_t> random_x(int T, int H, uint64_t seed);

// Weights of rank r's experts [r*E_loc, (r+1)*E_loc): uniform with standard
// deviation 1/sqrt(fan_in) (H for W1, I for W2), times a per-128x128-block
// factor in [1/2, 2]; FP8 mode quantizes them with quantize_128x128 and
// Problem.pow2_scales, BF16 mode rounds them to bf16. Each expert draws from
// its own stream keyed by its global index.
RankWeights make_rank_weights(const Problem& p, int rank, uint64_t seed);
std::vector<RankWeights> make_problem_weights(const Problem& p, uint64_t seed);

// ---- Routing -----------------------------------------------------------------

enum class Routing {
  kUniform,         // K distinct experts, uniform
  kZipf,            // K distinct experts, popularity ~ 1/rank^1.2 over a seeded permutation
  kOneExpert,       // slot 0 = expert 0, the other slots -1
  kOneRank,         // min(K, E_loc) distinct experts of rank 0, the other slots -1
  kMasked,          // uniform, then ~25% of slots -1, with some tokens fully masked
  kDuplicateRanks,  // >= 2 distinct experts of one rank per token, the rest uniform
};
const char* routing_name(Routing k);
inline constexpr Routing kAllRoutings[] = {Routing::kUniform, Routing::kZipf,   Routing::kOneExpert,
                                           Routing::kOneRank, Routing::kMasked, Routing::kDuplicateRanks};

struct Routed {
  std::vector<int32_t> topk_idx;  // [T][K]
  std::vector<float> topk_w;      // [T][K]
};

// Routing of T tokens of one rank. Weights are drawn for every slot (masked
// ones too, so a kernel reading a masked slot's weight still sees a plausible
// number): positive, in [0.1, 1] before normalization, summing to ~1 per token.
// The valid experts of a token are always distinct, as a real router's are.
//   kOneExpert: why -1 and not other experts: "every token to one expert"
//     is then literal, the most skewed load there is, and rank 0 gets all work.
//   kOneRank / kDuplicateRanks: when E_loc is too small, slots that cannot be
//     filled with distinct experts of that rank are -1 (kOneRank) or uniform
//     (kDuplicateRanks, which needs E_loc >= 2 and K >= 2 to hold).
// Throws std::invalid_argument if K > E for a routing that needs K distinct.
Routed make_routing(const Problem& p, Routing kind, int rank, int T, uint64_t seed);

// x and routing for one rank, and for all ranks (T_per_rank.size() == R, each
// in [0, T_max]).
RankInput make_rank_input(const Problem& p, Routing kind, int rank, int T, uint64_t seed);
std::vector<RankInput> make_problem_inputs(const Problem& p, Routing kind, const std::vector<int>& T_per_rank,
                                           uint64_t seed);

// Up to per_rank distinct tokens of each rank, sorted, drawn with the given
// seed (use a fresh one per run).
std::vector<std::vector<int>> sample_tokens(const std::vector<int>& T_per_rank, int per_rank, uint64_t seed);

}  // namespace epmoe::ref
