// Pingpong, 64 x 128 x 128 tiles, 2 x 1 clusters: the pingpong overlap with two M tiles sharing
// each B tile by TMA multicast.
#include "sm90_grouped_fp8_kernel.cuh"

namespace epmoe_cutlass_probe {

std::string make_pingpong_64x128x128_c2x1(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  return make_runner<Sm90GroupedFp8Gemm<64, 128, 2, 1, Pingpong>>(p, out);
}

}  // namespace epmoe_cutlass_probe
