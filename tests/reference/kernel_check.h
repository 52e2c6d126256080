// Kernel-consistent checks of FP8 mode: what a GPU path's intermediate values may
// differ from the CPU reference's by, step by step, given that its GEMMs accumulate with less
// precision than float64.
//
// Why: SPEC's end-to-end bound (rel_l2 <= 1e-2 against the float64 reference) is a statistic. The
// GPU's h differs from the float64 h by its accumulation error (~1e-4 relative), which moves a
// few e4m3 codes of step 5 across a rounding midpoint; each such code is one e4m3 step (1/16 to
// 1/8 of the value) off, and over a small sample (a few tokens) those few flips decide rel_l2.
// These checks hold every step to the reference instead, with tolerances from the arithmetic:
//   step 5: each GPU scale is the one SPEC's rule gives for some amax within the GEMM error of the
//     reference's, and each code is RNE of a value within that error of a / s (so a code differs
//     from the reference's only next to a rounding midpoint);
//   step 6: each GPU o is bf16 of a value within the GEMM error of the float64 W2 a^, where a^ is
//     the GPU's own step-5 output;
//   step 7: each GPU y is bf16 of the sum of the GPU's own o rows up to fp32 reordering (and the
//     bf16 rounding of per-rank partials where the layer uses them).
// They hold for any sample size, so they gate small samples where rel_l2 is not stable.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "reference/data.h"

#include "reference/reference.h"

namespace epmoe::ref {

// gamma: bound on a GPU FP8 GEMM's accumulation error, relative to the sum of the absolute
// products of the dot (gemm1_row_abs / gemm2_row_abs): |dot_gpu - dot| <= gamma * sum |w_i v_i|.
// Why this size: the FP8 tensor cores keep ~13-14 bits in their 128-deep partial sums before the
// fp32 promotion (DeepSeek-V3's measurement; docs/GEMM.md "Accuracy"), i.e. each partial carries
// an error of a few units of 2^-13 of its own magnitude, which is at most the block's absolute
// sum; the promotions add one fp32 rounding per 128-K block (2^-24 each, far below). 2^-12 keeps
// a factor 2 over one unit of 2^-13 for truncation bias across the four k=32 wgmma steps of a
// block. Against the noise model that reproduces the FP8 small-sample tail on the CPU
// (tools/probes/fp8_small_sample_tail.cpp, "abs" with eps 2e-5: a Gaussian error of 2e-5 of the
// absolute sum), that is ~12 standard deviations. The evidence test (tests/e2e, LayerE2EEvidence)
// prints how much of the window the GPU's flips use ("window used"): its maximum over many calls
// says how far this could be tightened.
inline constexpr double kGemmAccumError = 0x1p-12;
// The same bound for the W2 GEMM (step 6), measured larger: on one H100 (2026-11-26, evidence
// test, 600 calls of the small shape, 6.1 M o values) six o values lay 1.16-1.27 x 2^-12 of their
// absolute sum from the float64 W2 a^ (all others inside 2^-12), while step 5's flips used at
// most 0.17 of their 2^-12 window. 2^-10 keeps a factor 3 over the largest seen; a defect (a wrong
// row, column, scale or code) moves an o value by far more than 2^-10 of its absolute sum.
inline constexpr double kGemm2AccumError = 0x1p-10;

// Relative error of the GPU epilogue's SwiGLU in fp32 (fast exp, reciprocal, its own product
// order), and of a * (1 / s) against a / s in the requantization: a few fp32 ulps; 2^-18 is 32 ulps.
inline constexpr double kEpilogueRelError = 0x1p-18;

// Steps 3-4: da[i] >= |a_gpu[i] - a[i]| when the GPU's h differs from h (the reference's, fp32)
// by at most gamma * h_abs elementwise (h_abs from gemm1_row_abs). Uses the Lipschitz bounds of
// the clamp (1) and of silu (|silu'| < 1.1).
void act_error_bound(const float* h, const double* h_abs, int I, float clamp, float weight, double gamma,
                     double* da);

// Step 5 on one row: the GPU's codes q[I] and scales s[I/128] against the reference activation
// a[I] (fp32, from the float64 GEMM) whose GPU counterpart may be off by da[I].
struct RequantCheck {
  int64_t groups = 0, codes = 0;
  int64_t ambiguous = 0;    // codes whose window holds a rounding midpoint (either neighbour passes)
  int64_t flips = 0;        // codes != RNE(a / s) that lie inside the window: rounding ties
  int64_t bad_codes = 0;    // codes outside the window (or NaN)
  int64_t bad_scales = 0;   // scales no amax within the window gives (or non-finite)
  int64_t scales_moved = 0; // scales != the reference's that the window allows
  // Over flips: how far a / s lies from the crossed rounding midpoint, as a fraction of the window
  // (0: on the midpoint, 1: at the window's edge). Near 0 everywhere means flips are ties.
  double max_window_used = 0.0;
  // Over flips: the largest distance of a from the crossed midpoint (times s), relative to the
  // group's amax: the perturbation of a, in units of the group's magnitude, that the flip needed.
  double max_flip_distance = 0.0;
  std::string first_bad;    // the first failure, for the message
  void merge(const RequantCheck& o);
  bool ok() const { return bad_codes == 0 && bad_scales == 0; }
};

// `where` names the row in first_bad. pow2 = Problem::pow2_scales. n = I (a multiple of 128).
void check_requant_row(const float* a, const double* da, const uint8_t* q, const float* s, int n, bool pow2,
                       const std::string& where, RequantCheck* out);

// Whether b is the bf16 RNE rounding of some fp32 value within [v - e, v + e] (b NaN: false).
bool bf16_within(uint16_t b, double v, double e);

// Step 6: the error window of one GPU output channel whose float64 dot is v with absolute sum
// v_abs, over a reduction of n_k (= I) elements: gamma * v_abs plus one fp32 rounding per 128-K
// promotion.
double gemm_error_window(double v_abs, int n_k, double gamma);

// Step 7: the window of y around the exact sum of the GPU's own o rows whose absolute values sum
// to o_abs_sum over `slots` rows: fp32 reordering of the sum, and with bf16 partials (per-rank
// sums rounded to bf16 before the final sum) half a bf16 ulp of each partial.
double combine_error_window(double o_abs_sum, int slots, bool bf16_partials);

// The small-sample tail of SPEC's rel_l2: `draws` samples of n tokens drawn with replacement from
// per-token squared errors err2[i] and squared reference norms ref2[i] (same length, not empty).
// rel: each sample's rel_l2, sorted; above: the fraction of samples whose rel_l2 exceeds `bound`.
struct SampleTail {
  std::vector<double> rel;
  double above = 0.0;
};
SampleTail bootstrap_rel_l2(const std::vector<double>& err2, const std::vector<double>& ref2, int n, int draws,
                            double bound, Rng& rng);

}  // namespace epmoe::ref
