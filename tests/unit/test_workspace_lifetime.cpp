// The lifetime rules of a workspace, without a GPU: close() and the C API's destroy refuse while a
// layer lives (nothing is released, the handle stays usable), a closed workspace reports itself and
// takes no new layer. The workspace here wraps a state with no device buffers behind it (no CUDA
// call is made); a live layer is stood in for by the state's layer count.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "epmoe/c_api.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"
#include "host/c_api_handles.h"
#include "host/workspace_internal.h"

namespace epmoe {
namespace {

WorkspaceConfig ws_config() {
  WorkspaceConfig w;
  w.num_ranks = 2;
  w.max_experts_per_rank = 8;
  w.max_hidden = 512;
  w.max_intermediate = 256;
  w.max_topk = 4;
  w.max_tokens_per_rank = 64;
  return w;
}

// A workspace over a state that holds `bytes` of (pretend) local memory and nothing to free.
std::unique_ptr<Workspace> host_only_workspace(std::shared_ptr<detail::WorkspaceState>* state, int64_t bytes) {
  *state = std::make_shared<detail::WorkspaceState>();
  (*state)->local_bytes = bytes;
  return detail::WorkspaceAccess::wrap(ws_config(), *state);
}

TEST(WorkspaceLifetime, CloseRefusesWhileALayerLives) {
  std::shared_ptr<detail::WorkspaceState> state;
  auto ws = host_only_workspace(&state, 4096);
  state->num_layers = 2;
  const Status st = ws->close();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("2 layers created on this workspace still live"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("destroy them first"), std::string::npos) << st.message();
  // Nothing was released.
  EXPECT_FALSE(ws->closed());
  EXPECT_EQ(ws->nbytes(), 4096);
  EXPECT_EQ(ws->num_layers(), 2);
  state->num_layers = 1;
  EXPECT_NE(ws->close().message().find("1 layer created on this workspace still lives"), std::string::npos);
  state->num_layers = 0;
  EXPECT_TRUE(ws->close().ok());
}

TEST(WorkspaceLifetime, AClosedWorkspaceTakesNoLayer) {
  std::shared_ptr<detail::WorkspaceState> state;
  auto ws = host_only_workspace(&state, 4096);
  std::weak_ptr<detail::WorkspaceState> watch = state;
  state.reset();
  ASSERT_TRUE(ws->close().ok());
  EXPECT_TRUE(watch.expired()) << "close() kept the buffers";
  EXPECT_TRUE(ws->closed());
  EXPECT_EQ(ws->nbytes(), 0);
  EXPECT_EQ(ws->num_layers(), 0);
  EXPECT_EQ(ws->config().max_hidden, 512);
  EXPECT_TRUE(ws->close().ok()) << "a second close is a no-op";
  // Refused before any CUDA call or collective: the message names the closed workspace.
  LayerConfig c;
  c.num_ranks = 2;
  c.num_experts = 16;
  c.hidden = 512;
  c.intermediate = 256;
  c.topk = 4;
  c.max_tokens_per_rank = 64;
  std::unique_ptr<MoELayer> layer;
  const Status st = MoELayer::create(*ws, c, &layer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("the workspace was closed"), std::string::npos) << st.message();
  EXPECT_EQ(layer, nullptr);
}

TEST(WorkspaceLifetime, CApiDestroyRefusesWhileALayerLives) {
  std::shared_ptr<detail::WorkspaceState> state;
  epmoe_comm comm;  // no communicator behind it: destroy touches only the device index
  auto* handle = new epmoe_workspace;
  handle->ws = host_only_workspace(&state, 8192).release();
  handle->comm = &comm;
  std::weak_ptr<detail::WorkspaceState> watch = state;
  state->num_layers = 1;
  int32_t count = -1;
  ASSERT_EQ(epmoe_workspace_num_layers(handle, &count), EPMOE_OK);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(epmoe_workspace_destroy(handle), EPMOE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(epmoe_last_error()).find("1 layer created on this workspace still lives"), std::string::npos)
      << epmoe_last_error();
  // The handle is intact: it still answers, and a later destroy (after the layer) releases it.
  int64_t bytes = 0;
  ASSERT_EQ(epmoe_workspace_nbytes(handle, &bytes), EPMOE_OK);
  EXPECT_EQ(bytes, 8192);
  state->num_layers = 0;
  state.reset();
  EXPECT_EQ(epmoe_workspace_destroy(handle), EPMOE_OK);
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(epmoe_workspace_num_layers(nullptr, &count), EPMOE_INVALID_ARGUMENT);
  EXPECT_EQ(epmoe_workspace_destroy(nullptr), EPMOE_OK);
}

}  // namespace
}  // namespace epmoe
