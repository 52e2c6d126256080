// Shared-memory map of one grouped GEMM block: the stage ring, FP8 activation scales and the
// pipeline barriers.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/pipeline/sm90_tma_pipeline.cuh"

namespace epmoe::gemm {

// The 1024-byte aligned start of dynamic smem, as a 32-bit shared-window address. Every kernel
// here places the stage ring there (smem = dynamic smem rounded up to 1024 bytes). Why from the
// extern symbol: its shared address is a link-time constant plus this CTA's window bits (one
// S2UR of the CTA id and an add in SASS), cheaper than rebuilding a generic pointer from the shared
// window base and converting it back. The K loops still keep the value live themselves (see the
// FP8 mainloop): rematerialized under register pressure, even that S2UR sat before every wait.
__device__ __forceinline__ uint32_t dyn_smem_base_s() {
  extern __shared__ uint8_t epmoe_dynamic_smem[];  // all unsized extern smem arrays share one start
  return (static_cast<uint32_t>(__cvta_generic_to_shared(epmoe_dynamic_smem)) + 1023u) & ~1023u;
}

// A claim slot's value after a GEMM's last tile (the end mark, in the static and the claimed order).
inline constexpr uint32_t kNoMoreTiles = ~0u;

template <bool kFp8, int kStages>
struct Sm90SmemLayout {
  static constexpr int kTileN = kBlockN;  // the weight rows (output columns) of a tile
  static constexpr uint32_t kRowBytes = 128;  // one swizzle span of K per row
  static constexpr uint32_t kTileA = kBlockM * kRowBytes;
  static constexpr uint32_t kTileB = uint32_t(kTileN) * kRowBytes;
  static constexpr uint32_t kScaleA = kFp8 ? kBlockM * 4 : 0;
  static constexpr uint32_t kTxBytes = kTileA + kTileB + kScaleA;  // what TMA lands per stage
  // FP8: the stage's two weight scales (one per 128-column half of the tile, then 8 bytes of
  // padding), stored by the producer thread (Sm90TmaProducer::store_weight_scales).
  static constexpr uint32_t kScaleB = kFp8 ? 16 : 0;

  static constexpr uint32_t a_offset(uint32_t s) { return s * kTileA; }
  static constexpr uint32_t b_offset(uint32_t s) { return kStages * kTileA + s * kTileB; }
  static constexpr uint32_t sa_offset(uint32_t s) { return kStages * (kTileA + kTileB) + s * kScaleA; }
  static constexpr uint32_t sb_offset(uint32_t s) { return kStages * (kTileA + kTileB + kScaleA) + s * kScaleB; }
  // Barriers: full[kStages], empty[kStages] (the ring), then the deferred L2 epilogue's two:
  // "staged" (the math warpgroups wrote a tile's output to smem) and "drained" (the storer
  // has read the staging tiles back).
  static constexpr uint32_t kBarOffset = kStages * (kTileA + kTileB + kScaleA + kScaleB);
  static constexpr uint32_t kStagedBarOffset = kBarOffset + 2 * kStages * 8;
  static constexpr uint32_t kDrainedBarOffset = kStagedBarOffset + 8;
  // The staged tile's description for the storer (4 ints: row0, rows_valid or -1 when the
  // math warpgroups have no more tiles, n_block, the kept stage), under the same two barriers.
  static constexpr uint32_t kTileInfoOffset = kDrainedBarOffset + 8;
  // The fused kernel's claimed tiles (kStages u32): the producer writes a tile's linear index, or
  // kNoMoreTiles, into the slot of the stage that carries the tile's first K block, before that
  // stage's arrival; the math warpgroups read it after their wait (Sm90TmaProducer::run).
  static constexpr uint32_t kClaimOffset = kTileInfoOffset + 16;
  static constexpr uint32_t claim_slot(uint32_t stage) { return kClaimOffset + stage * 4u; }
  // The watchdog's bound (u64), at the offset from the barriers that pipeline::TmaPipeline fixes.
  static constexpr uint32_t kWatchdogOffset = kBarOffset + pipeline::kWatchdogBoundFromBars;
  static_assert(kClaimOffset + kStages * 4 <= kWatchdogOffset, "the claim slots overlap the watchdog's bound");
  // The plain epilogue's staging tiles, one per math warpgroup: 64 rows x 64 bf16 columns (one
  // quarter of the warpgroup's 64 x 256 block at a time), 16-byte chunks XOR-swizzled by row % 8.
  static constexpr uint32_t kEpiRowBytes = 128;
  static constexpr uint32_t kEpiTileBytes = 64 * kEpiRowBytes;
  // 1024-byte aligned: the deferred epilogue's TMA stores read 128-byte swizzled boxes from here.
  static constexpr uint32_t kEpiOffset = (kWatchdogOffset + 8 + 1023) / 1024 * 1024;
  static constexpr uint32_t epi_offset(uint32_t math_wg) { return kEpiOffset + math_wg * kEpiTileBytes; }
  // The deferred L2 epilogue stages a whole 128 x 256 bf16 tile (64 KB) as eight 8 KB slabs
  // (slab j = math warpgroup j / 4, 64-column quarter j % 4; rows and chunks as in the staging
  // tiles above): slabs 0-1 in the A tile and 2-5 in the B tile of `stage` (the stage of the
  // tile's last K block, which the math warpgroups keep instead of releasing it), 6-7 in the two
  // staging tiles.
  static constexpr uint32_t kSlabsB = kTileB / kEpiTileBytes;
  static constexpr uint32_t out_slab(uint32_t j, uint32_t stage) {
    return j < 2 ? a_offset(stage) + j * kEpiTileBytes
                 : j < 2 + kSlabsB ? b_offset(stage) + (j - 2) * kEpiTileBytes
                                   : kEpiOffset + (j - 2 - kSlabsB) * kEpiTileBytes;
  }
  // The deferred L1 epilogue's row scales of a tile (128 floats), after the staging tiles.
  static constexpr uint32_t kEpiScaleOffset = kEpiOffset + 2 * kEpiTileBytes;
  // The tile scheduler's tables of the current GEMM call (scheduler::GroupedTileScheduler,
  // fill_tile_tables): per expert the m-block prefix (kMaxGroups + 1), the row count and the
  // first pool row (kMaxGroups each), u32.
  static constexpr uint32_t kMaxGroups = 1024;
  static constexpr uint32_t kTableOffset = kEpiScaleOffset + kBlockM * 4;
  static constexpr uint32_t kTableBytes = (3 * kMaxGroups + 1) * 4;
  static constexpr uint32_t kBytes = kTableOffset + kTableBytes;
  // Why + 1024: dynamic smem is only 16-byte aligned; swizzled tiles need 1024.
  static constexpr uint32_t kAllocBytes = kBytes + 1024;

  static_assert(kTileA % 1024 == 0 && kTileB % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
  static_assert(kEpiOffset % 1024 == 0, "TMA boxes with a 128-byte swizzle need 1024-byte aligned smem");
  static_assert(kTileA == 2 * kEpiTileBytes && kTileB == uint32_t(kTileN / 64) * kEpiTileBytes,
                "a stage's A tile holds two slabs and its B tile one per 64 columns");
  static_assert(kScaleA % 16 == 0, "scale copies need 16-byte aligned destinations");
  static_assert(kAllocBytes <= 227 * 1024, "the stage ring does not fit in 227 KB of smem: fewer stages");
};

}  // namespace epmoe::gemm
