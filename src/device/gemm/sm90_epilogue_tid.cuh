// The thread index as the GEMM epilogues read it.
#pragma once

#include <cstdint>

#include "device/ptx/fence.cuh"

// The fused megakernel's translation units define this to 1 before any GEMM header
// (kernels/sm90_fused_moe.cuh, which static_asserts that it took effect); the standalone GEMM
// kernels keep 0.
#ifndef EPMOE_GEMM_EPILOGUE_TID_PER_TILE
#define EPMOE_GEMM_EPILOGUE_TID_PER_TILE 0
#endif

namespace epmoe::gemm {

inline constexpr bool kEpilogueTidPerTile = EPMOE_GEMM_EPILOGUE_TID_PER_TILE != 0;

// threadIdx.x, or (kEpilogueTidPerTile) %tid.x read where the epilogue uses it.
// Why two forms: threadIdx.x is loop-invariant, so ptxas hoists the
// epilogue's thread-derived smem offsets out of the persistent tile loop. In the standalone kernels
// they stay in registers. In the fused kernel, at the same math budget but with more live state,
// they were spilled and reloaded per L2 tile (~25 LDL per tile, 112-byte stack frame); read per
// tile they are recomputed with a few integer instructions (56-byte frame, ~6 LDL per tile).
// Measured on one H200: fused 128 tokens 431-433 -> 422-423 us. The standalone kernels got slower
// with the per-tile read (FP8 L2 -2..-10% on the GEMM benchmark, pipeline at 4096 +1%), so they
// keep threadIdx.x.
__device__ __forceinline__ uint32_t epilogue_tid() {
  if constexpr (kEpilogueTidPerTile) {
    return ptx::tid_x_volatile();
  } else {
    return threadIdx.x;
  }
}

}  // namespace epmoe::gemm
