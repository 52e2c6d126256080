#include "e2e/layer_case.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>

#include "e2e/fp8_check.h"
#include "e2e/pool_rows.h"
#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "host/check.h"
#include "host/heuristics.h"
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

std::string call_name(const LayerCase& c, int rank, int call, uint64_t seed) {
  std::ostringstream os;
  os << "rank " << rank << " " << c.describe() << " call " << call << " (seed " << seed << ")";
  return os.str();
}

std::string replay_note(const LayerCase& c) { return c.replay.empty() ? "" : "\n  replay: " + c.replay; }

double quantile(std::vector<double> v, double f) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(f * double(v.size())))];
}

// Evidence mode (the FP8 small-sample tail): every checked call's numbers on this rank, printed at the end.
struct Evidence {
  std::vector<double> full, kc, window_used, flip_distance, flip_rate;
  std::vector<double> token_err2, token_ref2;
  int64_t groups = 0, codes = 0, ambiguous = 0, flips = 0, scales_moved = 0, o_checked = 0, o_flips = 0;
  int calls = 0, full_over = 0, kc_failed = 0, paths_checked = 0, paths_equal = 0;
  std::string first_failure;

  void add(const Fp8CallCheck& k) {
    ++calls;
    full.push_back(k.full.rel_l2);
    kc.push_back(k.kc.rel_l2);
    window_used.push_back(k.requant.max_window_used);
    flip_distance.push_back(k.requant.max_flip_distance);
    flip_rate.push_back(k.requant.codes ? double(k.requant.flips) / double(k.requant.codes) : 0.0);
    token_err2.insert(token_err2.end(), k.token_err2.begin(), k.token_err2.end());
    token_ref2.insert(token_ref2.end(), k.token_ref2.begin(), k.token_ref2.end());
    groups += k.groups;
    codes += k.requant.codes;
    flips += k.requant.flips;
    ambiguous += k.requant.ambiguous;
    scales_moved += k.requant.scales_moved;
    o_checked += k.o_checked;
    o_flips += k.o_flips;
    full_over += k.full.rel_l2 > 1e-2;
  }
  void fail(const std::string& s) {
    ++kc_failed;
    if (first_failure.empty()) first_failure = s;
  }
  void print(const LayerCase& c, int rank) const {
    const auto q = [](const std::vector<double>& v) {
      char b[160];
      std::snprintf(b, sizeof(b), "p50 %.2e p90 %.2e p99 %.2e p99.9 %.2e max %.2e", quantile(v, 0.5), quantile(v, 0.9),
                    quantile(v, 0.99), quantile(v, 0.999), quantile(v, 1.0));
      return std::string(b);
    };
    std::printf("[evidence] rank %d %s: %d calls, %.1f requantization groups per call (N_min %lld)\n", rank,
                c.describe().c_str(), calls, calls ? double(groups) / calls : 0.0,
                static_cast<long long>(kFullCheckMinGroups));
    std::printf("[evidence]   full-reference rel_l2: %s; above 1e-2: %d of %d\n", q(full).c_str(), full_over, calls);
    std::printf("[evidence]   kernel-consistent rel_l2: %s\n", q(kc).c_str());
    std::printf("[evidence]   step-5 flips (codes != RNE(a_ref / s)): %lld of %lld codes (%.3e); per call rate %s\n",
                static_cast<long long>(flips), static_cast<long long>(codes), codes ? double(flips) / double(codes) : 0.0,
                q(flip_rate).c_str());
    std::printf("[evidence]   codes whose window holds a rounding midpoint (either neighbour passes): %lld (%.3e)\n",
                static_cast<long long>(ambiguous), codes ? double(ambiguous) / double(codes) : 0.0);
    std::printf("[evidence]   flips: window used (max per call) %s; distance to midpoint / amax (max per call) %s\n",
                q(window_used).c_str(), q(flip_distance).c_str());
    std::printf("[evidence]   scales != reference: %lld; step-6 o != bf16(W2 a^_gpu): %lld of %lld (%.3e)\n",
                static_cast<long long>(scales_moved), static_cast<long long>(o_flips), static_cast<long long>(o_checked),
                o_checked ? double(o_flips) / double(o_checked) : 0.0);
    std::printf("[evidence]   fused == pipeline bitwise (and == a second fused call): %d of %d calls\n", paths_equal,
                paths_checked);
    std::printf("[evidence]   kernel-consistent or bitwise failures: %d%s%s\n", kc_failed,
                first_failure.empty() ? "" : "; first: ", first_failure.c_str());
    // rel_l2 of a sample of n tokens drawn from all sampled tokens of all calls (with replacement):
    // the small-sample tail as the GPU produces it, without a noise model.
    std::vector<double> per_token;
    for (size_t i = 0; i < token_err2.size(); ++i)
      if (token_ref2[i] > 0) per_token.push_back(std::sqrt(token_err2[i] / token_ref2[i]));
    std::printf("[evidence]   per-token rel_l2 (%zu tokens): %s\n", per_token.size(), q(per_token).c_str());
    if (token_err2.empty()) return;
    ref::Rng rng(ref::mix_seed(token_err2.size(), 34));
    for (int n : {1, 2, 4, 8, 16, 32, 64, 128}) {
      const ref::SampleTail t = ref::bootstrap_rel_l2(token_err2, token_ref2, n, 100000, 1e-2, rng);
      std::printf("[evidence]   bootstrap n=%3d tokens: rel_l2 %s; P(> 1e-2) = %.2e\n", n, q(t.rel).c_str(), t.above);
    }
  }
};

// Compares this rank's y with the reference on the sampled tokens, and checks every row of y
// (sampled or not) for NaN / Inf, which catches unwritten rows. FP8: also the kernel-consistent
// checks on the pool rows of the sampled tokens (tests/e2e/fp8_check.h), and SPEC's rel_l2 only
// from kFullCheckMinGroups requantization groups on (printed below that). In evidence mode the
// FP8 numbers go to *ev and nothing fails here.
Status check_output(const ref::Problem& p, const LayerCase& c, int rank, const std::vector<uint16_t>& y,
                    const std::vector<ref::RankInput>& inputs, const std::vector<ref::RankWeights>& weights,
                    const std::vector<std::vector<int>>& samples, const std::vector<PoolRow>& rows,
                    const std::string& pool_defect, uint64_t seed, int call, Evidence* ev) {
  const int T = c.tokens[rank];
  int64_t bad = 0;
  for (int64_t i = 0; i < int64_t(T) * p.H; ++i)
    if (!std::isfinite(ref::bf16_to_float(y[i]))) ++bad;
  const std::string name = call_name(c, rank, call, seed);
  const std::vector<int>& mine = samples[rank];

  if (p.dtype == ref::DType::kBF16) {
    std::vector<std::vector<int>> sample(p.R);
    sample[rank] = mine;
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
      os << name << ": rel_l2=" << cmp.rel_l2 << " (tolerance " << ref::tolerance(p.dtype)
         << "), non-finite outputs=" << bad << " of " << int64_t(T) * p.H << ", NaN in sampled=" << cmp.nan_count
         << replay_note(c);
      return fail(os.str());
    }
    return Status::Ok();
  }

  const Fp8CallCheck k = check_fp8_call(p, rank, mine, y, rows, inputs, weights, c.bf16_partials);
  const bool enforced = k.enforce_full();
  std::printf("[e2e] rank %d %s call %d: T=%d sampled=%zu groups=%lld rel_l2=%.3e (tol 1e-2, %s) kc_rel_l2=%.3e "
              "flips=%lld/%lld (window used %.2f, ambiguous %lld) scales_moved=%lld o_flips=%lld/%lld nonfinite=%lld\n",
              rank, c.describe().c_str(), call, T, mine.size(), static_cast<long long>(k.groups), k.full.rel_l2,
              enforced ? "enforced" : "not enforced below N_min", k.kc.rel_l2, static_cast<long long>(k.requant.flips),
              static_cast<long long>(k.requant.codes), k.requant.max_window_used,
              static_cast<long long>(k.requant.ambiguous), static_cast<long long>(k.requant.scales_moved), static_cast<long long>(k.o_flips),
              static_cast<long long>(k.o_checked), static_cast<long long>(bad));
  std::ostringstream os;
  if (bad || k.full.nan_count || k.kc.nan_count) {
    os << name << ": non-finite outputs=" << bad << " of " << int64_t(T) * p.H << ", NaN in sampled=" << k.full.nan_count;
  } else if (!pool_defect.empty()) {
    os << name << ": " << pool_defect;
  } else if (!k.kernel_consistent()) {
    os << name << ": kernel-consistent check failed: " << k.first_bad << " (step 5: " << k.requant.bad_codes
       << " codes and " << k.requant.bad_scales << " scales outside their windows of " << k.requant.codes << " / "
       << k.requant.groups << "; step 6: " << k.o_bad << " of " << k.o_checked << " o values; step 7: " << k.y_bad
       << " of " << k.y_checked << " y values; slots without one pool row: " << k.rows_bad << ")";
  } else if (k.kc.rel_l2 > kKernelConsistentTolerance) {
    os << name << ": kernel-consistent rel_l2=" << k.kc.rel_l2 << " above " << kKernelConsistentTolerance;
  } else if (enforced && !mine.empty() && !ref::passes(k.full, p.dtype)) {
    os << name << ": rel_l2=" << k.full.rel_l2 << " (tolerance " << ref::tolerance(p.dtype) << ", enforced from "
       << kFullCheckMinGroups << " requantization groups; this sample has " << k.groups << ")";
  }
  if (ev) {
    ev->add(k);
    if (!os.str().empty()) {
      // Only the kernel-consistent and finiteness failures count in evidence mode; rel_l2 is the
      // statistic being measured.
      if (!(enforced && k.kernel_consistent() && !bad && pool_defect.empty() && k.kc.rel_l2 <= kKernelConsistentTolerance))
        ev->fail(os.str());
    }
    return Status::Ok();
  }
  if (!os.str().empty()) return fail(os.str() + replay_note(c));
  return Status::Ok();
}

const char* path_label(Path q) { return q == Path::kFused ? "fused" : q == Path::kAuto ? "auto" : "pipeline"; }

// y (just computed by the case's paths: this rank's is path_of(rank, call)) against the pipeline on
// every rank on the same inputs, and against a second call of the case's paths: both must be
// bitwise equal over this rank's T rows. Collective (every rank makes the same forward calls in the
// same order).
Status check_paths_agree(const ref::Problem& p, const LayerCase& c, int rank, MoELayer& layer, RankBuffers& buf,
                         const std::vector<uint16_t>& y_fused, cudaStream_t stream, int call, uint64_t seed) {
  const int T = c.tokens[rank];
  const size_t n = size_t(T) * p.H;
  std::vector<uint16_t> other(size_t(p.T_max) * p.H);
  const Path mine = c.path_of(rank, call);
  const Path order[2] = {Path::kPipeline, mine};
  const std::string second = std::string("second ") + path_label(mine) + " call";
  const char* what[2] = {"pipeline", second.c_str()};
  // Why both calls before any verdict: they are collective, so a rank that stopped after the first
  // would leave its peers waiting in the second.
  std::string first;
  for (int i = 0; i < 2; ++i) {
    EPMOE_RETURN_IF_ERROR(buf.poison(p, stream));
    EPMOE_RETURN_IF_ERROR(layer.forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, T, stream, order[i]));
    EPMOE_RETURN_IF_ERROR(layer.check_device_error(stream));
    EPMOE_CUDA_RETURN(cudaMemcpy(other.data(), buf.y.p, other.size() * 2, cudaMemcpyDeviceToHost));
    size_t diff = 0, at = n;
    for (size_t j = 0; j < n; ++j)
      if (other[j] != y_fused[j]) {
        if (!diff) at = j;
        ++diff;
      }
    std::printf("[e2e] rank %d %s call %d: %s vs %s: %zu of %zu bf16 values differ\n", rank,
                c.describe().c_str(), call, path_label(mine), what[i], diff, n);
    if (diff && first.empty()) {
      std::ostringstream os;
      os << call_name(c, rank, call, seed) << ": " << path_label(mine) << " y differs from the " << what[i] << " in " << diff << " of " << n
         << " values (first at token " << at / p.H << ", channel " << at % p.H << ": 0x" << std::hex
         << y_fused[at] << " vs 0x" << other[at] << ")";
      first = os.str();
    }
  }
  if (!first.empty()) return fail(first + replay_note(c));
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
  if (!rank_paths.empty()) {
    os << "/paths=";
    for (size_t i = 0; i < rank_paths.size(); ++i) os << (i ? "," : "") << path_label(rank_paths[i]);
    if (rotate_paths) os << "/rotating";
  } else if (path != Path::kPipeline) {
    os << "/" << path_label(path);
  }
  if (auto_fused_max_tokens >= 0) os << "/auto_max=" << auto_fused_max_tokens;
  if (fused_epilogue) os << "/" << fused_epilogue;
  return os.str();
}

// Forces the megakernel's epilogue variant ("inline", "deferred"; nullptr: leaves the overrides
// alone) in this process's tuning overrides until the end of the scope, then restores them.
// The same for Path::kAuto's threshold (auto_fused_max_tokens >= 0).
class ScopedFusedEpilogue {
 public:
  explicit ScopedFusedEpilogue(const char* variant, int auto_fused_max_tokens = -1) {
    if (!variant && auto_fused_max_tokens < 0) return;
    old_ = detail::tuning_overrides();
    heuristics::TuningOverrides o = old_;
    if (variant) {
      const std::string v(variant);
      o.fused_epilogue = v == "inline" ? 1 : v == "deferred" ? 2 : 0;
    }
    if (auto_fused_max_tokens >= 0) o.auto_fused_max_tokens = auto_fused_max_tokens;
    detail::set_tuning_overrides(o);
    set_ = true;
  }
  ~ScopedFusedEpilogue() {
    if (set_) detail::set_tuning_overrides(old_);
  }
  ScopedFusedEpilogue(const ScopedFusedEpilogue&) = delete;
  ScopedFusedEpilogue& operator=(const ScopedFusedEpilogue&) = delete;

 private:
  heuristics::TuningOverrides old_;
  bool set_ = false;
};

Status run_layer_case(const RankContext& ctx, const LayerCase& c, uint64_t seed) {
  std::unique_ptr<Communicator> comm;
  EPMOE_RETURN_IF_ERROR(Communicator::create(ctx.id, ctx.rank, ctx.size, &comm));
  return run_layer_case(*comm, c, seed);
}

Status run_layer_case(Communicator& comm, const LayerCase& c, uint64_t seed) {
  const int R = comm.size(), rank = comm.rank();
  if (int(c.tokens.size()) != R) return fail("case lists " + std::to_string(c.tokens.size()) + " token counts for " + std::to_string(R) + " ranks");
  const ref::Problem p = make_problem(c, R);

  std::unique_ptr<MoELayer> layer;
  LayerConfig cfg = make_config(p);
  if (c.bf16_partials) cfg.combine_partials = PartialPrecision::kBFloat16;
  {
    // The case's megakernel variant, in this rank's overrides while the layer copies them at create;
    // then the overrides as they were. Why scoped: set for good, it also forced the variant on every
    // later case of the process (and overrode an outer EPMOE_FUSED_EPILOGUE for them).
    ScopedFusedEpilogue epilogue(c.fused_epilogue, c.auto_fused_max_tokens);
    EPMOE_RETURN_IF_ERROR(MoELayer::create(comm, cfg, &layer));
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
  Evidence evidence;
  // Why kept until the end: every rank makes the same collective calls whatever this rank found.
  std::string path_failure;
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
        Status st = layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, c.path_of(rank, call));
        cudaError_t end = cudaStreamEndCapture(stream, &graph);
        EPMOE_RETURN_IF_ERROR(st);
        EPMOE_CUDA_RETURN(end);
        EPMOE_CUDA_RETURN(cudaGraphInstantiate(&graph_exec, graph, 0));
        EPMOE_CUDA_RETURN(cudaGraphDestroy(graph));
      }
      EPMOE_CUDA_RETURN(cudaGraphLaunch(graph_exec, stream));
    } else {
      EPMOE_RETURN_IF_ERROR(layer->forward(buf.x.p, buf.idx.p, buf.w.p, buf.y.p, c.tokens[rank], stream, c.path_of(rank, call)));
    }
    if (c.path_of(rank, call) == Path::kAuto) {
      // The choice Path::kAuto made on this rank, from its own T alone.
      const int env_limit = detail::tuning_overrides().auto_fused_max_tokens;  // EPMOE_AUTO_FUSED_MAX
      const int64_t limit = c.auto_fused_max_tokens >= 0 ? c.auto_fused_max_tokens
                            : env_limit >= 0             ? env_limit
                                                         : heuristics::kAutoFusedMaxTokens;
      const Path want = c.tokens[rank] <= limit ? Path::kFused : Path::kPipeline;
      if (layer->last_path() != want && path_failure.empty())
        path_failure = ("rank " + std::to_string(rank) + " " + c.describe() + ": Path::kAuto with T=" +
                    std::to_string(c.tokens[rank]) + " and its threshold at " + std::to_string(limit) + " ran " +
                    path_label(layer->last_path()) + ", expected " + path_label(want) + replay_note(c));
    } else if (!c.graph && layer->last_path() != c.path_of(rank, call) && path_failure.empty()) {
      path_failure = "rank " + std::to_string(rank) + " " + c.describe() + ": last_path() reports " +
                     path_label(layer->last_path()) + " after a " + path_label(c.path_of(rank, call)) + " call";
    }
    const bool check = c.evidence || call == c.calls - 1 || call % c.check_every == 0;
    if (!check) continue;
    EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));
    EPMOE_CUDA_RETURN(cudaMemcpy(y.data(), buf.y.p, y.size() * 2, cudaMemcpyDeviceToHost));
    const std::vector<std::vector<int>> samples = ref::sample_tokens(c.tokens, c.sample_per_rank, call_seed);
    // FP8: the pool rows of every rank's sampled tokens, before the next forward call overwrites
    // the pools (collective; every rank checks the same calls).
    std::vector<PoolRow> rows;
    std::string pool_defect;
    if (p.dtype == ref::DType::kFP8)
      EPMOE_RETURN_IF_ERROR(gather_sampled_rows(*layer, comm, p, inputs, samples, stream, &rows, &pool_defect));
    EPMOE_RETURN_IF_ERROR(check_output(p, c, rank, y, inputs, weights, samples, rows, pool_defect, seed, call,
                                       c.evidence ? &evidence : nullptr));
    if (c.any_not_pipeline() && c.cross_check_paths) {
      const Status agree = check_paths_agree(p, c, rank, *layer, buf, y, stream, call, seed);
      if (c.evidence) {
        ++evidence.paths_checked;
        if (agree.ok()) ++evidence.paths_equal;
        else evidence.fail(agree.message());
      } else {
        EPMOE_RETURN_IF_ERROR(agree);
      }
    }
  }
  EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));
  if (!path_failure.empty()) return fail(path_failure);
  if (c.evidence) {
    evidence.print(c, rank);
    if (evidence.kc_failed)
      return fail("rank " + std::to_string(rank) + " " + c.describe() + " (seed " + std::to_string(seed) + "): " +
                  std::to_string(evidence.kc_failed) + " kernel-consistent or bitwise failures; first: " +
                  evidence.first_failure + replay_note(c));
  }
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
  // A configuration only one rank gets wrong: every rank fails at once (the checks are agreed),
  // naming that rank and its cause, instead of its peers waiting for the timeout.
  bad = make_config(p);
  if (rank == 0) bad.hidden = 100;
  st = MoELayer::create(*comm, bad, &layer);
  if (st.ok() || st.message().find("hidden=100") == std::string::npos ||
      st.message().find("failed on rank 0") == std::string::npos)
    return fail("create with hidden=100 on rank 0 only: expected every rank to name rank 0 and hidden=100, got " +
                st.to_string());

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
