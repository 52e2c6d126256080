#include "reference/data.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "reference/numeric.h"

namespace epmoe::ref {

namespace {

// Stream tags for mix_seed; changing one changes the data of that stream only.
enum : uint64_t { kTagX = 1, kTagRouting = 2, kTagWeights = 3, kTagZipfOrder = 4, kTagSample = 5 };

constexpr double kZipfExponent = 1.2;
constexpr double kMaskedTokenRate = 0.10;  // whole token masked
constexpr double kMaskedSlotRate = 1.0 / 6.0;  // per slot of the other tokens: 0.1 + 0.9/6 = 25% of slots

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("epmoe::ref data: " + what); }

// Block factor in [1/2, 2], log-uniform, so neighbouring scale groups differ.
float block_factor(Rng& rng) { return static_cast<float>(std::exp2(rng.uniform(-1.0, 1.0))); }

// W row-major [rows][cols] as float, std 1/sqrt(cols) per block factor.
std::vector<float> random_matrix(Rng& rng, int rows, int cols) {
  std::vector<float> w(int64_t(rows) * cols);
  const double bound = std::sqrt(3.0 / cols);  // uniform(-b, b) has std b/sqrt(3)
  const int bs = kQuantGroup;
  const int brows = (rows + bs - 1) / bs, bcols = (cols + bs - 1) / bs;
  std::vector<float> f(int64_t(brows) * bcols);
  for (float& v : f) v = block_factor(rng);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j)
      w[int64_t(i) * cols + j] = static_cast<float>(rng.uniform(-bound, bound)) * f[int64_t(i / bs) * bcols + j / bs];
  return w;
}

bool contains(const int32_t* v, int n, int32_t e) { return std::find(v, v + n, e) != v + n; }

// Draws experts into out[filled..K) distinct from out[0..filled), from
// [lo, lo + n). Rejection is cheap because K is small next to n in practice;
// the scan after many misses keeps it terminating when K is close to n.
void fill_distinct_uniform(Rng& rng, int32_t lo, int n, int32_t* out, int filled, int K) {
  for (int k = filled; k < K; ++k) {
    int32_t e = -1;
    for (int tries = 0; tries < 64 && e < 0; ++tries) {
      const int32_t c = lo + rng.below(n);
      if (!contains(out, k, c)) e = c;
    }
    for (int32_t c = lo; e < 0 && c < lo + n; ++c)
      if (!contains(out, k, c)) e = c;
    if (e < 0) fail("cannot draw " + std::to_string(K) + " distinct experts from " + std::to_string(n));
    out[k] = e;
  }
}

void shuffle_slots(Rng& rng, int32_t* idx, int K) {
  for (int k = K - 1; k > 0; --k) std::swap(idx[k], idx[rng.below(k + 1)]);
}

}  // namespace

uint64_t fresh_seed() {
  if (const char* env = std::getenv("EPMOE_SEED")) return std::strtoull(env, nullptr, 0);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ a) ^ b) ^ c);
}

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1], keeps log finite
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// ---- Activations and weights -----------------------------------------------

std::vector<uint16_t> random_x(int T, int H, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> x(int64_t(T) * H);
  for (int t = 0; t < T; ++t) {
    float f = 1.0f;
    for (int i = 0; i < H; ++i) {
      if (i % kQuantGroup == 0) f = block_factor(rng);
      double v = rng.normal();
      // Why a floor: SPEC.md wants no zeros, so that an unwritten output or a
      // dropped input channel cannot hide behind a zero.
      if (std::fabs(v) < 0.02) v = std::copysign(0.02 + std::fabs(v), v);
      x[int64_t(t) * H + i] = bf16_from_float(static_cast<float>(v) * f);
    }
  }
  return x;
}

namespace {

// Expert le of rank `rank`, into its slices of w (already sized).
void build_expert(const Problem& p, int rank, int le, uint64_t seed, RankWeights& w) {
  const int H = p.H, I = p.I;
  const int64_t n1 = int64_t(2) * I * H, n2 = int64_t(H) * I;
  Rng rng(mix_seed(seed, kTagWeights, uint64_t(rank) * p.E_loc() + le));
  const std::vector<float> w1 = random_matrix(rng, 2 * I, H);
  const std::vector<float> w2 = random_matrix(rng, H, I);
  if (p.dtype == DType::kFP8) {
    const int64_t b = int64_t(H / kQuantGroup) * (I / kQuantGroup);
    quantize_128x128(w1.data(), 2 * I, H, p.pow2_scales, w.w1_q.data() + le * n1, w.w1_s.data() + le * 2 * b);
    quantize_128x128(w2.data(), H, I, p.pow2_scales, w.w2_q.data() + le * n2, w.w2_s.data() + le * b);
  } else {
    std::transform(w1.begin(), w1.end(), w.w1_bf16.begin() + le * n1, bf16_from_float);
    std::transform(w2.begin(), w2.end(), w.w2_bf16.begin() + le * n2, bf16_from_float);
  }
}

}  // namespace

RankWeights make_rank_weights(const Problem& p, int rank, uint64_t seed) {
  check_problem(p);
  if (rank < 0 || rank >= p.R) fail("rank " + std::to_string(rank) + " is out of [0, R)");
  const int64_t E_loc = p.E_loc(), n1 = int64_t(2) * p.I * p.H, n2 = int64_t(p.H) * p.I;
  RankWeights w;
  if (p.dtype == DType::kFP8) {
    const int64_t b = int64_t(p.H / kQuantGroup) * (p.I / kQuantGroup);
    w.w1_q.resize(E_loc * n1);
    w.w1_s.resize(E_loc * 2 * b);
    w.w2_q.resize(E_loc * n2);
    w.w2_s.resize(E_loc * b);
  } else {
    w.w1_bf16.resize(E_loc * n1);
    w.w2_bf16.resize(E_loc * n2);
  }
  // Why threads: at model sizes this is minutes of random numbers. Each expert
  // has its own stream and its own output slice, so the bytes do not depend
  // on the schedule.
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int le = next++; le < E_loc; le = next++) build_expert(p, rank, le, seed, w);
  };
  std::vector<std::thread> helpers;
  for (int i = 1; i < std::min<int64_t>(worker_threads(), E_loc); ++i) helpers.emplace_back(worker);
  worker();
  for (auto& h : helpers) h.join();
  return w;
}

std::vector<RankWeights> make_problem_weights(const Problem& p, uint64_t seed) {
  std::vector<RankWeights> w;
  for (int r = 0; r < p.R; ++r) w.push_back(make_rank_weights(p, r, seed));
  return w;
}

// ---- Routing -----------------------------------------------------------------

const char* routing_name(Routing k) {
  switch (k) {
    case Routing::kUniform: return "uniform";
    case Routing::kZipf: return "zipf";
    case Routing::kOneExpert: return "one_expert";
    case Routing::kOneRank: return "one_rank";
    case Routing::kMasked: return "masked";
    case Routing::kDuplicateRanks: return "duplicate_ranks";
  }
  return "?";
}

Routed make_routing(const Problem& p, Routing kind, int rank, int T, uint64_t seed) {
  check_problem(p);
  if (T < 0) fail("T = " + std::to_string(T) + " is negative");
  const int E = p.E, K = p.K, E_loc = p.E_loc();
  const bool needs_k_distinct =
      kind == Routing::kUniform || kind == Routing::kZipf || kind == Routing::kMasked || kind == Routing::kDuplicateRanks;
  if (needs_k_distinct && K > E)
    fail(std::string(routing_name(kind)) + " routing needs K <= E (K = " + std::to_string(K) +
         ", E = " + std::to_string(E) + ")");

  Routed out;
  out.topk_idx.assign(int64_t(T) * K, -1);
  out.topk_w.assign(int64_t(T) * K, 0.0f);
  Rng rng(mix_seed(seed, kTagRouting, rank));

  // Zipf: the popularity order is shared by all ranks (keyed by seed alone),
  // so the hot experts are hot everywhere, as in a real model.
  std::vector<int32_t> order;
  std::vector<double> cdf;
  if (kind == Routing::kZipf) {
    order.resize(E);
    std::iota(order.begin(), order.end(), 0);
    Rng orng(mix_seed(seed, kTagZipfOrder));
    for (int i = E - 1; i > 0; --i) std::swap(order[i], order[orng.below(i + 1)]);
    cdf.resize(E);
    double sum = 0.0;
    for (int i = 0; i < E; ++i) cdf[i] = (sum += std::pow(i + 1.0, -kZipfExponent));
    for (double& c : cdf) c /= sum;
  }

  // A token whose whole row is masked must exist on every rank with a few
  // tokens, not only by chance.
  const int forced_masked = (kind == Routing::kMasked && T >= 4) ? rng.below(T) : -1;

  for (int t = 0; t < T; ++t) {
    int32_t* idx = out.topk_idx.data() + int64_t(t) * K;
    float* w = out.topk_w.data() + int64_t(t) * K;
    switch (kind) {
      case Routing::kUniform:
        fill_distinct_uniform(rng, 0, E, idx, 0, K);
        break;
      case Routing::kZipf:
        for (int k = 0; k < K; ++k) {
          int32_t e = -1;
          for (int tries = 0; tries < 1000 && e < 0; ++tries) {
            const int pos = static_cast<int>(std::upper_bound(cdf.begin(), cdf.end(), rng.uniform()) - cdf.begin());
            const int32_t c = order[std::min(pos, E - 1)];
            if (!contains(idx, k, c)) e = c;
          }
          for (int i = 0; e < 0 && i < E; ++i)
            if (!contains(idx, k, order[i])) e = order[i];
          idx[k] = e;
        }
        break;
      case Routing::kOneExpert:
        idx[0] = 0;
        break;
      case Routing::kOneRank:
        fill_distinct_uniform(rng, 0, E_loc, idx, 0, std::min(K, E_loc));
        break;
      case Routing::kMasked: {
        fill_distinct_uniform(rng, 0, E, idx, 0, K);
        const bool whole = t == forced_masked || rng.uniform() < kMaskedTokenRate;
        for (int k = 0; k < K; ++k)
          if (whole || rng.uniform() < kMaskedSlotRate) idx[k] = -1;
        break;
      }
      case Routing::kDuplicateRanks: {
        const int m = std::min({K, E_loc, std::max(2, K / 2)});
        int filled = 0;
        if (m >= 2) {
          const int r0 = rng.below(p.R);
          fill_distinct_uniform(rng, r0 * E_loc, E_loc, idx, 0, m);
          filled = m;
        }
        fill_distinct_uniform(rng, 0, E, idx, filled, K);
        shuffle_slots(rng, idx, K);  // so the shared-rank experts are not always slots 0..m-1
        break;
      }
    }
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += (w[k] = static_cast<float>(rng.uniform(0.1, 1.0)));
    for (int k = 0; k < K; ++k) w[k] /= sum;
  }
  return out;
}

RankInput make_rank_input(const Problem& p, Routing kind, int rank, int T, uint64_t seed) {
  check_problem(p);
  if (rank < 0 || rank >= p.R) fail("rank " + std::to_string(rank) + " is out of [0, R)");
  if (T < 0 || T > p.T_max)
    fail("T = " + std::to_string(T) + " of rank " + std::to_string(rank) + " is out of [0, T_max = " +
         std::to_string(p.T_max) + "]");
  RankInput in;
  in.T = T;
  in.x = random_x(T, p.H, mix_seed(seed, kTagX, rank));
  Routed routed = make_routing(p, kind, rank, T, seed);
  in.topk_idx = std::move(routed.topk_idx);
  in.topk_w = std::move(routed.topk_w);
  return in;
}

std::vector<RankInput> make_problem_inputs(const Problem& p, Routing kind, const std::vector<int>& T_per_rank,
                                           uint64_t seed) {
  if (static_cast<int>(T_per_rank.size()) != p.R)
    fail("T_per_rank has " + std::to_string(T_per_rank.size()) + " entries, R = " + std::to_string(p.R));
  std::vector<RankInput> in;
  for (int r = 0; r < p.R; ++r) in.push_back(make_rank_input(p, kind, r, T_per_rank[r], seed));
  return in;
}

std::vector<std::vector<int>> sample_tokens(const std::vector<int>& T_per_rank, int per_rank, uint64_t seed) {
  std::vector<std::vector<int>> s(T_per_rank.size());
  for (size_t r = 0; r < T_per_rank.size(); ++r) {
    const int T = T_per_rank[r];
    if (T < 0) fail("T_per_rank[" + std::to_string(r) + "] is negative");
    Rng rng(mix_seed(seed, kTagSample, r));
    // Partial Fisher-Yates over [0, T): exact, distinct, O(T) memory is fine here.
    std::vector<int> all(T);
    std::iota(all.begin(), all.end(), 0);
    const int n = std::max(0, std::min(per_rank, T));
    for (int i = 0; i < n; ++i) std::swap(all[i], all[i + rng.below(T - i)]);
    s[r].assign(all.begin(), all.begin() + n);
    std::sort(s[r].begin(), s[r].end());
  }
  return s;
}

}  // namespace epmoe::ref
