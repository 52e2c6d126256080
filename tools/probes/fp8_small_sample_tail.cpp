// CPU probe (no GPU): the tail of SPEC's FP8 rel_l2 over small samples, and the sample
// size from which it is negligible (tests/e2e/fp8_check.h, kFullCheckMinGroups).
//
// Model: the reference's own steps (tests/reference), with the GPU's L1 output h replaced by
// h + noise before SwiGLU and the step-5 requantization (the GPU's only departure from the
// float64 reference that moves e4m3 codes; step 6's GEMM error and bf16 roundings are ~1e-3 and
// not modelled). Two noise models:
//   rel: h * (1 + eps * N(0,1))               (tools/probes/fp8_requant_sensitivity.cpp)
//   abs: h + eps * sum_i |W1[j][i] x^[i]| * N(0,1)  (the accumulation error scales with the sum
//        of absolute products, kernel_check.h)
// Per token t (fresh x, uniform routing over E experts, K slots, weights as the e2e tests draw
// them) it records err2_t = ||y_t - y_ref_t||^2 and ref2_t = ||y_ref_t||^2. A sample of n tokens
// has rel_l2^2 = sum err2 / sum ref2, so rel_l2 > c exactly when sum Z_t > 0 with
// Z_t = err2_t - c^2 ref2_t; Chernoff: P(sum of n iid Z > 0) <= rho^n, rho = min_theta E[e^(theta Z)]
// (estimated on the token pool). N_min(p) = ln p / ln rho tokens, times K * I / 128 groups per token.
// It also prints a bootstrap of n-token samples (the empirical distribution, for comparison with
// the GPU's, tests/e2e LayerE2EEvidence) and the step-5 flip rate (codes that differ).
//
// Usage: epmoe-fp8-tail [H I K E tokens]   (default: the e2e small shape 512 256 4 8, 4000 tokens)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "reference/data.h"
#include "reference/kernel_check.h"
#include "reference/numeric.h"
#include "reference/reference.h"

using namespace epmoe::ref;

namespace {

struct Pool {
  std::vector<double> err2, ref2;
  int64_t codes = 0, flips = 0;
};

double rho_for(const Pool& pool, double c) {
  // min over theta of the mean of exp(theta Z), Z scaled by the mean ref2 for conditioning.
  double scale = 0;
  for (double r : pool.ref2) scale += r / double(pool.ref2.size());
  double best = 1.0;
  for (double theta = 1.0; theta < 1e7; theta *= 1.05) {
    double m = 0;
    for (size_t i = 0; i < pool.err2.size(); ++i) {
      const double z = (pool.err2[i] - c * c * pool.ref2[i]) / scale;
      m += std::exp(std::min(theta * z, 700.0));
    }
    m /= double(pool.err2.size());
    best = std::min(best, m);
    if (m > 10 * best && best < 1.0) break;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, int fallback) { return argc > i ? std::atoi(argv[i]) : fallback; };
  Problem p;
  p.R = 1;
  p.H = arg(1, 512);
  p.I = arg(2, 256);
  p.K = arg(3, 4);
  p.E = arg(4, 8);
  const int tokens = arg(5, 4000);
  p.T_max = 1;
  p.dtype = DType::kFP8;
  check_problem(p);
  const uint64_t seed = fresh_seed();
  const int groups_per_token = p.K * p.I / kQuantGroup;
  std::printf("fp8 small-sample tail: H %d I %d K %d E %d, %d tokens (%d groups each), seed %llu\n", p.H, p.I, p.K,
              p.E, tokens, groups_per_token, static_cast<unsigned long long>(seed));
  const RankWeights w = make_rank_weights(p, 0, seed);
  struct Model { const char* name; bool abs; double eps; };
  const Model models[] = {{"rel", false, 5e-5}, {"rel", false, 1e-4}, {"rel", false, 2e-4},
                          {"abs", true, 5e-6},  {"abs", true, 1e-5},  {"abs", true, 2e-5}};
  std::vector<Pool> pools(std::size(models));
  Rng rng(mix_seed(seed, 2));
  std::vector<double> x_hat(p.H), h_abs(2 * p.I), a_hat(p.I);
  std::vector<float> h(2 * p.I), hn(2 * p.I), a(p.I);
  std::vector<uint8_t> q_ref(p.I), q(p.I);
  std::vector<float> s(p.I / kQuantGroup);
  std::vector<uint16_t> o(p.H);
  for (int t = 0; t < tokens; ++t) {
    const std::vector<uint16_t> x = random_x(1, p.H, mix_seed(seed, 3, t));
    const Routed rt = make_routing(p, Routing::kUniform, 0, 1, mix_seed(seed, 4, t));
    dequant_input_row(p, x.data(), x_hat.data());
    std::vector<std::vector<float>> y(std::size(models) + 1, std::vector<float>(p.H, 0.f));
    std::vector<bool> any(std::size(models) + 1, false);
    for (int k = 0; k < p.K; ++k) {
      const int e = rt.topk_idx[k];
      if (e < 0) continue;
      gemm1_row_abs(p, w, e, x_hat.data(), h.data(), h_abs.data());
      for (size_t m = 0; m <= std::size(models); ++m) {
        if (m == 0) {
          hn = h;
        } else {
          const Model& md = models[m - 1];
          for (int i = 0; i < 2 * p.I; ++i)
            hn[i] = float(md.abs ? h[i] + md.eps * h_abs[i] * rng.normal() : h[i] * (1.0 + md.eps * rng.normal()));
        }
        swiglu_row(hn.data(), p.I, 0.f, rt.topk_w[k], a.data());
        requant_act_row(p, a.data(), a_hat.data(), m == 0 ? q_ref.data() : q.data(), s.data());
        if (m > 0) {
          pools[m - 1].codes += p.I;
          for (int i = 0; i < p.I; ++i) pools[m - 1].flips += q[i] != q_ref[i];
        }
        gemm2_row(p, w, e, a_hat.data(), o.data());
        for (int j = 0; j < p.H; ++j) y[m][j] = any[m] ? y[m][j] + bf16_to_float(o[j]) : bf16_to_float(o[j]);
        any[m] = true;
      }
    }
    for (size_t m = 1; m <= std::size(models); ++m) {
      double e2 = 0, r2 = 0;
      for (int j = 0; j < p.H; ++j) {
        const double want = bf16_to_float(bf16_from_float(y[0][j])), got = bf16_to_float(bf16_from_float(y[m][j]));
        e2 += (got - want) * (got - want);
        r2 += want * want;
      }
      pools[m - 1].err2.push_back(e2);
      pools[m - 1].ref2.push_back(r2);
    }
  }
  for (size_t m = 0; m < std::size(models); ++m) {
    const Pool& pool = pools[m];
    std::printf("model %s eps %.0e: step-5 flip rate %.3e\n", models[m].name, models[m].eps,
                double(pool.flips) / double(std::max<int64_t>(pool.codes, 1)));
    Rng br(mix_seed(seed, 5, m));
    for (int n : {1, 2, 4, 8, 16, 32, 64}) {
      const int draws = 200000;
      const SampleTail t = bootstrap_rel_l2(pool.err2, pool.ref2, n, draws, 1e-2, br);
      std::printf("  n=%3d tokens (%5d groups): rel_l2 p50 %.2e p90 %.2e p99 %.2e max %.2e; P(> 1e-2) %.2e\n", n,
                  n * groups_per_token, t.rel[draws / 2], t.rel[draws * 9 / 10], t.rel[draws * 99 / 100],
                  t.rel.back(), t.above);
    }
    const double rho = rho_for(pool, 1e-2);
    if (rho < 1.0) {
      const double n6 = std::log(1e-6) / std::log(rho), n9 = std::log(1e-9) / std::log(rho);
      std::printf("  Chernoff rho %.4f: P(rel_l2 > 1e-2) <= rho^n; <= 1e-6 from n = %.1f tokens (%.0f groups), "
                  "<= 1e-9 from %.1f tokens (%.0f groups)\n",
                  rho, n6, n6 * groups_per_token, n9, n9 * groups_per_token);
    } else {
      std::printf("  Chernoff: no theta with E[exp(theta Z)] < 1 (the mean is above the bound)\n");
    }
  }
  return 0;
}
