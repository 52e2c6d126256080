// Arithmetic instructions picked by hand: MUFU approximations, and register hints that steer
// ptxas (they compile to nothing or to one integer add).
#pragma once

#include <cstdint>

namespace epmoe::ptx {

// 2^x and 1/x from the MUFU unit (relative error ~2^-22 and ~1 ulp); .ftz flushes subnormal
// inputs and results to zero.
__device__ __forceinline__ float ex2_approx_ftz_f32(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float rcp_approx_ftz_f32(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// x + y as a volatile add.u32 the compiler cannot fold: with y a run-time zero, it keeps x a
// loop-carried register (the mainloops' 32-bit shared-window base) instead of a rematerialised
// constant. Why by value: a reference parameter changed the fused BF16 kernel's PTX (and SASS).
__device__ __forceinline__ uint32_t add_u32_volatile(uint32_t x, uint32_t y) {
  asm volatile("add.u32 %0, %0, %1;" : "+r"(x) : "r"(y));
  return x;
}

// Makes x opaque to the optimiser (no instruction): values derived from it are not treated as
// loop invariants.
__device__ __forceinline__ void opaque(int& x) { asm volatile("" : "+r"(x)); }
__device__ __forceinline__ void opaque(uint32_t& x) { asm volatile("" : "+r"(x)); }

}  // namespace epmoe::ptx
