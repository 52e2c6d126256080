#include "reference/kernel_check.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "reference/numeric.h"

namespace epmoe::ref {

namespace {

// One fp32 rounding, relative (2^-24), with a factor 2 for the reference's own fp32 round of h.
constexpr double kFp32Round = 0x1p-23;
// max |silu'(g)| = 1.0998 (at g ~ 2.4).
constexpr double kSiluLipschitz = 1.1;

// e4m3 codes in value order: ordinal 0 is +-0, ordinal n > 0 code n, n < 0 code 0x80 | -n; 126 is 448.
int ordinal(uint8_t c) { return (c & 0x80) ? -int(c & 0x7F) : int(c & 0x7F); }
double ordinal_value(int n) { return n >= 0 ? e4m3_table()[n] : -e4m3_table()[-n]; }
bool is_nan_code(uint8_t c) { return (c & 0x7F) == 0x7F; }

}  // namespace

void RequantCheck::merge(const RequantCheck& o) {
  groups += o.groups;
  codes += o.codes;
  ambiguous += o.ambiguous;
  flips += o.flips;
  bad_codes += o.bad_codes;
  bad_scales += o.bad_scales;
  scales_moved += o.scales_moved;
  max_window_used = std::max(max_window_used, o.max_window_used);
  max_flip_distance = std::max(max_flip_distance, o.max_flip_distance);
  if (first_bad.empty()) first_bad = o.first_bad;
}

void act_error_bound(const float* h, const double* h_abs, int I, float clamp, float weight, double gamma,
                     double* da) {
  for (int i = 0; i < I; ++i) {
    float g = h[i], u = h[I + i];
    const double dg = gamma * h_abs[i] + kFp32Round * std::fabs(g);
    const double du = gamma * h_abs[I + i] + kFp32Round * std::fabs(u);
    // The clamp is 1-Lipschitz: the GPU's clamped value is within dg (du) of the reference's.
    if (clamp > 0.0f) {
      g = std::fmin(g, clamp);
      u = std::fmax(std::fmin(u, clamp), -clamp);
    }
    const double silu_g = silu(g);
    const double a = silu_g * u * double(weight);
    da[i] = std::fabs(double(weight)) * (kSiluLipschitz * dg * (std::fabs(u) + du) + std::fabs(silu_g) * du) +
            kEpilogueRelError * std::fabs(a);
  }
}

void check_requant_row(const float* a, const double* da, const uint8_t* q, const float* s, int n, bool pow2,
                       const std::string& where, RequantCheck* out) {
  RequantCheck& st = *out;
  for (int g0 = 0; g0 < n; g0 += kQuantGroup) {
    const int g = g0 / kQuantGroup;
    ++st.groups;
    double amax = 0.0, amax_lo = 0.0, amax_hi = 0.0;
    for (int i = g0; i < g0 + kQuantGroup; ++i) {
      const double m = std::fabs(double(a[i]));
      amax = std::max(amax, m);
      amax_lo = std::max(amax_lo, m - da[i]);
      amax_hi = std::max(amax_hi, m + da[i]);
    }
    // The GPU's amax is the max of its own fp32 values, each within da of the reference's, so it
    // lies in [amax_lo, amax_hi]; SPEC's scale rule is monotone in amax (the power-of-two rounding
    // too), so the GPU scale lies between the scales of the two ends. With pow2 this admits the
    // power of two below (above) the reference's exactly when amax / 448 is within the window of
    // that power.
    const float s_ref = quant_scale(float(amax), pow2);
    const float s_lo = quant_scale(std::nextafter(float(amax_lo), 0.0f), pow2);
    const float s_hi = quant_scale(std::nextafter(float(amax_hi), INFINITY), pow2);
    const float sg = s[g];
    if (!(std::isfinite(sg) && sg > 0.0f && sg >= s_lo && sg <= s_hi)) {
      if (st.first_bad.empty()) {
        std::ostringstream os;
        os.precision(9);
        os << where << " group " << g << ": scale " << sg << " outside [" << s_lo << ", " << s_hi
           << "] (reference " << s_ref << ", amax " << amax << ")";
        st.first_bad = os.str();
      }
      ++st.bad_scales;
    } else if (sg != s_ref) {
      ++st.scales_moved;
    }
    for (int i = g0; i < g0 + kQuantGroup; ++i) {
      ++st.codes;
      const double v = double(a[i]) / double(sg);
      const double w = da[i] / double(sg) + kEpilogueRelError * std::fabs(v);
      const int lo = ordinal(e4m3_from_float(float(v - w)));
      const int hi = ordinal(e4m3_from_float(float(v + w)));
      const int got = ordinal(q[i]);
      if (is_nan_code(q[i]) || got < lo || got > hi) {
        if (st.first_bad.empty()) {
          std::ostringstream os;
          os.precision(9);
          os << where << " channel " << i << ": code 0x" << std::hex << int(q[i]) << std::dec << " ("
             << e4m3_to_float(q[i]) << ") outside codes [" << ordinal_value(lo) << ", " << ordinal_value(hi)
             << "] of a/s = " << v << " +- " << w << " (a " << a[i] << ", scale " << sg << ")";
          st.first_bad = os.str();
        }
        ++st.bad_codes;
        continue;
      }
      st.ambiguous += lo != hi;
      const int rne = ordinal(e4m3_from_float(float(v)));
      if (got == rne) continue;
      ++st.flips;
      // The rounding midpoint next to the GPU's code on the reference's side: a / s had to move
      // at least this far for RNE to give that code.
      const double mid = got > rne ? 0.5 * (ordinal_value(got - 1) + ordinal_value(got))
                                   : 0.5 * (ordinal_value(got) + ordinal_value(got + 1));
      const double dist = std::fabs(v - mid);
      st.max_window_used = std::max(st.max_window_used, w > 0.0 ? dist / w : 1.0);
      st.max_flip_distance = std::max(st.max_flip_distance, dist * double(sg) / std::max(amax, 1e-30));
    }
  }
}

bool bf16_within(uint16_t b, double v, double e) {
  const double got = bf16_to_float(b);
  if (!std::isfinite(got)) return false;
  // RNE to fp32 and then to bf16 are both monotone, and the GPU's fp32 value x in [v - e, v + e]
  // is its own fp32 rounding, so fl(v - e) <= x <= fl(v + e) and bf16 of those bracket bf16(x).
  const double lo = bf16_to_float(bf16_from_float(float(v - e)));
  const double hi = bf16_to_float(bf16_from_float(float(v + e)));
  return got >= lo && got <= hi;
}

double gemm_error_window(double v_abs, int n_k, double gamma) {
  // One fp32 rounding per 128-K promotion, and the final value's own.
  return (gamma + double(n_k / kQuantGroup + 1) * 0x1p-24) * v_abs;
}

double combine_error_window(double o_abs_sum, int slots, bool bf16_partials) {
  return (double(slots + 2) * 0x1p-24 + (bf16_partials ? 0x1p-8 : 0.0)) * o_abs_sum;
}

SampleTail bootstrap_rel_l2(const std::vector<double>& err2, const std::vector<double>& ref2, int n, int draws,
                            double bound, Rng& rng) {
  SampleTail t;
  t.rel.resize(size_t(draws));
  int over = 0;
  for (double& rel : t.rel) {
    double e2 = 0, r2 = 0;
    for (int i = 0; i < n; ++i) {
      const int j = rng.below(int(err2.size()));
      e2 += err2[j];
      r2 += ref2[j];
    }
    rel = r2 > 0 ? std::sqrt(e2 / r2) : 0.0;
    over += rel > bound;
  }
  std::sort(t.rel.begin(), t.rel.end());
  t.above = draws > 0 ? double(over) / draws : 0.0;
  return t;
}

}  // namespace epmoe::ref
