// The interface between the probe's C API (tools/probes/cutlass_grouped_fp8.cu) and its CUTLASS
// kernels (one translation unit per kernel, sm90_grouped_fp8_<kernel>.cu, each instantiating
// sm90_grouped_fp8_kernel.cuh). Plain C++: the C API's TU compiles without the CUTLASS headers.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

namespace epmoe_cutlass_probe {

// One grouped GEMM, described per group as CUTLASS's ptr-array kernels take it:
//   D[g] bf16 [rows[g]][n] = sum_kb a_scale[g][kb][r] * b_scale[g][n/128][kb] * (A[g] B[g]^T)_kb
//   A[g]       e4m3 [rows[g]][k], row stride k
//   a_scale[g] fp32 [k/128][rows[g]], compact (CUTLASS's grouped mainloop rebuilds this layout
//              from the group's M, so the K-block stride is rows[g], not the pool's scale_stride)
//   B[g]       e4m3 [n][k], row stride k
//   b_scale[g] fp32 [n/128][k/128] (K-major, which the mainloop reads through its layout type)
//   D[g]       bf16 [rows[g]][n], row stride n
// A group with rows[g] == 0 has no tiles; its pointers are still valid addresses.
struct GroupedProblem {
  int device = 0;
  int sm_count = 0;
  int n = 0;
  int k = 0;
  std::vector<int> rows;
  std::vector<const void*> a;
  std::vector<const float*> a_scale;
  std::vector<const void*> b;
  std::vector<const float*> b_scale;
  std::vector<void*> d;
  bool raster_along_n = false;  // the grouped scheduler's order within a group (CUTLASS's default: M)
  int max_swizzle = 1;
};

// One CUTLASS kernel with its arguments fixed: device arrays, workspace and params were set up once.
class GemmRunner {
 public:
  virtual ~GemmRunner() = default;
  // Launches the kernel on `stream` (the caller's current device must be the problem's device).
  // Returns "" or what failed.
  virtual std::string run(cudaStream_t stream) = 0;
};

// Builds a runner for one kernel: "" and *out set, or the reason and *out untouched.
using RunnerFactory = std::string (*)(const GroupedProblem&, std::unique_ptr<GemmRunner>*);

// The kernels, one per translation unit (the names say schedule, tile M x N x K, cluster M x N).
std::string make_coop_128x128x128_c1x1(const GroupedProblem&, std::unique_ptr<GemmRunner>*);
std::string make_coop_128x128x128_c2x1(const GroupedProblem&, std::unique_ptr<GemmRunner>*);
std::string make_coop_128x128x128_c1x2(const GroupedProblem&, std::unique_ptr<GemmRunner>*);
std::string make_pingpong_64x128x128_c1x1(const GroupedProblem&, std::unique_ptr<GemmRunner>*);
std::string make_pingpong_64x128x128_c2x1(const GroupedProblem&, std::unique_ptr<GemmRunner>*);

}  // namespace epmoe_cutlass_probe
