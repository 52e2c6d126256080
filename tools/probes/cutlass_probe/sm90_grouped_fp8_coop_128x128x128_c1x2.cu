// Cooperative, 128 x 128 x 128 tiles, 1 x 2 clusters: two N tiles share each A tile by TMA multicast
// (CUTLASS example 68's choice).
#include "sm90_grouped_fp8_kernel.cuh"

namespace epmoe_cutlass_probe {

std::string make_coop_128x128x128_c1x2(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  return make_runner<Sm90GroupedFp8Gemm<128, 128, 1, 2, Cooperative>>(p, out);
}

}  // namespace epmoe_cutlass_probe
