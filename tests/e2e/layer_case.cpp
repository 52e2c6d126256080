#include "e2e/layer_case.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>

#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "host/check.h"
#include "reference/compare.h"
#include "reference/numeric.h"
#include "reference/reference.h"

namespace epmoe::e2e {

namespace {

Status fail(const std::string& s) { return Status(StatusCode::kInternal, s); }

template <class T>
struct DevArray {
  T* p = nullptr;
  ~DevArray() { if (p) cudaFree(p); }
  cudaError_t alloc(size_t n) { return cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)); }
};

ref::Problem make_problem(const LayerCase& c, int R) {
  ref::Problem p;
  p.R = R;
  p.E = c.shape.experts_per_rank * R;
  p.H = c.shape.hidden;
  p.I = c.shape.inter;
  p.K = c.shape.topk;
  p.T_max = c.max_tokens;
  if (p.T_max == 0)
    for (int t : c.tokens) p.T_max = std::max(p.T_max, t);
  p.T_max = std::max(p.T_max, 1);
  p.dtype = c.dtype;
  p.clamp = c.clamp;
  p.pow2_scales = c.pow2_scales;
  return p;
}

LayerConfig make_config(const ref::Problem& p) {
  LayerConfig cfg;
  cfg.num_ranks = p.R;
  cfg.num_experts = p.E;
  cfg.hidden = p.H;
  cfg.intermediate = p.I;
  cfg.topk = p.K;
  cfg.max_tokens_per_rank = p.T_max;
  cfg.dtype = p.dtype == ref::DType::kFP8 ? DType::kFP8 : DType::kBF16;
  cfg.activation_clamp = p.clamp;
  cfg.pow2_scales = p.pow2_scales;
  // Why: under compute-sanitizer every kernel runs many times slower, and a peer can lag far
  // behind; EPMOE_TEST_TIMEOUT_S widens the device-side wait bound for such runs.
  if (const char* t = std::getenv("EPMOE_TEST_TIMEOUT_S")) cfg.timeout_seconds = std::atof(t);
  return cfg;
}

ExpertWeights host_weights(const ref::Problem& p, const ref::RankWeights& w) {
  ExpertWeights ew;
  ew.on_device = false;
  if (p.dtype == ref::DType::kFP8) {
    ew.w1 = w.w1_q.data();
    ew.w1_scale = w.w1_s.data();
    ew.w2 = w.w2_q.data();
    ew.w2_scale = w.w2_s.data();
  } else {
    ew.w1 = w.w1_bf16.data();
    ew.w2 = w.w2_bf16.data();
  }
  return ew;
}

// Per-rank device copies of one call's inputs and output.
struct RankBuffers {
  DevArray<uint16_t> x, y;
  DevArray<int32_t> idx;
  DevArray<float> w;
  Status alloc(const ref::Problem& p) {
    EPMOE_CUDA_RETURN(x.alloc(size_t(p.T_max) * p.H));
    EPMOE_CUDA_RETURN(y.alloc(size_t(p.T_max) * p.H));
    EPMOE_CUDA_RETURN(idx.alloc(size_t(p.T_max) * p.K));
    EPMOE_CUDA_RETURN(w.alloc(size_t(p.T_max) * p.K));
    return Status::Ok();
  }
  Status upload(const ref::RankInput& in, const ref::Problem& p) {
    if (in.T == 0) return Status::Ok();
    EPMOE_CUDA_RETURN(cudaMemcpy(x.p, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    EPMOE_CUDA_RETURN(cudaMemcpy(idx.p, in.topk_idx.data(), in.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    EPMOE_CUDA_RETURN(cudaMemcpy(w.p, in.topk_w.data(), in.topk_w.size() * 4, cudaMemcpyHostToDevice));
    (void)p;
    return Status::Ok();
  }
  // NaN everywhere (0xFFFF is a bf16 NaN), so an element the layer fails to write cannot pass.
  Status poison(const ref::Problem& p, cudaStream_t s) {
    EPMOE_CUDA_RETURN(cudaMemsetAsync(y.p, 0xFF, size_t(p.T_max) * p.H * 2, s));
    return Status::Ok();
  }
};

// Compares this rank's y with the reference on the sampled tokens, and checks every row of y
// (sampled or not) for NaN / Inf, which catches unwritten rows.
Status check_output(const ref::Problem& p, const LayerCase& c, int rank, const std::vector<uint16_t>& y,
                    const std::vector<ref::RankInput>& inputs, const std::vector<ref::RankWeights>& weights,
                    uint64_t call_seed, int call) {
  const int T = c.tokens[rank];
  int64_t bad = 0;
  for (int64_t i = 0; i < int64_t(T) * p.H; ++i)
    if (!std::isfinite(ref::bf16_to_float(y[i]))) ++bad;
  std::vector<std::vector<int>> sample(p.R);
  sample[rank] = ref::sample_tokens(c.tokens, c.sample_per_rank, call_seed)[rank];
  const auto y_ref = ref::forward(p, inputs, weights, &sample);
  std::vector<uint16_t> got, want;
  for (int t : sample[rank]) {
    got.insert(got.end(), y.begin() + int64_t(t) * p.H, y.begin() + int64_t(t + 1) * p.H);
    want.insert(want.end(), y_ref[rank].begin() + int64_t(t) * p.H, y_ref[rank].begin() + int64_t(t + 1) * p.H);
  }
  const ref::Compare cmp = ref::compare_bf16(got.data(), want.data(), int64_t(got.size()));
  std::printf("[e2e] rank %d %s call %d: T=%d sampled=%zu rel_l2=%.3e (tol %.0e) nonfinite=%lld\n", rank,
              c.describe().c_str(), call, T, sample[rank].size(), cmp.rel_l2, ref::tolerance(p.dtype),
              static_cast<long long>(bad));
  // Why the size test: with no token here (T = 0) there is nothing to compare, only to not crash.
  if (bad || (!got.empty() && !ref::passes(cmp, p.dtype))) {
    std::ostringstream os;
    os << "rank " << rank << " " << c.describe() << " call " << call << ": rel_l2=" << cmp.rel_l2
       << " (tolerance " << ref::tolerance(p.dtype) << "), non-finite outputs=" << bad << " of "
       << int64_t(T) * p.H << ", NaN in sampled=" << cmp.nan_count;
    return fail(os.str());
  }
  return Status::Ok();
}

// y (just computed by the fused path) against the pipeline on the same inputs, and against a
// second fused call: both must be bitwise equal over this rank's T rows. Collective (every rank
// makes the same forward calls in the same order).
Status check_paths_agree(const ref::Problem& p, const LayerCase& c, int rank, MoELayer& layer, RankBuffers& buf,
                         const std::vector<uint16_t>& y_fused, cudaStream_t stream, int call) {
  const int T = c.tokens[rank];
  const size_t n = size_t(T) * p.H;
  std::vector<uint16_t> other(size_t(p.T_max) * p.H);
  const Path order[2] = {Path::kPipeline, Path::kFused};
  const char* what[2] = {"pipeline", "second fused call"};
  for (int i = 0; i < 2; ++i) {
    EPMOE_RETURN_IF_ERROR(buf.poison(p, stream));
    EPMOE_RETURN_IF_ERROR(layer.forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, T, stream, order[i]));
    EPMOE_RETURN_IF_ERROR(layer.check_device_error(stream));
    EPMOE_CUDA_RETURN(cudaMemcpy(other.data(), buf.y.p, other.size() * 2, cudaMemcpyDeviceToHost));
    size_t diff = 0, first = n;
    for (size_t j = 0; j < n; ++j)
      if (other[j] != y_fused[j]) {
        if (!diff) first = j;
        ++diff;
      }
    std::printf("[e2e] rank %d %s call %d: fused vs %s: %zu of %zu bf16 values differ\n", rank,
                c.describe().c_str(), call, what[i], diff, n);
    if (diff) {
      std::ostringstream os;
      os << "rank " << rank << " " << c.describe() << " call " << call << ": fused y differs from the " << what[i]
         << " in " << diff << " of " << n << " values (first at token " << first / p.H << ", channel "
         << first % p.H << ": 0x" << std::hex << y_fused[first] << " vs 0x" << other[first] << ")";
      return fail(os.str());
    }
  }
  return Status::Ok();
}

}  // namespace

std::string LayerCase::describe() const {
  std::ostringstream os;
  os << shape.name << "/" << ref::dtype_name(dtype) << "/" << ref::routing_name(routing) << "/T=";
  for (size_t i = 0; i < tokens.size(); ++i) os << (i ? "," : "") << tokens[i];
  if (calls > 1) os << "/calls=" << calls;
  if (graph) os << "/graph";
  if (clamp > 0) os << "/clamp=" << clamp;
  if (pow2_scales) os << "/pow2";
  if (duplicate_experts) os << "/dup_experts";
  if (bf16_partials) os << "/bf16_partials";
  if (path == Path::kFused) os << "/fused";
  if (fused_epilogue) os << "/" << fused_epilogue;
  return os.str();
}

// Sets `name` to `value` (nullptr: leaves it alone) until the end of the scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (!value) return;
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
    set_ = true;
  }
  ~ScopedEnv() {
    if (!set_) return;
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false, set_ = false;
};

Status run_layer_case(const RankContext& ctx, const LayerCase& c, uint64_t seed) {
  const int R = ctx.size, rank = ctx.rank;
  if (int(c.tokens.size()) != R) return fail("case lists " + std::to_string(c.tokens.size()) + " token counts for " + std::to_string(R) + " ranks");
  const ref::Problem p = make_problem(c, R);

  std::unique_ptr<Communicator> comm;
  EPMOE_RETURN_IF_ERROR(Communicator::create(ctx.id, rank, R, &comm));
  std::unique_ptr<MoELayer> layer;
  LayerConfig cfg = make_config(p);
  if (c.bf16_partials) cfg.combine_partials = PartialPrecision::kBFloat16;
  {
    // The case's megakernel variant, in this rank's process while the layer reads it at create; then
    // the environment as it was. Why scoped: set for good, it also forced the variant on every
    // later case of the process (and overrode an outer EPMOE_FUSED_EPILOGUE for them).
    ScopedEnv epilogue("EPMOE_FUSED_EPILOGUE", c.fused_epilogue);
    EPMOE_RETURN_IF_ERROR(MoELayer::create(*comm, cfg, &layer));
  }
  cudaStream_t stream;
  EPMOE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Every rank builds every rank's weights: the reference needs them all.
  const std::vector<ref::RankWeights> weights = ref::make_problem_weights(p, ref::mix_seed(seed, 1));
  EPMOE_RETURN_IF_ERROR(layer->load_weights(host_weights(p, weights[rank]), stream));

  RankBuffers buf;
  EPMOE_RETURN_IF_ERROR(buf.alloc(p));
  std::vector<uint16_t> y(size_t(p.T_max) * p.H);

  cudaGraphExec_t graph_exec = nullptr;
  for (int call = 0; call < c.calls; ++call) {
    const uint64_t call_seed = ref::mix_seed(seed, 2, call);
    std::vector<ref::RankInput> inputs = ref::make_problem_inputs(p, c.routing, c.tokens, call_seed);
    if (c.duplicate_experts && p.K >= 2) {
      // SPEC allows any routing: an expert named twice is computed twice.
      for (auto& in : inputs)
        for (int t = 0; t < in.T; t += 3)
          if (in.topk_idx[int64_t(t) * p.K] >= 0) in.topk_idx[int64_t(t) * p.K + 1] = in.topk_idx[int64_t(t) * p.K];
    }
    EPMOE_RETURN_IF_ERROR(buf.upload(inputs[rank], p));
    EPMOE_RETURN_IF_ERROR(buf.poison(p, stream));
    if (c.graph) {
      if (!graph_exec) {
        cudaGraph_t graph;
        EPMOE_CUDA_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        Status st = layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, c.path);
        cudaError_t end = cudaStreamEndCapture(stream, &graph);
        EPMOE_RETURN_IF_ERROR(st);
        EPMOE_CUDA_RETURN(end);
        EPMOE_CUDA_RETURN(cudaGraphInstantiate(&graph_exec, graph, 0));
        EPMOE_CUDA_RETURN(cudaGraphDestroy(graph));
      }
      EPMOE_CUDA_RETURN(cudaGraphLaunch(graph_exec, stream));
    } else {
      EPMOE_RETURN_IF_ERROR(layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, c.path));
    }
    const bool check = call == c.calls - 1 || call % c.check_every == 0;
    if (!check) continue;
    EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));
    EPMOE_CUDA_RETURN(cudaMemcpy(y.data(), buf.y.p, y.size() * 2, cudaMemcpyDeviceToHost));
    EPMOE_RETURN_IF_ERROR(check_output(p, c, rank, y, inputs, weights, call_seed, call));
    if (c.path == Path::kFused && c.cross_check_paths) EPMOE_RETURN_IF_ERROR(check_paths_agree(p, c, rank, *layer, buf, y, stream, call));
  }
  EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));
  if (graph_exec) cudaGraphExecDestroy(graph_exec);
  cudaStreamDestroy(stream);
  return Status::Ok();
}

Status run_bad_input_case(const RankContext& ctx, uint64_t seed) {
  const int R = ctx.size, rank = ctx.rank;
  LayerCase c;
  c.shape = Shape{"small", 4, 256, 256, 2};
  c.tokens.assign(R, 16);
  const ref::Problem p = make_problem(c, R);
  std::unique_ptr<Communicator> comm;
  EPMOE_RETURN_IF_ERROR(Communicator::create(ctx.id, rank, R, &comm));

  // Configuration errors come back before anything is allocated.
  std::unique_ptr<MoELayer> layer;
  LayerConfig bad = make_config(p);
  bad.hidden = 100;
  Status st = MoELayer::create(*comm, bad, &layer);
  if (st.ok() || st.message().find("hidden=100") == std::string::npos)
    return fail("create with hidden=100: expected an error naming hidden=100, got " + st.to_string());
  bad = make_config(p);
  bad.num_ranks = R + 1;
  bad.num_experts = p.E_loc() * (R + 1);
  st = MoELayer::create(*comm, bad, &layer);
  if (st.ok() || st.message().find("communicator size") == std::string::npos)
    return fail("create with num_ranks != comm size: got " + st.to_string());

  EPMOE_RETURN_IF_ERROR(MoELayer::create(*comm, make_config(p), &layer));
  cudaStream_t stream;
  EPMOE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto weights = ref::make_problem_weights(p, ref::mix_seed(seed, 1));
  RankBuffers buf;
  EPMOE_RETURN_IF_ERROR(buf.alloc(p));

  // forward before load_weights is refused.
  st = layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, 1, stream, Path::kPipeline);
  if (st.ok() || st.message().find("load_weights") == std::string::npos)
    return fail("forward before load_weights: got " + st.to_string());
  EPMOE_RETURN_IF_ERROR(layer->load_weights(host_weights(p, weights[rank]), stream));

  // Host-side rejections leave y untouched.
  const auto inputs = ref::make_problem_inputs(p, ref::Routing::kUniform, c.tokens, ref::mix_seed(seed, 3));
  EPMOE_RETURN_IF_ERROR(buf.upload(inputs[rank], p));
  EPMOE_RETURN_IF_ERROR(buf.poison(p, stream));
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  st = layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, p.T_max + 1, stream, Path::kPipeline);
  if (st.code() != StatusCode::kInvalidArgument || st.message().find("num_tokens=") == std::string::npos)
    return fail("forward with T > T_max: got " + st.to_string());
  st = layer->forward(nullptr, buf.idx.p, buf.w.p, buf.y.p, 4, stream, Path::kPipeline);
  if (st.code() != StatusCode::kInvalidArgument || st.message().find("x is null") == std::string::npos)
    return fail("forward with x = null: got " + st.to_string());
  std::vector<uint16_t> y(size_t(p.T_max) * p.H);
  EPMOE_CUDA_RETURN(cudaMemcpy(y.data(), buf.y.p, y.size() * 2, cudaMemcpyDeviceToHost));
  for (uint16_t v : y)
    if (v != 0xFFFF) return fail("a rejected forward call wrote y");

  // An expert index out of range, found on the device, is reported by the next check.
  std::vector<int32_t> idx = inputs[rank].topk_idx;
  idx[0] = p.E;  // token 0, slot 0
  EPMOE_CUDA_RETURN(cudaMemcpy(buf.idx.p, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  EPMOE_RETURN_IF_ERROR(layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, Path::kPipeline));
  st = layer->check_device_error(stream);
  if (st.ok()) return fail("an expert index of E went unreported by check_device_error");
  std::printf("[e2e] rank %d: bad index reported as: %s\n", rank, st.to_string().c_str());

  // The error is cleared and the next good call passes.
  EPMOE_RETURN_IF_ERROR(buf.upload(inputs[rank], p));
  EPMOE_RETURN_IF_ERROR(layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, Path::kPipeline));
  EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));
  cudaStreamDestroy(stream);
  return Status::Ok();
}

}  // namespace epmoe::e2e
