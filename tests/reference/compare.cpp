#include "reference/compare.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "reference/numeric.h"

namespace epmoe::ref {

namespace {

struct Acc {
  double diff2 = 0.0, ref2 = 0.0;
  int64_t bad = 0, n = 0;
  void add(uint16_t yb, uint16_t rb) {
    const double yv = bf16_to_float(yb), rv = bf16_to_float(rb);
    ++n;
    // Why non-finite values stay out of the norm: one Inf would make rel_l2
    // meaningless; nan_count reports them and passes() rejects any.
    if (!std::isfinite(yv)) {
      ++bad;
      return;
    }
    diff2 += (yv - rv) * (yv - rv);
    ref2 += rv * rv;
  }
  Compare result() const {
    Compare c;
    c.n = n;
    c.nan_count = bad;
    if (ref2 > 0.0) c.rel_l2 = std::sqrt(diff2 / ref2);
    else c.rel_l2 = diff2 > 0.0 ? std::numeric_limits<double>::infinity() : 0.0;
    return c;
  }
};

}  // namespace

double tolerance(DType d) { return d == DType::kFP8 ? 1e-2 : 5e-3; }

bool passes(const Compare& c, DType d) { return c.n > 0 && c.nan_count == 0 && c.rel_l2 <= tolerance(d); }

Compare compare_bf16(const uint16_t* y, const uint16_t* ref, int64_t n) {
  Acc acc;
  for (int64_t i = 0; i < n; ++i) acc.add(y[i], ref[i]);
  return acc.result();
}

Compare compare_bf16(const std::vector<std::vector<uint16_t>>& y, const std::vector<std::vector<uint16_t>>& ref) {
  if (y.size() != ref.size())
    throw std::invalid_argument("compare_bf16: " + std::to_string(y.size()) + " ranks vs " +
                                std::to_string(ref.size()) + " in the reference");
  Acc acc;
  for (size_t r = 0; r < y.size(); ++r) {
    if (y[r].size() != ref[r].size())
      throw std::invalid_argument("compare_bf16: rank " + std::to_string(r) + " has " +
                                  std::to_string(y[r].size()) + " elements vs " +
                                  std::to_string(ref[r].size()) + " in the reference");
    for (size_t i = 0; i < y[r].size(); ++i) acc.add(y[r][i], ref[r][i]);
  }
  return acc.result();
}

Compare compare_bf16_sampled(const std::vector<std::vector<uint16_t>>& y,
                             const std::vector<std::vector<uint16_t>>& ref, int H,
                             const std::vector<std::vector<int>>& sample) {
  if (y.size() != ref.size() || sample.size() != ref.size())
    throw std::invalid_argument("compare_bf16_sampled: rank counts differ (y " + std::to_string(y.size()) +
                                ", ref " + std::to_string(ref.size()) + ", sample " +
                                std::to_string(sample.size()) + ")");
  Acc acc;
  for (size_t r = 0; r < y.size(); ++r)
    for (int t : sample[r]) {
      const int64_t base = int64_t(t) * H;
      if (t < 0 || base + H > static_cast<int64_t>(y[r].size()) || base + H > static_cast<int64_t>(ref[r].size()))
        throw std::invalid_argument("compare_bf16_sampled: token " + std::to_string(t) + " of rank " +
                                    std::to_string(r) + " is outside the outputs");
      for (int i = 0; i < H; ++i) acc.add(y[r][base + i], ref[r][base + i]);
    }
  return acc.result();
}

}  // namespace epmoe::ref
