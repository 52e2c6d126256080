// Shared-memory map of one grouped GEMM block: the stage ring, FP8 activation scales and the
// pipeline barriers.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"

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

template <bool kFp8, int kStages>
struct Sm90SmemLayout {
  static constexpr uint32_t kRowBytes = 128;  // one swizzle span of K per row
  static constexpr uint32_t kTileA = kBlockM * kRowBytes;
  static constexpr uint32_t kTileB = kBlockN * kRowBytes;
  static constexpr uint32_t kScaleA = kFp8 ? kBlockM * 4 : 0;
  static constexpr uint32_t kTxBytes = kTileA + kTileB + kScaleA;  // what TMA lands per stage

  static constexpr uint32_t a_offset(uint32_t s) { return s * kTileA; }
  static constexpr uint32_t b_offset(uint32_t s) { return kStages * kTileA + s * kTileB; }
  static constexpr uint32_t sa_offset(uint32_t s) { return kStages * (kTileA + kTileB) + s * kScaleA; }
  static constexpr uint32_t kBarOffset = kStages * (kTileA + kTileB + kScaleA);
  // The plain epilogue's staging tiles, one per math warpgroup: 64 rows x 64 bf16 columns (one
  // quarter of the warpgroup's 64 x 256 block at a time), 16-byte chunks XOR-swizzled by row % 8.
  static constexpr uint32_t kEpiRowBytes = 128;
  static constexpr uint32_t kEpiTileBytes = 64 * kEpiRowBytes;
  static constexpr uint32_t kEpiOffset = (kBarOffset + 2 * kStages * 8 + 127) / 128 * 128;
  static constexpr uint32_t epi_offset(uint32_t math_wg) { return kEpiOffset + math_wg * kEpiTileBytes; }
  static constexpr uint32_t kBytes = kEpiOffset + 2 * kEpiTileBytes;
  // Why + 1024: dynamic smem is only 16-byte aligned; swizzled tiles need 1024.
  static constexpr uint32_t kAllocBytes = kBytes + 1024;

  static_assert(kTileA % 1024 == 0 && kTileB % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
  static_assert(kScaleA % 16 == 0, "scale copies need 16-byte aligned destinations");
  static_assert(kAllocBytes <= 227 * 1024, "the stage ring does not fit in 227 KB of smem: fewer stages");
};

}  // namespace epmoe::gemm
