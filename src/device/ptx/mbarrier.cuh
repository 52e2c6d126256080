// mbarrier: one wrapper per PTX instruction. Scope is the CTA.
#pragma once

#include <cstdint>

namespace epmoe::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrive_count));
}

// Makes mbarrier.init visible to the async proxy (TMA completes transactions on these barriers).
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once and announces `bytes` of async-proxy transactions that will complete on `bar`.
__device__ __forceinline__ void mbarrier_arrive_expect_tx_release_cta(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Announces `bytes` of async-proxy transactions on `bar` without arriving (the phase still waits
// for its arrivals).
__device__ __forceinline__ void mbarrier_expect_tx_relaxed_cta(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Consumer-side operations on a 32-bit shared-window address (smem_u32 of the barrier). Why: a hot
// loop that holds generic pointers converts them on every use (S2R of the shared window base); the
// GEMM's consumer loop keeps the barrier addresses as 32-bit values instead.
__device__ __forceinline__ void mbarrier_arrive_release_cta_s(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// `count` arrivals in one operation (sm_90): one thread standing for several others that met it
// at a named barrier first.
__device__ __forceinline__ void mbarrier_arrive_count_release_cta_s(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait_parity_acquire_cta_s(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// try_wait with a suspend-time hint: the thread sleeps in the instruction until the phase
// completes or about `hint_ns` pass, instead of returning at once. For waits that last long
// (a producer ahead of its consumers, the deferred epilogue's storer): a polling loop around a
// plain try_wait took one issue slot in six to nine of its SM sub-partition from the math warps
// there (ncu, FP8 L2 kernel: 4.1 M producer and 5.9 M storer polls per launch).
__device__ __forceinline__ bool mbarrier_try_wait_parity_suspend_s(uint32_t bar, uint32_t parity, uint32_t hint_ns) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2, %3;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity), "r"(hint_ns)
      : "memory");
  return done != 0;
}

// A non-blocking test of the phase with the given parity: 1 once that phase has completed, else 0.
// Unlike try_wait it never suspends the thread, so it can be issued early (the K loop tests the
// next stage while it promotes the current one) and its result read later.
__device__ __forceinline__ uint32_t mbarrier_test_wait_parity_acquire_cta_s(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done;
}

// Waits for one phase of the barrier at shared-window address `bar`, for at most the u64 bound in
// ns that shared-window address `limit_addr` holds (read only once the first probe failed), the
// whole loop in one asm block. Returns `mark` (nonzero) when the bound passed, else `failed`; with
// `failed` != 0 on entry it returns at once without waiting (a loop that already timed out skips
// its later waits, and `failed` keeps the mark of the first wait that expired).
// Why the bound from smem: it is a launch parameter (the layer's timeout_seconds), and a register
// holding it would stay live across the K loops that wait here.
// Why one asm block: its branches are invisible to the compiler, so a K loop that waits through it
// has no data-dependent exit and stays convergent: no divergence bookkeeping (BSSY/BSYNC,
// BRA.DIV, a vote) on the path between two wgmma batches.
// `ready` != 0 (an earlier mbarrier_test_wait_parity_acquire_cta_s of the same phase saw it
// complete) also returns `failed` at once, without probing again.
__device__ __forceinline__ uint32_t mbarrier_wait_parity_acquire_cta_bounded_tested_s(uint32_t bar, uint32_t parity,
                                                                                     uint32_t limit_addr,
                                                                                     uint32_t failed, uint32_t ready,
                                                                                     uint32_t mark = 1) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      ".reg .u32 any;\n"
      ".reg .u64 t0, t1, lim;\n"
      "or.b32 any, %0, %5;\n"
      "setp.ne.u32 p, any, 0;\n"
      "@p bra DONE;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "@p bra DONE;\n"
      "mov.u64 t0, %%globaltimer;\n"
      "ld.shared.u64 lim, [%3];\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "@p bra DONE;\n"
      "mov.u64 t1, %%globaltimer;\n"
      "sub.u64 t1, t1, t0;\n"
      "setp.lt.u64 p, t1, lim;\n"
      "@p bra WAIT;\n"
      "mov.u32 %0, %4;\n"
      "DONE:\n"
      "}\n"
      : "+r"(failed)
      : "r"(bar), "r"(parity), "r"(limit_addr), "r"(mark), "r"(ready)
      : "memory");
  return failed;
}

// The same wait with no earlier test.
__device__ __forceinline__ uint32_t mbarrier_wait_parity_acquire_cta_bounded_s(uint32_t bar, uint32_t parity,
                                                                              uint32_t limit_addr, uint32_t failed,
                                                                              uint32_t mark = 1) {
  return mbarrier_wait_parity_acquire_cta_bounded_tested_s(bar, parity, limit_addr, failed, 0u, mark);
}

// One probe of the phase with the given parity; true once that phase has completed.
__device__ __forceinline__ bool mbarrier_try_wait_parity_acquire_cta(uint64_t* bar, uint32_t parity) {
  return mbarrier_try_wait_parity_acquire_cta_s(smem_u32(bar), parity);
}

}  // namespace epmoe::ptx
