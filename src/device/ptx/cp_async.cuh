// Non-bulk asynchronous copies (cp.async, sm_80+) from global to shared memory, with completion
// tracked by an mbarrier. The gathered L1 A operand uses them (sm90_gather_producer.cuh): TMA on
// sm_90 copies boxes of a tensor, it cannot gather rows by index.
#pragma once

#include <cstdint>

namespace epmoe::ptx {

// 16 bytes from src to the shared-window address dst; src_bytes 0 fills the 16 bytes with zeros
// (src is then not read, but must still be a valid address). .cg: cached in L2 only.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 16 bytes from src to the shared-window address dst.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 4 bytes (4-byte copies exist only with .ca).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// 4 bytes, as cp_async_16_zfill (4-byte copies exist only with .ca).
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Closes this thread's group of cp.async issued since the last commit; wait_group<N> waits until at
// most N of this thread's groups are still in flight (their writes are then visible to the thread).
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The mbarrier at bar (shared-window address) receives one arrival once every cp.async this
// thread issued before has completed. .noinc: the arrival counts against the barrier's expected
// count (the barrier must be initialised with these arrivals included).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

}  // namespace epmoe::ptx
