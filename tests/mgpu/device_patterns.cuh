// Inputs and expected outputs generated and checked on the device, so that thousands of calls (and
// graph replays) run without a host round trip. Every value is a hash of (rank, token, slot, channel,
// iteration): any rank can recompute any other rank's routing and expert outputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace epmoe::mgpu {

__host__ __device__ inline uint32_t hash4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u;
  h ^= h >> 15;
  h = (h ^ c * 0xC2B2AE3Du) * 0x27D4EB2Fu;
  h ^= h >> 13;
  h = (h ^ d * 0x165667B1u) * 0x9E3779B1u;
  return h ^ (h >> 16);
}

struct PatternShape {
  int E, K, H;
};

// Slot k of token t on rank r in iteration it: distinct experts (E a power of two, odd stride),
// about one slot in eight masked.
__device__ inline int pattern_expert(const PatternShape& p, int r, int t, int k, uint32_t it) {
  if (hash4(r, t, k, it * 7 + 1) % 8 == 0) return -1;
  const uint32_t base = hash4(r, t, 99, it), stride = 2 * (hash4(r, t, 98, it) % (p.E / 2 > 0 ? p.E / 2 : 1)) + 1;
  return int((base + uint32_t(k) * stride) % uint32_t(p.E));
}
__device__ inline float pattern_weight(int r, int t, int k, uint32_t it) {
  return float(hash4(r, t, k, it * 7 + 2) % 1000 + 1) / 1000.f;
}
// Token values in [-4, 4], never 0; channel groups get different magnitudes.
__device__ inline float pattern_x(int r, int t, int h, uint32_t it) {
  const uint32_t v = hash4(r, t, h, it * 7 + 3);
  const float mag = float((h / 128 + it) % 5 + 1) * 0.25f;
  return (float(v % 1999) - 999.f + 0.5f) / 999.f * mag * 3.2f;
}
// Expert outputs: multiples of 1/64 in [-2, 2] (exact in bf16), so fp32 sums over slots are exact and
// independent of the summation order.
__device__ inline float pattern_o(int r, int t, int k, int h, uint32_t it) {
  return float(int(hash4(r, t * 33 + k, h, it * 7 + 4) % 257) - 128) / 64.f;
}

}  // namespace epmoe::mgpu
