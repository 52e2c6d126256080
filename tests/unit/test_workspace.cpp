// Workspace configs, the layer-fits-workspace check, the buffer sizes, and the layout rule that lets
// layers of different shapes share one workspace: every region at the same offset.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device/layout/comm_layout.h"
#include "device/layout/expert_pool.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"
#include "host/workspace_internal.h"

namespace epmoe {
namespace {

WorkspaceConfig ws_config() {
  WorkspaceConfig w;
  w.num_ranks = 4;
  w.max_experts_per_rank = 64;
  w.max_hidden = 7168;
  w.max_intermediate = 2048;
  w.max_topk = 8;
  w.max_tokens_per_rank = 1024;
  w.dtype = DType::kFP8;
  return w;
}

LayerConfig layer(int E, int H, int I, int K, DType d = DType::kFP8) {
  LayerConfig c;
  c.num_ranks = 4;
  c.num_experts = E;
  c.hidden = H;
  c.intermediate = I;
  c.topk = K;
  c.max_tokens_per_rank = 1024;
  c.dtype = d;
  return c;
}

void expect_rejects(const Status& s, const std::string& field) {
  ASSERT_FALSE(s.ok()) << "expected a rejection naming " << field;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(Workspace, ValidateNamesEachField) {
  EXPECT_TRUE(validate(ws_config()).ok());
  auto bad = [](auto edit, const char* field) {
    WorkspaceConfig w = ws_config();
    edit(w);
    expect_rejects(validate(w), field);
  };
  bad([](WorkspaceConfig& w) { w.num_ranks = 0; }, "num_ranks");
  bad([](WorkspaceConfig& w) { w.num_ranks = 9; }, "num_ranks");
  bad([](WorkspaceConfig& w) { w.max_experts_per_rank = 0; }, "max_experts_per_rank");
  bad([](WorkspaceConfig& w) { w.max_experts_per_rank = Limits::kMaxExpertsPerRank + 1; }, "max_experts_per_rank");
  bad([](WorkspaceConfig& w) { w.max_hidden = 100; }, "max_hidden");
  bad([](WorkspaceConfig& w) { w.max_intermediate = 0; }, "max_intermediate");
  bad([](WorkspaceConfig& w) { w.max_topk = 33; }, "max_topk");
  bad([](WorkspaceConfig& w) { w.max_tokens_per_rank = 0; }, "max_tokens_per_rank");
  bad([](WorkspaceConfig& w) { w.dtype = DType(7); }, "dtype");
  bad([](WorkspaceConfig& w) { w.timeout_seconds = 0; }, "timeout_seconds");
}

TEST(Workspace, FitsNamesTheField) {
  const WorkspaceConfig w = ws_config();
  EXPECT_TRUE(check_fits(w, layer(256, 7168, 2048, 8)).ok());
  EXPECT_TRUE(check_fits(w, layer(128, 2048, 768, 8)).ok());  // Qwen3-like beside DeepSeek-V3-like
  expect_rejects(check_fits(w, layer(512, 7168, 2048, 8)), "num_experts");
  expect_rejects(check_fits(w, layer(256, 7296, 2048, 8)), "max_hidden");
  expect_rejects(check_fits(w, layer(256, 7168, 2176, 8)), "max_intermediate");
  expect_rejects(check_fits(w, layer(256, 7168, 2048, 9)), "max_topk");
  LayerConfig t = layer(256, 7168, 2048, 8);
  t.max_tokens_per_rank = 2048;
  expect_rejects(check_fits(w, t), "max_tokens_per_rank");
  LayerConfig r = layer(256, 7168, 2048, 8);
  r.num_ranks = 2;
  r.num_experts = 128;
  expect_rejects(check_fits(w, r), "num_ranks");
  expect_rejects(check_fits(w, layer(256, 7168, 2048, 8, DType::kBF16)), "dtype");
  WorkspaceConfig wb = w;
  wb.dtype = DType::kBF16;
  EXPECT_TRUE(check_fits(wb, layer(256, 7168, 2048, 8, DType::kBF16)).ok());
  EXPECT_TRUE(check_fits(wb, layer(256, 7168, 2048, 8, DType::kFP8)).ok());
  // An invalid layer config is reported as such, before the fit.
  expect_rejects(check_fits(w, layer(256, 100, 2048, 8)), "hidden");
}

TEST(Workspace, ConfigForALayerFitsIt) {
  const LayerConfig l = layer(256, 7168, 2048, 8);
  const WorkspaceConfig w = workspace_config_for(l);
  EXPECT_TRUE(validate(w).ok());
  EXPECT_TRUE(check_fits(w, l).ok());
  EXPECT_EQ(w.max_experts_per_rank, 64);
}

// A layer on the workspace lays its buffers out exactly as the workspace does (same region
// offsets, same total), whatever its own E, H, K, dtype and combine precision.
TEST(Workspace, EveryFittingShapeHasTheWorkspaceOffsets) {
  for (const DType wd : {DType::kFP8, DType::kBF16}) {
    WorkspaceConfig wc = ws_config();
    wc.dtype = wd;
    const layout::CommShape room = detail::workspace_shape(wc);
    const layout::CommSymLayout ws_sym{room};
    const layout::CommLocalLayout ws_loc{room};
    struct L { int e_loc, H, K; bool fp8; int pb; };
    std::vector<L> shapes = {{64, 7168, 8, true, 4}, {16, 2048, 2, true, 2}, {1, 128, 1, true, 4}, {64, 128, 8, true, 2}};
    if (wd == DType::kBF16) shapes.push_back({32, 4096, 4, false, 4});
    for (const L& l : shapes) {
      layout::CommShape s{4, 4 * l.e_loc, l.H, l.K, wc.max_tokens_per_rank, l.fp8, l.pb};
      s.cap = room.cap;
      const layout::CommSymLayout sym{s};
      const layout::CommLocalLayout loc{s};
      EXPECT_EQ(sym.counts_offset(), ws_sym.counts_offset());
      EXPECT_EQ(sym.stage_x_offset(), ws_sym.stage_x_offset());
      EXPECT_EQ(sym.stage_scale_offset(), ws_sym.stage_scale_offset());
      EXPECT_EQ(sym.stage_meta_offset(), ws_sym.stage_meta_offset());
      EXPECT_EQ(sym.partials_offset(), ws_sym.partials_offset());
      EXPECT_EQ(sym.num_bytes(), ws_sym.num_bytes());
      EXPECT_EQ(loc.cursor_offset(), ws_loc.cursor_offset());
      EXPECT_EQ(loc.token_rows_offset(), ws_loc.token_rows_offset());
      EXPECT_EQ(loc.recv_tokens_offset(), ws_loc.recv_tokens_offset());
      EXPECT_EQ(loc.mblock_ready_offset(), ws_loc.mblock_ready_offset());
      EXPECT_EQ(loc.mblock_arrive_offset(), ws_loc.mblock_arrive_offset());
      EXPECT_EQ(loc.tile_claim_offset(), ws_loc.tile_claim_offset());
      EXPECT_EQ(loc.num_bytes(), ws_loc.num_bytes());
      // Strides stay the layer's own.
      EXPECT_EQ(sym.counts_stride(), l.e_loc + 1);
      EXPECT_EQ(sym.partial_row_bytes(), int64_t(l.H) * l.pb);
      // The layer's pool fits the workspace's.
      const layout::ExpertPoolLayout pool{layout::pool_shape_for(s, 2048, 128)};
      EXPECT_LE(pool.num_bytes(), detail::workspace_pool_bytes(wc));
    }
  }
}

TEST(Workspace, SizesAreTheLayoutsAndFlatInLayers) {
  const WorkspaceConfig w = ws_config();
  const WorkspaceSizes z = workspace_sizes(w);
  EXPECT_EQ(z.symmetric, (layout::CommSymLayout{detail::workspace_shape(w)}.num_bytes() + 4095) / 4096 * 4096);
  EXPECT_EQ(z.local, layout::CommLocalLayout{detail::workspace_shape(w)}.num_bytes());
  EXPECT_EQ(z.total(), z.symmetric + z.local + z.pool);
  // A workspace made for one layer is what MoELayer::create(comm, cfg) allocated before: the
  // layer's own buffers, no more.
  const LayerConfig l = layer(256, 7168, 2048, 8);
  const WorkspaceSizes own = workspace_sizes(workspace_config_for(l));
  layout::CommShape s{4, 256, 7168, 8, 1024, true, 4};
  EXPECT_EQ(own.symmetric, (layout::CommSymLayout{s}.num_bytes() + 4095) / 4096 * 4096);
  EXPECT_EQ(own.pool, layout::ExpertPoolLayout{layout::pool_shape_for(s, 2048, 128)}.num_bytes());
  // A BF16 workspace also holds FP8 layers: at least as large as both.
  WorkspaceConfig wb = w;
  wb.dtype = DType::kBF16;
  EXPECT_GE(workspace_sizes(wb).pool, z.pool);
  EXPECT_GE(workspace_sizes(wb).symmetric, z.symmetric);
}

TEST(Workspace, W13TransformBytes) {
  const W13Bytes f = w13_transform_bytes(DType::kFP8, 32, 2048, 7168);
  EXPECT_EQ(f.weight, int64_t(32) * 4096 * 7168);
  EXPECT_EQ(f.scale, int64_t(32) * 32 * 56 * 4);
  const W13Bytes b = w13_transform_bytes(DType::kBF16, 2, 256, 512);
  EXPECT_EQ(b.weight, int64_t(2) * 512 * 512 * 2);
  EXPECT_EQ(b.scale, 0);
}

TEST(Workspace, Int64RoutingHostCheckNeverWraps) {
  LayerConfig c = layer(16, 128, 128, 2);
  const int64_t ok[4] = {0, 15, -1, 3};
  EXPECT_TRUE(validate_routing_host(c, 2, ok).ok());
  // 2^32 + 3 would be 3 after narrowing to int32.
  const int64_t wrap[4] = {0, (int64_t(1) << 32) + 3, 1, 2};
  expect_rejects(validate_routing_host(c, 2, wrap), "topk_idx[0][1]=4294967299");
  const int64_t neg[2] = {-2, 0};
  expect_rejects(validate_routing_host(c, 1, neg), "topk_idx[0][0]=-2");
}

TEST(Workspace, Int64RoutingNeedsEightByteAlignment) {
  LayerConfig c = layer(16, 128, 128, 2);
  alignas(16) static char buf[64];
  EXPECT_TRUE(validate_call(c, 1, buf, buf + 8, IndexType::kInt64, buf, buf).ok());
  expect_rejects(validate_call(c, 1, buf, buf + 4, IndexType::kInt64, buf, buf), "8-byte aligned");
  EXPECT_TRUE(validate_call(c, 1, buf, buf + 4, IndexType::kInt32, buf, buf).ok());
  expect_rejects(validate_call(c, 1, buf, buf + 8, IndexType(5), buf, buf), "topk_idx type");
}

}  // namespace
}  // namespace epmoe
