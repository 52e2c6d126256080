// epmoe-bench comm: standalone dispatch / combine time and NVLink GB/s per GPU, next to NCCL
// all-to-all(v) (grouped ncclSend/ncclRecv) of the same payload, in the same run.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "bench_util.h"
#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "epmoe/launcher.h"
#include "host/dispatch_internal.h"
#include "reference/data.h"

namespace epmoe::bench {
namespace {

struct Options {
  int ranks = 2, hidden = 7168, topk = 8, experts = 64, iters = 30, warmup = 5;
  std::vector<int> tokens = {128, 1024, 4096, 8192};
  ref::Routing routing = ref::Routing::kUniform;
};

#define BENCH_CUDA(call)                                                                                  \
  do {                                                                                                   \
    cudaError_t _e = (call);                                                                             \
    if (_e != cudaSuccess) return Status(StatusCode::kCudaError, std::string(#call) + ": " + cudaGetErrorString(_e)); \
  } while (0)
#define BENCH_NCCL(call)                                                                                  \
  do {                                                                                                   \
    ncclResult_t _r = (call);                                                                            \
    if (_r != ncclSuccess) return Status(StatusCode::kNcclError, std::string(#call) + ": " + ncclGetErrorString(_r)); \
  } while (0)
#define BENCH_OK(expr)             \
  do {                             \
    Status _s = (expr);            \
    if (!_s.ok()) return _s;       \
  } while (0)

// Bytes that cross NVLink into (dispatch) / out of (combine) rank `me`, from every rank's routing.
struct Traffic {
  int64_t disp_meta = 0;   // routing metadata pulled (K SlotMeta per remote token)
  int64_t disp_idle = 0;   // remote tokens with no slot here (their speculative read is wasted)
  int64_t comb_rows = 0;                    // (token, this expert rank) pairs sent back
  std::vector<int64_t> send_rows;           // per peer: tokens of mine that go to that peer
  std::vector<int64_t> recv_rows;           // per peer: tokens of theirs that come to me
};

Traffic count_traffic(const std::vector<ref::Routed>& all, int me, int T, int K, int E_loc) {
  Traffic tr;
  const int R = int(all.size());
  tr.send_rows.assign(R, 0);
  tr.recv_rows.assign(R, 0);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < T; ++t) {
      unsigned ranks = 0;
      for (int k = 0; k < K; ++k) {
        const int e = all[s].topk_idx[size_t(t) * K + k];
        if (e >= 0) ranks |= 1u << (e / E_loc);
      }
      if (s == me) {
        for (int d = 0; d < R; ++d)
          if (d != me && (ranks >> d & 1)) tr.send_rows[d]++;
      } else {
        tr.disp_meta += int64_t(K) * 16;
        if (ranks >> me & 1) {
          tr.recv_rows[s]++;
          tr.comb_rows++;
        } else {
          tr.disp_idle++;
        }
      }
    }
  return tr;
}

template <class F>
Status time_batch(cudaStream_t stream, int iters, F&& body, double* us_per_iter) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  BENCH_CUDA(cudaEventRecord(a, stream));
  for (int i = 0; i < iters; ++i) BENCH_OK(body());
  BENCH_CUDA(cudaEventRecord(b, stream));
  BENCH_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
  *us_per_iter = ms * 1000.0 / iters;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Status::Ok();
}

// Grouped send/recv of `bytes_to[p]` / `bytes_from[p]` with every peer p != me.
Status nccl_alltoallv(ncclComm_t comm, int me, int R, const std::vector<int64_t>& bytes_to,
                      const std::vector<int64_t>& bytes_from, char* sbuf, char* rbuf, int64_t slot, cudaStream_t stream) {
  BENCH_NCCL(ncclGroupStart());
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    if (bytes_to[p]) BENCH_NCCL(ncclSend(sbuf + p * slot, size_t(bytes_to[p]), ncclUint8, p, comm, stream));
    if (bytes_from[p]) BENCH_NCCL(ncclRecv(rbuf + p * slot, size_t(bytes_from[p]), ncclUint8, p, comm, stream));
  }
  BENCH_NCCL(ncclGroupEnd());
  return Status::Ok();
}

Status run_rank(const RankContext& ctx, const Options& o, const Output& out) {
  std::unique_ptr<Communicator> comm;
  BENCH_OK(Communicator::create(ctx.id, ctx.rank, ctx.size, &comm));
  const int R = ctx.size, me = ctx.rank, H = o.hidden, K = o.topk, E = o.experts, E_loc = E / R, G = H / 128;
  const int T_max = *std::max_element(o.tokens.begin(), o.tokens.end());
  DispatchConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens_per_rank = T_max;
  cfg.row_align = 128;
  // The target pairing (FP8 dispatch, bf16 partials) and the most exact one (bf16, fp32 partials).
  cfg.dtype = DType::kFP8;
  cfg.combine_partials = PartialPrecision::kBFloat16;
  std::unique_ptr<DispatchHandle> fp8h, bf16h;
  BENCH_OK(DispatchHandle::create(*comm, cfg, &fp8h));
  cfg.dtype = DType::kBF16;
  cfg.combine_partials = PartialPrecision::kFloat32;
  BENCH_OK(DispatchHandle::create(*comm, cfg, &bf16h));

  void *x, *y, *sbuf, *rbuf;
  int* idx;
  float* w;
  BENCH_CUDA(cudaMalloc(&x, size_t(T_max) * H * 2));
  BENCH_CUDA(cudaMalloc(&y, size_t(T_max) * H * 2));
  BENCH_CUDA(cudaMalloc(&idx, size_t(T_max) * K * 4));
  BENCH_CUDA(cudaMalloc(&w, size_t(T_max) * K * 4));
  const int64_t slot = int64_t(T_max) * H * 4;  // largest per-peer message (fp32 partial rows)
  BENCH_CUDA(cudaMalloc(&sbuf, size_t(slot) * R));
  BENCH_CUDA(cudaMalloc(&rbuf, size_t(slot) * R));
  BENCH_CUDA(cudaMemset(sbuf, 0, size_t(slot) * R));
  // o_pool of both handles: finite bf16 values (0x3F3F is about 0.75).
  for (DispatchHandle* h : {fp8h.get(), bf16h.get()})
    BENCH_CUDA(cudaMemset(h->pool().o_pool, 0x3F, size_t(h->pool().max_rows) * H * 2));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The kernels' phase stamps (comm::CommPhase), read in a separate pass after the timing.
  unsigned long long* stamps = nullptr;
  BENCH_CUDA(cudaMalloc(&stamps, sizeof(unsigned long long) * comm::kCommPhaseCount));

  ref::Problem prob;
  prob.R = R;
  prob.E = E;
  prob.H = H;
  prob.K = K;
  prob.T_max = T_max;
  // Rank 0 prints the table (or, with a bare --json, JSON lines) and writes the --json file.
  const bool table = me == 0 && !out.json_stdout();
  Progress progress("comm", int(o.tokens.size()), out.quiet || me != 0);
  if (table) {
    std::printf("\nepmoe-bench comm: R=%d H=%d K=%d E=%d routing=%s, %d iters after %d warm-up, rank 0's view\n", R, H,
                K, E, ref::routing_name(o.routing), o.iters, o.warmup);
    std::printf("NVLink bytes = token payload crossing into (dispatch) / out of (combine) this GPU; GB/s = bytes/time\n");
    std::printf("phases (rank 0, median of 10 separate calls): dispatch = first block in -> all staged -> all counts "
                "received -> last warp pulled; combine = first block in -> last partial pushed -> all partials "
                "received -> last warp reduced\n");
    std::printf("%6s | %-22s | %9s | %10s | %8s | %9s | %8s | %6s | %s\n", "T/rank", "op", "time us", "NVLink MB", "GB/s",
                "nccl us", "nccl GB/s", "ratio", "phases");
  }
  for (int T : o.tokens) {
    progress.step("tokens " + std::to_string(T));
    std::string json;  // this case's JSON lines
    std::vector<ref::Routed> all(R);
    for (int r = 0; r < R; ++r) all[r] = ref::make_routing(prob, o.routing, r, T, ref::mix_seed(42, T));
    std::vector<uint16_t> hx = ref::random_x(T, H, ref::mix_seed(7, T, me));
    BENCH_CUDA(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(idx, all[me].topk_idx.data(), size_t(T) * K * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(w, all[me].topk_w.data(), size_t(T) * K * 4, cudaMemcpyHostToDevice));
    const Traffic tr = count_traffic(all, me, T, K, E_loc);

    struct Row {
      const char* name;
      DispatchHandle* h;
      int kind;           // 0 dispatch, 1 combine, 2 dispatch+combine
      int64_t row_bytes;  // bytes per crossing token row
    };
    const Row rows[] = {
        {"dispatch fp8", fp8h.get(), 0, H + 4 * G},
        {"dispatch bf16", bf16h.get(), 0, 2 * H},
        {"combine bf16 partials", fp8h.get(), 1, 2 * H},
        {"combine fp32 partials", bf16h.get(), 1, 4 * H},
        {"fp8 disp + bf16p comb", fp8h.get(), 2, 0},
        {"bf16 disp + fp32p comb", bf16h.get(), 2, 0},
    };
    for (const Row& row : rows) {
      DispatchHandle* h = row.h;
      BENCH_OK(h->dispatch(x, idx, w, T, stream));
      auto op = [&]() -> Status {
        if (row.kind != 1) BENCH_OK(h->dispatch(x, idx, w, T, stream));
        if (row.kind != 0) BENCH_OK(h->combine(y, T, stream));
        return Status::Ok();
      };
      for (int i = 0; i < o.warmup; ++i) BENCH_OK(op());
      BENCH_OK(h->check_errors(stream));
      BENCH_OK(comm->barrier(stream));
      double us = 0;
      BENCH_OK(time_batch(stream, o.iters, op, &us));
      BENCH_OK(h->check_errors(stream));

      // The same payload through NCCL: token rows to / from every peer.
      double nccl_us = 0;
      int64_t bytes = 0;
      if (row.kind != 2) {
        std::vector<int64_t> to(R), from(R);
        for (int p = 0; p < R; ++p) {
          // dispatch: my tokens go out to p, theirs come in; combine: the reverse direction.
          to[p] = (row.kind == 0 ? tr.send_rows[p] : tr.recv_rows[p]) * row.row_bytes;
          from[p] = (row.kind == 0 ? tr.recv_rows[p] : tr.send_rows[p]) * row.row_bytes;
          bytes += row.kind == 0 ? from[p] : to[p];
        }
        auto nop = [&]() { return nccl_alltoallv(comm->nccl(), me, R, to, from, (char*)sbuf, (char*)rbuf, slot, stream); };
        for (int i = 0; i < o.warmup; ++i) BENCH_OK(nop());
        BENCH_OK(comm->barrier(stream));
        BENCH_OK(time_batch(stream, o.iters, nop, &nccl_us));
      }
      // Where the time goes: median over 10 more calls of the kernel's phase stamps (their own
      // pass: the stamps' atomics stay out of the timing above).
      std::string phases;
      double phase_us[3] = {0, 0, 0};
      if (row.kind != 2) {
        std::vector<double> ph[3];
        detail::DispatchAccess::set_phase_stamps(*h, stamps);
        for (int i = 0; i < 10; ++i) {
          unsigned long long ts[comm::kCommPhaseCount];
          BENCH_CUDA(cudaMemsetAsync(stamps, 0, sizeof(ts), stream));
          BENCH_OK(op());
          BENCH_CUDA(cudaMemcpyAsync(ts, stamps, sizeof(ts), cudaMemcpyDeviceToHost, stream));
          BENCH_CUDA(cudaStreamSynchronize(stream));
          double span[3];
          comm_phase_spans_us(ts, row.kind == 0 ? comm::kDispatchStart : comm::kCombineStart, span);
          for (int k = 0; k < 3; ++k) ph[k].push_back(span[k]);
        }
        detail::DispatchAccess::set_phase_stamps(*h, nullptr);
        BENCH_OK(h->check_errors(stream));
        for (auto& v : ph) std::sort(v.begin(), v.end());
        char buf[160];
        std::snprintf(buf, sizeof(buf),
                      row.kind == 0 ? "stage %.1f / counts %.1f / pull %.1f us"
                                    : "partials %.1f / wait %.1f / reduce %.1f us",
                      ph[0][5], ph[1][5], ph[2][5]);
        phases = buf;
        for (int k = 0; k < 3; ++k) phase_us[k] = ph[k][5];
      }
      if (me == 0 && out.json.size()) {
        Json j;
        j["mode"] = "comm";
        j["ranks"] = R;
        j["hidden"] = H;
        j["topk"] = K;
        j["experts"] = E;
        j["routing"] = ref::routing_name(o.routing);
        j["tokens"] = T;
        j["op"] = row.name;
        j["time_us"] = json_number(us, 1);
        if (row.kind != 2) {
          j["nvlink_bytes"] = bytes;
          j["gbs"] = json_number(bytes / (us * 1e3), 1);
          j["nccl_us"] = json_number(nccl_us, 1);
          j["nccl_gbs"] = json_number(bytes / (nccl_us * 1e3), 1);
          j["nccl_ratio"] = json_number(nccl_us / us, 2);
          const char* const names[2][3] = {{"stage", "counts", "pull"}, {"partials", "wait", "reduce"}};
          Json ph;
          for (int k = 0; k < 3; ++k) ph[names[row.kind][k]] = json_number(phase_us[k], 1);
          j["phases_us"] = ph;
        }
        if (row.kind == 0) {
          j["dispatch_metadata_bytes"] = tr.disp_meta;
          j["dispatch_idle_tokens"] = tr.disp_idle;
          j["dispatch_speculative_bytes"] = tr.disp_idle * int64_t(H + 4 * G);
        }
        json += json_line(j);
      }
      if (table) {
        if (row.kind == 2)
          std::printf("%6d | %-22s | %9.1f | %10s | %8s | %9s | %8s | %6s\n", T, row.name, us, "", "", "", "", "");
        else
          std::printf("%6d | %-22s | %9.1f | %10.2f | %8.1f | %9.1f | %8.1f | %5.2fx | %s\n", T, row.name, us,
                      bytes / 1e6, bytes / (us * 1e3), nccl_us, bytes / (nccl_us * 1e3), nccl_us / us, phases.c_str());
      }
    }
    if (me == 0 && out.json_stdout()) {
      std::fputs(json.c_str(), stdout);
      std::fflush(stdout);
    }
    if (me == 0 && out.json_file() && !append_json_file(out, json, "comm"))
      return Status(StatusCode::kInvalidArgument, "cannot write the --json file");
    if (table)
      std::printf("%6d | (dispatch also pulls %.2f MB of routing metadata and %.2f MB of speculative fp8 rows "
                  "of %lld tokens with no expert here)\n",
                  T, tr.disp_meta / 1e6, tr.disp_idle * double(H + 4 * G) / 1e6, (long long)tr.disp_idle);
  }
  std::fflush(stdout);
  BENCH_OK(comm->barrier(stream));
  return Status::Ok();
}

int run_comm(const Options& o, const Output& out) {
  if (o.ranks < 1 || o.tokens.empty()) {
    std::fprintf(stderr, "epmoe-bench comm: bad --ranks or --tokens\n");
    return 2;
  }
  const int gpus = probe_gpu_count();
  if (gpus < o.ranks) {
    std::fprintf(stderr, "epmoe-bench comm: needs %d GPUs, %d visible\n", o.ranks, gpus);
    return 1;
  }
  LaunchOptions lo;
  lo.num_ranks = o.ranks;
  lo.timeout_seconds = 600;
  const LaunchResult r = launch_ranks(lo, [&](const RankContext& ctx) { return run_rank(ctx, o, out); });
  if (!r.ok) {
    std::fprintf(stderr, "epmoe-bench comm failed:\n%s", r.message.c_str());
    return 1;
  }
  return 0;
}

// The flags; parsed in the parent before it looks for GPUs.
Run setup_comm(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto routing = std::make_shared<std::string>("uniform");
  app.add_option("--ranks", o->ranks, "processes, one GPU each")->capture_default_str();
  add_int_list(app, "--tokens", &o->tokens, "tokens per rank, one case each", 0);
  app.add_option("--hidden", o->hidden, "hidden size H (token row width)")->capture_default_str();
  app.add_option("--topk", o->topk, "experts per token K")->capture_default_str();
  app.add_option("--experts", o->experts, "experts E over all ranks")->capture_default_str();
  app.add_option("--iters", o->iters, "timed calls per row")->capture_default_str();
  app.add_option("--warmup", o->warmup, "untimed calls before them")->capture_default_str();
  app.add_option("--routing", *routing, "token-to-expert routing")
      ->check(CLI::IsMember({"uniform", "zipf"}))
      ->capture_default_str();
  app.footer("Prints rank 0's table: per token count, dispatch and combine (FP8 and BF16) time, NVLink GB/s, "
             "NCCL all-to-all of the same payload, and the kernels' phases.");
  return [o, routing](const Output& out) {
    o->routing = *routing == "zipf" ? ref::Routing::kZipf : ref::Routing::kUniform;
    return run_comm(*o, out);
  };
}

EPMOE_BENCH_COMMAND("comm", "dispatch/combine time and NVLink GB/s vs NCCL all-to-all", setup_comm);

}  // namespace
}  // namespace epmoe::bench
