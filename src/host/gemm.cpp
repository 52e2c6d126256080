// Host side of the grouped GEMMs: shape checks, tensor maps, plans and launches (src/host/gemm.h).
#include "host/gemm.h"

#include <cuda.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <mutex>

#include "device/gemm/sm90_gemm_params.h"
#include "device/kernels/sm90_gemm_launch.h"
#include "host/check.h"

namespace epmoe::gemm {

namespace {

using detail::GemmStage;
using ::epmoe::detail::invalid;

// Why through the runtime: cudart is linked statically and the binary must run on machines
// whose libcuda we do not link against; the runtime hands out the driver's entry point.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

Status encode_tiled_fn(EncodeTiledFn* out) {
  static EncodeTiledFn fn = nullptr;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (err == cudaSuccess && q != cudaDriverEntryPointSuccess) err = cudaErrorSymbolNotFound;
    fn = reinterpret_cast<EncodeTiledFn>(p);
  });
  EPMOE_CUDA_RETURN(err);
  *out = fn;
  return Status::Ok();
}

// A 2D row-major tensor [rows][cols] with row stride ld elements (e4m3 or bf16), boxes of box_rows
// x 128 bytes, 128-byte swizzle: the layout the wgmma descriptors in device/gemm/sm90_smem_desc.cuh
// expect (operands: K-major, cols = ld = k) and the deferred L2 epilogue's slabs (its output pool:
// 64-row boxes, device/gemm/sm90_epilogue_deferred.cuh). promotion: L2 sector promotion of loads.
Status make_swizzled_map(CUtensorMap* map, const void* base, bool fp8, int64_t rows, int64_t cols, int64_t ld,
                         int box_rows, CUtensorMapL2promotion promotion, const char* what) {
  EncodeTiledFn encode = nullptr;
  EPMOE_RETURN_IF_ERROR(encode_tiled_fn(&encode));
  const int elem = fp8 ? 1 : 2;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld * elem)};
  const cuuint32_t box[2] = {cuuint32_t(128 / elem), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status(StatusCode::kInternal, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)) +
                                             " for " + what + " rows=" + std::to_string(rows) +
                                             " cols=" + std::to_string(cols) + " ld=" + std::to_string(ld));
  return Status::Ok();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Checks common to every call; dims are the GEMM's (n = B rows per expert, k = reduction).
Status check_args(const char* who, const GroupedArgs& g, int hidden, int inter, bool fp8) {
  if (g.num_groups < 1 || g.num_groups > Limits::kMaxExpertsPerRank)
    return invalid(who, ": num_groups=", g.num_groups, " must be in [1, ", Limits::kMaxExpertsPerRank, "]");
  if (g.expert_count == nullptr || g.expert_offset == nullptr)
    return invalid(who, ": expert_count and expert_offset must be device pointers");
  if (hidden <= 0 || hidden % kScaleBlock != 0)
    return invalid(who, ": hidden=", hidden, " must be a positive multiple of 128");
  if (inter <= 0 || inter % kScaleBlock != 0)
    return invalid(who, ": intermediate=", inter, " must be a positive multiple of 128");
  if (g.max_rows <= 0 || g.max_rows % kBlockM != 0 || g.max_rows > (int64_t(1) << 31) - kBlockM)
    return invalid(who, ": max_rows=", g.max_rows, " must be a positive multiple of ", kBlockM, " below 2^31");
  if (int64_t(g.num_groups) * 2 * inter > (int64_t(1) << 31) || int64_t(g.num_groups) * hidden > (int64_t(1) << 31))
    return invalid(who, ": num_groups x weight rows exceeds 2^31");
  if (fp8 && (g.scale_stride < g.max_rows || g.scale_stride % 4 != 0))
    return invalid(who, ": scale_stride=", g.scale_stride, " must be >= max_rows=", g.max_rows,
                   " and a multiple of 4");
  return Status::Ok();
}

Status check_ptr(const char* who, const char* name, const void* p) {
  if (p == nullptr) return invalid(who, ": ", name, " is null");
  if (!aligned16(p)) return invalid(who, ": ", name, " must be 16-byte aligned");
  return Status::Ok();
}

// The current device, which must be an sm_90 GPU (the kernels are built for sm_90a only), and
// its SM count (the persistent grid).
Status current_sm90_device(int* device, int* sms) {
  int dev = 0;
  EPMOE_CUDA_RETURN(cudaGetDevice(&dev));
  int major = 0, minor = 0;
  EPMOE_CUDA_RETURN(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  EPMOE_CUDA_RETURN(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0)
    return Status(StatusCode::kUnsupported, "grouped GEMM kernels need an sm_90 GPU (H100/H200; built for sm_90a), "
                                            "but CUDA device " + std::to_string(dev) + " is sm_" +
                                                std::to_string(major) + std::to_string(minor));
  EPMOE_CUDA_RETURN(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  if (*sms <= 0) return Status(StatusCode::kInternal, "CUDA device " + std::to_string(dev) + " reports no SMs");
  *device = dev;
  return Status::Ok();
}

GroupedGemmParams base_params(const GroupedArgs& g, int n, int k) {
  GroupedGemmParams p{};
  p.num_groups = g.num_groups;
  p.expert_count = g.expert_count;
  p.expert_offset = g.expert_offset;
  p.n = n;
  p.k = k;
  p.scale_stride = g.scale_stride;
  return p;
}

// The device half of planning, after the arguments passed their checks. Writes *out last.
Status build_plan(bool fp8, GemmStage stage, const GroupedArgs& g, const void* a, const void* b, int n, int k,
                  const GroupedGemmParams& p, GemmPlan* out) {
  GemmPlan plan;
  EPMOE_RETURN_IF_ERROR(current_sm90_device(&plan.device, &plan.grid));
  EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_a, a, fp8, g.max_rows, k, k, kBlockM,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "the activations"));
  EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_a64, a, fp8, g.max_rows, k, k, kBlockM / 2,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "the activations (64-row boxes)"));
  EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_b, b, fp8, int64_t(g.num_groups) * n, k, k, kBlockN,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "the weights"));
  if (stage == GemmStage::kL1)
    EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_b64, b, fp8, int64_t(g.num_groups) * n, k, k, kBlockN / 4,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "the weights (64-row boxes)"));
  if (stage != GemmStage::kL1)
    EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_d, p.out, false, g.max_rows, n, p.out_ld, 64,
                                            CU_TENSOR_MAP_L2_PROMOTION_NONE, "the output pool"));
  // L1's deferred epilogue: e4m3 or bf16 output with n / 2 channels, same 64-row boxes.
  if (stage == GemmStage::kL1)
    EPMOE_RETURN_IF_ERROR(make_swizzled_map(&plan.map_d, p.out, fp8, g.max_rows, n / 2, p.out_ld, 64,
                                            CU_TENSOR_MAP_L2_PROMOTION_NONE, "the L1 output pool"));
  EPMOE_CUDA_RETURN(fp8 ? detail::configure_sm90_grouped_gemm_fp8(stage, plan.device)
                        : detail::configure_sm90_grouped_gemm_bf16(stage, plan.device));
  plan.fp8 = fp8;
  plan.l1 = stage == GemmStage::kL1;
  plan.params = p;
  *out = plan;
  return Status::Ok();
}

}  // namespace

int row_align(DType) { return kBlockM; }

Status validate_shape(DType, int hidden, int inter) {
  if (hidden <= 0 || hidden % kScaleBlock != 0)
    return invalid("gemm: hidden=", hidden, " must be a positive multiple of 128");
  if (inter <= 0 || inter % kScaleBlock != 0)
    return invalid("gemm: intermediate=", inter, " must be a positive multiple of 128");
  return Status::Ok();
}

Status prepare_w1(DType dtype, const void* w1_user, const float* w1_scale_user, void* w1_internal,
                  float* w1_scale_internal, int num_groups, int inter, int hidden, cudaStream_t stream) {
  const bool fp8 = dtype == DType::kFP8;
  if (num_groups < 1) return invalid("prepare_w1: num_groups=", num_groups, " must be >= 1");
  EPMOE_RETURN_IF_ERROR(validate_shape(dtype, hidden, inter));
  EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w1", "w1_user", w1_user));
  EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w1", "w1_internal", w1_internal));
  if (w1_user == w1_internal) return invalid("prepare_w1: the transform cannot run in place");
  if (fp8) {
    EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w1", "w1_scale_user", w1_scale_user));
    EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w1", "w1_scale_internal", w1_scale_internal));
    if (w1_scale_user == w1_scale_internal) return invalid("prepare_w1: the scale transform cannot run in place");
  }
  EPMOE_CUDA_RETURN(detail::launch_w1_interleave(w1_user, w1_internal, num_groups, inter,
                                                 int64_t(hidden) * (fp8 ? 1 : 2), fp8 ? w1_scale_user : nullptr,
                                                 fp8 ? w1_scale_internal : nullptr, hidden / 128, stream));
  return Status::Ok();
}

Status prepare_w2(DType dtype, const void* w2_user, const float* w2_scale_user, void* w2_internal,
                  float* w2_scale_internal, int num_groups, int hidden, int inter, cudaStream_t stream) {
  const bool fp8 = dtype == DType::kFP8;
  if (num_groups < 1) return invalid("prepare_w2: num_groups=", num_groups, " must be >= 1");
  EPMOE_RETURN_IF_ERROR(validate_shape(dtype, hidden, inter));
  EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w2", "w2_user", w2_user));
  EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w2", "w2_internal", w2_internal));
  const size_t bytes = size_t(num_groups) * hidden * inter * (fp8 ? 1 : 2);
  if (w2_internal != w2_user)
    EPMOE_CUDA_RETURN(cudaMemcpyAsync(w2_internal, w2_user, bytes, cudaMemcpyDeviceToDevice, stream));
  if (fp8) {
    EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w2", "w2_scale_user", w2_scale_user));
    EPMOE_RETURN_IF_ERROR(check_ptr("prepare_w2", "w2_scale_internal", w2_scale_internal));
    const size_t sbytes = size_t(num_groups) * (hidden / 128) * (inter / 128) * sizeof(float);
    if (w2_scale_internal != w2_scale_user)
      EPMOE_CUDA_RETURN(
          cudaMemcpyAsync(w2_scale_internal, w2_scale_user, sbytes, cudaMemcpyDeviceToDevice, stream));
  }
  return Status::Ok();
}

Status plan_l1(DType dtype, const GroupedArgs& g, const void* x, const float* x_scale, const void* w1,
               const float* w1_scale, const float* row_weight, int hidden, int inter, float clamp,
               bool pow2_scales, void* a, float* a_scale, GemmPlan* out) {
  const bool fp8 = dtype == DType::kFP8;
  if (out == nullptr) return invalid("gemm::l1: the plan output is null");
  if (dtype != DType::kFP8 && dtype != DType::kBF16) return invalid("gemm::l1: unknown dtype ", int(dtype));
  EPMOE_RETURN_IF_ERROR(check_args("gemm::l1", g, hidden, inter, fp8));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "x", x));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "w1", w1));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "row_weight", row_weight));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "a", a));
  if (fp8) {
    EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "x_scale", x_scale));
    EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "w1_scale", w1_scale));
    EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l1", "a_scale", a_scale));
  }
  if (!std::isfinite(clamp)) return invalid("gemm::l1: clamp=", clamp, " must be finite (<= 0 disables it)");
  GroupedGemmParams p = base_params(g, 2 * inter, hidden);
  p.a_scale = fp8 ? x_scale : nullptr;
  p.b_scale = fp8 ? w1_scale : nullptr;
  p.out = a;
  p.out_ld = inter;
  p.out_scale = fp8 ? a_scale : nullptr;
  p.row_weight = row_weight;
  p.clamp = clamp > 0.0f ? clamp : 0.0f;
  p.pow2_scales = pow2_scales ? 1 : 0;
  return build_plan(fp8, GemmStage::kL1, g, x, w1, 2 * inter, hidden, p, out);
}

Status plan_l2(DType dtype, const GroupedArgs& g, const void* a, const float* a_scale, const void* w2,
               const float* w2_scale, int inter, int hidden, void* o, GemmPlan* out) {
  const bool fp8 = dtype == DType::kFP8;
  if (out == nullptr) return invalid("gemm::l2: the plan output is null");
  if (dtype != DType::kFP8 && dtype != DType::kBF16) return invalid("gemm::l2: unknown dtype ", int(dtype));
  EPMOE_RETURN_IF_ERROR(check_args("gemm::l2", g, hidden, inter, fp8));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l2", "a", a));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l2", "w2", w2));
  EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l2", "o", o));
  if (fp8) {
    EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l2", "a_scale", a_scale));
    EPMOE_RETURN_IF_ERROR(check_ptr("gemm::l2", "w2_scale", w2_scale));
  }
  GroupedGemmParams p = base_params(g, hidden, inter);
  p.a_scale = fp8 ? a_scale : nullptr;
  p.b_scale = fp8 ? w2_scale : nullptr;
  p.out = o;
  p.out_ld = hidden;
  return build_plan(fp8, GemmStage::kL2, g, a, w2, hidden, inter, p, out);
}

Status launch(const GemmPlan& plan, cudaStream_t stream, bool weights_evict_first) {
  if (plan.device < 0 || plan.grid <= 0) return invalid("gemm::launch: the plan is empty (plan_l1/plan_l2 failed or was not called)");
  const GemmStage stage = plan.l1 ? GemmStage::kL1 : GemmStage::kL2;
  GroupedGemmParams params = plan.params;
  params.weights_evict_first = weights_evict_first ? 1 : 0;
  EPMOE_CUDA_RETURN(plan.fp8 ? detail::launch_sm90_grouped_gemm_fp8(stage, plan.map_a, plan.map_a64, plan.map_b,
                                                                     plan.map_d, params, plan.grid, stream)
                             : detail::launch_sm90_grouped_gemm_bf16(stage, plan.map_a, plan.map_a64, plan.map_b,
                                                                      plan.map_d, params, plan.grid, stream));
  return Status::Ok();
}

Status l1(DType dtype, const GroupedArgs& g, const void* x, const float* x_scale, const void* w1,
          const float* w1_scale, const float* row_weight, int hidden, int inter, float clamp, bool pow2_scales,
          void* a, float* a_scale, cudaStream_t stream) {
  GemmPlan plan;
  EPMOE_RETURN_IF_ERROR(
      plan_l1(dtype, g, x, x_scale, w1, w1_scale, row_weight, hidden, inter, clamp, pow2_scales, a, a_scale, &plan));
  return launch(plan, stream);
}

Status l2(DType dtype, const GroupedArgs& g, const void* a, const float* a_scale, const void* w2,
          const float* w2_scale, int inter, int hidden, void* o, cudaStream_t stream) {
  GemmPlan plan;
  EPMOE_RETURN_IF_ERROR(plan_l2(dtype, g, a, a_scale, w2, w2_scale, inter, hidden, o, &plan));
  return launch(plan, stream);
}


}  // namespace epmoe::gemm
