// Grouped GEMM kernels (src/host/gemm.h) against a float64 host GEMM fed the same quantized
// inputs, and the L1 epilogue against the reference's SwiGLU and 1x128 requant.
// Fresh random data every run; outputs and padding rows are poisoned with NaN.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "host/gemm.h"
#include "reference/numeric.h"
#include "reference/reference.h"

namespace {

using epmoe::DType;
namespace ref = epmoe::ref;
namespace gemm = epmoe::gemm;

struct Case {
  DType dtype;
  bool l1;                  // L1 (SwiGLU epilogue) or L2 (bf16 store)
  std::vector<int> counts;  // rows per expert
  int hidden;
  int inter;
  float clamp = 0.0f;
  bool pow2 = false;
  bool exact = false;  // small-integer operands: the fp32 GEMM is exact, the epilogue must match ~bit for bit
};

template <class T>
struct DeviceBuf {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuf(size_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuf() { cudaFree(ptr); }
  void upload(const std::vector<T>& h) { ASSERT_EQ(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> download() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

int e4m3_ordinal(uint8_t c) { return (c & 0x80) ? -int(c & 0x7F) : int(c & 0x7F); }

std::string describe(const Case& c) {
  std::string s = std::string(c.dtype == DType::kFP8 ? "fp8 " : "bf16 ") + (c.l1 ? "L1" : "L2") +
                  " H=" + std::to_string(c.hidden) + " I=" + std::to_string(c.inter) + " counts=";
  for (int n : c.counts) s += std::to_string(n) + ",";
  s += " clamp=" + std::to_string(c.clamp) + (c.pow2 ? " pow2" : "") + (c.exact ? " exact" : "");
  return s;
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const bool fp8 = c.dtype == DType::kFP8;
  const int G = int(c.counts.size());
  const int align = gemm::row_align(c.dtype);
  const int K = c.l1 ? c.hidden : c.inter;     // reduction
  const int NB = c.l1 ? 2 * c.inter : c.hidden;  // weight rows per expert (user layout)
  const int NO = c.l1 ? c.inter : c.hidden;      // output columns
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> small(-4, 4);

  // Expert segments, with an extra gap after odd experts and a padded tail.
  std::vector<int> offset(G + 1, 0);
  for (int e = 0; e < G; ++e) offset[e + 1] = offset[e] + (c.counts[e] + align - 1) / align * align + (e % 2) * align;
  const int64_t max_rows = offset[G] + align;
  const int64_t ss = max_rows + 4;  // scale stride deliberately != max_rows
  std::vector<char> valid(max_rows, 0);
  std::vector<int> row_expert(max_rows, -1);
  for (int e = 0; e < G; ++e)
    for (int r = 0; r < c.counts[e]; ++r) {
      valid[offset[e] + r] = 1;
      row_expert[offset[e] + r] = e;
    }

  // ---- Activations: quantized / rounded inputs and their exact values. -------------------------
  std::vector<double> a_val(max_rows * size_t(K), 0.0);
  std::vector<uint8_t> a_q(fp8 ? max_rows * size_t(K) : 0, 0x7F);  // NaN in padding rows
  std::vector<float> a_s(fp8 ? size_t(K / 128) * ss : 0, NAN);
  std::vector<uint16_t> a_b(fp8 ? 0 : max_rows * size_t(K), 0x7FFF);
  std::vector<float> row(K);
  std::vector<uint8_t> qrow(K);
  std::vector<float> srow(K / 128);
  for (int64_t r = 0; r < max_rows; ++r) {
    if (!valid[r]) continue;
    const float mag = std::ldexp(1.0f, int(rng() % 7) - 3);  // rows of different magnitude
    if (fp8 && c.exact) {
      for (int k = 0; k < K; ++k) qrow[k] = ref::e4m3_from_float(float(small(rng)));
      for (int g = 0; g < K / 128; ++g) srow[g] = std::ldexp(1.0f, int(rng() % 5) - 2);
    } else if (fp8) {
      for (int k = 0; k < K; ++k) row[k] = uni(rng) * mag;
      ref::quantize_1x128(row.data(), K, c.pow2, qrow.data(), srow.data());
    }
    for (int k = 0; k < K; ++k) {
      if (fp8) {
        a_q[r * K + k] = qrow[k];
        a_val[r * K + k] = ref::e4m3_table()[qrow[k]] * double(srow[k / 128]);
      } else {
        const float v = c.exact ? float(small(rng)) : uni(rng) * mag;
        a_b[r * K + k] = ref::bf16_from_float(v);
        a_val[r * K + k] = ref::bf16_to_float(a_b[r * K + k]);
      }
    }
    if (fp8)
      for (int g = 0; g < K / 128; ++g) a_s[g * ss + r] = srow[g];
  }

  // ---- Weights, user layout [G][NB][K], FP8 scales [G][NB/128][K/128]. ------------------------
  const size_t wn = size_t(G) * NB * K;
  std::vector<double> w_val(wn);
  std::vector<uint8_t> w_q(fp8 ? wn : 0);
  std::vector<float> w_s(fp8 ? size_t(G) * (NB / 128) * (K / 128) : 0);
  std::vector<uint16_t> w_b(fp8 ? 0 : wn);
  {
    std::vector<float> wf(size_t(NB) * K);
    for (int e = 0; e < G; ++e) {
      const size_t base = size_t(e) * NB * K;
      const size_t sbase = size_t(e) * (NB / 128) * (K / 128);
      if (fp8 && c.exact) {
        for (size_t i = 0; i < size_t(NB) * K; ++i) w_q[base + i] = ref::e4m3_from_float(float(small(rng)));
        for (int i = 0; i < (NB / 128) * (K / 128); ++i) w_s[sbase + i] = std::ldexp(1.0f, int(rng() % 5) - 4);
      } else if (fp8) {
        for (auto& v : wf) v = uni(rng) * 0.05f;
        ref::quantize_128x128(wf.data(), NB, K, false, w_q.data() + base, w_s.data() + sbase);
      }
      for (int n = 0; n < NB; ++n)
        for (int k = 0; k < K; ++k) {
          const size_t i = base + size_t(n) * K + k;
          if (fp8) {
            w_val[i] = ref::e4m3_table()[w_q[i]] * double(w_s[sbase + (n / 128) * (K / 128) + k / 128]);
          } else {
            const float v = c.exact ? float(small(rng)) * 0.125f : uni(rng) * 0.05f;
            w_b[i] = ref::bf16_from_float(v);
            w_val[i] = ref::bf16_to_float(w_b[i]);
          }
        }
    }
  }
  std::vector<float> row_weight(max_rows, NAN);
  for (int64_t r = 0; r < max_rows; ++r)
    if (valid[r]) row_weight[r] = c.exact ? std::ldexp(1.0f, -int(rng() % 3)) : 0.1f + 0.9f * (uni(rng) * 0.5f + 0.5f);

  // ---- float64 reference GEMM: h[r][n] over the user layout. ---------------------------------
  std::vector<double> h(max_rows * size_t(NB), 0.0);
  for (int64_t r = 0; r < max_rows; ++r) {
    if (!valid[r]) continue;
    const double* ar = &a_val[r * K];
    const double* we = &w_val[size_t(row_expert[r]) * NB * K];
    for (int n = 0; n < NB; ++n) {
      const double* wr = we + size_t(n) * K;
      double acc = 0.0;
      for (int k = 0; k < K; ++k) acc += ar[k] * wr[k];
      h[r * NB + n] = acc;
    }
  }

  // ---- Device run. ---------------------------------------------------------------------------
  DeviceBuf<int> d_count(G), d_offset(G + 1);
  d_count.upload(c.counts);
  d_offset.upload(offset);
  DeviceBuf<uint8_t> d_a(max_rows * size_t(K) * (fp8 ? 1 : 2));
  DeviceBuf<float> d_as(fp8 ? a_s.size() : 1);
  DeviceBuf<uint8_t> d_w(wn * (fp8 ? 1 : 2)), d_w_int(wn * (fp8 ? 1 : 2));
  DeviceBuf<float> d_ws(fp8 ? w_s.size() : 1), d_ws_int(fp8 ? w_s.size() : 1);
  DeviceBuf<float> d_rw(max_rows);
  const size_t out_elem = (c.l1 && fp8) ? 1 : 2;
  DeviceBuf<uint8_t> d_out(max_rows * size_t(NO) * out_elem);
  DeviceBuf<float> d_out_s(size_t(NO / 128) * ss);
  ASSERT_NE(d_out.ptr, nullptr);
  ASSERT_NE(d_w_int.ptr, nullptr);
  if (fp8) {
    EPMOE_CUDA_OK(cudaMemcpy(d_a.ptr, a_q.data(), a_q.size(), cudaMemcpyHostToDevice));
    EPMOE_CUDA_OK(cudaMemcpy(d_as.ptr, a_s.data(), a_s.size() * 4, cudaMemcpyHostToDevice));
    EPMOE_CUDA_OK(cudaMemcpy(d_w.ptr, w_q.data(), w_q.size(), cudaMemcpyHostToDevice));
    EPMOE_CUDA_OK(cudaMemcpy(d_ws.ptr, w_s.data(), w_s.size() * 4, cudaMemcpyHostToDevice));
  } else {
    EPMOE_CUDA_OK(cudaMemcpy(d_a.ptr, a_b.data(), a_b.size() * 2, cudaMemcpyHostToDevice));
    EPMOE_CUDA_OK(cudaMemcpy(d_w.ptr, w_b.data(), w_b.size() * 2, cudaMemcpyHostToDevice));
  }
  d_rw.upload(row_weight);
  EPMOE_CUDA_OK(cudaMemset(d_out.ptr, 0xFF, d_out.n));      // NaN in bf16 and e4m3
  EPMOE_CUDA_OK(cudaMemset(d_out_s.ptr, 0xFF, d_out_s.n * 4));  // NaN scales

  gemm::GroupedArgs args{G, d_count.ptr, d_offset.ptr, max_rows, ss};
  cudaStream_t stream;
  EPMOE_CUDA_OK(cudaStreamCreate(&stream));
  if (c.l1) {
    EPMOE_OK(gemm::prepare_w1(c.dtype, d_w.ptr, fp8 ? d_ws.ptr : nullptr, d_w_int.ptr, fp8 ? d_ws_int.ptr : nullptr, G,
                              c.inter, c.hidden, stream));
    EPMOE_OK(gemm::l1(c.dtype, args, d_a.ptr, fp8 ? d_as.ptr : nullptr, d_w_int.ptr, fp8 ? d_ws_int.ptr : nullptr,
                      d_rw.ptr, c.hidden, c.inter, c.clamp, c.pow2, d_out.ptr, fp8 ? d_out_s.ptr : nullptr, stream));
  } else {
    EPMOE_OK(gemm::prepare_w2(c.dtype, d_w.ptr, fp8 ? d_ws.ptr : nullptr, d_w_int.ptr, fp8 ? d_ws_int.ptr : nullptr, G,
                              c.hidden, c.inter, stream));
    EPMOE_OK(gemm::l2(c.dtype, args, d_a.ptr, fp8 ? d_as.ptr : nullptr, d_w_int.ptr, fp8 ? d_ws_int.ptr : nullptr,
                      c.inter, c.hidden, d_out.ptr, stream));
  }
  EPMOE_CUDA_OK(cudaStreamSynchronize(stream));
  EPMOE_CUDA_OK(cudaGetLastError());
  EPMOE_CUDA_OK(cudaStreamDestroy(stream));
  const std::vector<uint8_t> out = d_out.download();
  const std::vector<float> out_s = d_out_s.download();

  // ---- Checks. -------------------------------------------------------------------------------
  auto bf16_at = [&](int64_t r, int n) {
    uint16_t b;
    std::memcpy(&b, &out[(r * NO + n) * 2], 2);
    return double(ref::bf16_to_float(b));
  };
  double err2 = 0.0, ref2 = 0.0;
  int64_t nonfinite = 0, checked = 0;
  if (!c.l1) {
    for (int64_t r = 0; r < max_rows; ++r) {
      if (!valid[r]) continue;
      for (int n = 0; n < NO; ++n) {
        const double g = bf16_at(r, n), x = h[r * NB + n];
        if (!std::isfinite(g)) ++nonfinite;
        err2 += (g - x) * (g - x);
        ref2 += x * x;
        ++checked;
      }
    }
    EXPECT_EQ(nonfinite, 0) << "unwritten or non-finite outputs";
    const double rel = checked ? std::sqrt(err2 / std::max(ref2, 1e-300)) : 0.0;
    EXPECT_LE(rel, c.exact ? 2e-3 : 4e-3) << "relative L2 error " << rel << " over " << checked << " outputs";
    return;
  }

  // L1: the reference activation in fp32 from the float64 GEMM, then SPEC step 5.
  std::vector<float> a_ref(NO);
  std::vector<uint8_t> q_ref(NO);
  std::vector<float> s_ref(NO / 128);
  int64_t code_far = 0, code_off = 0, scale_bad = 0;
  for (int64_t r = 0; r < max_rows; ++r) {
    if (!valid[r]) continue;
    for (int i = 0; i < NO; ++i)
      a_ref[i] = ref::swiglu(float(h[r * NB + i]), float(h[r * NB + NO + i]), c.clamp, row_weight[r]);
    if (fp8) {
      ref::quantize_1x128(a_ref.data(), NO, c.pow2, q_ref.data(), s_ref.data());
      for (int g = 0; g < NO / 128; ++g) {
        const float s = out_s[g * ss + r];
        if (!std::isfinite(s)) ++nonfinite;
        // Exact operands: only the epilogue's approximate silu (a few ulps) may differ. Random: the FP8 tensor-core
        // partial sums carry ~2^-13 relative error before promotion, so amax moves by ~1e-4.
        const double tol = c.exact ? 1e-6 : 2e-3;
        // Power-of-two scales with random operands: when amax / 448 lies within that error of a power
        // of two, the GPU's amax may round up to the power below the reference's (seen: 2^-15 against
        // 2^-14). Accepted only there, and only one power apart.
        bool at_boundary = false;
        if (c.pow2 && !c.exact) {
          float amax = 0.0f;
          for (int i = g * 128; i < g * 128 + 128; ++i) amax = std::max(amax, std::fabs(a_ref[i]));
          const double raw = std::max(double(amax), 1e-4) / 448.0;
          at_boundary = double(s) == 0.5 * double(s_ref[g]) && raw <= (1.0 + tol) * double(s);
        }
        if (!(std::fabs(s - s_ref[g]) <= tol * s_ref[g]) && !at_boundary) {
          if (scale_bad++ < 5)
            ADD_FAILURE() << "row " << r << " group " << g << ": scale " << s << " vs reference " << s_ref[g];
        }
      }
      for (int i = 0; i < NO; ++i) {
        const uint8_t q = out[r * NO + i];
        if ((q & 0x7F) == 0x7F) ++nonfinite;
        // Against the reference's dequantized activation.
        const double g = ref::e4m3_table()[q] * double(out_s[(i / 128) * ss + r]);
        const double x = ref::e4m3_table()[q_ref[i]] * double(s_ref[i / 128]);
        const int d = std::abs(e4m3_ordinal(q) - e4m3_ordinal(q_ref[i]));
        // Exact: at most one code apart (a rounding boundary). Random: within one e4m3 step of
        // the value plus the GEMM's error, which scales with the group's amax (448 s).
        const bool far = c.exact ? d > 1 : std::fabs(g - x) > 0.125 * std::fabs(x) + 4e-3 * 448.0 * s_ref[i / 128];
        if (far && code_far++ < 5)
          ADD_FAILURE() << "row " << r << " channel " << i << ": code " << int(q) << " vs reference " << int(q_ref[i])
                        << " (a=" << a_ref[i] << ", scale " << s_ref[i / 128] << ")";
        if (d >= 1) ++code_off;
        err2 += (g - x) * (g - x);
        ref2 += x * x;
        ++checked;
      }
    } else {
      for (int i = 0; i < NO; ++i) {
        const double g = bf16_at(r, i);
        if (!std::isfinite(g)) ++nonfinite;
        err2 += (g - a_ref[i]) * (g - a_ref[i]);
        ref2 += double(a_ref[i]) * a_ref[i];
        ++checked;
      }
    }
  }
  EXPECT_EQ(nonfinite, 0) << "unwritten or non-finite outputs";
  EXPECT_EQ(scale_bad, 0);
  EXPECT_EQ(code_far, 0);
  // Codes apart come from values a last bit away from the reference's at a rounding boundary:
  // rare with exact operands; with random ones the GEMM's own error moves a few percent.
  EXPECT_LE(double(code_off), (c.exact ? 0.002 : 0.08) * double(std::max<int64_t>(checked, 1)) + 2)
      << code_off << " of " << checked << " codes differ";
  const double rel = checked ? std::sqrt(err2 / std::max(ref2, 1e-300)) : 0.0;
  EXPECT_LE(rel, fp8 ? 1e-2 : 4e-3) << "relative L2 error of the activations " << rel;
}

uint64_t fresh_seed() {
  std::random_device rd;
  const uint64_t s = (uint64_t(rd()) << 32) ^ rd();
  std::printf("[gemm test] seed %llu\n", (unsigned long long)s);
  return s;
}

// Counts 0, 1, block-1, block+1 and a large one, in a mixed order.
std::vector<int> edge_counts(DType d) {
  const int b = gemm::row_align(d);
  return {0, 1, b - 1, b + 1, 0, 9 * b + 17};
}

class GemmShapes : public ::testing::TestWithParam<std::tuple<DType, bool, int, int>> {};

TEST_P(GemmShapes, MatchesFloat64Reference) {
  EPMOE_REQUIRE_GPUS(1);
  auto [dt, l1, hidden, inter] = GetParam();
  Case c{dt, l1, edge_counts(dt), hidden, inter};
  run_case(c, fresh_seed());
}

// N and K at the smallest size (128) and odd multiples of 128.
INSTANTIATE_TEST_SUITE_P(
    Sm90, GemmShapes,
    ::testing::Combine(::testing::Values(DType::kFP8, DType::kBF16), ::testing::Bool(), ::testing::Values(128, 384),
                       ::testing::Values(128, 640)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == DType::kFP8 ? "fp8" : "bf16") + (std::get<1>(info.param) ? "_L1" : "_L2") +
             "_H" + std::to_string(std::get<2>(info.param)) + "_I" + std::to_string(std::get<3>(info.param));
    });

// The FP8 L2 kernel at N = 128 (half a tile), 384 (one and a half), 7168 (28); K = 128 (one K
// block), 640 (a chunk of four plus one), 768 (four plus two), 2048 (four chunks). Exact operands
// too. (These shapes were the 256-column half of the removed 128-column tile's test.)
TEST(GemmL2Shapes, Fp8EdgeShapes) {
  EPMOE_REQUIRE_GPUS(1);
  const struct { int hidden, inter; } shapes[] = {{128, 128}, {384, 640}, {384, 768}, {7168, 2048}};
  for (const auto& sh : shapes)
    for (bool exact : {false, true}) {
      Case c{DType::kFP8, false, edge_counts(DType::kFP8), sh.hidden, sh.inter};
      if (sh.hidden == 7168) c.counts = {0, 1, 129, 256};
      c.exact = exact;
      run_case(c, fresh_seed());
    }
}

// The FP8 K loop has two forms: whole rings of 4 stages per tile (K / 128 a multiple of 4, each
// tile starting at stage 0) and the general one. K = 512 (one ring: the first ring is the last),
// 1536 (three) and 896 (seven K blocks, general), both GEMMs, random and exact operands; full tiles
// (the deferred epilogue keeps the last stage), partial ones, and tiles of <= 64 rows (one math
// warpgroup idle).
TEST(GemmFp8KLoop, WholeRingsAndGeneral) {
  EPMOE_REQUIRE_GPUS(1);
  for (int k : {512, 1536, 896})
    for (bool l1 : {false, true})
      for (bool exact : {false, true}) {
        Case c{DType::kFP8, l1, {256, 1, 129, 64, 0, 383}, l1 ? k : 384, l1 ? 256 : k};
        c.exact = exact;
        run_case(c, fresh_seed());
      }
}

TEST(GemmL1Epilogue, Fp8ExactClampPow2) {
  EPMOE_REQUIRE_GPUS(1);
  for (bool pow2 : {false, true})
    for (float clamp : {0.0f, 3.0f}) {
      Case c{DType::kFP8, true, {70, 0, 130, 1}, 384, 256, clamp, pow2, true};
      run_case(c, fresh_seed());
    }
}

TEST(GemmL1Epilogue, Bf16Clamp) {
  EPMOE_REQUIRE_GPUS(1);
  Case c{DType::kBF16, true, {5, 200, 64}, 256, 384, 2.5f, false, false};
  run_case(c, fresh_seed());
}

TEST(GemmL1Epilogue, Fp8RandomClampPow2) {
  EPMOE_REQUIRE_GPUS(1);
  Case c{DType::kFP8, true, {300, 63, 65}, 512, 384, 0.75f, true, false};
  run_case(c, fresh_seed());
}

TEST(GemmManyExperts, UnevenCountsRepeatedCalls) {
  EPMOE_REQUIRE_GPUS(1);
  // More tiles than SMs with many empty experts, twice with fresh data on the same shapes.
  std::vector<int> counts;
  for (int e = 0; e < 40; ++e) counts.push_back(e % 5 == 0 ? 0 : (e * 37) % 200);
  for (int rep = 0; rep < 2; ++rep) {
    run_case(Case{DType::kFP8, false, counts, 768, 256}, fresh_seed());
    run_case(Case{DType::kBF16, false, counts, 768, 256}, fresh_seed());
  }
}

// Blocks with several tiles each, full and partial mixed: the L2 kernel's deferred epilogue then
// stages consecutive tiles in one block (its barrier phases advance), refills a kept stage, and runs
// a partial tile's inline store right after a deferred one; K = 640 is 5 K blocks, so the kept
// stage moves around the 4-stage ring. (The other cases here give each block at most one tile.)
TEST(GemmManyTilesPerBlock, DeferredAndPartialTilesMix) {
  EPMOE_REQUIRE_GPUS(1);
  const std::vector<int> counts = {24 * 128, 3 * 128 + 3, 0, 130, 5 * 128 + 127, 1};
  for (DType d : {DType::kFP8, DType::kBF16})
    for (bool l1 : {false, true}) run_case(Case{d, l1, counts, 1024, 640}, fresh_seed());
}

// A tile of <= 64 rows runs on one math warpgroup (the other idle), a larger one on both (64 rows
// each; run, run_rings). The same rows must come out bit for bit the same either way: each output
// row depends only on its own A row, whatever the tile's count (a decode call and a larger one
// give a token the same result). One expert, the same data, called with a count of <= 64 and
// again with more; rows [0, small) are compared, outputs (and L1's scales) poisoned before each
// call. K = 512 takes the whole-ring loop for the larger tile, 640 the general one.
TEST(GemmFp8SmallTiles, SameBitsAsWholeTiles) {
  EPMOE_REQUIRE_GPUS(1);
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (int k : {512, 640})
    for (bool l1 : {false, true}) {
      const int N = 512;                 // L2: hidden; L1: 2 x intermediate
      const int NO = l1 ? N / 2 : N;     // output columns
      const int64_t rows = 128, ss = rows;
      std::vector<uint8_t> a_q(rows * size_t(k)), w_q(size_t(N) * k);
      std::vector<float> a_s(size_t(k / 128) * ss), w_s(size_t(N / 128) * (k / 128)), row(k), srow(k / 128);
      for (int64_t r = 0; r < rows; ++r) {
        const float mag = std::ldexp(1.0f, int(rng() % 7) - 3);
        for (auto& v : row) v = uni(rng) * mag;
        ref::quantize_1x128(row.data(), k, false, a_q.data() + r * k, srow.data());
        for (int g = 0; g < k / 128; ++g) a_s[g * ss + r] = srow[g];
      }
      std::vector<float> wf(size_t(N) * k);
      for (auto& v : wf) v = uni(rng) * 0.05f;
      ref::quantize_128x128(wf.data(), N, k, false, w_q.data(), w_s.data());
      std::vector<float> rw(rows);
      for (auto& v : rw) v = 0.1f + 0.9f * (uni(rng) * 0.5f + 0.5f);

      DeviceBuf<int> d_count(1), d_offset(2);
      d_offset.upload({0, int(rows)});
      DeviceBuf<uint8_t> d_a(a_q.size()), d_w(w_q.size()), d_w_int(w_q.size());
      DeviceBuf<float> d_as(a_s.size()), d_ws(w_s.size()), d_ws_int(w_s.size()), d_rw(rows);
      DeviceBuf<uint8_t> d_out(rows * size_t(NO) * (l1 ? 1 : 2));
      DeviceBuf<float> d_out_s(size_t(NO / 128) * ss);
      for (const void* ptr : {static_cast<const void*>(d_count.ptr), static_cast<const void*>(d_offset.ptr),
                              static_cast<const void*>(d_a.ptr), static_cast<const void*>(d_w.ptr),
                              static_cast<const void*>(d_w_int.ptr), static_cast<const void*>(d_as.ptr),
                              static_cast<const void*>(d_ws.ptr), static_cast<const void*>(d_ws_int.ptr),
                              static_cast<const void*>(d_rw.ptr), static_cast<const void*>(d_out.ptr),
                              static_cast<const void*>(d_out_s.ptr)})
        ASSERT_NE(ptr, nullptr) << "cudaMalloc failed";
      d_a.upload(a_q);
      d_as.upload(a_s);
      d_w.upload(w_q);
      d_ws.upload(w_s);
      d_rw.upload(rw);
      gemm::GroupedArgs args{1, d_count.ptr, d_offset.ptr, rows, ss};
      if (l1)
        EPMOE_OK(gemm::prepare_w1(DType::kFP8, d_w.ptr, d_ws.ptr, d_w_int.ptr, d_ws_int.ptr, 1, N / 2, k, nullptr));
      else
        EPMOE_OK(gemm::prepare_w2(DType::kFP8, d_w.ptr, d_ws.ptr, d_w_int.ptr, d_ws_int.ptr, 1, N, k, nullptr));
      auto call = [&](int count, std::vector<uint8_t>& out, std::vector<float>& out_s) {
        d_count.upload({count});
        EPMOE_CUDA_OK(cudaMemset(d_out.ptr, 0xFF, d_out.n));
        EPMOE_CUDA_OK(cudaMemset(d_out_s.ptr, 0xFF, d_out_s.n * 4));
        if (l1)
          EPMOE_OK(gemm::l1(DType::kFP8, args, d_a.ptr, d_as.ptr, d_w_int.ptr, d_ws_int.ptr, d_rw.ptr, k, N / 2,
                            0.0f, false, d_out.ptr, d_out_s.ptr, nullptr));
        else
          EPMOE_OK(gemm::l2(DType::kFP8, args, d_a.ptr, d_as.ptr, d_w_int.ptr, d_ws_int.ptr, k, N, d_out.ptr, nullptr));
        EPMOE_CUDA_OK(cudaDeviceSynchronize());
        out = d_out.download();
        out_s = d_out_s.download();
      };
      const struct { int small, large; } pairs[] = {{64, 100}, {1, 128}, {37, 65}};
      for (const auto& pr : pairs) {
        SCOPED_TRACE(std::string(l1 ? "L1" : "L2") + " K=" + std::to_string(k) + " rows " + std::to_string(pr.small) +
                     " against " + std::to_string(pr.large));
        std::vector<uint8_t> o_small, o_large;
        std::vector<float> s_small, s_large;
        // (The lambda's assertions return from it only.)
        call(pr.small, o_small, s_small);
        if (HasFatalFailure()) return;
        call(pr.large, o_large, s_large);
        if (HasFatalFailure()) return;
        const size_t row_bytes = size_t(NO) * (l1 ? 1 : 2);
        // Poison left in a row that should have been written: 0xFF is never an e4m3 output (NaN),
        // and 0xFFFF never a bf16 one (the kernels write finite values here).
        const auto poisoned_in = [&](const std::vector<uint8_t>& o, int r) {
          int64_t n = 0;
          for (size_t b = 0; b < row_bytes; b += l1 ? 1 : 2)
            n += l1 ? o[r * row_bytes + b] == 0xFF : (o[r * row_bytes + b] == 0xFF && o[r * row_bytes + b + 1] == 0xFF);
          return n;
        };
        int64_t differ = 0, poisoned = 0;
        for (int r = 0; r < pr.small; ++r) {
          for (size_t b = 0; b < row_bytes; ++b) differ += o_small[r * row_bytes + b] != o_large[r * row_bytes + b];
          poisoned += poisoned_in(o_small, r);
        }
        for (int r = 0; r < pr.large; ++r) poisoned += poisoned_in(o_large, r);
        EXPECT_EQ(differ, 0) << "output bytes differ";
        EXPECT_EQ(poisoned, 0) << "outputs left unwritten";
        if (l1)
          for (int g = 0; g < NO / 128; ++g)
            for (int r = 0; r < pr.small; ++r) {
              uint32_t a, b;
              std::memcpy(&a, &s_small[g * ss + r], 4);
              std::memcpy(&b, &s_large[g * ss + r], 4);
              ASSERT_EQ(a, b) << "scale of row " << r << " group " << g;
              ASSERT_TRUE(std::isfinite(s_small[g * ss + r])) << "row " << r << " group " << g;
            }
        // Rows past the count stay untouched, in both calls.
        for (const auto& [o, count] : {std::make_pair(&o_small, pr.small), std::make_pair(&o_large, pr.large)})
          for (int64_t r = count; r < rows; ++r)
            for (size_t b = 0; b < row_bytes; ++b)
              ASSERT_EQ((*o)[r * row_bytes + b], 0xFF) << "row " << r << " past the count " << count << " was written";
      }
    }
}

// Many experts of 1-64 rows: every tile has one working math warpgroup, and each block runs
// several in a row, so the idle warpgroup runs ahead into the next tile (the other cases here give
// each block at most one tile of <= 64 rows).
TEST(GemmFp8SmallTiles, ManyPerBlock) {
  EPMOE_REQUIRE_GPUS(1);
  std::vector<int> counts;
  for (int e = 0; e < 160; ++e) counts.push_back(1 + (e * 29) % 64);
  for (bool l1 : {false, true}) run_case(Case{DType::kFP8, l1, counts, 512, 640}, fresh_seed());
}

// The layer's use of a plan: built once, launched on several calls whose expert counts change on
// the device in between. Also: a stale error from an unrelated runtime call is not blamed on the
// launch (launch returns cudaLaunchKernelEx's own result, never cudaGetLastError).
TEST(GemmPlanLaunch, ReusedAcrossCountsAndIgnoresStaleErrors) {
  EPMOE_REQUIRE_GPUS(1);
  constexpr int G = 2, H = 128, I = 128;
  const int b = gemm::row_align(DType::kBF16);
  const std::vector<int> offset = {0, b, 3 * b};
  const int64_t max_rows = 3 * b;
  DeviceBuf<int> d_count(G), d_offset(G + 1);
  DeviceBuf<uint16_t> d_a(size_t(max_rows) * I), d_w(size_t(G) * H * I), d_out(size_t(max_rows) * H);
  ASSERT_NE(d_a.ptr, nullptr);
  ASSERT_NE(d_w.ptr, nullptr);
  ASSERT_NE(d_out.ptr, nullptr);
  d_offset.upload(offset);
  d_a.upload(std::vector<uint16_t>(d_a.n, 0x3F80));  // bf16 1.0
  d_w.upload(std::vector<uint16_t>(d_w.n, 0x3F80));

  gemm::GemmPlan empty;
  EXPECT_EQ(gemm::launch(empty, nullptr).code(), epmoe::StatusCode::kInvalidArgument);

  gemm::GroupedArgs args{G, d_count.ptr, d_offset.ptr, max_rows, max_rows};
  gemm::GemmPlan plan;
  EPMOE_OK(gemm::plan_l2(DType::kBF16, args, d_a.ptr, nullptr, d_w.ptr, nullptr, I, H, d_out.ptr, &plan));
  int dev = -1, sms = 0;
  EPMOE_CUDA_OK(cudaGetDevice(&dev));
  EPMOE_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  EXPECT_EQ(plan.device, dev);
  EXPECT_EQ(plan.grid, sms);

  const std::vector<std::vector<int>> calls = {{3, 0}, {0, b + 2}, {b, 1}};
  for (const auto& counts : calls) {
    d_count.upload(counts);
    EPMOE_CUDA_OK(cudaMemset(d_out.ptr, 0xFF, d_out.n * 2));  // NaN
    EXPECT_NE(cudaSetDevice(-1), cudaSuccess);               // leaves a stale error behind
    EPMOE_OK(gemm::launch(plan, nullptr));
    (void)cudaGetLastError();
    EPMOE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = d_out.download();
    for (int e = 0; e < G; ++e)
      for (int64_t r = offset[e]; r < offset[e + 1]; ++r) {
        const uint16_t want = r - offset[e] < counts[e] ? 0x4300 : 0xFFFF;  // 128.0 or untouched
        for (int c = 0; c < H; ++c)
          ASSERT_EQ(out[size_t(r) * H + c], want) << "expert " << e << " row " << r << " col " << c
                                                 << " counts " << counts[0] << "," << counts[1];
      }
  }
}

TEST(GemmValidation, RejectsBadShapes) {
  gemm::GroupedArgs args{2, reinterpret_cast<const int*>(16), reinterpret_cast<const int*>(32), 128, 128};
  const void* p = reinterpret_cast<const void*>(256);
  float* fp = reinterpret_cast<float*>(512);
  auto st = gemm::l2(DType::kBF16, args, p, nullptr, p, nullptr, 100, 256, const_cast<void*>(p), nullptr);
  EXPECT_EQ(st.code(), epmoe::StatusCode::kInvalidArgument) << st.to_string();
  args.max_rows = 100;
  st = gemm::l2(DType::kBF16, args, p, nullptr, p, nullptr, 128, 256, const_cast<void*>(p), nullptr);
  EXPECT_EQ(st.code(), epmoe::StatusCode::kInvalidArgument) << st.to_string();
  args.max_rows = 128;
  args.scale_stride = 64;
  st = gemm::l1(DType::kFP8, args, p, fp, p, fp, fp, 128, 128, 0.0f, false, const_cast<void*>(p), fp, nullptr);
  EXPECT_EQ(st.code(), epmoe::StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_FALSE(gemm::validate_shape(DType::kFP8, 7168, 100).ok());
  EXPECT_TRUE(gemm::validate_shape(DType::kFP8, 7168, 2048).ok());
}

}  // namespace
