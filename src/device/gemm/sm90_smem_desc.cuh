// wgmma shared-memory matrix descriptors for K-major tiles written by TMA with 128-byte swizzle.
#pragma once

#include <cstdint>

#include "device/ptx/mbarrier.cuh"

namespace epmoe::gemm {

// Rows are 128 bytes (the swizzle span); 8 rows form one 1024-byte swizzle atom.
//   bits  0-13: start address >> 4
//   bits 16-29: leading byte offset >> 4 (unused for swizzled K-major; 1 by convention)
//   bits 32-45: stride byte offset >> 4 = 1024 B between 8-row groups
//   bits 62-63: 1 = 128-byte swizzle
// The tile base must be 1024-byte aligned (base offset field 0).
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(const void* tile) {
  const uint64_t addr = ptx::smem_u32(tile);
  return ((addr & 0x3FFFFull) >> 4) | (1ull << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

// The same descriptor split into its two 32-bit words, for loops that step through stages with
// integer adds on a 32-bit shared-window address. The low word holds the start address >> 4
// (an 18-bit smem address fits the 14-bit field, so adding (offset >> 4) never carries out of it)
// and the leading byte offset; the high word is constant.
inline constexpr uint32_t kSmemDescHiSw128 = uint32_t(1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t smem_desc_lo_sw128(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t smem_desc_from_lo(uint32_t lo) {
  return (uint64_t(kSmemDescHiSw128) << 32) | lo;
}

// Why adding to the start address works: within a 128-byte swizzle atom the hardware applies the
// XOR pattern to the final address, so the k-th 32-byte slice of every row starts at +32k bytes.
__device__ __forceinline__ uint64_t smem_desc_advance_k(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

}  // namespace epmoe::gemm
