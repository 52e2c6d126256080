// The host heuristics (src/host/heuristics.h): the per-call choices and what the overrides force.
#include <gtest/gtest.h>

#include "host/heuristics.h"

namespace epmoe::heuristics {
namespace {

TEST(Heuristics, LayerTuningFollowsTheCallSize) {
  const LayerShape s{8, 32};  // topk 8, 32 experts per rank
  const TuningOverrides none;
  // 4 tokens x 8 = 32 rows <= 32 experts: a tiny call.
  Tuning t = choose_layer_tuning(s, 4, none);
  EXPECT_TRUE(t.weights_evict_first);
  EXPECT_TRUE(t.fused_b_first);
  EXPECT_EQ(t.fused_claim_tiles, ClaimTiles::kBeyondGrid);
  EXPECT_FALSE(t.fused_deferred_epilogue);
  EXPECT_EQ(t.fused_prefetch_k_blocks, 0);
  t = choose_layer_tuning(s, 5, none);
  EXPECT_FALSE(t.weights_evict_first);
  EXPECT_FALSE(t.fused_b_first);
  EXPECT_EQ(t.fused_claim_tiles, ClaimTiles::kAlways);
  // The deferred epilogue from 256 rows per expert on average: 1024 x 8 = 256 x 32.
  EXPECT_FALSE(choose_layer_tuning(s, 1023, none).fused_deferred_epilogue);
  EXPECT_TRUE(choose_layer_tuning(s, 1024, none).fused_deferred_epilogue);
}

// Tiny calls leave the tile order to the kernel (claims once the call's L1 tiles exceed the grid);
// larger calls always claim.
TEST(Heuristics, TinyCallsClaimTilesBeyondTheGrid) {
  const TuningOverrides none;
  const LayerShape dsv3{8, 32};
  EXPECT_EQ(choose_layer_tuning(dsv3, 0, none).fused_claim_tiles, ClaimTiles::kBeyondGrid);
  EXPECT_EQ(choose_layer_tuning(dsv3, 1, none).fused_claim_tiles, ClaimTiles::kBeyondGrid);
  EXPECT_EQ(choose_layer_tuning(dsv3, 4, none).fused_claim_tiles, ClaimTiles::kBeyondGrid);
  EXPECT_EQ(choose_layer_tuning(dsv3, 5, none).fused_claim_tiles, ClaimTiles::kAlways);
  const LayerShape qwen3{8, 64};
  EXPECT_EQ(choose_layer_tuning(qwen3, 8, none).fused_claim_tiles, ClaimTiles::kBeyondGrid);
  EXPECT_EQ(choose_layer_tuning(qwen3, 9, none).fused_claim_tiles, ClaimTiles::kAlways);
  // Out-of-range overrides are ignored.
  TuningOverrides o;
  o.fused_claim_tiles = 3;
  EXPECT_EQ(choose_layer_tuning(dsv3, 1, o).fused_claim_tiles, ClaimTiles::kBeyondGrid);
  o.fused_claim_tiles = 0;
  EXPECT_EQ(choose_layer_tuning(dsv3, 64, o).fused_claim_tiles, ClaimTiles::kNever);
}

// Path::kAuto: the megakernel up to kAutoFusedMaxTokens (512) local tokens, 0 included; the override
// moves the threshold.
TEST(Heuristics, AutoPathTakesTheMegakernelUpTo512Tokens) {
  const LayerShape s{8, 32};
  TuningOverrides o;
  EXPECT_EQ(kAutoFusedMaxTokens, 512);
  for (int64_t t : {0, 1, 2, 128, 512}) EXPECT_TRUE(choose_layer_tuning(s, t, o).auto_fused) << t;
  for (int64_t t : {513, 1024, 4096}) EXPECT_FALSE(choose_layer_tuning(s, t, o).auto_fused) << t;
  o.auto_fused_max_tokens = 100;
  EXPECT_TRUE(choose_layer_tuning(s, 100, o).auto_fused);
  EXPECT_FALSE(choose_layer_tuning(s, 101, o).auto_fused);
  o.auto_fused_max_tokens = 0;
  EXPECT_TRUE(choose_layer_tuning(s, 0, o).auto_fused);
  EXPECT_FALSE(choose_layer_tuning(s, 1, o).auto_fused);
}

// Split L1 units from H = 4096 (kL1SplitMinHidden); the override forces them either way.
TEST(Heuristics, SplitL1UnitsFromHidden4096) {
  const TuningOverrides none;
  EXPECT_TRUE(choose_layer_tuning(LayerShape{8, 32, 7168}, 1, none).fused_l1_split);
  EXPECT_TRUE(choose_layer_tuning(LayerShape{8, 32, 4096}, 128, none).fused_l1_split);
  EXPECT_FALSE(choose_layer_tuning(LayerShape{8, 32, 2048}, 1, none).fused_l1_split);
  EXPECT_FALSE(choose_layer_tuning(LayerShape{8, 32, 4095}, 1, none).fused_l1_split);
  TuningOverrides o;
  o.fused_l1_split = 1;
  EXPECT_TRUE(choose_layer_tuning(LayerShape{8, 32, 2048}, 1, o).fused_l1_split);
  o.fused_l1_split = 0;
  EXPECT_FALSE(choose_layer_tuning(LayerShape{8, 32, 7168}, 1, o).fused_l1_split);
  o.fused_l1_split = 2;  // out of range: ignored
  EXPECT_TRUE(choose_layer_tuning(LayerShape{8, 32, 7168}, 1, o).fused_l1_split);
}

TEST(Heuristics, OverridesForceTheLayerChoices) {
  const LayerShape s{8, 32};
  TuningOverrides o;
  o.fused_epilogue = 1;
  o.fused_prefetch_k_blocks = 8;
  o.fused_b_first = 0;
  o.fused_claim_tiles = 1;
  Tuning t = choose_layer_tuning(s, 1, o);
  EXPECT_FALSE(t.fused_deferred_epilogue);
  EXPECT_EQ(t.fused_prefetch_k_blocks, 8);
  EXPECT_FALSE(t.fused_b_first);
  EXPECT_EQ(t.fused_claim_tiles, ClaimTiles::kAlways);
  EXPECT_TRUE(t.weights_evict_first);  // not an override
  o.fused_epilogue = 2;
  EXPECT_TRUE(choose_layer_tuning(s, 1, o).fused_deferred_epilogue);
}

TEST(Heuristics, CommBlocks) {
  CommShape s{8, 7168, 132, false};
  const TuningOverrides none;
  EXPECT_EQ(choose_comm_blocks(s, 1, 8, none), 16);      // at least 16
  s.max_blocks = 1000;
  EXPECT_EQ(choose_comm_blocks(s, 100, 8, none), 700);  // 100 x 8 ranks x 7 slices / 8 warps
  s.max_blocks = 132;
  EXPECT_EQ(choose_comm_blocks(s, 4096, 8, none), 132);  // at most max_blocks
  TuningOverrides o;
  o.comm_blocks = 40;
  EXPECT_EQ(choose_comm_blocks(s, 1, 8, o), 40);
  o.comm_blocks = 500;
  EXPECT_EQ(choose_comm_blocks(s, 1, 8, o), 132);
  s.fixed_blocks = true;
  s.max_blocks = 24;
  EXPECT_EQ(choose_comm_blocks(s, 4096, 8, o), 24);
}

}  // namespace
}  // namespace epmoe::heuristics
