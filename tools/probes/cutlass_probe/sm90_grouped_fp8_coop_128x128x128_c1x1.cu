// Cooperative, 128 x 128 x 128 tiles, no cluster: the plain CUTLASS configuration.
#include "sm90_grouped_fp8_kernel.cuh"

namespace epmoe_cutlass_probe {

std::string make_coop_128x128x128_c1x1(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  return make_runner<Sm90GroupedFp8Gemm<128, 128, 1, 1, Cooperative>>(p, out);
}

}  // namespace epmoe_cutlass_probe
