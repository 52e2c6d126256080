// FP8 e4m3 grouped GEMM kernels: L1 (SwiGLU + requant epilogue) and L2 (bf16 store).
#include "device/kernels/sm90_gemm_launch.h"
#include "device/kernels/sm90_grouped_gemm.cuh"

namespace epmoe::gemm::detail {

namespace {

// Why 4 stages: 4 x 48.5 KB fills the 227 KB of smem.
using L1Fp8 = Sm90GroupedGemmConfig<true, Sm90Epilogue::kSwiGLU, 4>;
using L2Fp8 = Sm90GroupedGemmConfig<true, Sm90Epilogue::kStoreBf16, 4>;

template <class Cfg>
cudaError_t launch(const CUtensorMap& a, const CUtensorMap& b, const GroupedGemmParams& p, int grid,
                   cudaStream_t stream) {
  constexpr int kSmem = Cfg::Layout::kAllocBytes;
  static bool configured = false;  // Why static: the attribute is per function and sticky
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(sm90_grouped_gemm_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  sm90_grouped_gemm_kernel<Cfg><<<grid, kNumThreads, kSmem, stream>>>(a, b, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sm90_grouped_gemm_fp8(GemmStage stage, const CUtensorMap& map_a, const CUtensorMap& map_b,
                                         const GroupedGemmParams& p, int grid, cudaStream_t stream) {
  return stage == GemmStage::kL1 ? launch<L1Fp8>(map_a, map_b, p, grid, stream)
                                 : launch<L2Fp8>(map_a, map_b, p, grid, stream);
}

}  // namespace epmoe::gemm::detail
