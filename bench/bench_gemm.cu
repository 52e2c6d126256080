// epmoe-bench gemm: grouped GEMM TFLOP/s per shape, next to cuBLASLt measured in the same run.
//   FP8:  ours (L2 kernel: block-scaled e4m3, bf16 out) vs a per-expert loop of cuBLASLt FP8
//         matmuls with VEC128 (activation) and BLK128x128 (weight) scales.
//   BF16: ours vs cublasGemmGroupedBatchedEx.
// Also the L1 kernel (same GEMM with the SwiGLU/requant epilogue, weight rows = N).
// Flags (epmoe-bench gemm --help): --dtype fp8|bf16|both  --iters N  --quick (first two shapes only)
//        --shape G,M,N,K (repeatable: G groups of M rows each, instead of the built-in list)
//        --json [FILE]  --quiet
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "bench_util.h"
#include "host/gemm.h"

namespace {

using epmoe::DType;
using epmoe::bench::Json;
using epmoe::bench::json_number;
using epmoe::bench::Output;
namespace gemm = epmoe::gemm;

#define BENCH_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t _e = (call);                                                                  \
    if (_e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(_e)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// Deterministic pseudo-random fill on the device: finite e4m3 codes, bf16 in [-1, 1], or
// positive fp32 scales near `scale`.
__device__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return uint32_t(x);
}
__global__ void fill_e4m3(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(i, seed);
    p[i] = uint8_t((h & 0x80) | (h % 0x58));  // |v| < 2^4: finite, never NaN
  }
}
__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = (hash32(i, seed) & 0xFFFF) / 32768.0f - 1.0f;
    p[i] = uint16_t(__float_as_uint(v) >> 16);
  }
}
__global__ void fill_f32(float* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = scale * (0.5f + (hash32(i, seed) & 0xFFFF) / 65536.0f);
}

struct Shape {
  std::string name;
  std::vector<int> rows;  // per expert
  int n, k;
};

std::vector<int> zipf_rows(int groups, int total, double s) {
  std::vector<double> w(groups);
  double sum = 0;
  for (int i = 0; i < groups; ++i) sum += (w[i] = 1.0 / std::pow(i + 1, s));
  std::vector<int> r(groups);
  for (int i = 0; i < groups; ++i) r[i] = int(std::floor(total * w[i] / sum));
  return r;
}

// Median milliseconds of each fn over 5 reps, each rep timing `iters` back-to-back calls of one fn;
// the fns take turns rep by rep. Why in turns: under the GPUs' power cap the clock drifts down over
// a few hundred ms of FP8 work, and whichever kernel was timed later took the slower clock (the L1
// kernel, timed after the L2 one, read 15-20% slower back to back while ncu measured the two within
// 2% of each other in cycles); taking turns gives every kernel the same drift (docs/DESIGN.md).
// A null fn is skipped (its entry is NaN).
std::vector<double> time_ms_turns(const std::vector<std::function<void()>>& fns, int iters, cudaStream_t s) {
  for (const auto& fn : fns)
    if (fn)
      for (int i = 0; i < 3; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<std::vector<float>> t(fns.size());
  for (int rep = 0; rep < 5; ++rep) {
    for (size_t f = 0; f < fns.size(); ++f) {
      if (!fns[f]) continue;
      BENCH_CUDA(cudaEventRecord(a, s));
      for (int i = 0; i < iters; ++i) fns[f]();
      BENCH_CUDA(cudaEventRecord(b, s));
      BENCH_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
      t[f].push_back(ms / iters);
    }
  }
  BENCH_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<double> med(fns.size(), NAN);
  for (size_t f = 0; f < fns.size(); ++f) {
    if (t[f].empty()) continue;
    std::sort(t[f].begin(), t[f].end());
    med[f] = t[f][t[f].size() / 2];
  }
  return med;
}

struct Buffers {
  void* a = nullptr;  // [max_rows][k]
  float* as = nullptr;
  void* w = nullptr;  // [G][n][k]
  float* ws = nullptr;
  void* out = nullptr;  // [max_rows][n] bf16 (L1 uses [max_rows][n/2])
  float* out_s = nullptr;
  float* rw = nullptr;
  int* count = nullptr;
  int* offset = nullptr;
};

// cuBLASLt FP8 with block scales, one matmul per expert: D^T[n][m] = W[n][k] . X[m][k]^T.
struct LtFp8 {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t ws_bytes = 64u << 20;
  std::vector<cublasLtMatmulDesc_t> descs;
  std::vector<cublasLtMatrixLayout_t> layouts;
  struct Call {
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    const void *A, *B;
    void* C;
  };
  std::vector<Call> calls;
  std::string error;

  bool setup(const Shape& sh, const Buffers& b, const std::vector<int>& offset, int64_t scale_stride) {
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return fail("cublasLtCreate");
    BENCH_CUDA(cudaMalloc(&workspace, ws_bytes));
    const int G = int(sh.rows.size());
    for (int e = 0; e < G; ++e) {
      const int m = sh.rows[e];
      if (m == 0) continue;
      Call c{};
      if (cublasLtMatmulDescCreate(&c.d, CUBLAS_COMPUTE_32F, CUDA_R_32F)) return fail("desc");
      descs.push_back(c.d);
      cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
      cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
      int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      if (cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)) ||
          cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)))
        return fail("scale modes");
      const float* sa = b.ws + size_t(e) * (sh.n / 128) * (sh.k / 128);
      const float* sb = b.as + offset[e];  // timing only: the scale layouts are not matched exactly
      cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
      cublasLtMatmulDescSetAttribute(c.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
      cublasLtMatrixLayoutCreate(&c.la, CUDA_R_8F_E4M3, sh.k, sh.n, sh.k);
      // Why round to 16: cuBLASLt FP8 wants 16-aligned sizes; it computes up to 15 padding rows.
      const int m16 = (m + 15) / 16 * 16;
      cublasLtMatrixLayoutCreate(&c.lb, CUDA_R_8F_E4M3, sh.k, m16, sh.k);
      cublasLtMatrixLayoutCreate(&c.lc, CUDA_R_16BF, sh.n, m16, sh.n);
      layouts.insert(layouts.end(), {c.la, c.lb, c.lc});
      cublasLtMatmulPreference_t pref;
      cublasLtMatmulPreferenceCreate(&pref);
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, c.d, c.la, c.lb, c.lc, c.lc, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0) return fail("no cuBLASLt FP8 block-scaled algorithm");
      c.algo = res.algo;
      c.A = static_cast<const uint8_t*>(b.w) + size_t(e) * sh.n * sh.k;
      c.B = static_cast<const uint8_t*>(b.a) + size_t(offset[e]) * sh.k;
      c.C = static_cast<uint16_t*>(b.out) + size_t(offset[e]) * sh.n;
      calls.push_back(c);
    }
    (void)scale_stride;
    return true;
  }
  bool fail(const char* what) {
    error = what;
    return false;
  }
  bool run(cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    for (auto& c : calls)
      if (cublasLtMatmul(lt, c.d, &one, c.A, c.la, c.B, c.lb, &zero, c.C, c.lc, c.C, c.lc, &c.algo, workspace, ws_bytes,
                         s) != CUBLAS_STATUS_SUCCESS)
        return false;
    return true;
  }
  ~LtFp8() {
    for (auto l : layouts) cublasLtMatrixLayoutDestroy(l);
    for (auto d : descs) cublasLtMatmulDescDestroy(d);
    if (workspace) cudaFree(workspace);
    if (lt) cublasLtDestroy(lt);
  }
};

// cublasGemmGroupedBatchedEx over the non-empty experts, one group each.
struct GroupedBf16 {
  cublasHandle_t h = nullptr;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  void** d_ptrs = nullptr;  // A[], B[], C[] on the device
  int groups = 0;
  bool setup(const Shape& sh, const Buffers& b, const std::vector<int>& offset) {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return false;
    std::vector<void*> pa, pb, pc;
    for (size_t e = 0; e < sh.rows.size(); ++e) {
      if (sh.rows[e] == 0) continue;
      ta.push_back(CUBLAS_OP_T);
      tb.push_back(CUBLAS_OP_N);
      m.push_back(sh.n);
      n.push_back(sh.rows[e]);
      k.push_back(sh.k);
      lda.push_back(sh.k);
      ldb.push_back(sh.k);
      ldc.push_back(sh.n);
      size.push_back(1);
      alpha.push_back(1.0f);
      beta.push_back(0.0f);
      pa.push_back(static_cast<uint16_t*>(b.w) + e * size_t(sh.n) * sh.k);
      pb.push_back(static_cast<uint16_t*>(b.a) + size_t(offset[e]) * sh.k);
      pc.push_back(static_cast<uint16_t*>(b.out) + size_t(offset[e]) * sh.n);
    }
    groups = int(pa.size());
    BENCH_CUDA(cudaMalloc(&d_ptrs, 3 * groups * sizeof(void*)));
    BENCH_CUDA(cudaMemcpy(d_ptrs, pa.data(), groups * sizeof(void*), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_ptrs + groups, pb.data(), groups * sizeof(void*), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_ptrs + 2 * groups, pc.data(), groups * sizeof(void*), cudaMemcpyHostToDevice));
    return true;
  }
  bool run(cudaStream_t s) {
    cublasSetStream(h, s);
    return cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                      (const void* const*)d_ptrs, CUDA_R_16BF, lda.data(),
                                      (const void* const*)(d_ptrs + groups), CUDA_R_16BF, ldb.data(), beta.data(),
                                      d_ptrs + 2 * groups, CUDA_R_16BF, ldc.data(), groups, size.data(),
                                      CUBLAS_COMPUTE_32F) == CUBLAS_STATUS_SUCCESS;
  }
  ~GroupedBf16() {
    if (d_ptrs) cudaFree(d_ptrs);
    if (h) cublasDestroy(h);
  }
};

// Times one shape and prints its table row; returns its JSON record. With a bare --json the row
// is not printed (the caller prints the record) and notes go to stderr.
Json bench_shape(const Shape& sh, DType dt, int iters, cudaStream_t s, const Output& out) {
  FILE* note = out.json_stdout() ? stderr : stdout;
  const bool fp8 = dt == DType::kFP8;
  const int G = int(sh.rows.size());
  const int align = gemm::row_align(dt);
  std::vector<int> offset(G + 1, 0);
  int64_t total_rows = 0;
  for (int e = 0; e < G; ++e) {
    offset[e + 1] = offset[e] + (sh.rows[e] + align - 1) / align * align;
    total_rows += sh.rows[e];
  }
  const int64_t max_rows = std::max<int64_t>(offset[G], align);
  const int64_t ss = max_rows;
  const size_t el = fp8 ? 1 : 2;
  Buffers b;
  BENCH_CUDA(cudaMalloc(&b.a, max_rows * sh.k * el));
  BENCH_CUDA(cudaMalloc(&b.as, size_t(sh.k / 128) * ss * 4 * 2));
  BENCH_CUDA(cudaMalloc(&b.w, size_t(G) * sh.n * sh.k * el));
  BENCH_CUDA(cudaMalloc(&b.ws, size_t(G) * (sh.n / 128) * (sh.k / 128) * 4 * 2));
  BENCH_CUDA(cudaMalloc(&b.out, max_rows * sh.n * 2));
  BENCH_CUDA(cudaMalloc(&b.out_s, size_t(sh.n / 256) * ss * 4 + 16));
  BENCH_CUDA(cudaMalloc(&b.rw, max_rows * 4));
  BENCH_CUDA(cudaMalloc(&b.count, G * 4));
  BENCH_CUDA(cudaMalloc(&b.offset, (G + 1) * 4));
  BENCH_CUDA(cudaMemcpy(b.count, sh.rows.data(), G * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(b.offset, offset.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
  if (fp8) {
    fill_e4m3<<<1024, 256, 0, s>>>(static_cast<uint8_t*>(b.a), max_rows * sh.k, 1);
    fill_e4m3<<<1024, 256, 0, s>>>(static_cast<uint8_t*>(b.w), size_t(G) * sh.n * sh.k, 2);
  } else {
    fill_bf16<<<1024, 256, 0, s>>>(static_cast<uint16_t*>(b.a), max_rows * sh.k, 1);
    fill_bf16<<<1024, 256, 0, s>>>(static_cast<uint16_t*>(b.w), size_t(G) * sh.n * sh.k, 2);
  }
  fill_f32<<<256, 256, 0, s>>>(b.as, size_t(sh.k / 128) * ss * 2, 3, 1.0f / 16);
  fill_f32<<<256, 256, 0, s>>>(b.ws, size_t(G) * (sh.n / 128) * (sh.k / 128) * 2, 4, 1.0f / 256);
  fill_f32<<<256, 256, 0, s>>>(b.rw, max_rows, 5, 0.5f);
  BENCH_CUDA(cudaGetLastError());

  gemm::GroupedArgs args{G, b.count, b.offset, max_rows, ss};
  const double flops = 2.0 * double(total_rows) * sh.n * sh.k;
  const double bytes = double(G) * sh.n * sh.k * el + double(total_rows) * sh.k * el + double(total_rows) * sh.n * 2;
  // Planned once, as the layer does; the timed loop only launches.
  gemm::GemmPlan plan_l2, plan_l1;
  const epmoe::Status st2 = gemm::plan_l2(dt, args, b.a, b.as, b.w, b.ws, sh.k, sh.n, b.out, &plan_l2);
  const epmoe::Status st1 =
      gemm::plan_l1(dt, args, b.a, b.as, b.w, b.ws, b.rw, sh.k, sh.n / 2, 0.0f, false, b.out, b.out_s, &plan_l1);
  if (!st2.ok()) std::fprintf(note, "  plan_l2: %s\n", st2.to_string().c_str());
  if (!st1.ok()) std::fprintf(note, "  plan_l1: %s\n", st1.to_string().c_str());
  bool ok = true;
  auto ours_l2 = [&] { ok &= gemm::launch(plan_l2, s).ok(); };
  auto ours_l1 = [&] { ok &= gemm::launch(plan_l1, s).ok(); };
  // cuBLASLt (FP8, block-scaled, per expert) or the grouped bf16 GEMM, timed in turns with ours.
  LtFp8 lt;
  GroupedBf16 gb;
  std::function<void()> ref;
  std::string ref_note;
  if (fp8) {
    if (lt.setup(sh, b, offset, ss) && lt.run(s)) {
      ref = [&] { lt.run(s); };
    } else {
      ref_note = lt.error.empty() ? "cuBLASLt call failed" : lt.error;
      cudaGetLastError();
    }
  } else {
    if (gb.setup(sh, b, offset) && gb.run(s)) {
      ref = [&] { gb.run(s); };
    } else {
      ref_note = "cublasGemmGroupedBatchedEx failed";
    }
  }
  const std::vector<double> tm = time_ms_turns({ours_l2, ours_l1, ref}, iters, s);
  const double t2 = tm[0], t1 = tm[1], tref = tm[2];
  if (!ok) std::fprintf(note, "  (a gemm call returned an error)\n");

  const double tf2 = flops / (t2 * 1e9), tf1 = flops / (t1 * 1e9), tfr = flops / (tref * 1e9);
  if (!out.json_stdout())
    std::printf("%-5s %-26s %9.3f %8.1f %8.0f | %9.3f %8.1f | %9.3f %8.1f %6.2f %s\n", fp8 ? "fp8" : "bf16",
                sh.name.c_str(), t2, tf2, bytes / (t2 * 1e6), t1, tf1, tref, tfr, tf2 / tfr, ref_note.c_str());
  std::fflush(stdout);
  // The table's columns, same precision; null where the table has "-" or the time is missing.
  Json j;
  j["mode"] = "gemm";
  j["dtype"] = fp8 ? "fp8" : "bf16";
  j["shape"] = sh.name;
  j["groups"] = G;
  j["rows"] = total_rows;
  j["n"] = sh.n;
  j["k"] = sh.k;
  j["iters"] = iters;
  j["l2_ms"] = json_number(t2, 3);
  j["l2_tflops"] = json_number(tf2, 1);
  j["l2_gbs"] = json_number(bytes / (t2 * 1e6), 0);
  j["l1_ms"] = json_number(t1, 3);
  j["l1_tflops"] = json_number(tf1, 1);
  j["ref_ms"] = json_number(tref, 3);
  j["ref_tflops"] = json_number(tfr, 1);
  j["ratio"] = json_number(tf2 / tfr, 2);
  j["ref_note"] = ref_note;
  j["calls_ok"] = ok;
  cudaFree(b.a), cudaFree(b.as), cudaFree(b.w), cudaFree(b.ws), cudaFree(b.out), cudaFree(b.out_s);
  cudaFree(b.rw), cudaFree(b.count), cudaFree(b.offset);
  return j;
}

struct GemmFlags {
  std::string dtype = "both";
  int iters = 10;
  bool quick = false;
  std::vector<std::string> shapes;
};

int run_gemm(const GemmFlags& f, const Output& out) {
  const std::string& dtype = f.dtype;
  const int iters = f.iters;
  const bool quick = f.quick;
  std::vector<Shape> custom;
  const char* usage = "usage: epmoe-bench gemm [--dtype fp8|bf16|both] [--iters N] [--quick] [--shape G,M,N,K ...]\n";
  for (const std::string& v : f.shapes) {
    int g = 0, m = 0, n = 0, k = 0;
    char tail = 0;
    // Why these limits: the kernels need N and K in multiples of 128 (gemm::validate_shape), and
    // the benchmark allocates every group's rows at once.
    if (std::sscanf(v.c_str(), "%d,%d,%d,%d%c", &g, &m, &n, &k, &tail) != 4 || g < 1 || g > 1024 || m < 0 ||
        m > 65536 || n < 128 || n % 128 != 0 || k < 128 || k % 128 != 0) {
      std::fprintf(stderr, "epmoe-bench gemm: bad --shape '%s' (want G,M,N,K: G in [1, 1024], M in [0, 65536], N and K positive multiples of 128)\n", v.c_str());
      return 2;
    }
    custom.push_back({"(" + v + ")", std::vector<int>(g, m), n, k});
  }
  if (iters < 1) {
    std::fprintf(stderr, "epmoe-bench gemm: --iters must be >= 1\n%s", usage);
    return 2;
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("epmoe-bench gemm: needs 1 GPU, 0 visible. Nothing to measure here.\n");
    return 0;
  }
  auto uniform = [](int g, int m) { return std::vector<int>(g, m); };
  std::vector<Shape> shapes = {
      {"(8,4096,4096,7168)", uniform(8, 4096), 4096, 7168},
      {"(8,4096,7168,2048)", uniform(8, 4096), 7168, 2048},
      {"(32,256,4096,7168)", uniform(32, 256), 4096, 7168},
      {"(32,256,7168,2048)", uniform(32, 256), 7168, 2048},
      {"decode(32,64,4096,7168)", uniform(32, 64), 4096, 7168},
      {"decode(32,8,4096,7168)", uniform(32, 8), 4096, 7168},
      {"(64,512,1536,2048)", uniform(64, 512), 1536, 2048},
      {"zipf(32,~256,4096,7168)", zipf_rows(32, 32 * 256, 1.1), 4096, 7168},
  };
  if (quick) shapes.resize(2);
  if (!custom.empty()) shapes = custom;
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (!out.json_stdout()) {
    std::printf("epmoe-bench gemm on %s (%d SMs); median of 5 x %d calls, the kernels of a shape timed in turns\n",
                prop.name, prop.multiProcessorCount, iters);
    std::printf("%-5s %-26s %9s %8s %8s | %9s %8s | %9s %8s %6s\n", "dtype", "shape (G,M,N,K)", "L2 ms", "TFLOP/s",
                "GB/s", "L1 ms", "TFLOP/s", "ref ms", "TFLOP/s", "ratio");
  }
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  std::vector<DType> dtypes;
  for (DType dt : {DType::kFP8, DType::kBF16}) {
    if (dtype == "fp8" && dt != DType::kFP8) continue;
    if (dtype == "bf16" && dt != DType::kBF16) continue;
    dtypes.push_back(dt);
  }
  epmoe::bench::Progress progress("gemm", int(dtypes.size() * shapes.size()), out.quiet);
  for (DType dt : dtypes)
    for (const auto& sh : shapes) {
      progress.step(std::string(dt == DType::kFP8 ? "fp8 " : "bf16 ") + sh.name);
      Json j = bench_shape(sh, dt, iters, s, out);
      j["gpu"] = prop.name;
      const std::string line = epmoe::bench::json_line(j);
      if (out.json_stdout()) {
        std::fputs(line.c_str(), stdout);
        std::fflush(stdout);
      }
      if (out.json_file() && !epmoe::bench::append_json_file(out, line, "gemm")) return 1;
    }
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace

// The flags; every check that needs no GPU runs before the GPU count is read.
epmoe::bench::Run setup_gemm(CLI::App& app) {
  auto f = std::make_shared<GemmFlags>();
  app.add_option("--dtype", f->dtype, "which kernels: fp8, bf16 or both")
      ->check(CLI::IsMember({"fp8", "bf16", "both"}))
      ->capture_default_str();
  app.add_option("--iters", f->iters, "calls per timed batch (median of 5 batches)")->capture_default_str();
  app.add_flag("--quick", f->quick, "only the first two built-in shapes");
  app.add_option("--shape", f->shapes,
                 "G,M,N,K: G groups of M rows, N x K weights, instead of the built-in list (repeatable; N and K "
                 "multiples of 128)")
      ->type_name("G,M,N,K")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.footer("Prints one row per (dtype, shape): the L2 and L1 kernels and the cuBLAS(Lt) reference. Without a GPU "
             "it says so and exits 0.");
  return [f](const Output& out) { return run_gemm(*f, out); };
}

EPMOE_BENCH_COMMAND("gemm", "grouped GEMM TFLOP/s per shape vs cuBLASLt (FP8 block-scaled) and cuBLAS grouped (BF16)",
                    setup_gemm);
