// One workspace, many layers (include/epmoe/workspace.h), on mgpu::test_ranks(2) ranks:
// - two different layers alternate on one workspace for several calls; each y equals, bit for bit,
//   the same layer on its own workspace, and tests/reference within SPEC's bound;
// - weights by reference (transform_w13 into the caller's buffer, W2 as is) equal copied weights;
// - int64 topk_idx gives the same y as int32, and an int64 index that would wrap into range is
//   reported, not used;
// - the per-call expert counts equal the host's count, the running sum their sum;
// - close() is refused while a layer lives and releases the buffers once none does.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"
#include "mgpu/mgpu_util.h"
#include "reference/compare.h"
#include "reference/data.h"
#include "reference/reference.h"

namespace epmoe::e2e {
namespace {

using mgpu::test_ranks;

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  ~Dev() { if (p) cudaFree(p); }
  Status alloc(size_t count) {
    n = std::max<size_t>(count, 1);
    RANK_CUDA(cudaMalloc(&p, n * sizeof(T)));
    return Status::Ok();
  }
  Status upload(const std::vector<T>& v) {
    if (!v.empty()) RANK_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  std::vector<T> download(size_t count) const {
    std::vector<T> v(count);
    if (count) cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};

struct Model {
  ref::Problem p;
  LayerConfig cfg;
  ref::RankWeights w;  // this rank's experts
  Dev<uint8_t> w13, w13_kernel, w2;  // device copies in the checkpoint layout
  Dev<float> w13_scale, w13_kernel_scale, w2_scale;
};

ref::Problem problem(int R, int e_loc, int H, int I, int K, int T_max) {
  ref::Problem p;
  p.R = R;
  p.E = e_loc * R;
  p.H = H;
  p.I = I;
  p.K = K;
  p.T_max = T_max;
  p.dtype = ref::DType::kFP8;
  return p;
}

LayerConfig config_of(const ref::Problem& p) {
  LayerConfig c;
  c.num_ranks = p.R;
  c.num_experts = p.E;
  c.hidden = p.H;
  c.intermediate = p.I;
  c.topk = p.K;
  c.max_tokens_per_rank = p.T_max;
  c.dtype = DType::kFP8;
  return c;
}

ExpertWeights host_weights(const ref::RankWeights& w) {
  ExpertWeights e;
  e.w1 = w.w1_q.data();
  e.w1_scale = w.w1_s.data();
  e.w2 = w.w2_q.data();
  e.w2_scale = w.w2_s.data();
  return e;
}

// The checkpoint tensors on the device, and W1 transformed into a buffer this test owns.
Status upload_and_transform(Model& m, cudaStream_t s) {
  const int g = m.p.E_loc();
  RANK_OK(m.w13.alloc(m.w.w1_q.size()));
  RANK_OK(m.w13.upload(m.w.w1_q));
  RANK_OK(m.w13_scale.alloc(m.w.w1_s.size()));
  RANK_OK(m.w13_scale.upload(m.w.w1_s));
  RANK_OK(m.w2.alloc(m.w.w2_q.size()));
  RANK_OK(m.w2.upload(m.w.w2_q));
  RANK_OK(m.w2_scale.alloc(m.w.w2_s.size()));
  RANK_OK(m.w2_scale.upload(m.w.w2_s));
  const W13Bytes b = w13_transform_bytes(DType::kFP8, g, m.p.I, m.p.H);
  if (size_t(b.weight) != m.w.w1_q.size() || size_t(b.scale) != m.w.w1_s.size() * 4)
    return mgpu::fail("w13_transform_bytes disagrees with the checkpoint sizes");
  RANK_OK(m.w13_kernel.alloc(size_t(b.weight)));
  RANK_OK(m.w13_kernel_scale.alloc(size_t(b.scale) / 4));
  RANK_OK(transform_w13(DType::kFP8, m.w13.p, m.w13_scale.p, m.w13_kernel.p, m.w13_kernel_scale.p, g, m.p.I, m.p.H, s));
  RANK_CUDA(cudaStreamSynchronize(s));
  return Status::Ok();
}

struct CallInputs {
  std::vector<ref::RankInput> all;  // every rank's (for the reference and the expert counts)
  Dev<uint16_t> x, y;
  Dev<int32_t> idx32;
  Dev<int64_t> idx64;
  Dev<float> wt;
  Status make(const ref::Problem& p, const std::vector<int>& T, int rank, uint64_t seed) {
    all = ref::make_problem_inputs(p, ref::Routing::kUniform, T, seed);
    const ref::RankInput& in = all[size_t(rank)];
    RANK_OK(x.alloc(size_t(p.T_max) * p.H));
    RANK_OK(y.alloc(size_t(p.T_max) * p.H));
    RANK_OK(idx32.alloc(size_t(p.T_max) * p.K));
    RANK_OK(idx64.alloc(size_t(p.T_max) * p.K));
    RANK_OK(wt.alloc(size_t(p.T_max) * p.K));
    RANK_OK(x.upload(in.x));
    RANK_OK(idx32.upload(in.topk_idx));
    RANK_OK(idx64.upload(std::vector<int64_t>(in.topk_idx.begin(), in.topk_idx.end())));
    RANK_OK(wt.upload(in.topk_w));
    return Status::Ok();
  }
};

// Rows each local expert of `rank` receives from every rank's routing.
std::vector<int32_t> host_counts(const ref::Problem& p, const std::vector<ref::RankInput>& all, int rank) {
  std::vector<int32_t> c(size_t(p.E_loc()), 0);
  for (const auto& in : all)
    for (int64_t i = 0; i < int64_t(in.T) * p.K; ++i) {
      const int e = in.topk_idx[size_t(i)];
      if (e >= rank * p.E_loc() && e < (rank + 1) * p.E_loc()) ++c[size_t(e - rank * p.E_loc())];
    }
  return c;
}

std::vector<uint16_t> run(MoELayer& l, CallInputs& in, int T, bool int64, int32_t* counts, int64_t* totals,
                          cudaStream_t s, Path path, Status* st) {
  const size_t n = size_t(T) * l.config().hidden;
  cudaMemsetAsync(in.y.p, 0xFF, in.y.n * 2, s);  // NaN: an element the layer fails to write cannot pass
  ForwardArgs a;
  a.x = in.x.p;
  a.topk_idx = int64 ? static_cast<const void*>(in.idx64.p) : static_cast<const void*>(in.idx32.p);
  a.idx_type = int64 ? IndexType::kInt64 : IndexType::kInt32;
  a.topk_weights = in.wt.p;
  a.y = in.y.p;
  a.num_tokens = T;
  a.expert_counts = counts;
  a.expert_counts_total = totals;
  *st = l.forward(a, s, path);
  if (st->ok()) *st = l.check_device_error(s);
  return in.y.download(n);
}

Status rank_body(const RankContext& ctx, Path path, uint64_t seed) {
  std::unique_ptr<Communicator> comm;
  RANK_OK(mgpu::make_comm(ctx, &comm));
  const int R = ctx.size, T_max = 96;
  cudaStream_t s = nullptr;
  RANK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Two layers of different E, H, I, K on one workspace sized for the larger of each.
  Model a, b;
  a.p = problem(R, 8, 512, 256, 4, T_max);
  b.p = problem(R, 4, 256, 384, 2, T_max);
  const std::vector<ref::RankWeights> wa = ref::make_problem_weights(a.p, ref::mix_seed(seed, 1));
  const std::vector<ref::RankWeights> wb = ref::make_problem_weights(b.p, ref::mix_seed(seed, 2));
  a.w = wa[size_t(ctx.rank)];
  b.w = wb[size_t(ctx.rank)];
  a.cfg = config_of(a.p);
  b.cfg = config_of(b.p);
  RANK_OK(upload_and_transform(a, s));
  RANK_OK(upload_and_transform(b, s));

  WorkspaceConfig wc;
  wc.num_ranks = R;
  wc.max_experts_per_rank = 8;
  wc.max_hidden = 512;
  wc.max_intermediate = 384;
  wc.max_topk = 4;
  wc.max_tokens_per_rank = T_max;
  std::unique_ptr<Workspace> ws;
  RANK_OK(Workspace::create(*comm, wc, &ws));
  RANK_CHECK(ws->nbytes() == workspace_sizes(wc).total(), ctx, "nbytes " << ws->nbytes());

  // On the shared workspace: A with copied weights, B by reference. Each also on its own workspace.
  std::unique_ptr<MoELayer> la, lb, la_own, lb_own;
  RANK_OK(MoELayer::create(*ws, a.cfg, &la));
  RANK_OK(la->load_weights(host_weights(a.w), s));
  ExpertWeightRefs refs;
  refs.w13 = b.w13_kernel.p;
  refs.w13_scale = b.w13_kernel_scale.p;
  refs.w2 = b.w2.p;
  refs.w2_scale = b.w2_scale.p;
  const int64_t before = ws->nbytes();
  RANK_OK(MoELayer::create(*ws, b.cfg, &lb, &refs));
  RANK_CHECK(ws->nbytes() == before, ctx, "a layer on the workspace changed its size");
  RANK_CHECK(ws->num_layers() == 2, ctx, "num_layers " << ws->num_layers());
  // Closing it now is refused (the layers run on its buffers), and releases nothing.
  {
    const Status st = ws->close();
    RANK_CHECK(st.code() == StatusCode::kInvalidArgument && st.message().find("2 layers") != std::string::npos, ctx,
               "close with live layers: " << st.to_string());
    RANK_CHECK(!ws->closed() && ws->nbytes() == before, ctx, "a refused close released the workspace");
  }
  // A layer that does not fit is refused, naming the field.
  {
    LayerConfig big = a.cfg;
    big.hidden = 640;
    std::unique_ptr<MoELayer> no;
    const Status st = MoELayer::create(*ws, big, &no);
    RANK_CHECK(!st.ok() && st.message().find("max_hidden") != std::string::npos, ctx, st.to_string());
    RANK_CHECK(!lb->load_weights(host_weights(b.w), s).ok(), ctx, "load_weights on a by-reference layer");
  }
  RANK_OK(MoELayer::create(*comm, a.cfg, &la_own));
  RANK_OK(la_own->load_weights(host_weights(a.w), s));
  RANK_OK(MoELayer::create(*comm, b.cfg, &lb_own));
  RANK_OK(lb_own->load_weights(host_weights(b.w), s));

  Dev<int32_t> counts;
  Dev<int64_t> totals;
  RANK_OK(counts.alloc(8));
  RANK_OK(totals.alloc(8));
  RANK_CUDA(cudaMemset(totals.p, 0, 8 * sizeof(int64_t)));
  std::vector<int64_t> want_totals(size_t(a.p.E_loc()), 0);

  constexpr int kCalls = 4;
  for (int call = 0; call < kCalls; ++call) {
    std::vector<int> T(static_cast<size_t>(R), 0);
    for (int r = 0; r < R; ++r) T[size_t(r)] = (T_max - 17 * r - 5 * call) > 0 ? T_max - 17 * r - 5 * call : 0;
    const int mine = T[size_t(ctx.rank)];
    CallInputs ia, ib;
    RANK_OK(ia.make(a.p, T, ctx.rank, ref::mix_seed(seed, 10, uint64_t(call))));
    RANK_OK(ib.make(b.p, T, ctx.rank, ref::mix_seed(seed, 20, uint64_t(call))));
    Status st;
    // Alternate the two layers on the shared workspace (A int32 with counts, B int64 by reference).
    const auto ya = run(*la, ia, mine, false, counts.p, totals.p, s, path, &st);
    RANK_OK(st);
    const std::vector<int32_t> got_counts = counts.download(size_t(a.p.E_loc()));
    const auto yb = run(*lb, ib, mine, true, nullptr, nullptr, s, path, &st);
    RANK_OK(st);
    const auto ya_own = run(*la_own, ia, mine, false, nullptr, nullptr, s, path, &st);
    RANK_OK(st);
    const auto yb_own = run(*lb_own, ib, mine, false, nullptr, nullptr, s, path, &st);
    RANK_OK(st);
    RANK_CHECK(ya == ya_own, ctx, "call " << call << ": layer A on the shared workspace differs from its own");
    RANK_CHECK(yb == yb_own, ctx,
               "call " << call << ": layer B (by reference, int64) differs from B (copied, int32) on its own workspace");
    const std::vector<int32_t> want_counts = host_counts(a.p, ia.all, ctx.rank);
    RANK_CHECK(got_counts == want_counts, ctx, "call " << call << ": expert counts differ from the host's count");
    for (size_t e = 0; e < want_counts.size(); ++e) want_totals[e] += want_counts[e];
    // Against tests/reference (this rank's tokens).
    for (int which = 0; which < 2; ++which) {
      const ref::Problem& p = which ? b.p : a.p;
      const std::vector<ref::RankWeights>& w = which ? wb : wa;
      const CallInputs& in = which ? ib : ia;
      const std::vector<uint16_t>& y = which ? yb : ya;
      std::vector<std::vector<int>> sample(static_cast<size_t>(R));
      for (int t = 0; t < mine; ++t) sample[size_t(ctx.rank)].push_back(t);
      const auto y_ref = ref::forward(p, in.all, w, &sample);
      if (mine == 0) continue;
      const ref::Compare cmp = ref::compare_bf16(y.data(), y_ref[size_t(ctx.rank)].data(), int64_t(y.size()));
      std::printf("[workspace] rank %d call %d layer %c: T=%d rel_l2=%.3e\n", ctx.rank, call, which ? 'B' : 'A', mine,
                  cmp.rel_l2);
      RANK_CHECK(ref::passes(cmp, p.dtype), ctx,
                 "call " << call << " layer " << (which ? 'B' : 'A') << ": rel_l2=" << cmp.rel_l2);
    }
  }
  RANK_CHECK(totals.download(size_t(a.p.E_loc())) == want_totals, ctx, "the running expert counts differ");

  // An int64 index that narrowing would wrap into range (2^32 + 1 -> 1) is masked and reported.
  {
    std::vector<int> T(static_cast<size_t>(R), 8);
    CallInputs in;
    RANK_OK(in.make(a.p, T, ctx.rank, ref::mix_seed(seed, 30)));
    const int64_t wrap = (int64_t(1) << 32) + 1;
    RANK_CUDA(cudaMemcpy(in.idx64.p + 1, &wrap, sizeof(wrap), cudaMemcpyHostToDevice));
    Status st;
    run(*la, in, 8, true, nullptr, nullptr, s, path, &st);
    RANK_CHECK(st.code() == StatusCode::kInvalidArgument && st.message().find("outside") != std::string::npos, ctx,
               "the wrapped int64 index was not reported: " << st.to_string());
  }
  la.reset();
  lb.reset();
  la_own.reset();
  lb_own.reset();
  // No layer left: close releases the buffers (collectively) and takes no new layer.
  RANK_CHECK(ws->num_layers() == 0, ctx, "num_layers after the layers went: " << ws->num_layers());
  RANK_OK(ws->close());
  RANK_CHECK(ws->closed() && ws->nbytes() == 0, ctx, "closed " << ws->closed() << " nbytes " << ws->nbytes());
  {
    std::unique_ptr<MoELayer> no;
    const Status st = MoELayer::create(*ws, a.cfg, &no);
    RANK_CHECK(!st.ok() && st.message().find("closed") != std::string::npos, ctx, st.to_string());
  }
  ws.reset();
  RANK_CUDA(cudaStreamDestroy(s));
  return Status::Ok();
}

void run_case(Path path) {
  const int ranks = test_ranks(2);
  EPMOE_REQUIRE_RANKS(ranks);
  const uint64_t seed = ref::fresh_seed();
  std::printf("[workspace] seed %llu ranks %d path %s\n", static_cast<unsigned long long>(seed), ranks,
              path == Path::kFused ? "fused" : "pipeline");
  mgpu::run_on_ranks(ranks, [&](const RankContext& ctx) { return rank_body(ctx, path, seed); }, 300.0);
}

TEST(LayerWorkspace, TwoLayersOneWorkspacePipeline) { run_case(Path::kPipeline); }
TEST(LayerWorkspace, TwoLayersOneWorkspaceFused) { run_case(Path::kFused); }

}  // namespace
}  // namespace epmoe::e2e
