// How the warps of a cooperatively launched comm phase share its work units.
#pragma once

#include <cstdint>

namespace epmoe::comm {

// This warp's first unit in a grid-stride loop over `units` work units:
//   for (int64_t u = first_unit<kWarps>(units); u < units; u += gridDim.x * kWarps)
// Every warp of the grid gets a distinct start, so each unit is done exactly once either way.
// Why two numberings (measured on one H200 at R = 1, docs/COMM.md):
// - fewer units than warps (decode): warps numbered across blocks first put the units, and the
//   stores that fan them out, on as many SMs as there are units. Numbered block by block, the 16
//   pull units of 8 tokens all ran in the first block: dispatch at 8 tokens 27.7 -> 19.6 us.
// - more units than warps: block by block keeps a token's consecutive units (its slices or
//   chunks) on one SM; numbered across blocks, dispatch at 1024-4096 tokens was 2-4% slower.
template <int kWarps>
__device__ __forceinline__ int first_unit(int64_t units) {
  const int warp = int(threadIdx.x >> 5), blocks = int(gridDim.x), block = int(blockIdx.x);
  return units <= int64_t(blocks) * kWarps ? warp * blocks + block : block * kWarps + warp;
}

}  // namespace epmoe::comm
