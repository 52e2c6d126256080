// The expert-major pool on one rank: where dispatched tokens, L1 activations and L2 outputs live
// between the stages of a layer call. One struct serves host allocation and kernel pointer maths;
// docs/LAYOUTS.md explains each region.
#pragma once

#include <cstdint>

#include "device/layout/hd.h"

namespace epmoe::layout {

inline constexpr int kScaleGroup = 128;     // channels that share one FP8 activation scale
inline constexpr int64_t kRegionAlign = 256;  // bytes; TMA needs 16, 256 keeps regions on L2 sectors

struct ExpertPoolShape {
  int num_ranks;         // R
  int experts_per_rank;  // E_loc
  int hidden;            // H
  int intermediate;      // I
  int topk;              // K
  int max_tokens;        // T_max per rank
  int row_align;         // each expert's segment starts at a multiple of this (the GEMM BLOCK_M)
  bool fp8;
};

// Region offsets in bytes from the start of one device allocation.
struct ExpertPoolLayout {
  ExpertPoolShape s;

  // Why this bound: a token owns K slots and any of them may name a local expert (SPEC allows
  // any routing, an expert named twice included), every rank may route all its tokens here, and
  // each expert segment may waste up to row_align-1 rows of padding.
  EPMOE_HD int64_t max_rows() const {
    int64_t rows = int64_t(s.num_ranks) * s.max_tokens * s.topk +
                   int64_t(s.experts_per_rank) * (s.row_align - 1);
    return round_up<int64_t>(rows, s.row_align);
  }
  // Activation scales are stored MN-major: scale[k_group][row], row stride = scale_stride().
  EPMOE_HD int64_t scale_stride() const { return round_up<int64_t>(max_rows(), 4); }
  EPMOE_HD int64_t elem_bytes() const { return s.fp8 ? 1 : 2; }

  EPMOE_HD int64_t x_pool_bytes() const { return max_rows() * s.hidden * elem_bytes(); }
  EPMOE_HD int64_t x_scale_bytes() const { return s.fp8 ? (s.hidden / kScaleGroup) * scale_stride() * 4 : 0; }
  EPMOE_HD int64_t row_weight_bytes() const { return max_rows() * 4; }
  EPMOE_HD int64_t row_source_bytes() const { return max_rows() * 4; }
  EPMOE_HD int64_t a_pool_bytes() const { return max_rows() * s.intermediate * elem_bytes(); }
  EPMOE_HD int64_t a_scale_bytes() const { return s.fp8 ? (s.intermediate / kScaleGroup) * scale_stride() * 4 : 0; }
  EPMOE_HD int64_t o_pool_bytes() const { return max_rows() * s.hidden * 2; }
  EPMOE_HD int64_t expert_count_bytes() const { return int64_t(s.experts_per_rank) * 4; }
  EPMOE_HD int64_t expert_offset_bytes() const { return int64_t(s.experts_per_rank + 1) * 4; }

  EPMOE_HD int64_t x_pool_offset() const { return 0; }
  EPMOE_HD int64_t x_scale_offset() const { return next(x_pool_offset(), x_pool_bytes()); }
  EPMOE_HD int64_t row_weight_offset() const { return next(x_scale_offset(), x_scale_bytes()); }
  EPMOE_HD int64_t row_source_offset() const { return next(row_weight_offset(), row_weight_bytes()); }
  EPMOE_HD int64_t a_pool_offset() const { return next(row_source_offset(), row_source_bytes()); }
  EPMOE_HD int64_t a_scale_offset() const { return next(a_pool_offset(), a_pool_bytes()); }
  EPMOE_HD int64_t o_pool_offset() const { return next(a_scale_offset(), a_scale_bytes()); }
  EPMOE_HD int64_t expert_count_offset() const { return next(o_pool_offset(), o_pool_bytes()); }
  EPMOE_HD int64_t expert_offset_offset() const { return next(expert_count_offset(), expert_count_bytes()); }
  EPMOE_HD int64_t num_bytes() const { return next(expert_offset_offset(), expert_offset_bytes()); }

 private:
  EPMOE_HD static int64_t next(int64_t offset, int64_t bytes) {
    return round_up<int64_t>(offset + bytes, kRegionAlign);
  }
};

// One word per pool row, telling combine where the row came from.
struct RowSource {
  static constexpr int kSlotBits = 5;   // K <= 32
  static constexpr int kRankBits = 3;   // R <= 8
  static constexpr int kTokenBits = 32 - kSlotBits - kRankBits;  // T_max <= 2^24

  EPMOE_HD static uint32_t pack(int rank, int token, int slot) {
    return (uint32_t(token) << (kSlotBits + kRankBits)) | (uint32_t(rank) << kSlotBits) | uint32_t(slot);
  }
  EPMOE_HD static int slot(uint32_t w) { return int(w & ((1u << kSlotBits) - 1)); }
  EPMOE_HD static int rank(uint32_t w) { return int((w >> kSlotBits) & ((1u << kRankBits) - 1)); }
  EPMOE_HD static int token(uint32_t w) { return int(w >> (kSlotBits + kRankBits)); }
};

}  // namespace epmoe::layout
