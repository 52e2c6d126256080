// Diagnostic timeline of a kernel call, per block: %globaltimer at fixed points of the comm phases
// and of the megakernel, written by thread 0 of each block. Off (every call compiles to nothing)
// unless the project is configured with -DEPMOE_DIAG_TRACE=ON, which a normal build never is.
// Why: the phase stamps the benchmark prints are one atomicMax per phase over the whole grid, so
// they say which phase is long but not which step of it, nor which blocks. This says both, for the
// last call of each kernel: `epmoe-bench layer` prints it at exit in a trace build
// (bash tools/gpu_all.sh trace).
// One buffer per translation unit (static: the project has no relocatable device code), so each
// kernel's .cu file defines a host dump function for its own copy (diag_dump.h).
// The timelines are approximate: the trace build's kernels are not the measured ones (a few more
// registers, and the decode megakernel's stack grows from 32 to 64 bytes), and the points cost a
// store each.
#pragma once

#include <cstdint>

#include "device/ptx/fence.cuh"

namespace epmoe::diag {

inline constexpr int kTraceBlocks = 256;
inline constexpr int kTracePoints = 40;

enum TracePoint : int {
  // dispatch_phases
  kDispEntry = 0,      // the phases begin (after the kernel's own setup)
  kDispPhase0,         // every destination finished reading our previous staging
  kDispStaged,         // this block's staging units done (thread 0's warp; the block's other warps may still run)
  kDispBarrier,        // past the grid barrier after staging
  kDispPublished,      // block 0: counts and T published, dispatch_ready released
  kDispCounts,         // every source's counts acquired
  kDispLayout,         // segments laid out, tokens_of read
  kDispPulled,         // thread 0's warp done with its pull units
  kDispPadding,        // after the pull: the last block's pool bookkeeping and this block's padding rows
  kDispArrived,        // past the last-block arrival (so every warp of the block is done)
  kDispEnd,            // the phases end (the last block also released read_done)
  // combine_phases
  kCombEntry,
  kCombPhase0,         // every source finished reading the partials we pushed last call
  kCombA,              // thread 0's warp done with its phase-A units
  kCombArrivedA,       // past the phase-A arrival (the last block then released combine_ready)
  kCombReady,          // every expert rank's combine_ready acquired
  kCombB,              // thread 0's warp done with its phase-B units
  kCombEnd,            // past the phase-C arrival
  // the megakernel
  kFusedEntry,         // kernel entry
  kFusedInit,          // mbarriers initialised
  kFusedBarrier1,      // past the dispatch and the scheduler tables' fill (no grid barrier there)
  kFusedGemm,          // this block's GEMM roles done (roles-done barrier for the producer warpgroup)
  kFusedBarrier2,      // past the grid barrier after the GEMMs
  kFusedReset,         // ready[] reset
  kFusedEnd,           // combine done
  // inside work units and roles (thread 0's unit or role; thread 128 for the math points)
  kDispUnitMeta,       // pull unit: slot metadata arrived (after the ballot on it)
  kDispUnitStored,     // pull unit: the row data stored to every local row
  kCombUnitRows,       // phase-A unit: token_rows arrived
  kCombUnitSummed,     // phase-A unit: this rank's rows loaded and summed
  kFusedProdL1,        // producer thread: done issuing L1 tiles
  kFusedProdL2,        // producer thread: done issuing L2 tiles
  kFusedMathL1,        // math thread 128: L1 tiles done
  kFusedMathL2,        // math thread 128: L2 tiles done
  kTracePointCount
};
static_assert(kTracePointCount <= kTracePoints, "trace points");

// Per-tile timeline of the GEMM roles (math warpgroup 0's thread 128 of each block): for each of
// the first kTileSlots tiles of GEMM g (0: L1, 1: L2), the time its loop iteration began (the tile
// known), the time its mainloop ended, the time its epilogue (with the fused L1's readiness
// release, where it follows the epilogue) ended and, for the math warpgroups' own stores, the time
// those stores were issued (before the release) and the time the L1 epilogue's values were
// computed (its row weights loaded, SwiGLU done); tile_trace_end marks the loop's end in slot
// kTileSlots.
// The tile is known before any wait in the static order, but only after its first stage landed
// where the producer publishes it in the stage's slot (the megakernel): there the mainloop time
// leaves out that first wait, and the gap before it holds it.
inline constexpr int kTileSlots = 96;

#if defined(EPMOE_DIAG_TRACE) && EPMOE_DIAG_TRACE
inline constexpr bool kTraceOn = true;
static __device__ unsigned long long g_trace[kTraceBlocks][kTracePoints];
inline constexpr int kTileFields = 5;
static __device__ unsigned long long g_tiles[2][kTraceBlocks][kTileSlots + 1][kTileFields];
__device__ __forceinline__ void tile_trace(int gemm, int slot, int field) {
  if (threadIdx.x == 128 && blockIdx.x < kTraceBlocks && slot < kTileSlots)
    g_tiles[gemm][blockIdx.x][slot][field] = ptx::globaltimer_ns();
}
__device__ __forceinline__ void tile_trace_end(int gemm) {
  if (threadIdx.x == 128 && blockIdx.x < kTraceBlocks) g_tiles[gemm][blockIdx.x][kTileSlots][0] = ptx::globaltimer_ns();
}
// Clears this block's tile rows of GEMM g (thread 128, before its first tile of the call).
__device__ __forceinline__ void tile_trace_reset(int g) {
  if (threadIdx.x == 128 && blockIdx.x < kTraceBlocks)
    for (int s = 0; s <= kTileSlots; ++s)
      for (int f = 0; f < kTileFields; ++f) g_tiles[g][blockIdx.x][s][f] = 0ull;
}

// At a kernel's entry, before any trace(): clears this block's row so that points a block does not
// reach this call (block 0's publish, say) do not keep an older call's time.
__device__ __forceinline__ void trace_reset() {
  if (threadIdx.x < kTracePoints && blockIdx.x < kTraceBlocks) g_trace[blockIdx.x][threadIdx.x] = 0ull;
  __syncwarp();
}
__device__ __forceinline__ void trace(int point, unsigned thread = 0) {
  if (threadIdx.x == thread && blockIdx.x < kTraceBlocks) g_trace[blockIdx.x][point] = ptx::globaltimer_ns();
}
#else
inline constexpr bool kTraceOn = false;
__device__ __forceinline__ void trace_reset() {}
__device__ __forceinline__ void trace(int, unsigned = 0) {}
__device__ __forceinline__ void tile_trace(int, int, int) {}
__device__ __forceinline__ void tile_trace_end(int) {}
__device__ __forceinline__ void tile_trace_reset(int) {}
#endif

}  // namespace epmoe::diag
