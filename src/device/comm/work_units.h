// How the warps of a cooperatively launched comm phase share its work units.
#pragma once

#include <cstdint>

#include "device/layout/hd.h"

namespace epmoe::comm {

// This warp's first unit in a grid-stride loop over `units` work units:
//   for (int64_t u = first_unit<kWarps>(units); u < units; u += gridDim.x * kWarps)
// Every warp of the grid gets a distinct start, so each unit is done exactly once either way,
// provided `units` is the same in every block: it picks the numbering for the whole grid. All
// callers pass counts every block reads alike (T, or counts published before a flag or barrier).
// Why two numberings (measured on one H200 at R = 1, docs/DESIGN.md, "Work units spread by size"):
// - at most half as many units as warps (decode): numbered block by block, the units and the
//   stores that fan them out ran on the first few blocks only (the 16 pull units of 8 tokens all
//   in block 0); numbered across blocks first, they land on as many SMs as there are units.
//   Dispatch fp8 at 8 tokens 27.8 -> 19.9 us, at 128 tokens 28.0-28.4 -> 22.9-23.0 us.
// - more units: block by block keeps a token's consecutive units (its slices or chunks) on one
//   SM. Numbered across blocks, dispatch was 2-4% slower at 1024-4096 tokens, with 0.97 units per
//   warp at 1024. Every block is busy there anyway.
// The numbering itself, for warp `warp` of block `block` in a grid of `blocks` blocks of `warps`
// warps (host-callable, so the unit tests can check that it covers every unit once).
EPMOE_HD int first_unit_of(int64_t units, int warp, int block, int blocks, int warps) {
  return 2 * units <= int64_t(blocks) * warps ? warp * blocks + block : block * warps + warp;
}

// Unit u of a walk over (source rank, token, slice) units, as the dispatch's pull and combine's
// phase A number them: slices of a token first, then sources, each token's sources starting at
// rank + 1, so that at any moment the grid reads from every source (NVLink and local copies overlap).
struct SourceTokenSlice {
  int slice, src, t;
};
EPMOE_HD SourceTokenSlice source_token_slice(int64_t u, int slices, int num_ranks, int rank) {
  SourceTokenSlice w;
  w.slice = int(u % slices);
  const int64_t item = u / slices;
  w.src = int((rank + 1 + item % num_ranks) % num_ranks);
  w.t = int(item / num_ranks);
  return w;
}

#if defined(__CUDACC__)
template <int kWarps>
__device__ __forceinline__ int first_unit(int64_t units) {
  return first_unit_of(units, int(threadIdx.x >> 5), int(blockIdx.x), int(gridDim.x), kWarps);
}

// Whether this warp's lane 0 stamps the end of a phase (comm::stamp_phase): the warps that had a
// unit (had_unit: first_unit < units, taken before the loop), and warp 0 of block 0, so that the
// stamp exists when no warp had one. Why not every warp: the stamp is one atomicMax on one word,
// and the fused kernel has 1,584 warps. (Measured on one H200 at T = 1: the fused kernel's spans
// did not change, so that contention is not why they are longer than the standalone kernels'.)
__device__ __forceinline__ bool stamps_phase_end(bool had_unit) {
  return (threadIdx.x & 31) == 0 && (had_unit || (threadIdx.x == 0 && blockIdx.x == 0));
}
#endif

}  // namespace epmoe::comm
