// libepmoe_cutlass_probe.so: CUTLASS's sm90 FP8 grouped GEMM with block-scaled accumulation
// (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum) behind a small C
// interface, so that python/benchmarks/gemm_vs_deepgemm.py --cutlass-lib can time it in turns
// with DeepGEMM and our L2 kernel, on the same tensors and stream. A measuring tool, not part of
// the library: built by tools/probes/build_cutlass_probe.sh against the CUTLASS headers of the
// nvidia-cutlass wheel; the kernels are tools/probes/cutlass_probe/sm90_grouped_fp8_*.cu.
//
// Semantics: those of the L2 kernel (docs/GEMM.md, "Contract with the pool"):
//   A       e4m3 [rows][k]; group g owns rows [offset[g], offset[g] + count[g]), offsets multiples
//           of 128
//   A scale fp32 [k/128][scale_stride], MN-major
//   B       e4m3 [groups][n][k], scales fp32 [groups][n/128][k/128]
//   D       bf16 [rows][n]: D[r][c] = sum_kb a_scale[kb][r] b_scale[g][c/128][kb] A[r, kb] . B[g][c, kb];
//           rows past a group's count are not written
// Counts and offsets come from the host: CUTLASS's grouped GEMM takes per-group pointers, shapes
// and strides in device arrays, which create() builds once (with the counts known on the host).
//
// The A scales are copied at create(), once: CUTLASS's grouped mainloop rebuilds each group's
// scale layout from the group's M, so it reads [k/128][count] per group, compact, where the pool
// has the stride scale_stride. Later writes to a_scale are not seen by run().
//
// Conventions: every function returns 0 or an epmoe::StatusCode value (1 InvalidArgument,
// 2 Unsupported, 3 CudaError, 6 Internal) and keeps the calling thread's last message for
// epmoe_cutlass_probe_last_error(); no C++ exception crosses the boundary. The library carries
// its own (static) CUDA runtime: create() makes the device of `a` current in it, run() makes that
// device current again if the caller's thread changed it.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cutlass_probe/sm90_grouped_fp8_probe.h"

#define EPMOE_CUTLASS_PROBE_EXPORT extern "C" __attribute__((visibility("default")))

// Bumped whenever a signature or the config list changes; the script refuses another version.
#define EPMOE_CUTLASS_PROBE_VERSION 1

namespace {

using epmoe_cutlass_probe::GemmRunner;
using epmoe_cutlass_probe::GroupedProblem;
using epmoe_cutlass_probe::RunnerFactory;

enum Code : int { kOk = 0, kInvalidArgument = 1, kUnsupported = 2, kCudaError = 3, kInternal = 6 };

struct Config {
  const char* name;
  RunnerFactory make;
  bool raster_along_n;
};

// The kernels worth measuring on H100, one compiled kernel each; the rasterN entries only change
// the grouped scheduler's runtime argument (within a group it walks tiles M-fastest by default,
// N-fastest with rasterN). Not here: a cooperative 128 x 256 tile (CUTLASS 4.2's block-scaled
// mainloop does not compile with 1 x 128 A scales and two 128-column B scale blocks per tile) and a
// pingpong 128 x 128 tile (ptxas spills 744 bytes: the warpgroup's 128 x 128 accumulator and its
// scratch exceed the register budget).
const Config kConfigs[] = {
    {"coop_128x128x128_c1x1", epmoe_cutlass_probe::make_coop_128x128x128_c1x1, false},
    {"coop_128x128x128_c2x1", epmoe_cutlass_probe::make_coop_128x128x128_c2x1, false},
    {"coop_128x128x128_c1x2", epmoe_cutlass_probe::make_coop_128x128x128_c1x2, false},
    {"pingpong_64x128x128_c1x1", epmoe_cutlass_probe::make_pingpong_64x128x128_c1x1, false},
    {"pingpong_64x128x128_c2x1", epmoe_cutlass_probe::make_pingpong_64x128x128_c2x1, false},
    {"coop_128x128x128_c2x1_rasterN", epmoe_cutlass_probe::make_coop_128x128x128_c2x1, true},
    {"pingpong_64x128x128_c2x1_rasterN", epmoe_cutlass_probe::make_pingpong_64x128x128_c2x1, true},
};
constexpr int kNumConfigs = static_cast<int>(sizeof(kConfigs) / sizeof(kConfigs[0]));

thread_local std::string t_last_error;

struct Failure {
  int code;
  std::string message;
};

template <class... Parts>
Failure fail(int code, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return {code, os.str()};
}

Failure cuda_fail(const char* what, cudaError_t e) {
  return fail(kCudaError, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Runs `body` (returning a Failure, code 0 on success) under the C boundary's convention.
template <class Body>
int guarded(Body&& body) {
  try {
    Failure f = body();
    if (f.code != kOk) t_last_error = std::move(f.message);
    return f.code;
  } catch (const std::bad_alloc&) {
    t_last_error = "out of host memory";
  } catch (const std::exception& ex) {
    t_last_error = std::string("internal error: ") + ex.what();
  } catch (...) {
    t_last_error = "internal error: unknown exception";
  }
  return kInternal;
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};

bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

}  // namespace

struct epmoe_cutlass_probe_handle {
  int device = 0;
  std::unique_ptr<void, CudaFree> a_scale_compact;  // read by the kernel: freed after the runner
  std::unique_ptr<GemmRunner> runner;
};

EPMOE_CUTLASS_PROBE_EXPORT int epmoe_cutlass_probe_version(void) { return EPMOE_CUTLASS_PROBE_VERSION; }

// The calling thread's message of its last failed call ("" before any).
EPMOE_CUTLASS_PROBE_EXPORT const char* epmoe_cutlass_probe_last_error(void) { return t_last_error.c_str(); }

EPMOE_CUTLASS_PROBE_EXPORT int epmoe_cutlass_probe_num_configs(void) { return kNumConfigs; }

// The config's name, or null outside [0, num_configs).
EPMOE_CUTLASS_PROBE_EXPORT const char* epmoe_cutlass_probe_config_name(int config) {
  return config >= 0 && config < kNumConfigs ? kConfigs[config].name : nullptr;
}

// Every host step, once: argument checks (before any CUDA call), the device of `a` made current,
// the compact copy of the A scales, the per-group device arrays, CUTLASS's workspace, can_implement
// and initialize. Synchronizes the device (a setup call, never timed). *handle is set on success.
EPMOE_CUTLASS_PROBE_EXPORT int epmoe_cutlass_probe_create(int config, int groups, const int* host_counts,
                                                          const int* host_offsets, int n, int k, void* a,
                                                          void* a_scale, int scale_stride, void* b, void* b_scale,
                                                          void* d, void** handle) {
  return guarded([&]() -> Failure {
    if (handle == nullptr) return fail(kInvalidArgument, "create: handle is null");
    if (config < 0 || config >= kNumConfigs)
      return fail(kInvalidArgument, "create: config=", config, " must be in [0, ", kNumConfigs, ")");
    if (groups < 1 || groups > 65536)
      return fail(kInvalidArgument, "create: groups=", groups, " must be in [1, 65536]");
    if (host_counts == nullptr || host_offsets == nullptr)
      return fail(kInvalidArgument, "create: host_counts and host_offsets must be host arrays of `groups` ints");
    if (n <= 0 || n % 128 != 0 || k <= 0 || k % 128 != 0)
      return fail(kInvalidArgument, "create: n=", n, " and k=", k, " must be positive multiples of 128");
    if (a == nullptr || a_scale == nullptr || b == nullptr || b_scale == nullptr || d == nullptr)
      return fail(kInvalidArgument, "create: a, a_scale, b, b_scale and d must all be device pointers (one is null)");
    const std::pair<const char*, const void*> ptrs[] = {{"a", a}, {"a_scale", a_scale}, {"b", b}, {"b_scale", b_scale},
                                                        {"d", d}};
    for (const auto& [name, p] : ptrs)
      if (!aligned(p, 16)) return fail(kInvalidArgument, "create: ", name, " must be 16-byte aligned");
    for (int g = 0; g < groups; ++g) {
      const int64_t count = host_counts[g], offset = host_offsets[g];
      if (count < 0 || offset < 0 || offset % 128 != 0)
        return fail(kInvalidArgument, "create: group ", g, ": count=", count, " must be >= 0 and offset=", offset,
                    " a non-negative multiple of 128");
      if (offset + count > scale_stride)
        return fail(kInvalidArgument, "create: group ", g, " ends at row ", offset + count, ", past scale_stride=",
                    scale_stride);
    }

    // The device of the operands, current in this library's runtime (not torch's).
    cudaPointerAttributes attr{};
    if (cudaError_t e = cudaPointerGetAttributes(&attr, a); e != cudaSuccess)
      return cuda_fail("create: cudaPointerGetAttributes(a)", e);
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      return fail(kInvalidArgument, "create: a is not device memory");
    const int device = attr.device;
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return cuda_fail("create: cudaSetDevice", e);
    int major = 0, minor = 0, sm_count = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device); e != cudaSuccess)
      return cuda_fail("create: compute capability", e);
    if (cudaError_t e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device); e != cudaSuccess)
      return cuda_fail("create: compute capability", e);
    if (major != 9 || minor != 0)
      return fail(kUnsupported, "create: device ", device, " is sm_", major, minor,
                  "; the kernels are built for sm_90a");
    if (cudaError_t e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess)
      return cuda_fail("create: SM count", e);
    // Why: the caller's inputs may still be being written on its (non-blocking) streams.
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
      return cuda_fail("create: cudaDeviceSynchronize (an earlier error of the caller's work?)", e);

    auto h = std::make_unique<epmoe_cutlass_probe_handle>();
    h->device = device;
    // The compact A scales: group g's [k/128][count] block at a 16-byte aligned offset.
    const int64_t kb = k / 128;
    std::vector<int64_t> sfa_offset(groups);
    int64_t sfa_floats = 0;
    for (int g = 0; g < groups; ++g) {
      sfa_offset[g] = sfa_floats;
      sfa_floats += (kb * host_counts[g] + 3) / 4 * 4;
    }
    void* sfa = nullptr;
    if (cudaError_t e = cudaMalloc(&sfa, static_cast<size_t>(sfa_floats < 4 ? 4 : sfa_floats) * sizeof(float));
        e != cudaSuccess)
      return cuda_fail("create: cudaMalloc (compact A scales)", e);
    h->a_scale_compact.reset(sfa);
    const auto* src_sf = static_cast<const float*>(a_scale);
    auto* dst_sf = static_cast<float*>(sfa);
    for (int g = 0; g < groups; ++g) {
      const int64_t count = host_counts[g];
      if (count == 0) continue;
      // k/128 rows of `count` floats: from pitch scale_stride to pitch count.
      const size_t row_bytes = count * sizeof(float);
      if (cudaError_t e = cudaMemcpy2DAsync(dst_sf + sfa_offset[g], row_bytes, src_sf + host_offsets[g],
                                            static_cast<size_t>(scale_stride) * sizeof(float), row_bytes, kb,
                                            cudaMemcpyDeviceToDevice, nullptr);
          e != cudaSuccess)
        return cuda_fail("create: cudaMemcpy2DAsync (compact A scales)", e);
    }
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
      return cuda_fail("create: cudaDeviceSynchronize (compact A scales)", e);

    GroupedProblem p;
    p.device = device;
    p.sm_count = sm_count;
    p.n = n;
    p.k = k;
    p.raster_along_n = kConfigs[config].raster_along_n;
    const auto* a8 = static_cast<const uint8_t*>(a);
    const auto* b8 = static_cast<const uint8_t*>(b);
    const auto* bs = static_cast<const float*>(b_scale);
    auto* d16 = static_cast<uint16_t*>(d);
    for (int g = 0; g < groups; ++g) {
      const int64_t offset = host_offsets[g];
      p.rows.push_back(host_counts[g]);
      p.a.push_back(a8 + offset * k);
      p.a_scale.push_back(dst_sf + sfa_offset[g]);
      p.b.push_back(b8 + static_cast<int64_t>(g) * n * k);
      p.b_scale.push_back(bs + static_cast<int64_t>(g) * (n / 128) * kb);
      p.d.push_back(d16 + offset * n);
    }
    if (std::string err = kConfigs[config].make(p, &h->runner); !err.empty())
      return fail(kCudaError, "create (", kConfigs[config].name, "): ", err);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
      return cuda_fail("create: cudaDeviceSynchronize (setup)", e);
    *handle = h.release();
    return {kOk, {}};
  });
}

// One launch of the kernel on `stream` (a cudaStream_t; null: the legacy default stream), nothing
// else: this is the call that is timed, and it can be captured in a CUDA graph.
EPMOE_CUTLASS_PROBE_EXPORT int epmoe_cutlass_probe_run(void* handle, void* stream) {
  return guarded([&]() -> Failure {
    if (handle == nullptr) return fail(kInvalidArgument, "run: handle is null");
    auto* h = static_cast<epmoe_cutlass_probe_handle*>(handle);
    int current = -1;
    if (cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) return cuda_fail("run: cudaGetDevice", e);
    if (current != h->device) {
      if (cudaError_t e = cudaSetDevice(h->device); e != cudaSuccess) return cuda_fail("run: cudaSetDevice", e);
    }
    if (std::string err = h->runner->run(static_cast<cudaStream_t>(stream)); !err.empty())
      return fail(kCudaError, "run: ", err);
    return {kOk, {}};
  });
}

// Frees everything create() allocated; the caller must have synchronized with the last run().
EPMOE_CUTLASS_PROBE_EXPORT void epmoe_cutlass_probe_destroy(void* handle) {
  auto* h = static_cast<epmoe_cutlass_probe_handle*>(handle);
  if (h == nullptr) return;
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != h->device) cudaSetDevice(h->device);
  h->runner.reset();
  delete h;
}
