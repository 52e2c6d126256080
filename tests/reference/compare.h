// Comparison of a computed bf16 output against the reference, as SPEC.md
// measures it: relative L2 error plus a count of non-finite values.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/reference.h"

namespace epmoe::ref {

struct Compare {
  double rel_l2 = 0.0;    // ||y - ref|| / ||ref|| over finite y; 0/0 = 0, x/0 = inf
  int64_t nan_count = 0;  // NaN or Inf in y
  int64_t n = 0;          // elements compared
};

// SPEC.md bound: 1e-2 for FP8, 5e-3 for BF16.
double tolerance(DType d);
// rel_l2 within tolerance(d), no non-finite value, something compared.
bool passes(const Compare& c, DType d);

Compare compare_bf16(const uint16_t* y, const uint16_t* ref, int64_t n);
// Whole outputs, all ranks pooled into one norm.
Compare compare_bf16(const std::vector<std::vector<uint16_t>>& y,
                     const std::vector<std::vector<uint16_t>>& ref);
// Only the rows [T_r][H] listed in sample[r], all ranks pooled.
Compare compare_bf16_sampled(const std::vector<std::vector<uint16_t>>& y,
                             const std::vector<std::vector<uint16_t>>& ref, int H,
                             const std::vector<std::vector<int>>& sample);

}  // namespace epmoe::ref
