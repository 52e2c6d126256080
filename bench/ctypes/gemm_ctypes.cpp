// libepmoe_gemm_ctypes.so: the grouped GEMM kernels (src/host/gemm.h) behind a small C interface,
// so that python/benchmarks/gemm_vs_deepgemm.py (FP8) and bf16_gemm_turns.py (BF16) can run them
// through ctypes on the same torch tensors, in the same process and on the same stream as the peers. A benchmark helper: not
// installed, not part of the library's API (include/epmoe/ has none of it).
//
// Conventions, as in include/epmoe/c_api.h: every function returns an epmoe::StatusCode value (0 is
// success) and keeps the message of the calling thread's last failure for
// epmoe_gemm_ctypes_last_error(); streams are cudaStream_t passed as void*; no C++ exception
// crosses the boundary. Layouts are those of gemm.h (docs/GEMM.md, "Contract with the pool"):
//   A       e4m3 [max_rows][k], expert e owning rows [offset[e], offset[e] + count[e])
//   A scale fp32 [k/128][scale_stride], MN-major (scale_stride >= max_rows, a multiple of 4)
//   B       e4m3 [groups][n][k], scales fp32 [groups][n/128][k/128]
//   counts  int32 [groups], offsets int32 [groups + 1] (multiples of row_align), both on the device
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "epmoe/config.h"
#include "epmoe/status.h"
#include "host/c_guard.h"
#include "host/check.h"
#include "host/gemm.h"

#define EPMOE_GEMM_CTYPES_EXPORT extern "C" __attribute__((visibility("default")))

// Bumped whenever a signature below changes; the script refuses a library of another version.
#define EPMOE_GEMM_CTYPES_VERSION 1

struct epmoe_gemm_ctypes_plan {
  epmoe::gemm::GemmPlan plan;
};

namespace {

using epmoe::DType;
using epmoe::Status;
using epmoe::StatusCode;
using epmoe::detail::invalid;
namespace gemm = epmoe::gemm;

thread_local std::string t_last_error;

// Runs `body` (returning Status) under the C boundary's convention (host/c_guard.h).
template <class Body>
int guarded(Body&& body) {
  return epmoe::detail::guarded_call(t_last_error, std::forward<Body>(body));
}

// device >= 0: make it current in this library's (static) runtime; -1: keep the current one. Why
// explicit: this library carries its own cudart, whose current device is not torch's.
Status use_device(int device) {
  if (device < -1) return invalid("device=", device, " must be a CUDA ordinal or -1 (the current device)");
  if (device == -1) return Status::Ok();
  int current = -1;
  EPMOE_CUDA_RETURN(cudaGetDevice(&current));
  if (current != device) EPMOE_CUDA_RETURN(cudaSetDevice(device));
  return Status::Ok();
}

// Takes ownership of a finished plan (*out stays untouched on failure).
Status hand_out(const gemm::GemmPlan& plan, epmoe_gemm_ctypes_plan** out) {
  auto* p = new (std::nothrow) epmoe_gemm_ctypes_plan{plan};
  if (p == nullptr) return Status(StatusCode::kInternal, "out of host memory for a GEMM plan");
  *out = p;
  return Status::Ok();
}

}  // namespace

EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_version(void) { return EPMOE_GEMM_CTYPES_VERSION; }

// The calling thread's message of its last failed call ("" before any).
EPMOE_GEMM_CTYPES_EXPORT const char* epmoe_gemm_ctypes_last_error(void) { return t_last_error.c_str(); }

// Every expert segment must start at a multiple of this many rows.
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_row_align(void) { return gemm::row_align(DType::kFP8); }

// The L2 kernel: out bf16 [max_rows][n] = A [max_rows][k] x B[e]^T per expert, block-scaled. Rows
// past an expert's count are left untouched. Arguments are checked before any CUDA call.
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_plan_l2(int device, int num_groups, const int* expert_count,
                                                       const int* expert_offset, int64_t max_rows,
                                                       int64_t scale_stride, const void* a, const float* a_scale,
                                                       const void* b, const float* b_scale, int n, int k, void* out,
                                                       epmoe_gemm_ctypes_plan** plan_out) {
  return guarded([&]() -> Status {
    if (plan_out == nullptr) return invalid("plan_l2: plan_out is null");
    const gemm::GroupedArgs args{num_groups, expert_count, expert_offset, max_rows, scale_stride};
    // This call's own checks, then gemm::plan_l2's, all before the first CUDA call (with device
    // -1), so a bad call fails the same way on any machine (the script's --dry-run relies on it).
    if (n <= 0 || n % 128 != 0 || k <= 0 || k % 128 != 0)
      return invalid("plan_l2: n=", n, " and k=", k, " must be positive multiples of 128");
    if (a == nullptr || a_scale == nullptr || b == nullptr || b_scale == nullptr || out == nullptr)
      return invalid("plan_l2: a, a_scale, b, b_scale and out must all be device pointers (one is null)");
    EPMOE_RETURN_IF_ERROR(use_device(device));
    gemm::GemmPlan plan;
    // plan_l2(dtype, args, a, a_scale, w2, w2_scale, inter = k, hidden = n, o, plan)
    EPMOE_RETURN_IF_ERROR(gemm::plan_l2(DType::kFP8, args, a, a_scale, b, b_scale, k, n, out, &plan));
    return hand_out(plan, plan_out);
  });
}

// The L1 kernel (SwiGLU + FP8 requant epilogue) with n = 2I weight rows: w1 [groups][2I][k] in the
// user layout (rows 0..I-1 gate, I..2I-1 up) with scales [groups][2I/128][k/128] is first copied by
// gemm::prepare_w1, enqueued on `stream`, into the caller's w1_internal / w1_scale_internal (same
// sizes, no aliasing); launches on another stream must wait for `stream`. Out: a_out e4m3
// [max_rows][I] and a_scale_out fp32 [I/128][scale_stride]. row_weight fp32 [max_rows]; clamp <= 0
// disables the clamp; pow2_scales != 0 rounds the requant scales up to powers of two.
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_plan_l1(
    int device, int num_groups, const int* expert_count, const int* expert_offset, int64_t max_rows,
    int64_t scale_stride, const void* x, const float* x_scale, const void* w1_user, const float* w1_scale_user,
    void* w1_internal, float* w1_scale_internal, const float* row_weight, int n, int k, float clamp,
    int pow2_scales, void* a_out, float* a_scale_out, void* stream, epmoe_gemm_ctypes_plan** plan_out) {
  return guarded([&]() -> Status {
    if (plan_out == nullptr) return invalid("plan_l1: plan_out is null");
    if (n <= 0 || n % 256 != 0) return invalid("plan_l1: n=", n, " (2I weight rows) must be a positive multiple of 256");
    const int inter = n / 2;
    const gemm::GroupedArgs args{num_groups, expert_count, expert_offset, max_rows, scale_stride};
    if (k <= 0 || k % 128 != 0) return invalid("plan_l1: k=", k, " must be a positive multiple of 128");
    if (x == nullptr || x_scale == nullptr || w1_user == nullptr || w1_scale_user == nullptr ||
        w1_internal == nullptr || w1_scale_internal == nullptr || row_weight == nullptr || a_out == nullptr ||
        a_scale_out == nullptr)
      return invalid("plan_l1: every tensor argument must be a device pointer (one is null)");
    EPMOE_RETURN_IF_ERROR(use_device(device));
    gemm::GemmPlan plan;
    // Planned before the weight copy is enqueued: a call that cannot run enqueues nothing.
    EPMOE_RETURN_IF_ERROR(gemm::plan_l1(DType::kFP8, args, x, x_scale, w1_internal, w1_scale_internal, row_weight,
                                        k, inter, clamp, pow2_scales != 0, a_out, a_scale_out, &plan));
    EPMOE_RETURN_IF_ERROR(gemm::prepare_w1(DType::kFP8, w1_user, w1_scale_user, w1_internal, w1_scale_internal,
                                           num_groups, inter, k, static_cast<cudaStream_t>(stream)));
    return hand_out(plan, plan_out);
  });
}

// The BF16 kernels (python/benchmarks/bf16_gemm_turns.py), same conventions: A bf16 [max_rows][k],
// B bf16 [groups][n][k]; no scales. L2: out bf16 [max_rows][n].
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_plan_l2_bf16(int device, int num_groups, const int* expert_count,
                                                            const int* expert_offset, int64_t max_rows, const void* a,
                                                            const void* b, int n, int k, void* out,
                                                            epmoe_gemm_ctypes_plan** plan_out) {
  return guarded([&]() -> Status {
    if (plan_out == nullptr) return invalid("plan_l2_bf16: plan_out is null");
    if (n <= 0 || n % 128 != 0 || k <= 0 || k % 128 != 0)
      return invalid("plan_l2_bf16: n=", n, " and k=", k, " must be positive multiples of 128");
    if (a == nullptr || b == nullptr || out == nullptr)
      return invalid("plan_l2_bf16: a, b and out must all be device pointers (one is null)");
    const gemm::GroupedArgs args{num_groups, expert_count, expert_offset, max_rows, max_rows};
    EPMOE_RETURN_IF_ERROR(use_device(device));
    gemm::GemmPlan plan;
    EPMOE_RETURN_IF_ERROR(gemm::plan_l2(DType::kBF16, args, a, nullptr, b, nullptr, k, n, out, &plan));
    return hand_out(plan, plan_out);
  });
}

// BF16 L1 (SwiGLU epilogue, bf16 output a_out [max_rows][I]) with n = 2I weight rows in the user
// layout, copied by gemm::prepare_w1 on `stream` into w1_internal as plan_l1 does.
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_plan_l1_bf16(int device, int num_groups, const int* expert_count,
                                                            const int* expert_offset, int64_t max_rows, const void* x,
                                                            const void* w1_user, void* w1_internal,
                                                            const float* row_weight, int n, int k, float clamp,
                                                            void* a_out, void* stream,
                                                            epmoe_gemm_ctypes_plan** plan_out) {
  return guarded([&]() -> Status {
    if (plan_out == nullptr) return invalid("plan_l1_bf16: plan_out is null");
    if (n <= 0 || n % 256 != 0)
      return invalid("plan_l1_bf16: n=", n, " (2I weight rows) must be a positive multiple of 256");
    if (k <= 0 || k % 128 != 0) return invalid("plan_l1_bf16: k=", k, " must be a positive multiple of 128");
    if (x == nullptr || w1_user == nullptr || w1_internal == nullptr || row_weight == nullptr || a_out == nullptr)
      return invalid("plan_l1_bf16: every tensor argument must be a device pointer (one is null)");
    const int inter = n / 2;
    const gemm::GroupedArgs args{num_groups, expert_count, expert_offset, max_rows, max_rows};
    EPMOE_RETURN_IF_ERROR(use_device(device));
    gemm::GemmPlan plan;
    EPMOE_RETURN_IF_ERROR(gemm::plan_l1(DType::kBF16, args, x, nullptr, w1_internal, nullptr, row_weight, k, inter,
                                        clamp, false, a_out, nullptr, &plan));
    EPMOE_RETURN_IF_ERROR(gemm::prepare_w1(DType::kBF16, w1_user, nullptr, w1_internal, nullptr, num_groups, inter, k,
                                           static_cast<cudaStream_t>(stream)));
    return hand_out(plan, plan_out);
  });
}

// Enqueues `count` back-to-back launches of the plan on `stream` (one ctypes call for a whole
// timed batch, so Python's per-call cost does not enter our side of the loop). Stops at the
// first failed launch. Capturable in a CUDA graph (gemm::launch makes one cudaLaunchKernelEx).
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_launch(const epmoe_gemm_ctypes_plan* plan, void* stream, int count) {
  return guarded([&]() -> Status {
    if (plan == nullptr) return invalid("launch: the plan is null");
    if (count < 1) return invalid("launch: count=", count, " must be >= 1");
    EPMOE_RETURN_IF_ERROR(use_device(plan->plan.device));
    for (int i = 0; i < count; ++i)
      EPMOE_RETURN_IF_ERROR(gemm::launch(plan->plan, static_cast<cudaStream_t>(stream)));
    return Status::Ok();
  });
}

// Frees the host-side plan (null is fine; always 0). The buffers it names are the caller's.
EPMOE_GEMM_CTYPES_EXPORT int epmoe_gemm_ctypes_destroy(epmoe_gemm_ctypes_plan* plan) {
  delete plan;
  return 0;
}
