// Fault injection on the layer, at mgpu::test_ranks(2) ranks (EPMOE_TEST_RANKS=4 for four), both
// paths. Each case runs in its own forked ranks (a trap kills a rank's CUDA context), ends within
// its bound, and checks the message on every rank:
// - a rank that never arrives (the never-arrive hook): every other rank gets kTimeout naming
//   itself and the silent rank's dispatch flag, from a later forward without a sync;
// - a GEMM wait forced to time out (the stall hook on rank 0): rank 0 gets kTimeout naming a GEMM
//   role, every other rank kTimeout naming rank 0's combine flag;
// - a rank whose create fails (the fail-create hook): every rank's create fails naming that rank
//   and the cause, frees what it allocated, and a new layer on the same communicator works;
// - a bad expert index followed by normal calls: the next forward on that rank returns it without
//   a sync (the call itself runs), the one after is clean; in strict mode every rank refuses the
//   call before launch;
// - two streams on one layer: calls alternate between them without syncs, and both results equal
//   the single-stream results bit for bit.
// A rank that leaves (exits mid-call, or destroys its layer alone): test_layer_departures.cpp.
// The hooks exist only in test builds (-DEPMOE_TEST_HOOKS=ON); without them the hook cases skip.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "e2e/fault_rig.h"
#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "host/heuristics.h"
#include "mgpu/mgpu_util.h"

namespace epmoe::e2e {
namespace {

using namespace faults;

#ifdef EPMOE_TEST_HOOKS

constexpr int kFaultyRank = 0;

// ---- a rank that never arrives --------------------------------------------------------------------

Status never_arrive_rank(const RankContext& ctx, Path path, Checked& checked) {
  detail::set_debug_never_arrive_rank(kFaultyRank);
  const bool silent = ctx.rank == kFaultyRank;
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, kWaitSeconds), &r));
  const Status first = forward(r, path);
  RANK_CHECK(first.ok() || (!silent && first.code() == StatusCode::kTimeout), ctx, "forward: " << first.to_string());
  if (silent) {
    // It launched nothing; it stays up until every peer has checked its message.
    const Status st = r.layer->check_device_error(r.stream);
    std::printf("[faults] rank %d (silent, launched nothing): %s\n", ctx.rank, st.to_string().c_str());
    (void)r.layer.release();  // collective destructors: the peers' contexts are gone
    (void)r.comm.release();
    RANK_CHECK(checked.wait_for(ctx.size - 1, 25.0), ctx, "a waiting rank never reported");
    RANK_CHECK(st.ok(), ctx, "the silent rank launched nothing, yet: " << st.to_string());
    return Status::Ok();
  }
  Status st;
  RANK_OK(timeout_without_sync(r, path, first, &st));
  std::printf("[faults] rank %d forward after the trap: %s\n", ctx.rank, st.to_string().c_str());
  (void)r.layer.release();
  (void)r.comm.release();
  checked.mark();
  const std::string& m = st.message();
  RANK_CHECK(st.code() == StatusCode::kTimeout, ctx, "expected kTimeout, got " << st.to_string());
  RANK_CHECK(contains(m, "TIMEOUT rank " + std::to_string(ctx.rank) + " "), ctx, "no waiter rank in: " << m);
  RANK_CHECK(contains(m, "flag dispatch_ready[" + std::to_string(kFaultyRank) + "]"), ctx,
             "the record does not name the silent rank's flag: " << m);
  RANK_CHECK(contains(m, "expected >= ") && contains(m, "seen "), ctx, "no expected/seen values in: " << m);
  return Status::Ok();
}

void never_arrive(Path path) {
  Checked checked;
  ASSERT_TRUE(checked.ok());
  run_case((std::string("never-arrive ") + path_name(path)).c_str(),
           [&](const RankContext& ctx) { return never_arrive_rank(ctx, path, checked); });
}

TEST(LayerFaults, NeverArrivingRankPipeline) { never_arrive(Path::kPipeline); }
TEST(LayerFaults, NeverArrivingRankFused) { never_arrive(Path::kFused); }

// ---- a GEMM wait forced to time out ----------------------------------------------------------------

Status gemm_stall_rank(const RankContext& ctx, Path path, Checked& checked) {
  detail::set_debug_stall_gemm_rank(kFaultyRank);
  const bool stalled = ctx.rank == kFaultyRank;
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, kWaitSeconds), &r));
  const Status first = forward(r, path);
  RANK_CHECK(first.ok() || first.code() == StatusCode::kTimeout, ctx, "forward: " << first.to_string());
  Status st;
  RANK_OK(timeout_without_sync(r, path, first, &st));
  std::printf("[faults] rank %d%s forward after the trap: %s\n", ctx.rank, stalled ? " (stalled GEMM)" : "",
              st.to_string().c_str());
  (void)r.layer.release();
  (void)r.comm.release();
  checked.mark();
  // Every rank's context is lost; wait for the others so that no rank's exit unmaps memory a
  // peer's trapped kernel could still be reporting about.
  RANK_CHECK(checked.wait_for(ctx.size, 25.0), ctx, "a rank never reported");
  const std::string& m = st.message();
  RANK_CHECK(st.code() == StatusCode::kTimeout, ctx, "expected kTimeout, got " << st.to_string());
  RANK_CHECK(contains(m, "TIMEOUT rank " + std::to_string(ctx.rank) + " "), ctx, "no waiter rank in: " << m);
  if (stalled) {
    RANK_CHECK(contains(m, "(GEMM "), ctx, "the stalled rank's record names no GEMM role: " << m);
  } else {
    RANK_CHECK(contains(m, "(comm): flag combine_ready[" + std::to_string(kFaultyRank) + "]"), ctx,
               "the record does not name the stalled rank's combine flag: " << m);
  }
  return Status::Ok();
}

void gemm_stall(Path path) {
  Checked checked;
  ASSERT_TRUE(checked.ok());
  run_case((std::string("GEMM stall ") + path_name(path)).c_str(),
           [&](const RankContext& ctx) { return gemm_stall_rank(ctx, path, checked); });
}

TEST(LayerFaults, GemmWaitTimesOutPipeline) { gemm_stall(Path::kPipeline); }
TEST(LayerFaults, GemmWaitTimesOutFused) { gemm_stall(Path::kFused); }

// ---- a rank whose create fails ---------------------------------------------------------------------

Status create_fails_rank(const RankContext& ctx, Path path) {
  const int failing = ctx.size - 1;
  detail::set_debug_fail_create_rank(failing);
  std::unique_ptr<Communicator> comm;
  RANK_OK(mgpu::make_comm(ctx, &comm));
  // Why a barrier first: NCCL allocates its buffers at the first collective, which would read as
  // memory the failed create kept.
  RANK_OK(comm->barrier(nullptr, 10.0));
  size_t free_before = 0, free_after = 0, total = 0;
  RANK_CUDA(cudaMemGetInfo(&free_before, &total));
  // Weights of ~200 MB per rank, so that a create that kept them would show.
  LayerConfig cfg = small_config(ctx.size, 10.0);
  cfg.num_experts = 8 * ctx.size;
  cfg.hidden = 2048;
  cfg.intermediate = 2048;
  std::unique_ptr<MoELayer> layer;
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = MoELayer::create(*comm, cfg, &layer);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[faults] rank %d create: %s (%.2f s)\n", ctx.rank, st.to_string().c_str(), s);
  RANK_CHECK(!st.ok() && !layer, ctx, "create succeeded on a rank although rank " << failing << " failed");
  RANK_CHECK(contains(st.message(), "failed on rank " + std::to_string(failing)), ctx,
             "the message does not name the failing rank: " << st.message());
  RANK_CHECK(contains(st.message(), "simulated by the fail-create test hook"), ctx,
             "the message does not carry the cause: " << st.message());
  RANK_CHECK(s < cfg.timeout_seconds, ctx, "the failure took " << s << " s: it waited for the timeout");
  RANK_CUDA(cudaMemGetInfo(&free_after, &total));
  const double leaked_mb = (double(free_before) - double(free_after)) / (1 << 20);
  RANK_CHECK(leaked_mb < 64.0, ctx, "the failed create kept " << leaked_mb << " MB");
  // The communicator still works: a layer made next runs both paths.
  detail::set_debug_fail_create_rank(-1);
  Rig r;
  r.cfg = cfg;
  RANK_OK(MoELayer::create(*comm, cfg, &r.layer));
  RANK_CUDA(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
  const int g = cfg.experts_per_rank();
  RANK_CUDA(r.w1.upload(random_bf16(size_t(g) * 2 * cfg.intermediate * cfg.hidden, 5, 0.05f)));
  RANK_CUDA(r.w2.upload(random_bf16(size_t(g) * cfg.hidden * cfg.intermediate, 6, 0.05f)));
  ExpertWeights w;
  w.w1 = r.w1.p;
  w.w2 = r.w2.p;
  w.on_device = true;
  RANK_OK(r.layer->load_weights(w, r.stream));
  RANK_OK(load_inputs(r, ctx.rank, 0));
  RANK_OK(forward(r, path));
  RANK_OK(r.layer->check_device_error(r.stream));
  return Status::Ok();
}

TEST(LayerFaults, CreateFailsOnOneRankPipeline) {
  run_case("create fails pipeline", [](const RankContext& ctx) { return create_fails_rank(ctx, Path::kPipeline); });
}
TEST(LayerFaults, CreateFailsOnOneRankFused) {
  run_case("create fails fused", [](const RankContext& ctx) { return create_fails_rank(ctx, Path::kFused); });
}

#else

TEST(LayerFaults, NeedsTestHooks) {
  GTEST_SKIP() << "the fault-injection cases need a build with -DEPMOE_TEST_HOOKS=ON (tools/test.sh does that)";
}

#endif  // EPMOE_TEST_HOOKS

// ---- a bad expert index, then normal calls ---------------------------------------------------------

constexpr int kBadRank = 1;
constexpr int kBadToken = 3, kBadSlot = 1;

Status bad_then_normal_rank(const RankContext& ctx, Path path) {
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, 10.0), &r));
  const size_t n = size_t(r.T) * r.cfg.hidden;
  // The reference: the same inputs, good routing, before any fault.
  RANK_OK(forward(r, path));
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  const std::vector<uint16_t> good = download(r.y, n);
  // Call 2: rank kBadRank names expert E in one slot. Every rank's call completes.
  std::vector<int32_t> idx = routing(r.cfg, r.T, ctx.rank, 0);
  if (ctx.rank == kBadRank) idx[size_t(kBadToken) * r.cfg.topk + kBadSlot] = r.cfg.num_experts;
  DevBuf<int32_t> bad_idx;
  RANK_CUDA(bad_idx.upload(idx));
  RANK_OK(r.layer->forward(r.x.p, bad_idx.p, r.wt.p, r.y.p, r.T, r.stream, path));
  // A plain CUDA sync (not check_device_error) so that the report has certainly landed.
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  // Call 3: good routing. The bad rank gets call 2's error, after this call ran normally.
  const Status third = forward(r, path);
  std::printf("[faults] rank %d call after the bad one (%s): %s\n", ctx.rank, path_name(path),
              third.to_string().c_str());
  if (ctx.rank == kBadRank) {
    RANK_CHECK(third.code() == StatusCode::kInvalidArgument, ctx, "expected the bad index, got " << third.to_string());
    const std::string want = "rank " + std::to_string(kBadRank) + ": forward call 2 had topk_idx[" +
                             std::to_string(kBadToken) + "][" + std::to_string(kBadSlot) +
                             "]=" + std::to_string(r.cfg.num_experts);
    RANK_CHECK(contains(third.message(), want), ctx, "expected '" << want << "' in: " << third.message());
  } else {
    RANK_CHECK(third.ok(), ctx, "a rank with good routing got: " << third.to_string());
  }
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  RANK_CHECK(download(r.y, n) == good, ctx, "the call that reported the earlier error computed another y");
  // Call 4: clean everywhere, same result; nothing left for the explicit check.
  RANK_OK(forward(r, path));
  RANK_OK(r.layer->check_device_error(r.stream));
  RANK_CHECK(download(r.y, n) == good, ctx, "the call after the report computed another y");
  return Status::Ok();
}

TEST(LayerFaults, BadExpertThenNormalCallsPipeline) {
  run_case("bad expert pipeline", [](const RankContext& ctx) { return bad_then_normal_rank(ctx, Path::kPipeline); });
}
TEST(LayerFaults, BadExpertThenNormalCallsFused) {
  run_case("bad expert fused", [](const RankContext& ctx) { return bad_then_normal_rank(ctx, Path::kFused); });
}

// Strict mode: the bad call is refused on every rank before launch (y untouched), the next works.
Status strict_rank(const RankContext& ctx, Path path) {
  LayerConfig cfg = small_config(ctx.size, 10.0);
  cfg.strict_routing = true;
  Rig r;
  RANK_OK(make_rig(ctx, cfg, &r));
  const size_t n = size_t(r.T) * cfg.hidden;
  std::vector<int32_t> idx = routing(cfg, r.T, ctx.rank, 0);
  if (ctx.rank == kBadRank) idx[size_t(kBadToken) * cfg.topk + kBadSlot] = -2;
  DevBuf<int32_t> bad_idx;
  RANK_CUDA(bad_idx.upload(idx));
  RANK_CUDA(cudaMemset(r.y.p, 0x7F, n * 2));
  const std::vector<uint16_t> before = download(r.y, n);
  const Status st = r.layer->forward(r.x.p, bad_idx.p, r.wt.p, r.y.p, r.T, r.stream, path);
  std::printf("[faults] rank %d strict bad call (%s): %s\n", ctx.rank, path_name(path), st.to_string().c_str());
  RANK_CHECK(st.code() == StatusCode::kInvalidArgument, ctx, "expected kInvalidArgument, got " << st.to_string());
  const std::string want = "rank " + std::to_string(kBadRank) + ": topk_idx[" + std::to_string(kBadToken) + "][" +
                           std::to_string(kBadSlot) + "]=-2";
  RANK_CHECK(contains(st.message(), want), ctx, "expected '" << want << "' in: " << st.message());
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  RANK_CHECK(download(r.y, n) == before, ctx, "a refused call wrote y");
  RANK_OK(forward(r, path));
  RANK_OK(r.layer->check_device_error(r.stream));
  return Status::Ok();
}

TEST(LayerFaults, StrictRoutingRefusesBeforeLaunchPipeline) {
  run_case("strict pipeline", [](const RankContext& ctx) { return strict_rank(ctx, Path::kPipeline); });
}
TEST(LayerFaults, StrictRoutingRefusesBeforeLaunchFused) {
  run_case("strict fused", [](const RankContext& ctx) { return strict_rank(ctx, Path::kFused); });
}

// ---- two streams on one layer ----------------------------------------------------------------------

Status two_streams_rank(const RankContext& ctx, Path path) {
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, 10.0), &r));
  const size_t n = size_t(r.T) * r.cfg.hidden;
  // Two inputs (different routing and activations), each with its own output.
  Rig b;  // only its buffers
  b.cfg = r.cfg;
  b.T = r.T;
  RANK_OK(load_inputs(b, ctx.rank, 1));
  const auto call = [&](Rig& in, cudaStream_t s) {
    return r.layer->forward(in.x.p, in.idx.p, in.wt.p, in.y.p, in.T, s, path);
  };
  // References, one stream, synchronized.
  RANK_OK(call(r, r.stream));
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  const std::vector<uint16_t> ref_a = download(r.y, n);
  RANK_OK(call(b, r.stream));
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  const std::vector<uint16_t> ref_b = download(b.y, n);
  RANK_CHECK(ref_a != ref_b, ctx, "the two inputs give the same y: the check could not fail");
  // Alternate between two streams without any sync in between.
  cudaStream_t s2 = nullptr;
  RANK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  Status st;
  for (int i = 0; i < 50 && st.ok(); ++i) {
    RANK_CUDA(cudaMemsetAsync(r.y.p, 0, n * 2, r.stream));
    st = call(r, r.stream);
    if (!st.ok()) break;
    RANK_CUDA(cudaMemsetAsync(b.y.p, 0, n * 2, s2));
    st = call(b, s2);
  }
  RANK_CUDA(cudaStreamSynchronize(r.stream));
  RANK_CUDA(cudaStreamSynchronize(s2));
  RANK_CUDA(cudaStreamDestroy(s2));
  RANK_OK(st);
  RANK_OK(r.layer->check_device_error(r.stream));
  RANK_CHECK(download(r.y, n) == ref_a, ctx, "stream 1's result differs from the single-stream result");
  RANK_CHECK(download(b.y, n) == ref_b, ctx, "stream 2's result differs from the single-stream result");
  return Status::Ok();
}

TEST(LayerFaults, TwoStreamsSerializePipeline) {
  run_case("two streams pipeline", [](const RankContext& ctx) { return two_streams_rank(ctx, Path::kPipeline); });
}
TEST(LayerFaults, TwoStreamsSerializeFused) {
  run_case("two streams fused", [](const RankContext& ctx) { return two_streams_rank(ctx, Path::kFused); });
}

}  // namespace
}  // namespace epmoe::e2e
