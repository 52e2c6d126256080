// epmoe-bench layer: the whole MoE layer per rank, one process per GPU, for each requested path
// (pipeline, fused) in the same run. Prints median / p10 / p90 time, TFLOP/s, NVLink bytes and
// the ratio to the roofline floor and between the paths, and the GPU memory of the workspace the
// layer runs on (Workspace::nbytes: what epmoe holds, whatever the number of layers on it).
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "bench_util.h"
#include "device/debug/diag_dump.h"
#include "epmoe/comm.h"
#include "epmoe/launcher.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"
#include "host/check.h"
#include "host/dispatch_internal.h"
#include "host/layer_impl.h"
#include "reference/data.h"

namespace epmoe::bench {
namespace {

void cuda_free_ull(unsigned long long* p) { cudaFree(p); }

// ---- Device-side random data (no host round trip for gigabytes of weights) ---------------------
__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {  // [-1, 1)
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}
__global__ void fill_fp8(uint8_t* q, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    q[i] = __nv_cvt_float_to_fp8(448.f * hash_uniform(seed, i), __NV_SATFINITE, __NV_E4M3);
}
__global__ void fill_bf16(__nv_bfloat16* w, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    w[i] = __float2bfloat16(scale * hash_uniform(seed, i));
}
__global__ void fill_f32(float* s, int64_t n, uint64_t seed, float base) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s[i] = base * (1.0f + 0.5f * hash_uniform(seed, i));
}

struct ShapeArgs {
  std::string name;
  int experts_per_rank, hidden, inter, topk;
};

bool shape_by_name(const std::string& n, ShapeArgs* s) {
  if (n == "dsv3") *s = {n, 32, 7168, 2048, 8};
  else if (n == "qwen3") *s = {n, 64, 2048, 768, 8};
  else if (n == "qwen3-32") *s = {n, 32, 2048, 768, 8};  // the peers' script's Qwen3-like shape (32 experts per rank)
  else if (n == "top2") *s = {n, 16, 2048, 2048, 2};
  else if (n == "dsv3full") *s = {n, -256, 7168, 2048, 8};  // 256 experts over the ranks (set below)
  else return false;
  return true;
}

bool routing_by_name(const std::string& n, ref::Routing* r) {
  for (ref::Routing k : ref::kAllRoutings)
    if (n == ref::routing_name(k)) { *r = k; return true; }
  return false;
}

struct Options {
  ShapeArgs shape;
  DType dtype = DType::kFP8;
  ref::Routing routing = ref::Routing::kUniform;
  std::vector<int> tokens;
  std::vector<std::string> paths;
  int iters = 50, warmup = 10, sets = 4;
  // Layers of this shape on the one workspace, each with its own weights, taken in turn call by call
  // as a model's layers are: with enough of them a call finds none of its weights in L2, where
  // repeated calls of one layer find part of them there (docs/BENCHMARKS.md).
  int layers = 1;
  bool graph = true;
  bool per_set = false;  // also each input set's median (decode: the routing sets the busiest rank)
  Output out;  // --json, --quiet
  double peak_tflops = 0, hbm_gbs = 0;  // 0: by GPU (default_hbm_gbs)
  PartialPrecision partials = PartialPrecision::kFloat32;
};

// The HBM bandwidth of the roofline floor when --hbm-gbs is not given: what a device-to-device copy
// reaches (read + write bytes per second) on the current GPU, measured on these machines (H100 SXM
// ~3.0 TB/s, H200 ~4.2 TB/s). Why not the datasheet peak: no kernel reaches it, so a floor at it
// would make every ratio look worse than the hardware allows. Told apart by memory size (H100 SXM
// 80 GB, H200 141 GB).
Status default_hbm_gbs(double* gbs) {
  int dev = 0;
  EPMOE_CUDA_RETURN(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  EPMOE_CUDA_RETURN(cudaGetDeviceProperties(&prop, dev));
  *gbs = prop.totalGlobalMem > (size_t(100) << 30) ? 4200.0 : 3000.0;
  return Status::Ok();
}

// The layer of these options on R ranks, sized for the largest --tokens.
LayerConfig layer_config(const Options& o, int R) {
  int t_max = 1;
  for (int t : o.tokens) t_max = std::max(t_max, t);
  LayerConfig cfg;
  cfg.num_ranks = R;
  cfg.num_experts = o.shape.experts_per_rank * R;
  cfg.hidden = o.shape.hidden;
  cfg.intermediate = o.shape.inter;
  cfg.topk = o.shape.topk;
  cfg.max_tokens_per_rank = t_max;
  cfg.dtype = o.dtype;
  cfg.combine_partials = o.partials;
  return cfg;
}

std::string mib(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f MiB", double(bytes) / (1 << 20));
  return b;
}

// What one rank receives and sends for one routing draw (host-side count, exact).
struct Traffic {
  int64_t rows = 0;            // (token, local expert) pairs this rank computes
  int64_t active_experts = 0;  // local experts with >= 1 row
  int64_t tokens_in = 0;       // (token from another rank) arrivals: dispatch payload rows
  int64_t partials_out = 0;    // rows this rank returns to other ranks in combine
};

Traffic count_traffic(const ref::Problem& p, const std::vector<ref::Routed>& all, const std::vector<int>& T, int me) {
  Traffic tr;
  std::vector<char> active(p.E_loc(), 0);
  for (int src = 0; src < p.R; ++src) {
    for (int t = 0; t < T[src]; ++t) {
      bool here = false;
      for (int k = 0; k < p.K; ++k) {
        const int e = all[src].topk_idx[int64_t(t) * p.K + k];
        if (e < 0 || e / p.E_loc() != me) continue;
        ++tr.rows;
        active[e % p.E_loc()] = 1;
        here = true;
      }
      if (here && src != me) { ++tr.tokens_in; ++tr.partials_out; }
    }
  }
  for (char a : active) tr.active_experts += a;
  return tr;
}

Status run_rank(const RankContext& ctx, const Options& o, std::string* report) {
  // With a bare --json the JSON lines replace the table on stdout (the format this benchmark has
  // always printed); with --json FILE the table prints and the lines go to FILE, rank by rank.
  const bool json_stdout = o.out.json_stdout(), json_file = o.out.json_file();
  const int R = ctx.size, me = ctx.rank;
  std::unique_ptr<Communicator> comm;
  EPMOE_RETURN_IF_ERROR(Communicator::create(ctx.id, me, R, &comm));
  const LayerConfig cfg = layer_config(o, R);
  const int t_max = cfg.max_tokens_per_rank;
  // The layer on a workspace of exactly its size (what MoELayer::create(comm, cfg) makes), kept
  // here so that its GPU memory can be reported: every other layer of this shape would share it.
  std::unique_ptr<Workspace> ws;
  EPMOE_RETURN_IF_ERROR(Workspace::create(*comm, workspace_config_for(cfg), &ws));
  const int64_t ws_bytes = ws->nbytes();
  std::vector<std::unique_ptr<MoELayer>> layers(size_t(o.layers));
  for (auto& l : layers) EPMOE_RETURN_IF_ERROR(MoELayer::create(*ws, cfg, &l));
  MoELayer* const layer = layers[0].get();  // the probe calls and the stage-timing pass
  cudaStream_t stream;
  EPMOE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The comm phases' stamps (comm::CommPhase) of the stage-timing passes below.
  unsigned long long* cstamps = nullptr;
  EPMOE_CUDA_RETURN(cudaMalloc(&cstamps, sizeof(unsigned long long) * comm::kCommPhaseCount));
  std::unique_ptr<unsigned long long, decltype(&cuda_free_ull)> cstamps_owner(cstamps, &cuda_free_ull);

  // Weights, generated on the device (each layer its own).
  const int G = o.shape.experts_per_rank, H = cfg.hidden, I = cfg.intermediate;
  const bool fp8 = o.dtype == DType::kFP8;
  const int64_t n1 = int64_t(G) * 2 * I * H, n2 = int64_t(G) * H * I;
  const int64_t s1 = int64_t(G) * (2 * I / 128) * (H / 128), s2 = int64_t(G) * (H / 128) * (I / 128);
  void *w1 = nullptr, *w2 = nullptr;
  float *ws1 = nullptr, *ws2 = nullptr;
  EPMOE_CUDA_RETURN(cudaMalloc(&w1, n1 * (fp8 ? 1 : 2)));
  EPMOE_CUDA_RETURN(cudaMalloc(&w2, n2 * (fp8 ? 1 : 2)));
  const uint64_t seed = 1234567 + 7919 * me;
  if (fp8) {
    EPMOE_CUDA_RETURN(cudaMalloc(&ws1, s1 * 4));
    EPMOE_CUDA_RETURN(cudaMalloc(&ws2, s2 * 4));
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const uint64_t ls = seed + 104729 * l;
    if (fp8) {
      fill_fp8<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(w1), n1, ls);
      fill_fp8<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(w2), n2, ls + 1);
      fill_f32<<<256, 256, 0, stream>>>(ws1, s1, ls + 2, std::sqrt(3.0f / H) / 448.f);
      fill_f32<<<256, 256, 0, stream>>>(ws2, s2, ls + 3, std::sqrt(3.0f / I) / 448.f);
    } else {
      fill_bf16<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(w1), n1, ls, std::sqrt(3.0f / H));
      fill_bf16<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(w2), n2, ls + 1, std::sqrt(3.0f / I));
    }
    EPMOE_CUDA_RETURN(cudaGetLastError());
    ExpertWeights ew{w1, ws1, w2, ws2, true};
    EPMOE_RETURN_IF_ERROR(layers[l]->load_weights(ew, stream));
  }
  cudaFree(w1);
  cudaFree(w2);
  if (ws1) cudaFree(ws1);
  if (ws2) cudaFree(ws2);

  ref::Problem p;
  p.R = R; p.E = cfg.num_experts; p.H = H; p.I = I; p.K = cfg.topk; p.T_max = t_max;
  p.dtype = fp8 ? ref::DType::kFP8 : ref::DType::kBF16;

  std::ostringstream out, jout;  // this rank's table (or JSON lines on stdout); its --json file lines
  if (!json_stdout) {
    const WorkspaceSizes z = workspace_sizes(ws->config());
    out << "  rank " << me << ": Workspace.nbytes = " << ws_bytes << " (" << mib(ws_bytes)
        << ": symmetric " << mib(z.symmetric) << ", local " << mib(z.local) << ", pool " << mib(z.pool) << ")\n";
  }
  Progress progress("layer", int(o.tokens.size()), o.out.quiet || me != 0);
  const double peak = o.peak_tflops > 0 ? o.peak_tflops : (fp8 ? 1360.0 : 790.0);
  double hbm_gbs = o.hbm_gbs;
  if (hbm_gbs <= 0) EPMOE_RETURN_IF_ERROR(default_hbm_gbs(&hbm_gbs));
  const int64_t elem = fp8 ? 1 : 2;
  for (int T : o.tokens) {
    progress.step("tokens " + std::to_string(T));
    const std::vector<int> T_all(R, T);
    // Input sets, rotated so that repeats do not run from L2.
    const int sets = std::max(1, o.sets);
    std::vector<void*> xs(sets), ys(sets);
    std::vector<int32_t*> idxs(sets);
    std::vector<float*> wts(sets);
    std::vector<Traffic> traffic(sets);
    for (int s = 0; s < sets; ++s) {
      EPMOE_CUDA_RETURN(cudaMalloc(&xs[s], std::max<int64_t>(1, int64_t(T) * H) * 2));
      EPMOE_CUDA_RETURN(cudaMalloc(&ys[s], std::max<int64_t>(1, int64_t(T) * H) * 2));
      EPMOE_CUDA_RETURN(cudaMalloc(&idxs[s], std::max(1, T * cfg.topk) * 4));
      EPMOE_CUDA_RETURN(cudaMalloc(&wts[s], std::max(1, T * cfg.topk) * 4));
      fill_bf16<<<256, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(xs[s]), int64_t(T) * H, seed + 100 + s, 1.7f);
      std::vector<ref::Routed> all;
      for (int r = 0; r < R; ++r) all.push_back(ref::make_routing(p, o.routing, r, T, ref::mix_seed(99, T, s)));
      if (T > 0) {
        EPMOE_CUDA_RETURN(cudaMemcpy(idxs[s], all[me].topk_idx.data(), all[me].topk_idx.size() * 4, cudaMemcpyHostToDevice));
        EPMOE_CUDA_RETURN(cudaMemcpy(wts[s], all[me].topk_w.data(), all[me].topk_w.size() * 4, cudaMemcpyHostToDevice));
      }
      traffic[s] = count_traffic(p, all, T_all, me);
    }
    EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    Traffic avg;
    for (auto& t : traffic) {
      avg.rows += t.rows; avg.active_experts += t.active_experts;
      avg.tokens_in += t.tokens_in; avg.partials_out += t.partials_out;
    }
    const double rows = double(avg.rows) / sets, active = double(avg.active_experts) / sets;
    const double flops = 6.0 * H * I * rows;
    // Dispatch: one payload row (+ scales) per token and remote destination; combine: one fp32
    // partial row per token and remote expert rank (docs/COMM.md).
    const double row_bytes = double(H) * elem + (fp8 ? H / 128 * 4 : 0);
    const double nvlink = (double(avg.tokens_in) * row_bytes + double(avg.partials_out) * H * (o.partials == PartialPrecision::kFloat32 ? 4 : 2)) / sets;
    const double weight_bytes = active * 3.0 * H * I * elem;
    const double act_bytes = rows * (2.0 * H * elem + 2.0 * I * elem + 4.0 * H) + 4.0 * T * H;
    const double floor_us = std::max(flops / (peak * 1e12), (weight_bytes + act_bytes) / (hbm_gbs * 1e9)) * 1e6;

    // Why interleaved: the paths are timed call by call in turn (A, B, A, B, ...), not one after the
    // other. Measured: under sustained load the GPUs' clocks drop (power cap, 1.98 -> ~1.7 GHz), and
    // whichever path was timed second at 4096 tokens showed a slow tail (p90 +25%) and a median
    // 3-15% worse, whichever path it was.
    struct PathRun {
      std::string name;
      Path path;
      bool supported = true;
      std::string why;
      std::vector<cudaGraphExec_t> graphs;
      std::vector<double> us;
    };
    std::vector<PathRun> runs;
    for (const std::string& path_name : o.paths) {
      PathRun pr;
      pr.name = path_name;
      pr.path = path_name == "fused" ? Path::kFused : path_name == "auto" ? Path::kAuto : Path::kPipeline;
      Status probe = layer->forward(xs[0], idxs[0], wts[0], ys[0], T, stream, pr.path);
      // Path::kAuto is reported with the path it took on this rank: "auto:fused" or "auto:pipeline".
      if (probe.ok() && pr.path == Path::kAuto)
        pr.name = std::string("auto:") + (layer->last_path() == Path::kFused ? "fused" : "pipeline");
      if (probe.code() == StatusCode::kUnsupported) {
        pr.supported = false;
        pr.why = probe.message();
        runs.push_back(std::move(pr));
        continue;
      }
      EPMOE_RETURN_IF_ERROR(probe);
      // Every other layer once outside a capture too, as layer 0 just ran.
      for (size_t l = 1; l < layers.size(); ++l)
        EPMOE_RETURN_IF_ERROR(layers[l]->forward(xs[0], idxs[0], wts[0], ys[0], T, stream, pr.path));
      // One graph per (input set, layer): each call's set and layer, see `launch` below.
      pr.graphs.assign(size_t(sets) * layers.size(), nullptr);
      if (o.graph) {
        for (int s = 0; s < sets; ++s)
          for (size_t l = 0; l < layers.size(); ++l) {
            cudaGraph_t g;
            EPMOE_CUDA_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            Status st = layers[l]->forward(xs[s], idxs[s], wts[s], ys[s], T, stream, pr.path);
            cudaError_t e = cudaStreamEndCapture(stream, &g);
            EPMOE_RETURN_IF_ERROR(st);
            EPMOE_CUDA_RETURN(e);
            EPMOE_CUDA_RETURN(cudaGraphInstantiate(&pr.graphs[size_t(s) * layers.size() + l], g, 0));
            cudaGraphDestroy(g);
          }
      }
      runs.push_back(std::move(pr));
    }
    const int n_paths = int(runs.size());
    // Call `call` (= it x paths + path): input set it % sets (every path the same inputs), layer
    // call % layers. Why the layer by call and not by `it`: the paths of one `it` run back to back,
    // and on one layer the second would find the first one's weights in L2.
    auto launch = [&](const PathRun& pr, int it, int call) -> Status {
      const int s = it % sets;
      const size_t l = size_t(call) % layers.size();
      if (o.graph) {
        EPMOE_CUDA_RETURN(cudaGraphLaunch(pr.graphs[size_t(s) * layers.size() + l], stream));
        return Status::Ok();
      }
      return layers[l]->forward(xs[s], idxs[s], wts[s], ys[s], T, stream, pr.path);
    };
    for (int it = 0; it < o.warmup; ++it)
      for (int k = 0; k < n_paths; ++k)
        if (runs[k].supported) EPMOE_RETURN_IF_ERROR(launch(runs[k], it, it * n_paths + k));
    std::vector<cudaEvent_t> ev(size_t(2) * o.iters * n_paths);
    for (auto& e : ev) EPMOE_CUDA_RETURN(cudaEventCreate(&e));
    EPMOE_RETURN_IF_ERROR(comm->barrier(stream));
    for (int it = 0; it < o.iters; ++it)
      for (int k = 0; k < n_paths; ++k) {
        if (!runs[k].supported) continue;
        const size_t i = (size_t(it) * n_paths + k) * 2;
        EPMOE_CUDA_RETURN(cudaEventRecord(ev[i], stream));
        EPMOE_RETURN_IF_ERROR(launch(runs[k], it, it * n_paths + k));
        EPMOE_CUDA_RETURN(cudaEventRecord(ev[i + 1], stream));
      }
    EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    EPMOE_RETURN_IF_ERROR(layer->check_device_error(stream));  // the workspace's record, one for all layers
    for (int k = 0; k < n_paths; ++k) {
      if (!runs[k].supported) continue;
      runs[k].us.resize(o.iters);
      for (int it = 0; it < o.iters; ++it) {
        const size_t i = (size_t(it) * n_paths + k) * 2;
        float ms = 0;
        EPMOE_CUDA_RETURN(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        runs[k].us[it] = ms * 1e3;
      }
    }
    for (auto& e : ev) cudaEventDestroy(e);
    for (auto& pr : runs)
      for (auto g : pr.graphs) if (g) cudaGraphExecDestroy(g);

    std::vector<double> path_median;
    for (const PathRun& pr : runs) {
      const std::string& path_name = pr.name;
      const Path path = pr.path;
      if (!pr.supported) {
        out << "  rank " << me << "  " << path_name << "  T=" << T << "  n/a: " << pr.why << "\n";
        path_median.push_back(0);
        continue;
      }
      const Stats st = stats_of(pr.us);
      path_median.push_back(st.median);

      // Per-stage split, from a separate timed pass without graphs: stream events between the
      // pipeline's kernels, the megakernel's own phase stamps for the fused path (there L1 and L2
      // end at their last tile on any SM, and combine includes the GEMM -> combine barrier).
      std::string stages;
      {
        // The layers in turn, one per call.
        std::vector<detail::LayerInternals*> ins;
        for (auto& l : layers) ins.push_back(detail::internals(*l));
        // Also the comm kernels' (or the fused kernel's comm phases') own stamps (comm::CommPhase):
        // where dispatch and combine spend their time inside the stage, for both paths alike.
        std::vector<std::vector<double>> per(4), comm_ph(6);
        for (detail::LayerInternals* in : ins) {
          detail::DispatchAccess::set_phase_stamps(in->dispatcher(), cstamps);
          in->set_stage_timing(true);
        }
        for (int it = 0; it < std::min(o.iters, 20); ++it) {
          const size_t l = size_t(it) % layers.size();
          EPMOE_CUDA_RETURN(cudaMemsetAsync(cstamps, 0, sizeof(unsigned long long) * comm::kCommPhaseCount, stream));
          EPMOE_RETURN_IF_ERROR(
              layers[l]->forward(xs[it % sets], idxs[it % sets], wts[it % sets], ys[it % sets], T, stream, path));
          float ms[4];
          EPMOE_RETURN_IF_ERROR(ins[l]->stage_times_ms(ms));
          for (int k = 0; k < 4; ++k) per[k].push_back(ms[k] * 1e3);
          unsigned long long ts[comm::kCommPhaseCount];
          EPMOE_CUDA_RETURN(cudaMemcpy(ts, cstamps, sizeof(ts), cudaMemcpyDeviceToHost));
          double span[6];
          comm_phase_spans_us(ts, comm::kDispatchStart, span);
          comm_phase_spans_us(ts, comm::kCombineStart, span + 3);
          for (int k = 0; k < 6; ++k) comm_ph[k].push_back(span[k]);
        }
        for (detail::LayerInternals* in : ins) {
          in->set_stage_timing(false);
          detail::DispatchAccess::set_phase_stamps(in->dispatcher(), nullptr);
        }
        char buf[320];
        std::snprintf(buf, sizeof(buf),
                      "dispatch %.0f / L1 %.0f / L2 %.0f / combine %.0f us  [dispatch staged %.1f / counts %.1f / "
                      "pulled %.1f; combine partials %.1f / ready %.1f / reduced %.1f us]",
                      stats_of(per[0]).median, stats_of(per[1]).median, stats_of(per[2]).median,
                      stats_of(per[3]).median, stats_of(comm_ph[0]).median, stats_of(comm_ph[1]).median,
                      stats_of(comm_ph[2]).median, stats_of(comm_ph[3]).median, stats_of(comm_ph[4]).median,
                      stats_of(comm_ph[5]).median);
        stages = buf;
      }
      if (json_stdout || json_file) {
        // The fields, names and order of the hand-written lines this replaced; numbers rounded to
        // the digits those printed.
        Json j;
        j["rank"] = me;
        j["path"] = path_name;
        j["shape"] = o.shape.name;
        j["dtype"] = fp8 ? "fp8" : "bf16";
        j["tokens"] = T;
        j["median_us"] = json_number(st.median, 2);
        j["p10_us"] = json_number(st.p10, 2);
        j["p90_us"] = json_number(st.p90, 2);
        j["tflops"] = json_number(flops / (st.median * 1e-6) / 1e12, 1);
        j["rows"] = json_number(rows, 0);
        j["nvlink_bytes"] = json_number(nvlink, 0);
        j["floor_us"] = json_number(floor_us, 2);
        j["ratio_to_floor"] = json_number(st.median / floor_us, 3);
        j["graph"] = o.graph;
        j["layers"] = o.layers;
        j["workspace_bytes"] = ws_bytes;
        (json_stdout ? out : jout) << json_line(j);
      }
      if (!json_stdout) {
        char line[768];
        std::snprintf(line, sizeof(line),
                      "  %4d  %-8s %6d %10.1f %9.1f %9.1f %8.1f %10.0f %9.2f %8.1f %7.2fx  %s\n", me,
                      path_name.c_str(), T, st.median, st.p10, st.p90, flops / (st.median * 1e-6) / 1e12, rows,
                      nvlink / 1e6, floor_us, st.median / floor_us, stages.c_str());
        out << line;
      }
    }
    if (!json_stdout && path_median.size() == 2 && path_median[0] > 0 && path_median[1] > 0)
      out << "        " << o.paths[1] << " / " << o.paths[0] << " time ratio at T=" << T << ": "
          << path_median[1] / path_median[0] << "\n";
    if (!json_stdout && o.per_set) {
      for (int s = 0; s < sets; ++s) {
        char line[512];
        int n = std::snprintf(line, sizeof(line), "        set %d: rank %d rows %lld, active experts %lld;", s, me,
                              static_cast<long long>(traffic[s].rows),
                              static_cast<long long>(traffic[s].active_experts));
        for (const PathRun& pr : runs) {
          if (!pr.supported || n >= int(sizeof(line))) continue;
          std::vector<double> v;
          for (int it = s; it < int(pr.us.size()); it += sets) v.push_back(pr.us[it]);
          if (!v.empty())
            n += std::snprintf(line + n, sizeof(line) - size_t(n), " %s %.1f us (%zu calls)", pr.name.c_str(),
                               stats_of(v).median, v.size());
        }
        out << line << "\n";
      }
    }
    for (int s = 0; s < sets; ++s) {
      cudaFree(xs[s]); cudaFree(ys[s]); cudaFree(idxs[s]); cudaFree(wts[s]);
    }
  }

  // Print in rank order.
  for (int r = 0; r < R; ++r) {
    EPMOE_RETURN_IF_ERROR(comm->barrier(stream));
    if (r == me) {
      std::fputs(out.str().c_str(), stdout);
      std::fflush(stdout);
      if (json_file && !append_json_file(o.out, jout.str(), "layer"))
        return Status(StatusCode::kInvalidArgument, "cannot write the --json file");
    }
  }
  EPMOE_RETURN_IF_ERROR(comm->barrier(stream));
#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
  // A trace build (device/debug/diag_trace.cuh): the last call of each kernel, per block, rank by rank.
  for (int r = 0; r < R; ++r) {
    EPMOE_RETURN_IF_ERROR(comm->barrier(stream));
    if (r == me) {
      std::printf("[trace] rank %d\n", me);
      diag::dump_dispatch_trace(stdout);
      diag::dump_combine_trace(stdout);
      diag::dump_fused_trace(stdout);
      diag::dump_gemm_tiles(stdout);
      diag::dump_fused_tiles(stdout);
      std::fflush(stdout);
    }
  }
#endif
  (void)report;
  return Status::Ok();
}

// The flags as given; checked by run_layer (before it looks for GPUs) with the messages below.
struct LayerFlags {
  std::string shape = "dsv3", dtype = "fp8", partials = "fp32", routing = "uniform", path = "pipeline,fused";
  std::vector<int> tokens = {1, 128, 1024, 4096};
  int ranks = 0;
  bool ranks_given = false;  // else one rank per visible GPU
  int iters = 50, warmup = 10, sets = 4, graph = 1, layers = 1;
  double peak_tflops = 0, hbm_gbs = 0, timeout = 540;
  bool sizes = false;  // print the workspace's sizes and exit (no GPU)
  bool per_set = false;
};

// The GPU memory a workspace for this shape holds per rank (host arithmetic: the sizes that
// Workspace::create allocates), as a line of text or (--json) a JSON line.
int print_sizes(const Options& o, int ranks, bool header_only) {
  const LayerConfig cfg = layer_config(o, ranks);
  const WorkspaceConfig wc = workspace_config_for(cfg);
  const Status st = validate(wc);
  if (!st.ok()) {
    std::fprintf(stderr, "epmoe-bench layer: %s\n", st.message().c_str());
    return 2;
  }
  const WorkspaceSizes z = workspace_sizes(wc);
  if (!header_only && (o.out.json_stdout() || o.out.json_file())) {
    Json j;
    j["shape"] = o.shape.name;
    j["dtype"] = o.dtype == DType::kFP8 ? "fp8" : "bf16";
    j["ranks"] = ranks;
    j["max_tokens_per_rank"] = cfg.max_tokens_per_rank;
    j["workspace_bytes"] = z.total();
    j["symmetric_bytes"] = z.symmetric;
    j["local_bytes"] = z.local;
    j["pool_bytes"] = z.pool;
    if (o.out.json_stdout()) std::fputs(json_line(j).c_str(), stdout);
    if (o.out.json_file() && !append_json_file(o.out, json_line(j), "layer")) return 2;
  }
  if (!o.out.json_stdout())
    std::printf("  workspace per rank (T_max %d): %lld bytes (%s: symmetric %s, local %s, pool %s); one workspace "
                "serves any number of layers of this shape\n",
                cfg.max_tokens_per_rank, static_cast<long long>(z.total()), mib(z.total()).c_str(),
                mib(z.symmetric).c_str(), mib(z.local).c_str(), mib(z.pool).c_str());
  return 0;
}

int run_layer(const LayerFlags& f, const Output& output) {
  Options o;
  o.out = output;
  if (!shape_by_name(f.shape, &o.shape)) {
    std::fprintf(stderr, "epmoe-bench layer: --shape must be dsv3, dsv3full, qwen3, qwen3-32 or top2\n");
    return 2;
  }
  const std::string& dt = f.dtype;
  if (dt != "fp8" && dt != "bf16") {
    std::fprintf(stderr, "epmoe-bench layer: --dtype must be fp8 or bf16\n");
    return 2;
  }
  o.dtype = dt == "fp8" ? DType::kFP8 : DType::kBF16;
  const std::string& partials = f.partials;
  if (partials != "fp32" && partials != "bf16") {
    std::fprintf(stderr, "epmoe-bench layer: --partials must be fp32 or bf16\n");
    return 2;
  }
  o.partials = partials == "fp32" ? PartialPrecision::kFloat32 : PartialPrecision::kBFloat16;
  if (!routing_by_name(f.routing, &o.routing)) {
    std::fprintf(stderr, "epmoe-bench layer: unknown --routing (uniform, zipf, one_expert, one_rank, masked, duplicate_ranks)\n");
    return 2;
  }
  o.tokens = f.tokens;
  o.paths = split_list(f.path);
  if (o.paths.empty()) {
    std::fprintf(stderr, "epmoe-bench layer: --path takes pipeline, fused and/or auto\n");
    return 2;
  }
  for (auto& pth : o.paths)
    if (pth != "pipeline" && pth != "fused" && pth != "auto") {
      std::fprintf(stderr, "epmoe-bench layer: --path takes pipeline, fused and/or auto\n");
      return 2;
    }
  o.iters = f.iters;
  o.warmup = f.warmup;
  o.sets = f.sets;
  o.layers = f.layers;
  o.per_set = f.per_set;
  o.graph = f.graph != 0;
  o.peak_tflops = f.peak_tflops;
  o.hbm_gbs = f.hbm_gbs;
  if (o.hbm_gbs < 0 || o.peak_tflops < 0) {
    std::fprintf(stderr, "epmoe-bench layer: --hbm-gbs and --peak-tflops must be positive (or left out)\n");
    return 2;
  }
  if (o.iters < 1 || o.warmup < 0 || o.sets < 1) {
    std::fprintf(stderr, "epmoe-bench layer: --iters and --sets must be >= 1, --warmup >= 0\n");
    return 2;
  }
  if (o.layers < 1 || o.layers > 64) {
    std::fprintf(stderr, "epmoe-bench layer: --layers must be 1 to 64\n");
    return 2;
  }

  const int gpus = probe_gpu_count();
  // Why at least 1: without GPUs the default would be 0 ranks, reported as a bad flag; the check
  // below says what is missing instead.
  const int ranks = f.ranks_given ? f.ranks : std::max(gpus, 1);
  if (ranks < 1) {
    std::fprintf(stderr, "epmoe-bench layer: bad --ranks\n");
    return 2;
  }
  if (o.shape.experts_per_rank < 0) {  // a total expert count (dsv3full): split it over the ranks
    const int total = -o.shape.experts_per_rank;
    if (total % ranks != 0) {
      std::fprintf(stderr, "epmoe-bench layer: --shape %s has %d experts, not divisible by %d ranks\n",
                   o.shape.name.c_str(), total, ranks);
      return 2;
    }
    o.shape.experts_per_rank = total / ranks;
  }
  if (f.sizes) {
    if (!o.out.json_stdout())
      std::printf("epmoe-bench layer: shape %s (E/rank %d, H %d, I %d, K %d), %s, %d ranks\n", o.shape.name.c_str(),
                  o.shape.experts_per_rank, o.shape.hidden, o.shape.inter, o.shape.topk, dt.c_str(), ranks);
    return print_sizes(o, ranks, false);
  }
  if (gpus < ranks || gpus == 0) {
    std::printf("epmoe-bench layer: needs %d GPU(s), %d visible. Nothing to measure here.\n", std::max(ranks, 1), gpus);
    return gpus == 0 ? 0 : 1;
  }
  if (!o.out.json_stdout()) {
    std::printf("epmoe-bench layer: shape %s (E/rank %d, H %d, I %d, K %d), %s, routing %s, %s combine partials, "
                "%d ranks, %s, iters %d%s\n",
                o.shape.name.c_str(), o.shape.experts_per_rank, o.shape.hidden, o.shape.inter, o.shape.topk,
                dt.c_str(), ref::routing_name(o.routing), partials.c_str(), ranks,
                o.graph ? "CUDA graphs" : "direct launches", o.iters,
                o.layers > 1 ? (", " + std::to_string(o.layers) + " layers called in turn").c_str() : "");
    if (const int rc = print_sizes(o, ranks, true); rc != 0) return rc;
    char hbm[64];
    if (o.hbm_gbs > 0) std::snprintf(hbm, sizeof hbm, "%.0f GB/s", o.hbm_gbs);
    else std::snprintf(hbm, sizeof hbm, "%s", "GB/s of the GPU (H100 3000, H200 4200)");
    std::printf("  floor = max(FLOPs / %.0f TFLOP/s, HBM bytes / %s); NVLink MB = payload into+out of the rank\n",
                o.peak_tflops > 0 ? o.peak_tflops : (o.dtype == DType::kFP8 ? 1360.0 : 790.0), hbm);
    std::printf("  rank  path      tokens  median_us    p10_us    p90_us  TFLOP/s       rows NVLink_MB  floor_us  /floor  stages\n");
  }
  LaunchOptions lo;
  lo.num_ranks = ranks;
  lo.timeout_seconds = f.timeout;
  const LaunchResult r = launch_ranks(lo, [&](const RankContext& ctx) {
    std::string report;
    return run_rank(ctx, o, &report);
  });
  if (!r.ok) {
    std::fprintf(stderr, "epmoe-bench layer: FAILED: %s\n", r.message.c_str());
    return 1;
  }
  return 0;
}

// The flags; parsed in the parent before it looks for GPUs.
Run setup_layer(CLI::App& app) {
  auto f = std::make_shared<LayerFlags>();
  CLI::Option* ranks = app.add_option("--ranks", f->ranks, "processes, one GPU each [default: every visible GPU]");
  app.add_option("--shape", f->shape, "dsv3 (32 experts/rank, H 7168, I 2048, K 8), dsv3full (256 experts over "
                                      "the ranks), qwen3 (64, 2048, 768, 8), qwen3-32 (32, 2048, 768, 8) or top2 (16, 2048, 2048, 2)")
      ->capture_default_str();
  app.add_option("--dtype", f->dtype, "fp8 or bf16")->capture_default_str();
  add_int_list(app, "--tokens", &f->tokens, "tokens per rank, one case each (0 allowed)", 0);
  app.add_option("--routing", f->routing, "uniform, zipf, one_expert, one_rank, masked or duplicate_ranks")
      ->capture_default_str();
  app.add_option("--path", f->path, "pipeline, fused and/or auto (the path chosen per rank and T), timed call by call in turn")
      ->type_name("P,P")
      ->capture_default_str();
  app.add_option("--partials", f->partials, "combine partials: fp32 or bf16")->capture_default_str();
  app.add_option("--iters", f->iters, "timed calls per path")->capture_default_str();
  app.add_option("--warmup", f->warmup, "untimed calls per path before them")->capture_default_str();
  app.add_option("--sets", f->sets, "input sets rotated so that repeats do not run from L2")->capture_default_str();
  app.add_option("--layers", f->layers,
                 "layers of this shape on one workspace, each with its own weights (GPU memory: the DSV3 slice "
                 "~1.4 GB per layer and rank in FP8), called in turn (a model's layers: with enough of them no "
                 "call finds its weights in L2; 1 to 64)")
      ->capture_default_str();
  app.add_option("--graph", f->graph, "1: CUDA graphs, 0: direct launches (a bare --graph is 1)")
      ->expected(0, 1)
      ->default_str("1");
  app.add_option("--peak-tflops", f->peak_tflops, "roofline peak [default: 1360 fp8, 790 bf16]");
  app.add_option("--hbm-gbs", f->hbm_gbs,
                 "roofline HBM GB/s [default: by GPU, the device-to-device copy bandwidth measured on it: "
                 "H100 3000, H200 4200]");
  app.add_option("--timeout", f->timeout, "seconds before the ranks are killed")->capture_default_str();
  app.add_flag("--per-set", f->per_set,
               "also print each input set's median per path, with this rank's rows and active experts (in small "
               "calls the routing of a set decides the busiest rank, and so the call's time)");
  app.add_flag("--sizes", f->sizes,
               "print the GPU memory of the workspace for this shape, --ranks and the largest --tokens, and exit "
               "(host arithmetic, no GPU)");
  app.footer("Prints per rank, path and token count: median / p10 / p90 us, TFLOP/s, rows, NVLink MB, the roofline "
             "floor and the per-stage split, and the workspace's GPU memory (Workspace.nbytes; JSON: "
             "workspace_bytes). Without a GPU it says so and exits 0.");
  return [f, ranks](const Output& out) {
    f->ranks_given = ranks->count() > 0;
    return run_layer(*f, out);
  };
}

}  // namespace

EPMOE_BENCH_COMMAND("layer", "the whole MoE layer per rank, pipeline and fused paths", setup_layer);

}  // namespace epmoe::bench
