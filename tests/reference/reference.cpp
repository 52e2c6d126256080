#include "reference/reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <cstdlib>
#include <thread>
#include <utility>

#include "reference/numeric.h"

namespace epmoe::ref {

int worker_threads() {
  if (const char* env = std::getenv("EPMOE_REF_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
}

namespace {


[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("epmoe::ref: " + what);
}

void expect_size(const char* name, int rank, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) != want)
    fail(std::string(name) + (rank >= 0 ? " of rank " + std::to_string(rank) : std::string()) + " has " +
         std::to_string(got) + " elements, expected " + std::to_string(want));
}

// out[r] = sum over columns of W[r] . v, W row-major [rows][cols]. FP8: the
// 128x128 block scale multiplies each block's partial dot, which equals the
// dot of dequantized values up to double rounding. With out_abs, also
// out_abs[r] = sum of |W[r][j] v[j]|: the size a GPU GEMM's accumulation error
// scales with (tests/reference/kernel_check.h).
void gemv_fp8(const uint8_t* wq, const float* ws, int rows, int cols, const double* v, double* out,
              double* out_abs = nullptr) {
  const double* lut = e4m3_table();
  const int bcols = cols / kQuantGroup;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* wr = wq + int64_t(r) * cols;
    const float* sr = ws + int64_t(r / kQuantGroup) * bcols;
    double acc = 0.0, acc_abs = 0.0;
    for (int b = 0; b < bcols; ++b) {
      // Why four partial sums: one serial chain of double adds is latency
      // bound; the order change is far below fp32 resolution.
      double part[4] = {0.0, 0.0, 0.0, 0.0};
      for (int j = b * kQuantGroup; j < (b + 1) * kQuantGroup; j += 4)
        for (int l = 0; l < 4; ++l) part[l] += lut[wr[j + l]] * v[j + l];
      acc += ((part[0] + part[1]) + (part[2] + part[3])) * static_cast<double>(sr[b]);
      if (out_abs) {
        double mag = 0.0;
        for (int j = b * kQuantGroup; j < (b + 1) * kQuantGroup; ++j) mag += std::fabs(lut[wr[j]] * v[j]);
        acc_abs += mag * std::fabs(static_cast<double>(sr[b]));
      }
    }
    out[r] = acc;
    if (out_abs) out_abs[r] = acc_abs;
  }
}

void gemv_bf16(const uint16_t* w, int rows, int cols, const double* v, double* out, double* out_abs = nullptr) {
  for (int r = 0; r < rows; ++r) {
    const uint16_t* wr = w + int64_t(r) * cols;
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    int j = 0;
    for (; j + 4 <= cols; j += 4)
      for (int l = 0; l < 4; ++l) part[l] += static_cast<double>(bf16_to_float(wr[j + l])) * v[j + l];
    for (; j < cols; ++j) part[0] += static_cast<double>(bf16_to_float(wr[j])) * v[j];
    out[r] = (part[0] + part[1]) + (part[2] + part[3]);
    if (out_abs) {
      double mag = 0.0;
      for (j = 0; j < cols; ++j) mag += std::fabs(static_cast<double>(bf16_to_float(wr[j])) * v[j]);
      out_abs[r] = mag;
    }
  }
}

void check_inputs(const Problem& p, const std::vector<RankInput>& inputs) {
  if (static_cast<int>(inputs.size()) != p.R)
    fail("inputs has " + std::to_string(inputs.size()) + " ranks, Problem.R = " + std::to_string(p.R));
  for (int r = 0; r < p.R; ++r) {
    const RankInput& in = inputs[r];
    if (in.T < 0 || in.T > p.T_max)
      fail("T of rank " + std::to_string(r) + " = " + std::to_string(in.T) + " is out of [0, T_max = " +
           std::to_string(p.T_max) + "]");
    expect_size("x", r, in.x.size(), int64_t(in.T) * p.H);
    expect_size("topk_idx", r, in.topk_idx.size(), int64_t(in.T) * p.K);
    expect_size("topk_w", r, in.topk_w.size(), int64_t(in.T) * p.K);
    for (int t = 0; t < in.T; ++t)
      for (int k = 0; k < p.K; ++k) {
        const int32_t e = in.topk_idx[int64_t(t) * p.K + k];
        if (e < -1 || e >= p.E)
          fail("topk_idx[rank " + std::to_string(r) + "][token " + std::to_string(t) + "][slot " +
               std::to_string(k) + "] = " + std::to_string(e) + " is out of [-1, E = " +
               std::to_string(p.E) + ")");
      }
  }
}

void check_sample(const Problem& p, const std::vector<RankInput>& inputs,
                  const std::vector<std::vector<int>>& sample) {
  if (static_cast<int>(sample.size()) != p.R)
    fail("sample has " + std::to_string(sample.size()) + " ranks, Problem.R = " + std::to_string(p.R));
  for (int r = 0; r < p.R; ++r)
    for (int t : sample[r])
      if (t < 0 || t >= inputs[r].T)
        fail("sample token " + std::to_string(t) + " of rank " + std::to_string(r) +
             " is out of [0, T = " + std::to_string(inputs[r].T) + ")");
}

// Per-thread buffers, so a token costs no allocation.
struct Scratch {
  std::vector<double> x_hat, h64, a_hat, o64;
  std::vector<float> h, a, acc;
  std::vector<uint16_t> o;
  explicit Scratch(const Problem& p)
      : x_hat(p.H), h64(2 * int64_t(p.I)), a_hat(p.I), o64(p.H), h(2 * int64_t(p.I)), a(p.I),
        acc(p.H), o(p.H) {}
};

void gemm1_into(const Problem& p, const RankWeights& w, int le, const double* x_hat, double* h64, float* h,
                double* h_abs = nullptr) {
  const int rows = 2 * p.I;
  if (p.dtype == DType::kFP8) {
    gemv_fp8(w.w1_q.data() + int64_t(le) * rows * p.H,
             w.w1_s.data() + int64_t(le) * (rows / kQuantGroup) * (p.H / kQuantGroup), rows, p.H, x_hat, h64, h_abs);
  } else {
    gemv_bf16(w.w1_bf16.data() + int64_t(le) * rows * p.H, rows, p.H, x_hat, h64, h_abs);
  }
  for (int i = 0; i < rows; ++i) h[i] = static_cast<float>(h64[i]);
}

void gemm2_into(const Problem& p, const RankWeights& w, int le, const double* a_hat, double* o64, uint16_t* o,
                double* o_abs = nullptr) {
  if (p.dtype == DType::kFP8) {
    gemv_fp8(w.w2_q.data() + int64_t(le) * p.H * p.I,
             w.w2_s.data() + int64_t(le) * (p.H / kQuantGroup) * (p.I / kQuantGroup), p.H, p.I, a_hat, o64, o_abs);
  } else {
    gemv_bf16(w.w2_bf16.data() + int64_t(le) * p.H * p.I, p.H, p.I, a_hat, o64, o_abs);
  }
  for (int i = 0; i < p.H; ++i) o[i] = bf16_from_float(static_cast<float>(o64[i]));
}

void token_forward(const Problem& p, const RankInput& in, const std::vector<RankWeights>& weights, int t,
                   Scratch& sc, uint16_t* y) {
  const int E_loc = p.E_loc();
  dequant_input_row(p, in.x.data() + int64_t(t) * p.H, sc.x_hat.data());
  bool any = false;
  for (int k = 0; k < p.K; ++k) {
    const int32_t e = in.topk_idx[int64_t(t) * p.K + k];
    if (e < 0) continue;
    const RankWeights& w = weights[e / E_loc];
    const int le = e % E_loc;
    gemm1_into(p, w, le, sc.x_hat.data(), sc.h64.data(), sc.h.data());
    swiglu_row(sc.h.data(), p.I, p.clamp, in.topk_w[int64_t(t) * p.K + k], sc.a.data());
    requant_act_row(p, sc.a.data(), sc.a_hat.data());
    gemm2_into(p, w, le, sc.a_hat.data(), sc.o64.data(), sc.o.data());
    for (int i = 0; i < p.H; ++i) {
      const float v = bf16_to_float(sc.o[i]);
      sc.acc[i] = any ? sc.acc[i] + v : v;
    }
    any = true;
  }
  for (int i = 0; i < p.H; ++i) y[i] = any ? bf16_from_float(sc.acc[i]) : uint16_t{0};
}

}  // namespace

const char* dtype_name(DType d) { return d == DType::kFP8 ? "fp8" : "bf16"; }

void check_problem(const Problem& p) {
  if (p.R < 1) fail("R = " + std::to_string(p.R) + " must be >= 1");
  if (p.E < 1 || p.E % p.R != 0)
    fail("E = " + std::to_string(p.E) + " must be a positive multiple of R = " + std::to_string(p.R));
  if (p.H < 1 || p.I < 1 || p.K < 1 || p.T_max < 0)
    fail("H, I, K must be >= 1 and T_max >= 0 (H = " + std::to_string(p.H) + ", I = " + std::to_string(p.I) +
         ", K = " + std::to_string(p.K) + ", T_max = " + std::to_string(p.T_max) + ")");
  if (p.dtype == DType::kFP8 && (p.H % kQuantGroup != 0 || p.I % kQuantGroup != 0))
    fail("FP8 mode needs H and I to be multiples of 128 (H = " + std::to_string(p.H) +
         ", I = " + std::to_string(p.I) + ")");
}

void check_rank_weights(const Problem& p, const RankWeights& w, int rank) {
  const int64_t n1 = int64_t(p.E_loc()) * 2 * p.I * p.H;
  const int64_t n2 = int64_t(p.E_loc()) * p.H * p.I;
  if (p.dtype == DType::kFP8) {
    const int64_t b = int64_t(p.E_loc()) * (p.H / kQuantGroup) * (p.I / kQuantGroup);
    expect_size("w1_q", rank, w.w1_q.size(), n1);
    expect_size("w1_s", rank, w.w1_s.size(), 2 * b);
    expect_size("w2_q", rank, w.w2_q.size(), n2);
    expect_size("w2_s", rank, w.w2_s.size(), b);
  } else {
    expect_size("w1_bf16", rank, w.w1_bf16.size(), n1);
    expect_size("w2_bf16", rank, w.w2_bf16.size(), n2);
  }
}

void dequant_input_row(const Problem& p, const uint16_t* x_row, double* x_hat, uint8_t* q, float* s) {
  if (p.dtype == DType::kBF16) {
    for (int i = 0; i < p.H; ++i) x_hat[i] = bf16_to_float(x_row[i]);
    return;
  }
  std::vector<float> xf(p.H);
  for (int i = 0; i < p.H; ++i) xf[i] = bf16_to_float(x_row[i]);
  std::vector<uint8_t> qv(p.H);
  std::vector<float> sv(p.H / kQuantGroup);
  quantize_1x128(xf.data(), p.H, p.pow2_scales, qv.data(), sv.data());
  for (int i = 0; i < p.H; ++i) x_hat[i] = e4m3_table()[qv[i]] * static_cast<double>(sv[i / kQuantGroup]);
  if (q) std::copy(qv.begin(), qv.end(), q);
  if (s) std::copy(sv.begin(), sv.end(), s);
}

void gemm1_row(const Problem& p, const RankWeights& w, int local_e, const double* x_hat, float* h) {
  std::vector<double> h64(2 * int64_t(p.I));
  gemm1_into(p, w, local_e, x_hat, h64.data(), h);
}

float swiglu(float gate, float up, float clamp, float weight) {
  if (clamp > 0.0f) {
    // Why asymmetric: a very negative gate already drives silu to 0, so only
    // its top is clamped; up enters linearly and is clamped both ways.
    // fmin/fmax behave like the GPU's fminf/fmaxf (a NaN operand yields c).
    gate = std::fmin(gate, clamp);
    up = std::fmax(std::fmin(up, clamp), -clamp);
  }
  const float su = silu(gate) * up;
  return su * weight;
}

void swiglu_row(const float* h, int I, float clamp, float weight, float* a) {
  for (int i = 0; i < I; ++i) a[i] = swiglu(h[i], h[I + i], clamp, weight);
}

void requant_act_row(const Problem& p, const float* a, double* a_hat, uint8_t* q, float* s) {
  if (p.dtype == DType::kBF16) {
    for (int i = 0; i < p.I; ++i) a_hat[i] = bf16_to_float(bf16_from_float(a[i]));
    return;
  }
  std::vector<uint8_t> qv(p.I);
  std::vector<float> sv(p.I / kQuantGroup);
  quantize_1x128(a, p.I, p.pow2_scales, qv.data(), sv.data());
  for (int i = 0; i < p.I; ++i) a_hat[i] = e4m3_table()[qv[i]] * static_cast<double>(sv[i / kQuantGroup]);
  if (q) std::copy(qv.begin(), qv.end(), q);
  if (s) std::copy(sv.begin(), sv.end(), s);
}

void gemm2_row(const Problem& p, const RankWeights& w, int local_e, const double* a_hat, uint16_t* o) {
  std::vector<double> o64(p.H);
  gemm2_into(p, w, local_e, a_hat, o64.data(), o);
}

void gemm1_row_abs(const Problem& p, const RankWeights& w, int local_e, const double* x_hat, float* h, double* h_abs) {
  std::vector<double> h64(2 * int64_t(p.I));
  gemm1_into(p, w, local_e, x_hat, h64.data(), h, h_abs);
}

void gemm2_row_abs(const Problem& p, const RankWeights& w, int local_e, const double* a_hat, double* o64,
                   uint16_t* o, double* o_abs) {
  gemm2_into(p, w, local_e, a_hat, o64, o, o_abs);
}

void expert_forward_one(const Problem& p, const RankWeights& w, int local_e, const uint16_t* x_row,
                        float topk_weight, uint16_t* o, ExpertTrace* trace) {
  check_problem(p);
  if (local_e < 0 || local_e >= p.E_loc())
    fail("local expert " + std::to_string(local_e) + " is out of [0, E_loc = " + std::to_string(p.E_loc()) + ")");
  check_rank_weights(p, w, -1);
  ExpertTrace local;
  ExpertTrace& tr = trace ? *trace : local;
  const bool fp8 = p.dtype == DType::kFP8;
  tr.x_q.assign(fp8 ? p.H : 0, 0);
  tr.x_s.assign(fp8 ? p.H / kQuantGroup : 0, 0.0f);
  tr.x_hat.assign(p.H, 0.0);
  tr.h.assign(2 * int64_t(p.I), 0.0f);
  tr.a.assign(p.I, 0.0f);
  tr.a_q.assign(fp8 ? p.I : 0, 0);
  tr.a_s.assign(fp8 ? p.I / kQuantGroup : 0, 0.0f);
  tr.a_hat.assign(p.I, 0.0);
  tr.o.assign(p.H, 0);
  dequant_input_row(p, x_row, tr.x_hat.data(), fp8 ? tr.x_q.data() : nullptr, fp8 ? tr.x_s.data() : nullptr);
  gemm1_row(p, w, local_e, tr.x_hat.data(), tr.h.data());
  swiglu_row(tr.h.data(), p.I, p.clamp, topk_weight, tr.a.data());
  requant_act_row(p, tr.a.data(), tr.a_hat.data(), fp8 ? tr.a_q.data() : nullptr, fp8 ? tr.a_s.data() : nullptr);
  gemm2_row(p, w, local_e, tr.a_hat.data(), tr.o.data());
  std::copy(tr.o.begin(), tr.o.end(), o);
}

void combine_row(const std::vector<const uint16_t*>& o_valid, int H, uint16_t* y) {
  for (int i = 0; i < H; ++i) {
    if (o_valid.empty()) {
      y[i] = 0;
      continue;
    }
    float acc = bf16_to_float(o_valid[0][i]);
    for (size_t k = 1; k < o_valid.size(); ++k) acc += bf16_to_float(o_valid[k][i]);
    y[i] = bf16_from_float(acc);
  }
}

std::vector<std::vector<uint16_t>> forward(const Problem& p, const std::vector<RankInput>& inputs,
                                           const std::vector<RankWeights>& weights,
                                           const std::vector<std::vector<int>>* sample) {
  check_problem(p);
  check_inputs(p, inputs);
  if (static_cast<int>(weights.size()) != p.R)
    fail("weights has " + std::to_string(weights.size()) + " ranks, Problem.R = " + std::to_string(p.R));
  for (int r = 0; r < p.R; ++r) check_rank_weights(p, weights[r], r);
  if (sample) check_sample(p, inputs, *sample);

  std::vector<std::vector<uint16_t>> y(p.R);
  std::vector<std::pair<int, int>> work;  // (rank, token)
  for (int r = 0; r < p.R; ++r) {
    y[r].assign(int64_t(inputs[r].T) * p.H, 0);
    if (sample) {
      // Why the mask: a token listed twice must not be computed by both
      // threads into the same row.
      std::vector<char> listed(inputs[r].T, 0);
      for (int t : (*sample)[r])
        if (!listed[t]++) work.emplace_back(r, t);
    } else {
      for (int t = 0; t < inputs[r].T; ++t) work.emplace_back(r, t);
    }
  }

  // Why a shared counter rather than halves: token cost varies with the number
  // of valid slots (masked and skewed routings), so static halves can leave
  // one core idle.
  std::atomic<size_t> next{0};
  auto worker = [&] {
    Scratch sc(p);
    for (size_t i = next++; i < work.size(); i = next++) {
      const auto [r, t] = work[i];
      token_forward(p, inputs[r], weights, t, sc, y[r].data() + int64_t(t) * p.H);
    }
  };
  const int n_threads = static_cast<int>(std::min<size_t>(worker_threads(), std::max<size_t>(work.size(), 1)));
  std::vector<std::thread> pool;
  for (int i = 1; i < n_threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  return y;
}

}  // namespace epmoe::ref
