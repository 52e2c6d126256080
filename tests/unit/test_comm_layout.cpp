// The dispatch/combine buffer layouts: regions aligned, disjoint, and sized for the worst case.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "device/layout/comm_layout.h"

namespace {

using epmoe::layout::CommLocalLayout;
using epmoe::layout::CommShape;
using epmoe::layout::CommSymLayout;

void expect_disjoint_aligned(std::vector<std::pair<int64_t, int64_t>> regions, int64_t total) {
  std::sort(regions.begin(), regions.end());
  int64_t end = 0;
  for (auto [off, bytes] : regions) {
    EXPECT_EQ(off % epmoe::layout::kRegionAlign, 0) << off;
    EXPECT_GE(off, end);
    end = off + bytes;
  }
  EXPECT_LE(end, total);
}

// Control words: naturally aligned, disjoint, inside the control block.
void expect_disjoint_aligned_words(std::vector<std::pair<int64_t, int64_t>> words, int64_t total) {
  std::sort(words.begin(), words.end());
  int64_t end = 0;
  for (auto [off, bytes] : words) {
    EXPECT_EQ(off % bytes, 0) << off;
    EXPECT_GE(off, end) << off;
    end = off + bytes;
  }
  EXPECT_LE(end, total);
}

TEST(CommLayout, SymmetricRegionsDisjointAndAligned) {
  for (bool fp8 : {true, false})
    for (int pb : {2, 4}) {
      const CommShape s{2, 64, 7168, 8, 8192, fp8, pb};
      const CommSymLayout l{s};
      expect_disjoint_aligned({{0, l.flags_bytes()},
                               {l.counts_offset(), l.counts_bytes()},
                               {l.stage_x_offset(), l.stage_x_bytes()},
                               {l.stage_scale_offset(), l.stage_scale_bytes()},
                               {l.stage_meta_offset(), l.stage_meta_bytes()},
                               {l.partials_offset(), l.partials_bytes()}},
                              l.num_bytes());
      EXPECT_EQ(l.stage_x_bytes(), int64_t(8192) * 7168 * (fp8 ? 1 : 2));
      EXPECT_EQ(l.stage_scale_bytes(), fp8 ? int64_t(8192) * 56 * 4 : 0);
      EXPECT_EQ(l.partials_bytes(), int64_t(2) * 8192 * 7168 * pb);
      EXPECT_EQ(l.counts_stride(), 33);
    }
}

TEST(CommLayout, FlagsFitTheirRegion) {
  const CommSymLayout l{CommShape{8, 64, 128, 2, 16, true, 4}};
  for (int f = 0; f < epmoe::layout::kNumFlags; ++f)
    for (int r = 0; r < epmoe::layout::kCommMaxRanks; ++r) {
      EXPECT_EQ(l.flag_offset(f, r) % 8, 0);
      EXPECT_LT(l.flag_offset(f, r), l.flags_bytes());
    }
}

// The fused kernel's ready counters cover every 128-row block of the layer's pool.
TEST(CommLayout, ReadyCountersCoverThePool) {
  for (const CommShape s : {CommShape{2, 64, 7168, 8, 4096, true, 4}, CommShape{8, 256, 2048, 8, 1, false, 4},
                            CommShape{2, 2, 128, 1, 0, true, 2}}) {
    const CommLocalLayout l{s};
    const epmoe::layout::ExpertPoolLayout pool{
        epmoe::layout::pool_shape_for(s, 256, CommLocalLayout::kReadyBlockRows)};
    EXPECT_EQ(l.mblock_ready_count() * CommLocalLayout::kReadyBlockRows, pool.max_rows());
  }
}

TEST(CommLayout, LocalRegionsDisjointAndAligned) {
  const CommShape s{4, 256, 4096, 8, 1000, true, 4};
  const CommLocalLayout l{s};
  expect_disjoint_aligned({{0, l.control_bytes()},
                           {l.cursor_offset(), l.cursor_bytes()},
                           {l.token_rows_offset(), l.token_rows_bytes()},
                           {l.recv_tokens_offset(), l.recv_tokens_bytes()},
                           {l.mblock_ready_offset(), l.mblock_ready_bytes()},
                           {l.mblock_arrive_offset(), l.mblock_ready_bytes()},
                           {l.tile_claim_offset(), l.tile_claim_bytes()},
                           {l.split_exchange_offset(), l.split_exchange_bytes()}},
                          l.num_bytes());
  EXPECT_EQ(l.tile_claim_bytes(), 8);  // the L1 and L2 counters
  // The split L1 units' exchange: a u32 counter per pair and math warpgroup, then 64 floats per pair,
  // warpgroup and half; the floats start 16-byte aligned after the counters.
  EXPECT_EQ(l.split_counter_bytes(), int64_t(CommLocalLayout::kSplitMaxPairs) * 2 * 4);
  EXPECT_EQ(l.split_exchange_bytes(), l.split_counter_bytes() + int64_t(CommLocalLayout::kSplitMaxPairs) * 2 * 2 * 64 * 4);
  EXPECT_EQ((l.split_exchange_offset() + l.split_counter_bytes()) % 16, 0);
  EXPECT_EQ(l.cursor_bytes(), 256 * 4);
  EXPECT_EQ(l.token_rows_bytes(), int64_t(4) * 1000 * 8 * 4);
  // Control words do not overlap each other, and each kernel's last-block counters are distinct.
  EXPECT_EQ(l.dispatch_epoch_offset() % 8, 0);
  EXPECT_EQ(l.combine_epoch_offset() % 8, 0);
  EXPECT_EQ(l.timeout_record_offset() % 8, 0);  // a pointer, loaded as one 8-byte word
  expect_disjoint_aligned_words({{l.status_offset(), 4},
                                 {l.grid_barrier_offset(), 4},
                                 {l.dispatch_arrive_offset(), 4},
                                 {l.combine_arrive_offset(), 4},
                                 {l.dispatch_epoch_offset(), 8},
                                 {l.combine_epoch_offset(), 8},
                                 {l.combine_done_arrive_offset(), 4},
                                 {l.timeout_record_offset(), 8},
                                 {l.routing_report_offset(), 8}},  // a 64-bit atomicMax target
                                l.control_bytes());
}

TEST(CommLayout, PoolShapeFollowsTheCommShape) {
  const CommShape s{2, 64, 7168, 8, 4096, true, 4};
  const auto p = epmoe::layout::pool_shape_for(s, 2048, 128);
  EXPECT_EQ(p.num_ranks, 2);
  EXPECT_EQ(p.experts_per_rank, 32);
  EXPECT_EQ(p.hidden, 7168);
  EXPECT_EQ(p.intermediate, 2048);
  EXPECT_EQ(p.topk, 8);
  EXPECT_EQ(p.max_tokens, 4096);
  EXPECT_EQ(p.row_align, 128);
  EXPECT_TRUE(p.fp8);
  // Worst case fits: every token of every rank sends all K slots here, plus padding.
  const epmoe::layout::ExpertPoolLayout pl{p};
  EXPECT_GE(pl.max_rows(), int64_t(2) * 4096 * 8 + 32 * 127);
}

TEST(CommLayout, PoolHoldsKRowsPerTokenWhenKExceedsLocalExperts) {
  // Duplicate experts are computed, not masked: a token may put all K slots into one local expert,
  // so the bound is K rows per token even when E_loc < K (here E_loc = 4, K = 8).
  const CommShape s{2, 8, 128, 8, 96, true, 4};
  const epmoe::layout::ExpertPoolLayout pl{epmoe::layout::pool_shape_for(s, 0, 64)};
  EXPECT_GE(pl.max_rows(), int64_t(2) * 96 * 8 + 4 * 63);
  // token_rows has one entry per (source, token, slot).
  EXPECT_EQ(CommLocalLayout{s}.token_rows_bytes(), int64_t(2) * 96 * 8 * 4);
}

// The offsets the kernels read (CommOffsets) are the layouts' own, for shapes with and without a
// workspace's room, odd row alignments and both dtypes.
TEST(CommLayout, ResolvedOffsetsMatchTheLayouts) {
  CommShape shapes[] = {
      {4, 128, 7168, 8, 4096, true, 2},
      {2, 64, 2048, 8, 128, false, 4},
      {8, 8, 128, 8, 96, true, 4},
      {3, 9, 384, 2, 77, true, 2},
  };
  shapes[1].cap = {64, 7168, 8, 7168, 56, 4};  // a workspace sized for a larger layer
  for (const CommShape& s : shapes) {
    for (int row_align : {1, 64, 128, 1000}) {
      const epmoe::layout::ExpertPoolLayout pool{epmoe::layout::pool_shape_for(s, 768, row_align)};
      const epmoe::layout::CommOffsets o = epmoe::layout::comm_offsets(s, pool);
      const CommSymLayout sym{s};
      const CommLocalLayout loc{s};
      EXPECT_EQ(o.counts_offset(), sym.counts_offset());
      EXPECT_EQ(o.stage_x_offset(), sym.stage_x_offset());
      EXPECT_EQ(o.stage_scale_offset(), sym.stage_scale_offset());
      EXPECT_EQ(o.stage_meta_offset(), sym.stage_meta_offset());
      EXPECT_EQ(o.partials_offset(), sym.partials_offset());
      EXPECT_EQ(o.counts_stride(), sym.counts_stride());
      EXPECT_EQ(o.partial_row_bytes(), sym.partial_row_bytes());
      for (int f = 0; f < epmoe::layout::kNumFlags; ++f)
        for (int r = 0; r < s.num_ranks; ++r) EXPECT_EQ(o.flag_offset(f, r), sym.flag_offset(f, r));
      EXPECT_EQ(o.status_offset(), loc.status_offset());
      EXPECT_EQ(o.grid_barrier_offset(), loc.grid_barrier_offset());
      EXPECT_EQ(o.dispatch_arrive_offset(), loc.dispatch_arrive_offset());
      EXPECT_EQ(o.combine_arrive_offset(), loc.combine_arrive_offset());
      EXPECT_EQ(o.dispatch_epoch_offset(), loc.dispatch_epoch_offset());
      EXPECT_EQ(o.combine_epoch_offset(), loc.combine_epoch_offset());
      EXPECT_EQ(o.combine_done_arrive_offset(), loc.combine_done_arrive_offset());
      EXPECT_EQ(o.routing_report_offset(), loc.routing_report_offset());
      EXPECT_EQ(o.cursor_offset(), loc.cursor_offset());
      EXPECT_EQ(o.token_rows_offset(), loc.token_rows_offset());
      EXPECT_EQ(o.recv_tokens_offset(), loc.recv_tokens_offset());
      EXPECT_EQ(o.mblock_ready_offset(), loc.mblock_ready_offset());
      EXPECT_EQ(o.mblock_arrive_offset(), loc.mblock_arrive_offset());
      EXPECT_EQ(o.tile_claim_offset(), loc.tile_claim_offset());
      EXPECT_EQ(o.mblock_ready_count(), loc.mblock_ready_count());
      EXPECT_EQ(o.x_pool_offset(), pool.x_pool_offset());
      EXPECT_EQ(o.x_scale_offset(), pool.x_scale_offset());
      EXPECT_EQ(o.row_weight_offset(), pool.row_weight_offset());
      EXPECT_EQ(o.row_source_offset(), pool.row_source_offset());
      EXPECT_EQ(o.expert_count_offset(), pool.expert_count_offset());
      EXPECT_EQ(o.expert_offset_offset(), pool.expert_offset_offset());
      EXPECT_EQ(o.o_pool_offset(), pool.o_pool_offset());
      EXPECT_EQ(o.scale_stride(), pool.scale_stride());
      EXPECT_EQ(o.max_rows(), pool.max_rows());
    }
  }
}

}  // namespace
