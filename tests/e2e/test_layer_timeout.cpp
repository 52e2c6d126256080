// A rank that never arrives: with the never-arrive test hook naming rank 0
// (detail::set_debug_never_arrive_rank), rank 0 launches nothing, so rank 1's bounded wait for
// rank 0's dispatch flag expires and traps. The test checks that rank 1's check_device_error()
// then returns a kTimeout Status that carries the device's record (rank, flag, expected, seen), on both paths: the pipeline's kernels (which also printf) and the fused kernel
// (which cannot). Each case runs in its own forked ranks: the trap kills rank 1's CUDA context.
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/launcher.h"
#include "epmoe/layer.h"
#include "host/heuristics.h"
#include "mgpu/mgpu_util.h"

namespace epmoe::e2e {
namespace {

constexpr double kWaitSeconds = 1.0;  // LayerConfig::timeout_seconds of the waiting rank
constexpr int kSilentRank = 0;

template <class T>
struct DevBuf {
  T* p = nullptr;
  ~DevBuf() { if (p) cudaFree(p); }
  cudaError_t zeros(size_t n) {
    const cudaError_t e = cudaMalloc(&p, n * sizeof(T));
    return e != cudaSuccess ? e : cudaMemset(p, 0, n * sizeof(T));
  }
};

// One rank's side. `done` is a pipe the parent made before forking: the waiting rank writes a byte
// when it has checked its Status, and the silent rank stays alive until then (bounded), so that
// its memory, which the waiter's kernel writes into over NVLink, stays mapped.
Status never_arrive_rank(const RankContext& ctx, Path path, const int done[2]) {
  const bool silent = ctx.rank == kSilentRank;
  close(silent ? done[1] : done[0]);
  // The test hook, read once by DispatchHandle::create; every rank sets the same rank, only rank 0
  // acts on it.
  epmoe::detail::set_debug_never_arrive_rank(kSilentRank);

  LayerConfig cfg;
  cfg.num_ranks = ctx.size;
  cfg.num_experts = 2 * ctx.size;
  cfg.hidden = 512;
  cfg.intermediate = 256;
  cfg.topk = 2;
  cfg.max_tokens_per_rank = 64;
  cfg.dtype = DType::kBF16;
  cfg.timeout_seconds = kWaitSeconds;
  std::unique_ptr<Communicator> comm;
  RANK_OK(mgpu::make_comm(ctx, &comm));
  std::unique_ptr<MoELayer> layer;
  RANK_OK(MoELayer::create(*comm, cfg, &layer));
  cudaStream_t stream = nullptr;
  RANK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const int g = cfg.experts_per_rank(), h = cfg.hidden, in = cfg.intermediate, T = 16, K = cfg.topk;
  DevBuf<uint16_t> w1, w2, x, y;
  RANK_CUDA(w1.zeros(size_t(g) * 2 * in * h));
  RANK_CUDA(w2.zeros(size_t(g) * h * in));
  ExpertWeights w;
  w.w1 = w1.p;
  w.w2 = w2.p;
  w.on_device = true;
  RANK_OK(layer->load_weights(w, stream));

  std::vector<int32_t> idx(size_t(T) * K);
  std::vector<float> wt(size_t(T) * K, 0.5f);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = (t + k) % cfg.num_experts;
  DevBuf<int32_t> d_idx;
  DevBuf<float> d_wt;
  RANK_CUDA(x.zeros(size_t(T) * h));
  RANK_CUDA(y.zeros(size_t(T) * h));
  RANK_CUDA(d_idx.zeros(idx.size()));
  RANK_CUDA(d_wt.zeros(wt.size()));
  RANK_CUDA(cudaMemcpy(d_idx.p, idx.data(), idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  RANK_CUDA(cudaMemcpy(d_wt.p, wt.data(), wt.size() * sizeof(float), cudaMemcpyHostToDevice));

  // Both ranks call forward; the silent one launches nothing and still returns Ok.
  // The waiting rank's forward may itself fail: once its first kernel trapped, the later launches of
  // the same call return the sticky error, which forward turns into the timeout diagnostic.
  const Status fwd = layer->forward(x.p, d_idx.p, d_wt.p, y.p, T, stream, path);
  RANK_CHECK(fwd.ok() || (!silent && fwd.code() == StatusCode::kTimeout), ctx,
             "forward returned " << fwd.to_string());
  const Status st = fwd.ok() ? layer->check_device_error(stream) : fwd;
  std::printf("[timeout] rank %d check_device_error: %s\n", ctx.rank, st.to_string().c_str());
  std::fflush(stdout);

  // Why leak the layer and the communicator: their destructors are collective (they barrier with
  // the peer), and the waiter's context is dead. The launcher ends each child with _exit.
  (void)layer.release();
  (void)comm.release();

  if (silent) {
    pollfd pfd{done[0], POLLIN, 0};
    const int ready = poll(&pfd, 1, 20000);
    RANK_CHECK(ready == 1, ctx, "the waiting rank never reported (poll returned " << ready << ")");
    RANK_CHECK(st.ok(), ctx, "the silent rank launched nothing, yet check_device_error says: " << st.to_string());
    return Status::Ok();
  }
  const char byte = 1;
  const bool told = write(done[1], &byte, 1) == 1;
  RANK_CHECK(told, ctx, "could not tell the silent rank that the check is done");
  const std::string& m = st.message();
  RANK_CHECK(st.code() == StatusCode::kTimeout, ctx, "expected kTimeout, got " << st.to_string());
  RANK_CHECK(m.find("TIMEOUT") != std::string::npos, ctx, "no TIMEOUT in: " << m);
  RANK_CHECK(m.find("TIMEOUT rank " + std::to_string(ctx.rank)) != std::string::npos, ctx, "no waiter rank in: " << m);
  RANK_CHECK(m.find("flag dispatch_ready[" + std::to_string(kSilentRank) + "]") != std::string::npos, ctx,
             "the record does not name the flag of the silent rank: " << m);
  RANK_CHECK(m.find("expected >= ") != std::string::npos && m.find("seen ") != std::string::npos, ctx,
             "no expected/seen values in: " << m);
  return Status::Ok();
}

void run_never_arrive(Path path) {
  EPMOE_REQUIRE_RANKS(2);
  int done[2];
  ASSERT_EQ(pipe(done), 0);
  const auto t0 = std::chrono::steady_clock::now();
  LaunchOptions o;
  o.num_ranks = 2;
  o.timeout_seconds = 25.0;  // the launcher kills both ranks after this: nothing is left behind
  const LaunchResult r = launch_ranks(o, [&](const RankContext& ctx) { return never_arrive_rank(ctx, path, done); });
  close(done[0]);
  close(done[1]);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[timeout] path=%s: %.1f s\n", path == Path::kFused ? "fused" : "pipeline", s);
  ASSERT_TRUE(r.ok) << r.message;
  EXPECT_LT(s, 20.0);
}

TEST(LayerTimeout, NeverArrivingRankPipeline) { run_never_arrive(Path::kPipeline); }
TEST(LayerTimeout, NeverArrivingRankFused) { run_never_arrive(Path::kFused); }

}  // namespace
}  // namespace epmoe::e2e
