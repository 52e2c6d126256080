// Pingpong, 64 x 128 x 128 tiles, no cluster: each consumer warpgroup owns a tile, so one's
// promotion and epilogue overlap the other's wgmma.
#include "sm90_grouped_fp8_kernel.cuh"

namespace epmoe_cutlass_probe {

std::string make_pingpong_64x128x128_c1x1(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  return make_runner<Sm90GroupedFp8Gemm<64, 128, 1, 1, Pingpong>>(p, out);
}

}  // namespace epmoe_cutlass_probe
