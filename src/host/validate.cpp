#include <cmath>
#include <cstdint>

#include "epmoe/config.h"
#include "host/check.h"

namespace epmoe {

using detail::invalid;

Status validate(const LayerConfig& c) {
  if (c.num_ranks < 1 || c.num_ranks > Limits::kMaxRanks)
    return invalid("num_ranks=", c.num_ranks, " must be in [1, ", Limits::kMaxRanks, "]");
  if (c.num_experts < 1)
    return invalid("num_experts=", c.num_experts, " must be >= 1");
  if (c.num_experts % c.num_ranks != 0)
    return invalid("num_experts=", c.num_experts, " must be divisible by num_ranks=", c.num_ranks);
  if (c.experts_per_rank() > Limits::kMaxExpertsPerRank)
    return invalid("num_experts/num_ranks=", c.experts_per_rank(), " must be <= ",
                   Limits::kMaxExpertsPerRank);
  if (c.hidden < 128 || c.hidden % 128 != 0 || c.hidden > Limits::kMaxHidden)
    return invalid("hidden=", c.hidden, " must be a positive multiple of 128, at most ",
                   Limits::kMaxHidden);
  if (c.intermediate < 128 || c.intermediate % 128 != 0 || c.intermediate > Limits::kMaxIntermediate)
    return invalid("intermediate=", c.intermediate, " must be a positive multiple of 128, at most ",
                   Limits::kMaxIntermediate);
  if (c.topk < 1 || c.topk > c.num_experts || c.topk > Limits::kMaxTopK)
    return invalid("topk=", c.topk, " must be in [1, min(num_experts=", c.num_experts, ", ",
                   Limits::kMaxTopK, ")]");
  if (c.max_tokens_per_rank < 1 || c.max_tokens_per_rank > Limits::kMaxTokensPerRank)
    return invalid("max_tokens_per_rank=", c.max_tokens_per_rank, " must be in [1, ",
                   Limits::kMaxTokensPerRank, "]");
  if (c.dtype != DType::kFP8 && c.dtype != DType::kBF16)
    return invalid("dtype=", static_cast<int>(c.dtype), " is not a supported dtype (kFP8, kBF16)");
  if (c.combine_partials != PartialPrecision::kFloat32 && c.combine_partials != PartialPrecision::kBFloat16)
    return invalid("combine_partials=", static_cast<int>(c.combine_partials),
                   " is not a supported precision (kFloat32, kBFloat16)");
  if (!std::isfinite(c.activation_clamp))
    return invalid("activation_clamp=", c.activation_clamp, " must be finite (<= 0 disables it)");
  if (!(c.timeout_seconds > 0 && c.timeout_seconds <= 3600))
    return invalid("timeout_seconds=", c.timeout_seconds, " must be in (0, 3600]");
  return Status::Ok();
}

Status validate_call(const LayerConfig& c, int64_t num_tokens, const void* x, const void* topk_idx,
                     const void* topk_weights, const void* y) {
  return validate_call(c, num_tokens, x, topk_idx, IndexType::kInt32, topk_weights, y);
}

Status validate_call(const LayerConfig& c, int64_t num_tokens, const void* x, const void* topk_idx,
                     IndexType idx_type, const void* topk_weights, const void* y) {
  if (idx_type != IndexType::kInt32 && idx_type != IndexType::kInt64)
    return invalid("topk_idx type=", int(idx_type), " must be int32 or int64");
  if (num_tokens < 0 || num_tokens > c.max_tokens_per_rank)
    return invalid("num_tokens=", num_tokens, " must be in [0, max_tokens_per_rank=",
                   c.max_tokens_per_rank, "]");
  if (num_tokens > 0) {
    if (!x) return invalid("x is null with num_tokens=", num_tokens);
    if (!topk_idx) return invalid("topk_idx is null with num_tokens=", num_tokens);
    if (!topk_weights) return invalid("topk_weights is null with num_tokens=", num_tokens);
    if (!y) return invalid("y is null with num_tokens=", num_tokens);
    // Why: the kernels move rows of x and y as 16-byte vectors and routing entries as words.
    auto misaligned = [](const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0; };
    if (misaligned(x, 16)) return invalid("x=", x, " must be 16-byte aligned");
    if (misaligned(y, 16)) return invalid("y=", y, " must be 16-byte aligned");
    const int idx_bytes = idx_type == IndexType::kInt64 ? 8 : 4;
    if (misaligned(topk_idx, idx_bytes))
      return invalid("topk_idx=", topk_idx, " must be ", idx_bytes, "-byte aligned (", idx_bytes == 8 ? "int64" : "int32",
                     ")");
    if (misaligned(topk_weights, 4)) return invalid("topk_weights=", topk_weights, " must be 4-byte aligned");
  }
  return Status::Ok();
}

namespace {
template <typename Index>
Status check_routing(const LayerConfig& c, int64_t num_tokens, const Index* topk_idx) {
  if (num_tokens > 0 && !topk_idx) return invalid("topk_idx is null with num_tokens=", num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < c.topk; ++k) {
      const int64_t e = topk_idx[t * c.topk + k];
      if (e < -1 || e >= c.num_experts)
        return invalid("topk_idx[", t, "][", k, "]=", e, " must be in [0, num_experts=",
                       c.num_experts, ") or -1 for an unused slot");
    }
  }
  return Status::Ok();
}
}  // namespace

Status validate_routing_host(const LayerConfig& c, int64_t num_tokens, const int32_t* topk_idx) {
  return check_routing(c, num_tokens, topk_idx);
}
Status validate_routing_host(const LayerConfig& c, int64_t num_tokens, const int64_t* topk_idx) {
  return check_routing(c, num_tokens, topk_idx);
}

}  // namespace epmoe
