#include "mgpu/case_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "device/layout/expert_pool.h"
#include "mgpu/mgpu_util.h"
#include "reference/numeric.h"

namespace epmoe::mgpu {
namespace {

using layout::RowSource;

template <class T>
struct DeviceBuf {
  T* p = nullptr;
  explicit DeviceBuf(size_t n) { cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)); }
  ~DeviceBuf() { cudaFree(p); }
};

template <class T>
Status download(std::vector<T>* out, const void* src, size_t n) {
  out->resize(n);
  if (n) RANK_CUDA(cudaMemcpy(out->data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
  return Status::Ok();
}

struct RankData {
  int T = 0;
  std::vector<uint16_t> x;
  ref::Routed routed;
};

void add_duplicates(Duplicates kind, int K, ref::Routed* routed) {
  if (kind == Duplicates::kNone || K < 2) return;
  std::vector<int32_t>& idx = routed->topk_idx;
  const int T = int(idx.size()) / K;
  for (int t = 0; t < T; ++t) {
    int32_t* slots = idx.data() + size_t(t) * K;
    if (slots[0] < 0) continue;
    if (kind == Duplicates::kSome && t % 3 == 0) slots[K - 1] = slots[0];
    if (kind == Duplicates::kAllSlots)
      for (int k = 1; k < K; ++k) slots[k] = slots[0];
  }
}

}  // namespace

float expert_output_pattern(int src, int token, int slot, int h) {
  const uint64_t v = ref::mix_seed(0x5eedull, uint64_t(src) << 40 | uint64_t(token) << 8 | uint64_t(slot), uint64_t(h));
  return float(int(v % 2001) - 1000) / 500.0f;  // [-2, 2]
}

Status run_cases(const RankContext& ctx, const CaseShape& sh, const std::vector<RoutingCase>& cases, uint64_t seed) {
  std::unique_ptr<Communicator> comm;
  RANK_OK(make_comm(ctx, &comm));
  return run_cases(ctx, *comm, sh, cases, seed);
}

Status run_cases(const RankContext& ctx, Communicator& comm_ref, const CaseShape& sh,
                 const std::vector<RoutingCase>& cases, uint64_t seed) {
  Communicator* comm = &comm_ref;
  const int R = ctx.size, me = ctx.rank, E = sh.E, H = sh.H, K = sh.K, E_loc = E / R;
  DispatchConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens_per_rank = sh.T_max;
  cfg.row_align = sh.row_align;
  cfg.dtype = sh.dtype;
  cfg.pow2_scales = sh.pow2;
  cfg.combine_partials = sh.partials;
  cfg.timeout_seconds = 20;
  std::unique_ptr<DispatchHandle> handle;
  RANK_OK(DispatchHandle::create(*comm, cfg, &handle));
  const ExpertPoolView pool = handle->pool();
  const bool fp8 = sh.dtype == DType::kFP8;
  const int G = H / 128;

  ref::Problem prob;
  prob.R = R;
  prob.E = E;
  prob.H = H;
  prob.I = 128;
  prob.K = K;
  prob.T_max = sh.T_max;
  DeviceBuf<uint16_t> d_x(size_t(sh.T_max) * H), d_y(size_t(sh.T_max) * H);
  DeviceBuf<int32_t> d_idx(size_t(sh.T_max) * K);
  DeviceBuf<float> d_w(size_t(sh.T_max) * K);
  cudaStream_t stream;
  RANK_CUDA(cudaStreamCreate(&stream));

  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const RoutingCase& c = cases[ci];
    const uint64_t cseed = ref::mix_seed(seed, ci);
    std::vector<RankData> all(R);
    for (int r = 0; r < R; ++r) {
      // Lists shorter than the rank count (cases written for 2 ranks, run on more with
      // EPMOE_TEST_RANKS) repeat cyclically.
      all[r].T = c.tokens.empty() ? sh.T_max : c.tokens[size_t(r) % c.tokens.size()];
      all[r].x = ref::random_x(all[r].T, H, ref::mix_seed(cseed, 1, r));
      all[r].routed = ref::make_routing(prob, c.routing, r, all[r].T, ref::mix_seed(cseed, 2));
      add_duplicates(c.duplicates, K, &all[r].routed);
    }
    const RankData& mine = all[me];
    const int T = mine.T;
    const std::string where = "case '" + c.name + "' (seed " + std::to_string(seed) + ")";
    RANK_CUDA(cudaMemcpy(d_x.p, mine.x.data(), mine.x.size() * 2, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemcpy(d_idx.p, mine.routed.topk_idx.data(), mine.routed.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemcpy(d_w.p, mine.routed.topk_w.data(), mine.routed.topk_w.size() * 4, cudaMemcpyHostToDevice));

    // ---- dispatch -------------------------------------------------------------------------------
    RANK_OK(handle->dispatch(d_x.p, d_idx.p, d_w.p, T, stream));
    RANK_OK(handle->check_errors(stream));
    std::vector<int32_t> count, offset;
    RANK_OK(download(&count, pool.expert_count, E_loc));
    RANK_OK(download(&offset, pool.expert_offset, E_loc + 1));
    const int64_t rows = offset[E_loc];
    RANK_CHECK(offset[0] == 0 && rows <= pool.max_rows, ctx, where << " offsets [0]=" << offset[0] << " end=" << rows);
    std::vector<uint32_t> src;
    std::vector<float> wgt, scale;
    std::vector<uint8_t> xq;
    RANK_OK(download(&src, pool.row_source, rows));
    RANK_OK(download(&wgt, pool.row_weight, rows));
    RANK_OK(download(&xq, pool.x_pool, size_t(rows) * H * (fp8 ? 1 : 2)));
    if (fp8) RANK_OK(download(&scale, pool.x_scale, size_t(G) * pool.scale_stride));

    // Quantized tokens of every source, as the reference computes them.
    std::vector<std::vector<uint8_t>> q(R);
    std::vector<std::vector<float>> qs(R);
    if (fp8)
      for (int r = 0; r < R; ++r) {
        q[r].resize(size_t(all[r].T) * H);
        qs[r].resize(size_t(all[r].T) * G);
        std::vector<float> xf(H);
        for (int t = 0; t < all[r].T; ++t) {
          for (int h = 0; h < H; ++h) xf[h] = ref::bf16_to_float(all[r].x[size_t(t) * H + h]);
          ref::quantize_1x128(xf.data(), H, sh.pow2, &q[r][size_t(t) * H], &qs[r][size_t(t) * G]);
        }
      }

    for (int e = 0; e < E_loc; ++e) {
      const int eg = me * E_loc + e;
      RANK_CHECK(offset[e] % sh.row_align == 0 && offset[e] + count[e] <= offset[e + 1], ctx,
                 where << " expert " << e << " offset " << offset[e] << " count " << count[e] << " next " << offset[e + 1]);
      std::vector<uint32_t> want, got(src.begin() + offset[e], src.begin() + offset[e] + count[e]);
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < all[r].T; ++t)
          for (int k = 0; k < K; ++k)
            if (all[r].routed.topk_idx[size_t(t) * K + k] == eg) want.push_back(RowSource::pack(r, t, k));
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      RANK_CHECK(want == got, ctx, where << " expert " << eg << ": dispatched set differs (want " << want.size()
                                         << " rows, got " << got.size() << ")");
      for (int row = offset[e]; row < offset[e + 1]; ++row) {
        if (row >= offset[e] + count[e]) {
          RANK_CHECK(src[row] == 0xFFFFFFFFu && wgt[row] == 0.f, ctx, where << " padding row " << row);
          continue;
        }
        const int s = RowSource::rank(src[row]), t = RowSource::token(src[row]), k = RowSource::slot(src[row]);
        RANK_CHECK(wgt[row] == all[s].routed.topk_w[size_t(t) * K + k], ctx, where << " row " << row << " weight");
        if (fp8) {
          RANK_CHECK(std::memcmp(&xq[size_t(row) * H], &q[s][size_t(t) * H], H) == 0, ctx,
                     where << " row " << row << " (src " << s << " token " << t << ") e4m3 data differs");
          for (int g = 0; g < G; ++g)
            RANK_CHECK(scale[size_t(g) * pool.scale_stride + row] == qs[s][size_t(t) * G + g], ctx,
                       where << " row " << row << " scale group " << g);
        } else {
          RANK_CHECK(std::memcmp(&xq[size_t(row) * H * 2], &all[s].x[size_t(t) * H], size_t(H) * 2) == 0, ctx,
                     where << " row " << row << " bf16 data differs");
        }
      }
    }

    // ---- combine --------------------------------------------------------------------------------
    std::vector<uint16_t> o(size_t(rows) * H, 0x7FC0);  // padding rows: NaN, must never be read
    for (int64_t row = 0; row < rows; ++row) {
      if (src[row] == 0xFFFFFFFFu) continue;
      const int s = RowSource::rank(src[row]), t = RowSource::token(src[row]), k = RowSource::slot(src[row]);
      for (int h = 0; h < H; ++h) o[size_t(row) * H + h] = ref::bf16_from_float(expert_output_pattern(s, t, k, h));
    }
    if (rows) RANK_CUDA(cudaMemcpy(pool.o_pool, o.data(), o.size() * 2, cudaMemcpyHostToDevice));
    RANK_CUDA(cudaMemset(d_y.p, 0xFF, size_t(sh.T_max) * H * 2));  // poison: bf16 NaN
    RANK_OK(handle->combine(d_y.p, T, stream));
    RANK_OK(handle->check_errors(stream));
    std::vector<uint16_t> y;
    RANK_OK(download(&y, d_y.p, size_t(T) * H));
    double err2 = 0, ref2 = 0;
    int worst_ulp = 0;
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k)
          if (mine.routed.topk_idx[size_t(t) * K + k] >= 0)
            acc += ref::bf16_to_float(ref::bf16_from_float(expert_output_pattern(me, t, k, h)));
        const uint16_t want = ref::bf16_from_float(acc), got = y[size_t(t) * H + h];
        const float gf = ref::bf16_to_float(got), wf = ref::bf16_to_float(want);
        RANK_CHECK(std::isfinite(gf), ctx, where << " y[" << t << "][" << h << "] not finite (unwritten?)");
        err2 += double(gf - wf) * (gf - wf);
        ref2 += double(wf) * wf;
        // Why ordered: bf16 bits are sign-magnitude; this maps them to a line where ulps subtract.
        auto ordered = [](uint16_t b) { return (b & 0x8000) ? -int(b & 0x7FFF) : int(b); };
        worst_ulp = std::max(worst_ulp, std::abs(ordered(got) - ordered(want)));
      }
    }
    const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
    const bool fp32_partials = sh.partials == PartialPrecision::kFloat32;
    RANK_CHECK(rel <= (fp32_partials ? 1e-4 : 5e-3) && (!fp32_partials || worst_ulp <= 1), ctx,
               where << " combine error rel " << rel << " worst ulp " << worst_ulp);
    if (me == 0)
      std::printf("[rank 0] %-22s T=%d rows=%lld  combine rel err %.2e (worst %d ulp)\n", c.name.c_str(), T,
                  (long long)rows, rel, worst_ulp);
  }
  RANK_CUDA(cudaStreamDestroy(stream));
  return Status::Ok();
}

}  // namespace epmoe::mgpu
