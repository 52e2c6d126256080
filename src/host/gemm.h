// Grouped GEMMs of the MoE layer (L1: gate/up projection + SwiGLU, L2: down projection) over the
// expert-major pool (device/layout/expert_pool.h). FP8 e4m3 with 1x128 activation and 128x128
// weight block scales, or BF16. docs/GEMM.md describes the kernels and the weight layouts.
//
// All calls are stream-ordered, never synchronize with the host and never allocate, so they can
// be captured in a CUDA graph. Shapes are checked on the host before anything is launched.
//
// Two ways to run a GEMM: plan_l1 / plan_l2 do every host step that can fail (argument checks,
// the sm_90 check, tensor maps, kernel attributes) once, and launch() then only enqueues the
// kernel. The layer plans at creation so that a forward call cannot stop between dispatch and
// combine on a host-side error. l1 / l2 plan and launch in one call (tests, benchmark).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "epmoe/config.h"
#include "epmoe/status.h"

namespace epmoe::gemm {

// Each expert's segment of the pool must start at a multiple of this many rows (BLOCK_M).
int row_align(DType dtype);

// hidden and intermediate are positive multiples of 128 (the FP8 scale block; BF16 shares the
// kernels' tiling). Called by layer creation before anything is allocated.
Status validate_shape(DType dtype, int hidden, int inter);

// The grouped problem on the pool: expert e owns rows [expert_offset[e], expert_offset[e] +
// expert_count[e]); both arrays live on the device and may change between calls (any count,
// 0 included). Offsets must be multiples of row_align(); rows between count and the next
// segment are padding whose outputs are left untouched.
struct GroupedArgs {
  int num_groups;            // experts on this rank, >= 1
  const int* expert_count;   // device [num_groups]
  const int* expert_offset;  // device [num_groups + 1]
  int64_t max_rows;          // pool rows, a multiple of row_align(); every segment lies below it
  int64_t scale_stride;      // FP8: row stride of MN-major activation scales, >= max_rows, multiple of 4
};

// ---- One-time weight transforms (device to device, stream-ordered) --------------------------
// Dimensions follow the weight's shape. Scale pointers are ignored (may be null) for BF16.
// Outputs have the inputs' sizes and must not alias them.

// W1 user layout [G][2I][H] (rows 0..I-1 gate, I..2I-1 up) -> internal layout [G][2I][H] whose
// 128-row blocks are ordered gate0, up0, gate1, up1, ... FP8 scales [G][2I/128][H/128] are
// permuted the same way.
Status prepare_w1(DType dtype, const void* w1_user, const float* w1_scale_user, void* w1_internal,
                  float* w1_scale_internal, int num_groups, int inter, int hidden, cudaStream_t stream);

// W2 [G][H][I] is already in the kernel's layout (K-major, scales [G][H/128][I/128]); this is a
// device copy, kept so that a later layout change does not change the API.
Status prepare_w2(DType dtype, const void* w2_user, const float* w2_scale_user, void* w2_internal,
                  float* w2_scale_internal, int num_groups, int hidden, int inter, cudaStream_t stream);

// ---- L1: a = silu(gate) * up * row_weight (after the optional clamp), x W1^T in fp32 ---------
// FP8: x e4m3 [max_rows][H] with x_scale [H/128][scale_stride]; a is requantized per 128
// channels (SPEC step 5, pow2_scales rounds scales up to powers of two) into e4m3 [max_rows][I]
// and a_scale [I/128][scale_stride]. BF16: x bf16 [max_rows][H], a bf16 [max_rows][I].
// w1 / w1_scale in the internal layout (prepare_w1). row_weight [max_rows] fp32.
// clamp <= 0 disables the clamp; else up = clamp(up, -clamp, clamp), gate = min(gate, clamp).
Status l1(DType dtype, const GroupedArgs& args, const void* x, const float* x_scale, const void* w1,
          const float* w1_scale, const float* row_weight, int hidden, int inter, float clamp, bool pow2_scales,
          void* a, float* a_scale, cudaStream_t stream);

// ---- L2: o = a W2^T, accumulated in fp32, bf16 out [max_rows][H] ---------------------------------
// FP8: a e4m3 [max_rows][I] with a_scale [I/128][scale_stride]; BF16: a bf16 [max_rows][I].
Status l2(DType dtype, const GroupedArgs& args, const void* a, const float* a_scale, const void* w2,
          const float* w2_scale, int inter, int hidden, void* o, cudaStream_t stream);

// ---- Prepared launches -------------------------------------------------------------------------
// Everything one kernel launch needs, built on the host by plan_l1 / plan_l2 for the device that
// was current then. The plan captures pointers and shapes, never the expert counts/offsets
// themselves (the kernel reads those arrays from the device), so one plan serves any number of
// calls while the buffers it names stay allocated. Plain data: copy it freely.
struct GemmPlan {
  int device = -1;  // CUDA device the plan was built for; -1: empty (launch rejects it)
  bool fp8 = false;
  bool l1 = false;  // L1 (SwiGLU epilogue) or L2 (bf16 store)
  int grid = 0;     // persistent blocks: one per SM
  CUtensorMap map_a{};    // pool activations [max_rows][k]
  CUtensorMap map_a64{};  // the same with 64-row boxes (tiles of at most 64 rows load only those)
  CUtensorMap map_b64{};  // L1: the weights with 64-row boxes (the megakernel's split L1 units)
  CUtensorMap map_b{};  // weights [num_groups * n][k]
  CUtensorMap map_d{};  // the output pool for the deferred epilogues' TMA stores (L2 bf16; FP8 L1 e4m3)
  GroupedGemmParams params{};
};

// Arguments as for l1 / l2 below. Checks the arguments first (InvalidArgument, before any CUDA
// call), then needs an sm_90 device current (Unsupported otherwise), encodes the tensor maps (A
// with 128- and 64-row boxes, B; L2 also its output pool) and sets the kernel's shared-memory attribute on that device. *out
// is written only on success.
Status plan_l1(DType dtype, const GroupedArgs& args, const void* x, const float* x_scale, const void* w1,
               const float* w1_scale, const float* row_weight, int hidden, int inter, float clamp,
               bool pow2_scales, void* a, float* a_scale, GemmPlan* out);
Status plan_l2(DType dtype, const GroupedArgs& args, const void* a, const float* a_scale, const void* w2,
               const float* w2_scale, int inter, int hidden, void* o, GemmPlan* out);

// Enqueues the planned kernel on `stream` (cudaLaunchKernelEx; no other CUDA call). The plan's
// device must be current. Fails only on an empty plan or when the launch itself fails.
// weights_evict_first: this call's weight tiles of single-m-block experts go through L2 with an
// evict-first policy (GroupedGemmParams::weights_evict_first; the layer sets it for its smallest
// decode calls).
Status launch(const GemmPlan& plan, cudaStream_t stream, bool weights_evict_first = false);

}  // namespace epmoe::gemm
