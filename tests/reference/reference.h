// CPU reference of the whole MoE layer, all ranks at once, per shared/SPEC.md.
//
// Steps 1 and 5 (the FP8 quantizers) are bit-exact; the two GEMMs run in
// float64 and are rounded to fp32 at the end, standing in for the GPU's fp32
// accumulators. Dequantized values q * s are formed in double, where they are
// exact (4 + 24 significant bits), so a float64 dot of them differs from the
// exact dot only by double rounding, far below fp32 resolution.
//
// Layouts are those of SPEC.md, never a kernel's internal layout.
#pragma once

#include <cstdint>
#include <vector>

namespace epmoe::ref {

enum class DType { kFP8, kBF16 };
const char* dtype_name(DType d);

struct Problem {
  int R = 1, E = 1, H = 128, I = 128, K = 1, T_max = 0;
  DType dtype = DType::kFP8;
  float clamp = 0.0f;  // <= 0: off
  bool pow2_scales = false;
  int E_loc() const { return E / R; }
};

// Throws std::invalid_argument naming the offending field.
// Why FP8 alone needs multiples of 128: the scale groups are 128 wide; the
// BF16 reference works for any positive H and I.
void check_problem(const Problem& p);

// Threads the reference and the data generators use: EPMOE_REF_THREADS if set, else every core
// (at least 2). Results do not depend on it.
int worker_threads();

struct RankInput {
  int T = 0;
  std::vector<uint16_t> x;         // [T][H] bf16 bits
  std::vector<int32_t> topk_idx;   // [T][K], each in [0, E) or -1
  std::vector<float> topk_w;       // [T][K]
};

// Local experts of one rank, SPEC layout.
struct RankWeights {
  std::vector<uint8_t> w1_q;  std::vector<float> w1_s;  // FP8 [E_loc][2I][H], s [E_loc][2I/128][H/128]
  std::vector<uint8_t> w2_q;  std::vector<float> w2_s;  // FP8 [E_loc][H][I],  s [E_loc][H/128][I/128]
  std::vector<uint16_t> w1_bf16, w2_bf16;               // BF16 mode: same shapes, bf16 bits
};

void check_rank_weights(const Problem& p, const RankWeights& w, int rank);

// ---- The steps of SPEC.md, one token at a time ------------------------------
// These trust their arguments (shapes, local_e in [0, E_loc)); forward() and
// expert_forward_one() validate first.

// Step 1. x_hat[H]; in FP8 mode also the codes q[H] and scales s[H/128] when
// the pointers are not null.
void dequant_input_row(const Problem& p, const uint16_t* x_row, double* x_hat,
                       uint8_t* q = nullptr, float* s = nullptr);

// Step 2. h[2I] = W1[local_e] x_hat in float64, rounded to fp32.
void gemm1_row(const Problem& p, const RankWeights& w, int local_e, const double* x_hat, float* h);

// Steps 3-4 for one channel: gate = min(gate, c), up = clamp(up, -c, c) when
// c > 0, then (silu(gate) * up) * weight in fp32, in that order.
float swiglu(float gate, float up, float clamp, float weight);
// Steps 3-4 for a row: gate = h[0:I], up = h[I:2I], a[I].
void swiglu_row(const float* h, int I, float clamp, float weight, float* a);

// Step 5. a_hat[I]: FP8 dequant(quant_1x128(a)), also q[I] and s[I/128] when
// not null; BF16 bf16(a).
void requant_act_row(const Problem& p, const float* a, double* a_hat,
                     uint8_t* q = nullptr, float* s = nullptr);

// Step 6. o[H] = bf16(fp32(W2[local_e] a_hat)); the float64 sum is rounded to
// fp32 first, as the GPU's accumulator is, then to bf16.
void gemm2_row(const Problem& p, const RankWeights& w, int local_e, const double* a_hat, uint16_t* o);

// Steps 2 and 6 with the size of their sums, for checks that bound a GPU GEMM's accumulation
// error (tests/reference/kernel_check.h): h_abs[2I] = sum_i |W1[j][i] x_hat[i]|; o64[H] the
// float64 dot before any rounding, o[H] as gemm2_row, o_abs[H] = sum_i |W2[j][i] a_hat[i]|.
void gemm1_row_abs(const Problem& p, const RankWeights& w, int local_e, const double* x_hat, float* h, double* h_abs);
void gemm2_row_abs(const Problem& p, const RankWeights& w, int local_e, const double* a_hat, double* o64,
                   uint16_t* o, double* o_abs);

// Every intermediate of one (token, expert) pair, for kernel-level tests.
// x_q/x_s and a_q/a_s are filled in FP8 mode only.
struct ExpertTrace {
  std::vector<uint8_t> x_q;  std::vector<float> x_s;
  std::vector<double> x_hat;
  std::vector<float> h;      // [2I]
  std::vector<float> a;      // [I]
  std::vector<uint8_t> a_q;  std::vector<float> a_s;
  std::vector<double> a_hat;
  std::vector<uint16_t> o;   // [H]
};

// Steps 1-6 for one token and one expert of the rank that owns w. o[H] bf16.
void expert_forward_one(const Problem& p, const RankWeights& w, int local_e, const uint16_t* x_row,
                        float topk_weight, uint16_t* o, ExpertTrace* trace = nullptr);

// Step 7. y[H] = bf16 of the fp32 sum of the valid o rows, in slot order
// (the first row starts the sum, so one row passes through unchanged).
// No rows: y = +0.
void combine_row(const std::vector<const uint16_t*>& o_valid, int H, uint16_t* y);

// ---- The layer ----------------------------------------------------------------

// y per rank, [T_r][H] bf16 bits. With sample, only the tokens listed in
// (*sample)[r] are computed and every other row is 0 (for shapes too large to
// run in full). Runs on 2 threads, split over tokens.
// Throws std::invalid_argument on a bad shape, T_r > T_max, a topk index out of
// [-1, E), a sample index out of [0, T_r), or a wrongly sized vector.
std::vector<std::vector<uint16_t>> forward(const Problem& p, const std::vector<RankInput>& inputs,
                                           const std::vector<RankWeights>& weights,
                                           const std::vector<std::vector<int>>* sample = nullptr);

}  // namespace epmoe::ref
