// Fences, CTA-level synchronisation primitives and the special registers the kernels read.
#pragma once

#include <cstdint>

namespace epmoe::ptx {

// Generic-proxy smem writes become visible to the async proxy (wgmma operand reads, TMA stores).
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Generic-proxy global writes by this thread are ordered before later async-proxy (TMA) accesses
// to them. The fused kernel's writers (dispatch into x_pool, the L1 epilogue into a_pool) issue it
// before the grid barrier after which TMA reads those rows in the same kernel.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Named barriers: `count` threads (a multiple of 32) take part; id 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// named_barrier_sync that also returns whether any participating thread passed pred != 0.
__device__ __forceinline__ uint32_t named_barrier_sync_or(uint32_t id, uint32_t count, uint32_t pred) {
  uint32_t any;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tbarrier.red.or.pred q, %2, %3, p;\n\t"
      "selp.u32 %0, 1, 0, q;\n\t}"
      : "=r"(any)
      : "r"(pred), "r"(id), "r"(count)
      : "memory");
  return any;
}

// Register budget of the calling warpgroup (sm_90a); every warp of the warpgroup must call it.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Acquire-release fences, system scope (orders this thread's accesses against peer ranks') and
// gpu scope.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// ---- Special registers ----------------------------------------------------------------------------
// %tid.x through a volatile mov, read where it is called: unlike threadIdx.x it is not a loop
// invariant, so values derived from it are recomputed rather than held across a loop (see
// gemm::epilogue_tid).
__device__ __forceinline__ uint32_t tid_x_volatile() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

}  // namespace epmoe::ptx

namespace epmoe::ptx {

__device__ __forceinline__ void nanosleep(uint32_t ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

// Kills the grid with an illegal-instruction error the host sees at its next sync.
__device__ __forceinline__ void trap() { asm volatile("trap;"); }

}  // namespace epmoe::ptx
