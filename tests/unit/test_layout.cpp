// Host-side planning: the expert pool's capacity and region placement.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "device/layout/expert_pool.h"

namespace {

using epmoe::layout::ExpertPoolLayout;
using epmoe::layout::ExpertPoolShape;
using epmoe::layout::RowSource;

ExpertPoolShape dsv3(bool fp8) { return {2, 32, 7168, 2048, 8, 4096, 128, fp8}; }

TEST(ExpertPool, CapacityCoversWorstCaseRouting) {
  ExpertPoolLayout L{dsv3(true)};
  // Every slot of every token of both ranks may name a local expert, plus padding per expert
  // (32 * 127 rows, rounded up to a whole block).
  EXPECT_EQ(L.max_rows(), 2 * 4096 * 8 + 32 * 128);
  ExpertPoolShape s = dsv3(true);
  s.experts_per_rank = 4;  // K > E_loc: a token may still name one expert in several slots
  ExpertPoolLayout small{s};
  EXPECT_EQ(small.max_rows(), 2 * 4096 * 8 + 4 * 128);
  EXPECT_EQ(small.max_rows() % 128, 0);
}

TEST(ExpertPool, WorstCasePackingFits) {
  // Any split of the rows over experts, each segment rounded up to row_align, fits in max_rows.
  ExpertPoolShape s{3, 5, 256, 128, 4, 37, 64, true};
  ExpertPoolLayout L{s};
  const int64_t total = int64_t(s.num_ranks) * s.max_tokens * s.topk;
  for (int hot = 0; hot < s.experts_per_rank; ++hot) {
    std::vector<int64_t> count(s.experts_per_rank, 1);
    count[hot] = total - (s.experts_per_rank - 1);
    int64_t end = 0;
    for (int64_t c : count) end += (c + s.row_align - 1) / s.row_align * s.row_align;
    EXPECT_LE(end, L.max_rows());
  }
}

TEST(ExpertPool, RegionsAlignedAndDisjoint) {
  for (bool fp8 : {true, false}) {
    ExpertPoolLayout L{dsv3(fp8)};
    struct R { int64_t off, bytes; };
    std::vector<R> rs = {{L.x_pool_offset(), L.x_pool_bytes()},
                         {L.x_scale_offset(), L.x_scale_bytes()},
                         {L.row_weight_offset(), L.row_weight_bytes()},
                         {L.row_source_offset(), L.row_source_bytes()},
                         {L.a_pool_offset(), L.a_pool_bytes()},
                         {L.a_scale_offset(), L.a_scale_bytes()},
                         {L.o_pool_offset(), L.o_pool_bytes()},
                         {L.expert_count_offset(), L.expert_count_bytes()},
                         {L.expert_offset_offset(), L.expert_offset_bytes()}};
    for (size_t i = 0; i < rs.size(); ++i) {
      EXPECT_EQ(rs[i].off % 256, 0) << "region " << i;
      if (i + 1 < rs.size()) {
        EXPECT_LE(rs[i].off + rs[i].bytes, rs[i + 1].off) << "region " << i;
      }
    }
    EXPECT_GE(L.num_bytes(), rs.back().off + rs.back().bytes);
    if (!fp8) {
      EXPECT_EQ(L.x_scale_bytes(), 0);
      EXPECT_EQ(L.x_pool_bytes(), L.max_rows() * 7168 * 2);
    } else {
      EXPECT_EQ(L.x_scale_bytes(), (7168 / 128) * L.scale_stride() * 4);
      EXPECT_EQ(L.scale_stride() % 4, 0);
    }
  }
}

TEST(RowSource, PackRoundTrip) {
  for (int rank : {0, 1, 7})
    for (int token : {0, 1, 4095, (1 << 24) - 1})
      for (int slot : {0, 5, 31}) {
        uint32_t w = RowSource::pack(rank, token, slot);
        EXPECT_EQ(RowSource::rank(w), rank);
        EXPECT_EQ(RowSource::token(w), token);
        EXPECT_EQ(RowSource::slot(w), slot);
      }
}

}  // namespace
