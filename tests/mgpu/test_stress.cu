// Back-to-back calls with fresh routing each time, CUDA graph capture and replay, and bad input:
// inputs are generated and results checked on the device, so no call waits on the host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "device/layout/expert_pool.h"
#include "epmoe/dispatch.h"
#include "mgpu/device_patterns.cuh"
#include "mgpu/mgpu_util.h"
#include "reference/data.h"

namespace epmoe::mgpu {
namespace {

using layout::RowSource;

__global__ void bump_kernel(uint32_t* iter) { *iter += 1; }

__global__ void gen_inputs_kernel(PatternShape p, int rank, int T, const uint32_t* iter, __nv_bfloat16* x, int* idx,
                                  float* w) {
  const uint32_t it = *iter;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    for (int h = threadIdx.x; h < p.H; h += blockDim.x) x[int64_t(t) * p.H + h] = __float2bfloat16_rn(pattern_x(rank, t, h, it));
    if (threadIdx.x < p.K) {
      idx[t * p.K + threadIdx.x] = pattern_expert(p, rank, t, threadIdx.x, it);
      w[t * p.K + threadIdx.x] = pattern_weight(rank, t, threadIdx.x, it);
    }
  }
}

// Checks every dispatched row against its source (routing, weight, data) and writes its expert output.
// verify = false only fills o (bad-input test, where routing is not the pattern).
__global__ void check_pool_fill_o_kernel(PatternShape p, int rank, int E_loc, bool fp8, ExpertPoolView pool,
                                         const uint32_t* iter, bool verify, uint32_t* errors) {
  const uint32_t it = *iter;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int e = blockIdx.x; e < E_loc; e += gridDim.x) {
    const int begin = pool.expert_offset[e], n = pool.expert_count[e];
    if (threadIdx.x == 0 && (begin + n > pool.expert_offset[e + 1] || n < 0)) atomicAdd(errors, 1u);
    for (int i = warp; i < n; i += warps) {
      const int row = begin + i;
      const uint32_t src = pool.row_source[row];
      const int s = RowSource::rank(src), t = RowSource::token(src), k = RowSource::slot(src);
      if (verify) {
        bool bad = pattern_expert(p, s, t, k, it) != rank * E_loc + e || pool.row_weight[row] != pattern_weight(s, t, k, it);
        for (int h = lane; h < p.H; h += 32) {
          const float xv = __bfloat162float(__float2bfloat16_rn(pattern_x(s, t, h, it)));
          if (fp8) {
            const float sc = pool.x_scale[int64_t(h / 128) * pool.scale_stride + row];
            __nv_fp8_e4m3 q;
            q.__x = static_cast<const uint8_t*>(pool.x_pool)[int64_t(row) * p.H + h];
            const float deq = float(q) * sc;
            bad |= !(fabsf(deq - xv) <= fabsf(xv) * 0.0625f + sc * 0.002f);
          } else {
            bad |= static_cast<const __nv_bfloat16*>(pool.x_pool)[int64_t(row) * p.H + h] != __float2bfloat16_rn(xv);
          }
        }
        if (bad) atomicAdd(errors, 1u);
      }
      for (int h = lane; h < p.H; h += 32)
        reinterpret_cast<__nv_bfloat16*>(pool.o_pool)[int64_t(row) * p.H + h] = __float2bfloat16_rn(pattern_o(s, t, k, h, it));
    }
  }
}

// y[t] against the fp32 slot-order sum. idx = null: the pattern's routing; else that table.
// exact: fp32 partials (the pattern's sums are exact, so y must match bit for bit).
__global__ void check_y_kernel(PatternShape p, int rank, int T, const uint32_t* iter, const int* idx, bool exact,
                               const __nv_bfloat16* y, uint32_t* errors, uint32_t* checked) {
  const uint32_t it = *iter;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    for (int h = threadIdx.x; h < p.H; h += blockDim.x) {
      float acc = 0.f, mag = 0.f;
      for (int k = 0; k < p.K; ++k) {
        const int e = idx ? idx[t * p.K + k] : pattern_expert(p, rank, t, k, it);
        if (e < 0) continue;
        const float o = pattern_o(rank, t, k, h, it);
        acc += o;
        mag += fabsf(o);
      }
      const float got = __bfloat162float(y[int64_t(t) * p.H + h]);
      const float want = __bfloat162float(__float2bfloat16_rn(acc));
      const bool ok = exact ? got == want : fabsf(got - want) <= mag * 0.008f + fabsf(want) * 0.008f;
      if (!ok) {
        if (atomicAdd(errors, 1u) < 4)
          printf("rank %d iter %u y[%d][%d] = %f, expected %f\n", rank, it, t, h, got, want);
      }
    }
    if (threadIdx.x == 0) atomicAdd(checked, 1u);
  }
}

struct Rig {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<DispatchHandle> handle;
  PatternShape ps{};
  __nv_bfloat16 *x = nullptr, *y = nullptr;
  int* idx = nullptr;
  float* w = nullptr;
  uint32_t *iter = nullptr, *errors = nullptr, *checked = nullptr;
  cudaStream_t stream = nullptr;

  Status init(const RankContext& ctx, const DispatchConfig& cfg) {
    RANK_OK(make_comm(ctx, &comm));
    RANK_OK(DispatchHandle::create(*comm, cfg, &handle));
    ps = PatternShape{cfg.num_experts, cfg.topk, cfg.hidden};
    const size_t T = cfg.max_tokens_per_rank;
    RANK_CUDA(cudaMalloc(&x, T * cfg.hidden * 2));
    RANK_CUDA(cudaMalloc(&y, T * cfg.hidden * 2));
    RANK_CUDA(cudaMalloc(&idx, T * cfg.topk * 4));
    RANK_CUDA(cudaMalloc(&w, T * cfg.topk * 4));
    RANK_CUDA(cudaMalloc(&iter, 12));
    RANK_CUDA(cudaMemset(iter, 0, 12));
    errors = iter + 1;
    checked = iter + 2;
    RANK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return Status::Ok();
  }
  // One full round, all on `stream`, no host sync.
  Status round(int rank, int T, bool fp8, bool exact) {
    const int E_loc = ps.E / comm->size();
    bump_kernel<<<1, 1, 0, stream>>>(iter);
    gen_inputs_kernel<<<64, 128, 0, stream>>>(ps, rank, T, iter, x, idx, w);
    RANK_OK(handle->dispatch(x, idx, w, T, stream));
    check_pool_fill_o_kernel<<<E_loc, 256, 0, stream>>>(ps, rank, E_loc, fp8, handle->pool(), iter, true, errors);
    RANK_CUDA(cudaMemsetAsync(y, 0xFF, size_t(T) * ps.H * 2, stream));
    RANK_OK(handle->combine(y, T, stream));
    check_y_kernel<<<64, 128, 0, stream>>>(ps, rank, T, iter, nullptr, exact, y, errors, checked);
    RANK_CUDA(cudaGetLastError());
    return Status::Ok();
  }
  Status counters(uint32_t* err, uint32_t* chk) {
    RANK_CUDA(cudaStreamSynchronize(stream));
    uint32_t h[3];
    RANK_CUDA(cudaMemcpy(h, iter, 12, cudaMemcpyDeviceToHost));
    *err = h[1];
    *chk = h[2];
    return Status::Ok();
  }
  ~Rig() {
    if (stream) cudaStreamSynchronize(stream);
    cudaFree(x);
    cudaFree(y);
    cudaFree(idx);
    cudaFree(w);
    cudaFree(iter);
    if (stream) cudaStreamDestroy(stream);
  }
};

DispatchConfig small_config(DType dtype, PartialPrecision partials) {
  DispatchConfig c;
  c.num_experts = 16;
  c.hidden = 512;
  c.topk = 4;
  c.max_tokens_per_rank = 128;
  c.row_align = 32;
  c.dtype = dtype;
  c.combine_partials = partials;
  c.timeout_seconds = 20;
  return c;
}

TEST(DispatchCombine, ThousandBackToBackCallsFreshRouting) {
  EPMOE_REQUIRE_RANKS(2);
  run_on_ranks(2, [](const RankContext& ctx) {
    Rig rig;
    const DispatchConfig cfg = small_config(DType::kFP8, PartialPrecision::kFloat32);
    RANK_OK(rig.init(ctx, cfg));
    uint64_t tokens = 0;
    for (int i = 0; i < 1000; ++i) {
      // T varies per call and per rank, 0 included.
      const int T = (i * 37 + ctx.rank * 53) % (cfg.max_tokens_per_rank + 1);
      tokens += T;
      RANK_OK(rig.round(ctx.rank, T, true, true));
    }
    RANK_OK(rig.handle->check_errors(rig.stream));
    uint32_t err = 0, chk = 0;
    RANK_OK(rig.counters(&err, &chk));
    RANK_CHECK(err == 0 && chk == tokens, ctx, err << " errors, " << chk << " of " << tokens << " tokens checked");
    return Status::Ok();
  });
}

TEST(DispatchCombine, CudaGraphCaptureAndReplay) {
  EPMOE_REQUIRE_RANKS(2);
  for (auto mode : {std::make_pair(DType::kFP8, PartialPrecision::kFloat32),
                    std::make_pair(DType::kBF16, PartialPrecision::kBFloat16)}) {
    run_on_ranks(2, [mode](const RankContext& ctx) {
      Rig rig;
      const DispatchConfig cfg = small_config(mode.first, mode.second);
      RANK_OK(rig.init(ctx, cfg));
      const int T = ctx.rank == 0 ? 100 : 77;
      const bool fp8 = mode.first == DType::kFP8, exact = mode.second == PartialPrecision::kFloat32;
      RANK_OK(rig.round(ctx.rank, T, fp8, exact));  // warm-up outside the graph
      cudaGraph_t graph;
      RANK_CUDA(cudaStreamBeginCapture(rig.stream, cudaStreamCaptureModeThreadLocal));
      Status st = rig.round(ctx.rank, T, fp8, exact);
      RANK_CUDA(cudaStreamEndCapture(rig.stream, &graph));
      RANK_OK(st);
      cudaGraphExec_t exec;
      RANK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      const int replays = 50;
      for (int i = 0; i < replays; ++i) RANK_CUDA(cudaGraphLaunch(exec, rig.stream));
      RANK_OK(rig.handle->check_errors(rig.stream));
      uint32_t err = 0, chk = 0;
      RANK_OK(rig.counters(&err, &chk));
      RANK_CHECK(err == 0 && chk == uint32_t(T) * (replays + 1), ctx,
                 err << " errors, " << chk << " token checks (want " << T * (replays + 1) << ")");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return Status::Ok();
    });
  }
}

TEST(BadInput, HostSideErrorsBeforeAnyLaunch) {
  EPMOE_REQUIRE_RANKS(2);
  run_on_ranks(2, [](const RankContext& ctx) {
    std::unique_ptr<Communicator> comm;
    RANK_OK(make_comm(ctx, &comm));
    std::unique_ptr<DispatchHandle> h;
    DispatchConfig c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    c.hidden = 100;
    Status s1 = DispatchHandle::create(*comm, c, &h);
    RANK_CHECK(s1.code() == StatusCode::kInvalidArgument && s1.message().find("hidden=100") != std::string::npos, ctx,
               s1.to_string());
    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    c.num_experts = 15;
    Status s2 = DispatchHandle::create(*comm, c, &h);
    RANK_CHECK(!s2.ok() && s2.message().find("num_experts=15") != std::string::npos, ctx, s2.to_string());
    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    c.topk = 0;
    Status s3 = DispatchHandle::create(*comm, c, &h);
    RANK_CHECK(!s3.ok() && s3.message().find("topk=0") != std::string::npos, ctx, s3.to_string());

    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    RANK_OK(DispatchHandle::create(*comm, c, &h));
    Status s4 = h->combine(nullptr, 0, nullptr);
    RANK_CHECK(!s4.ok() && s4.message().find("no dispatch") != std::string::npos, ctx, s4.to_string());
    int* dummy = nullptr;
    RANK_CUDA(cudaMalloc(&dummy, 4096));
    Status s5 = h->dispatch(dummy, dummy, reinterpret_cast<float*>(dummy), 129, nullptr);
    RANK_CHECK(!s5.ok() && s5.message().find("num_tokens=129") != std::string::npos, ctx, s5.to_string());
    Status s6 = h->dispatch(nullptr, dummy, reinterpret_cast<float*>(dummy), 5, nullptr);
    RANK_CHECK(!s6.ok() && s6.message().find("non-null") != std::string::npos, ctx, s6.to_string());
    Status s7 = h->dispatch(dummy, dummy, reinterpret_cast<float*>(dummy), -1, nullptr);
    RANK_CHECK(!s7.ok(), ctx, s7.to_string());

    // Misaligned pointers are rejected before any launch.
    char* bytes = reinterpret_cast<char*>(dummy);
    Status a1 = h->dispatch(bytes + 8, dummy, reinterpret_cast<float*>(dummy), 5, nullptr);
    RANK_CHECK(a1.code() == StatusCode::kInvalidArgument && a1.message().find("x=") != std::string::npos &&
                   a1.message().find("16-byte") != std::string::npos,
               ctx, a1.to_string());
    Status a2 = h->dispatch(dummy, reinterpret_cast<int*>(bytes + 2), reinterpret_cast<float*>(dummy), 5, nullptr);
    RANK_CHECK(a2.code() == StatusCode::kInvalidArgument && a2.message().find("topk_idx") != std::string::npos &&
                   a2.message().find("4-byte") != std::string::npos,
               ctx, a2.to_string());
    Status a3 = h->dispatch(dummy, dummy, reinterpret_cast<float*>(bytes + 1), 5, nullptr);
    RANK_CHECK(a3.code() == StatusCode::kInvalidArgument && a3.message().find("topk_weights") != std::string::npos,
               ctx, a3.to_string());
    Status a4 = h->combine(bytes + 4, 0, nullptr);
    RANK_CHECK(a4.code() == StatusCode::kInvalidArgument && a4.message().find("16-byte") != std::string::npos, ctx,
               a4.to_string());
    h.reset();

    // A config that differs between ranks fails on every rank, naming the field and the ranks.
    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    c.hidden = ctx.rank == 0 ? 512 : 640;
    Status m1 = DispatchHandle::create(*comm, c, &h);
    RANK_CHECK(m1.code() == StatusCode::kInvalidArgument && m1.message().find("differs across ranks") != std::string::npos &&
                   m1.message().find("hidden is 512 on rank 0, 640 on rank 1") != std::string::npos,
               ctx, m1.to_string());
    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    c.combine_partials = ctx.rank == 1 ? PartialPrecision::kBFloat16 : PartialPrecision::kFloat32;
    Status m2 = DispatchHandle::create(*comm, c, &h);
    RANK_CHECK(!m2.ok() && m2.message().find("combine_partials") != std::string::npos, ctx, m2.to_string());

    // An external pool that is not 256-byte aligned on one rank fails on every rank.
    c = small_config(DType::kFP8, PartialPrecision::kFloat32);
    char* pool = nullptr;
    RANK_CUDA(cudaMalloc(&pool, size_t(DispatchHandle::pool_bytes_for(*comm, c)) + 256));
    Status p1 = DispatchHandle::create(*comm, c, &h, ctx.rank == 1 ? pool + 16 : pool);
    RANK_CHECK(p1.code() == StatusCode::kInvalidArgument && p1.message().find("256-byte") != std::string::npos &&
                   p1.message().find("rank 1") != std::string::npos,
               ctx, p1.to_string());
    RANK_OK(DispatchHandle::create(*comm, c, &h, pool));  // aligned on both: accepted
    h.reset();
    cudaFree(pool);
    cudaFree(dummy);
    return Status::Ok();
  });
}

// SPEC: any routing is legal and step 7 sums every valid slot, so an expert listed twice in a token
// is computed twice; only indices outside [-1, E) are masked (and reported).
TEST(BadInput, OutOfRangeExpertsMaskedAndReportedDuplicatesComputed) {
  EPMOE_REQUIRE_RANKS(2);
  run_on_ranks(2, [](const RankContext& ctx) {
    Rig rig;
    const DispatchConfig cfg = small_config(DType::kFP8, PartialPrecision::kFloat32);
    RANK_OK(rig.init(ctx, cfg));
    const int T = 64, K = cfg.topk, E = cfg.num_experts;
    ref::Problem prob;
    prob.R = ctx.size;
    prob.E = E;
    prob.H = cfg.hidden;
    prob.K = K;
    prob.T_max = cfg.max_tokens_per_rank;
    // Rank r's routing: duplicates on every rank, out-of-range indices on rank 0. sanitized = what
    // SPEC computes: the duplicates stay (each slot counts), the out-of-range slots become -1.
    const std::vector<int> bad_slots = {3 * K + 1, 5 * K + 0, 9 * K + 2};
    auto routing_of = [&](int r, std::vector<int>* sanitized) {
      ref::Routed routed = ref::make_routing(prob, ref::Routing::kUniform, r, T, 1234);
      std::vector<int32_t>& idx = routed.topk_idx;
      idx[7 * K + 2] = idx[7 * K + 0];                                   // one expert in two slots
      for (int k = 1; k < K; ++k) idx[11 * K + k] = idx[11 * K + 0];     // one expert in all K slots
      idx[13 * K + 3] = idx[13 * K + 1];                                 // two pairs
      idx[13 * K + 2] = idx[13 * K + 0];
      *sanitized = idx;
      if (r == 0) {
        idx[bad_slots[0]] = E;        // one past the end
        idx[bad_slots[1]] = -7;       // negative, not -1
        idx[bad_slots[2]] = 1 << 30;
        for (int i : bad_slots) (*sanitized)[i] = -1;
      }
      return routed;
    };
    std::vector<int> sanitized;
    const ref::Routed routed = routing_of(ctx.rank, &sanitized);
    std::vector<uint16_t> x = ref::random_x(T, cfg.hidden, 77 + ctx.rank);
    int* d_sanitized = nullptr;
    RANK_CUDA(cudaMalloc(&d_sanitized, sanitized.size() * 4));
    RANK_CUDA(cudaMemcpy(d_sanitized, sanitized.data(), sanitized.size() * 4, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemcpy(rig.idx, routed.topk_idx.data(), routed.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemcpy(rig.w, routed.topk_w.data(), routed.topk_w.size() * 4, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemcpy(rig.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    RANK_OK(rig.handle->dispatch(rig.x, rig.idx, rig.w, T, rig.stream));
    const int E_loc = E / ctx.size;
    check_pool_fill_o_kernel<<<E_loc, 256, 0, rig.stream>>>(rig.ps, ctx.rank, E_loc, true, rig.handle->pool(), rig.iter,
                                                           false, rig.errors);
    RANK_CUDA(cudaMemsetAsync(rig.y, 0xFF, size_t(T) * cfg.hidden * 2, rig.stream));
    RANK_OK(rig.handle->combine(rig.y, T, rig.stream));
    check_y_kernel<<<64, 128, 0, rig.stream>>>(rig.ps, ctx.rank, T, rig.iter, d_sanitized, true, rig.y, rig.errors,
                                               rig.checked);
    Status st = rig.handle->check_errors(rig.stream);
    if (ctx.rank == 0) {
      RANK_CHECK(st.code() == StatusCode::kInvalidArgument && st.message().find("outside [-1, 16)") != std::string::npos,
                 ctx, st.to_string());
      Status again = rig.handle->check_errors(rig.stream);  // reported once, then cleared
      RANK_CHECK(again.ok(), ctx, again.to_string());
    } else {
      RANK_OK(st);
    }
    uint32_t err = 0, chk = 0;
    RANK_OK(rig.counters(&err, &chk));
    RANK_CHECK(err == 0 && chk == uint32_t(T), ctx,
               err << " wrong outputs with masked bad slots and computed duplicate slots");
    // Every valid slot got its own row, the duplicates included.
    std::vector<int32_t> count(E_loc);
    RANK_CUDA(cudaMemcpy(count.data(), rig.handle->pool().expert_count, E_loc * 4, cudaMemcpyDeviceToHost));
    int64_t rows = 0, want_rows = 0;
    for (int c : count) rows += c;
    for (int r = 0; r < ctx.size; ++r) {
      std::vector<int> other;
      routing_of(r, &other);
      for (int e : other) want_rows += e >= ctx.rank * E_loc && e < (ctx.rank + 1) * E_loc;
    }
    RANK_CHECK(rows == want_rows, ctx, rows << " pool rows, want " << want_rows << " (one per valid slot)");
    cudaFree(d_sanitized);
    return Status::Ok();
  });
}

}  // namespace
}  // namespace epmoe::mgpu
