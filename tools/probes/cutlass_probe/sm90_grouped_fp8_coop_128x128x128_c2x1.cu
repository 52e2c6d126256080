// Cooperative, 128 x 128 x 128 tiles, 2 x 1 clusters: two M tiles share each B tile by TMA multicast
// (DeepGEMM's choice of multicast for the contiguous grouped layout).
#include "sm90_grouped_fp8_kernel.cuh"

namespace epmoe_cutlass_probe {

std::string make_coop_128x128x128_c2x1(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  return make_runner<Sm90GroupedFp8Gemm<128, 128, 2, 1, Cooperative>>(p, out);
}

}  // namespace epmoe_cutlass_probe
