// Probe: how much of the FP8 tensor rate each math-warpgroup structure can reach, with the
// operands already in shared memory (no TMA, no barriers, no global traffic). It isolates the
// mainloop's own cost (wgmma issue, drains, fp32 promotion) from the memory feed.
//
// Built with the project as epmoe-wgmma-probe (tools/stage_gpu.sh copies it to .gpu/bin).
// Run (GPU): epmoe-wgmma-probe [k_blocks [--fed]]   (default 4000 K blocks per warpgroup; --fed:
// the fed variants 9, 10, 16, 15, 14 and the unfed 0 and 4, two rounds)
//
// Variants (2 math warpgroups of 64 rows each unless said; FLOPs counted for what is computed):
//   0 halves     : 64x256 per warpgroup as two N halves of 128, each 4 x m64n128k32 -> scratch,
//                  wait 0, promote (the current epmoe mainloop)
//   1 halves 1wg : variant 0 with one math warpgroup
//   2 n128 dbuf  : 64x128 per warpgroup, two scratches, wait 1: the next K block's wgmma runs
//                  while the previous one is promoted
//   3 dbuf 1wg   : variant 2 with one math warpgroup
//   4 n192 1drain: 64x192 per warpgroup, 4 x m64n192k32 -> scratch, wait 0, promote (one drain
//                  per K block)
//   5 n256 nopromo: 4 x m64n256k32 straight into the accumulator, wait 0 per K block (bound)
//   6 halves+skew: variant 0, the second warpgroup starts half a K block late
//   7 n128 1drain: 64x128 per warpgroup, one scratch, wait 0, promote
//   9 halves+feed: variant 0 fed like the GEMM: a producer thread bulk-copies each stage (48.5 KB
//                  from an L2-resident buffer) into a 4-stage ring with full/empty mbarriers
//  10 regA+feed  : variant 9 with A in registers: each warp ldmatrix-loads its 16 x 128 A slice
//                  once per K block and both N halves use it (half the A reads from smem)
//  11 regA       : variant 10 without the feed
//  12 3wg n128     : three math warpgroups (512 threads; producer 24 registers, math 160), each
//                  64x128 (a 192x128 tile), 4 x m64n128k32 -> scratch, wait 0, promote
//  13 3wg n128+feed: variant 12 fed like variant 9 (5 stages of 40.75 KB: A 24 KB + B 16 KB + scales)
//  14 n128 dbuf+feed: variant 2 (two warpgroups of 64x128, two scratches) fed like variant 9
//                  (6 stages of 32.5 KB), each stage released after its K block's wait
//  15 n192+feed    : variant 4 (DeepGEMM's structure: a 128 x 192 tile, one drain per K block) fed
//                  like variant 9 (5 stages of 40.5 KB), each stage released before its promotion
//  16 regA late+feed: variant 10 with the next K block's A loaded right after the second half's
//                  wait, so that the ldmatrix latency runs under that half's promotion instead of
//                  in front of the next batch
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_cuda.h"
#include "tools/probes/wgmma_probe_ops.cuh"

namespace probe {

constexpr int kStages = 4;
constexpr int kABytes = 128 * 128;  // 128 rows x 128 e4m3
constexpr int kBBytes = 256 * 128;
constexpr int kStageBytes = kABytes + kBBytes + 512;
constexpr int kBarBytes = 2 * kStages * 8;
constexpr int kSmem = kStages * kStageBytes + kBarBytes + 1024;
constexpr int kFeedBuffers = 8;  // source stages in global memory, cycled (L2-resident)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint64_t desc(const void* tile) {
  const uint64_t a = smem_u32(tile);
  return ((a & 0x3FFFFull) >> 4) | (1ull << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void promote(float* acc, const float (&t)[N], float s0, float s1) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    acc[4 * i + 0] += t[4 * i + 0] * s0;
    acc[4 * i + 1] += t[4 * i + 1] * s0;
    acc[4 * i + 2] += t[4 * i + 2] * s1;
    acc[4 * i + 3] += t[4 * i + 3] * s1;
  }
}

__device__ __forceinline__ bool try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  while (!try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The two-scratch (dbuf) loop of variants 2, 3 and 14: the next K block's wgmma runs while the
// previous one is promoted. issue(t, kb) starts K block kb's batch into scratch t; scales(kb, s0,
// s1) reads its activation scales; release(kb) hands its stage back (a no-op without a feed).
// Why chunks of 4 K blocks that end drained: ptxas (13.0) tracks partial waits only in
// straight-line code; a wgmma group still in flight at a loop back edge whose sibling scratch is
// read in the loop makes it serialize every wgmma (C7514).
template <class Issue, class Scales, class Release>
__device__ __forceinline__ void dbuf_loop(float (&acc)[64], float (&t0r)[64], float (&t1r)[64], int k_blocks,
                                          Issue&& issue, Scales&& scales, Release&& release) {
  for (int kb = 0; kb < k_blocks; kb += 4) {  // k_blocks a multiple of 4
    float s0, s1;
    issue(t0r, kb);
    issue(t1r, kb + 1);
    scales(kb, s0, s1);
    wg_wait<1>();
    fence_regs(t0r);
    release(kb);
    promote<64>(acc, t0r, s0, s1);
    issue(t0r, kb + 2);
    scales(kb + 1, s0, s1);
    wg_wait<1>();
    fence_regs(t1r);
    release(kb + 1);
    promote<64>(acc, t1r, s0, s1);
    issue(t1r, kb + 3);
    scales(kb + 2, s0, s1);
    wg_wait<1>();
    fence_regs(t0r);
    release(kb + 2);
    promote<64>(acc, t0r, s0, s1);
    scales(kb + 3, s0, s1);
    wg_wait<0>();
    fence_regs(t1r);
    release(kb + 3);
    promote<64>(acc, t1r, s0, s1);
  }
}

template <int V>
__global__ void __launch_bounds__(384, 1) probe_kernel(int k_blocks, float* out, long long* cycles,
                                                       const uint8_t* feed_src) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  // Small finite e4m3 codes (no NaN encodings), scales near 1.
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
    const uint32_t b = (i * 2654435761u) >> 8;
    reinterpret_cast<uint32_t*>(smem)[i] = b & 0x2F2F2F2Fu;
  }
  __syncthreads();
  for (int s = 0; s < kStages; ++s) {
    float* sa = reinterpret_cast<float*>(smem + s * kStageBytes + kABytes + kBBytes);
    for (int i = threadIdx.x; i < 128; i += blockDim.x) sa[i] = 1.0f + 1e-3f * i;
  }
  constexpr bool kFeed = V == 9 || V == 10 || V == 16;
  constexpr bool kRegA = V == 10 || V == 11;
  const uint32_t bars = smem_u32(smem + kStages * kStageBytes);  // full[kStages], empty[kStages]
  if (kFeed && threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bars + 8 * s), "r"(1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bars + 8 * (kStages + s)), "r"(8));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (kFeed && threadIdx.x == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % kStages, round = kb / kStages;
        if (round > 0) wait_parity(bars + 8 * (kStages + s), uint32_t(round - 1) & 1u);
        asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bars + 8 * s),
                     "r"(kStageBytes)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_u32(smem + s * kStageBytes)),
            "l"(feed_src + size_t(kb % kFeedBuffers) * kStageBytes), "r"(kStageBytes), "r"(bars + 8 * s)
            : "memory");
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int mw = wg - 1;
  constexpr bool kOneWg = V == 1 || V == 3;
  if (kOneWg && mw == 1) return;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int r0 = mw * 64 + warp * 16 + lane / 4;
  const float sb = 0.5f;
  float result = 0.0f;
  long long t0 = 0;
  if (V == 6 && mw == 1) {
    const long long w = clock64();
    while (clock64() - w < 300) {
    }
  }
  t0 = clock64();

  // Variants 0, 1, 6 (the halves structure) and 9-11 (the same with a feed and / or A in registers).
  if constexpr (V == 0 || V == 1 || V == 6 || V == 9 || V == 10 || V == 11) {
    float acc[128], tmp[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % kStages;
      if constexpr (kFeed) wait_parity(bars + 8 * s, uint32_t(kb / kStages) & 1u);
      uint8_t* st = smem + s * kStageBytes;
      const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes);
      const float s0 = sa[r0] * sb, s1 = sa[r0 + 8] * sb;
      const uint64_t da = desc(st + mw * 64 * 128);
      uint32_t a[4][4];
      if constexpr (kRegA) {
        // This warp's 16 rows x 128 bytes of A, as the m64k32 fragments of the four k steps:
        // matrix j of k step k = rows (j & 1) * 8 .. +7, 16-byte chunk 2k + (j >> 1) (128B swizzle).
        const int row = mw * 64 + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int chunk = 2 * k + (lane >> 4);
          ldmatrix_x4(smem_u32(st) + uint32_t(row * 128 + ((chunk ^ (row & 7)) * 16)), a[k]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint64_t db = desc(st + kABytes + h * 128 * 128);
        fence_regs(tmp);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (kRegA)
            wgmma_m64n128k32_e4m3_rs(tmp, a[k], db + 2 * k, k > 0);
          else
            wgmma_m64n128k32_e4m3(tmp, da + 2 * k, db + 2 * k, k > 0);
        }
        wg_commit();
        wg_wait<0>();
        fence_regs(tmp);
        if (kFeed && h == 1) {
          __syncwarp();
          if (lane == 0) asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bars + 8 * (kStages + s)) : "memory");
        }
        promote<64>(acc + 64 * h, tmp, s0, s1);
      }
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) result += acc[i];
  } else if constexpr (V == 16) {
    float acc[128], tmp[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    // This warp's 16 rows x 128 bytes of A, as the m64k32 fragments of the four k steps (variant 10).
    const int arow = mw * 64 + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    uint32_t a[4][4];
    auto load_a = [&](int kb) {
      const uint32_t st = smem_u32(smem + (kb % kStages) * kStageBytes);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int chunk = 2 * k + (lane >> 4);
        ldmatrix_x4(st + uint32_t(arow * 128 + ((chunk ^ (arow & 7)) * 16)), a[k]);
      }
    };
    wait_parity(bars, 0u);
    load_a(0);
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % kStages;
      uint8_t* st = smem + s * kStageBytes;
      const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes);
      const float s0 = sa[r0] * sb, s1 = sa[r0 + 8] * sb;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint64_t db = desc(st + kABytes + h * 128 * 128);
        fence_regs(tmp);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n128k32_e4m3_rs(tmp, a[k], db + 2 * k, k > 0);
        wg_commit();
        wg_wait<0>();
        fence_regs(tmp);
        if (h == 1) {
          __syncwarp();
          if (lane == 0) asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bars + 8 * (kStages + s)) : "memory");
          if (kb + 1 < k_blocks) {
            wait_parity(bars + 8 * ((kb + 1) % kStages), uint32_t((kb + 1) / kStages) & 1u);
            load_a(kb + 1);
          }
        }
        promote<64>(acc + 64 * h, tmp, s0, s1);
      }
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) result += acc[i];
  } else if constexpr (V == 2 || V == 3) {
    float acc[64], t0r[64], t1r[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    // Why a runtime zero: with a constant scale-d of 0, ptxas treats the scratch as dead between
    // its promotion and the next batch, renames registers across the loop and serializes wgmma.
    const uint32_t first_scale_d = static_cast<uint32_t>(k_blocks) >> 31;
    auto issue = [&](float (&t)[64], int kb) {
      uint8_t* st = smem + (kb % kStages) * kStageBytes;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + kABytes);
      fence_regs(t);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n128k32_e4m3(t, da + 2 * k, db + 2 * k, k > 0 ? 1u : first_scale_d);
      wg_commit();
    };
    auto scales = [&](int kb, float& s0, float& s1) {
      const float* sa = reinterpret_cast<const float*>(smem + (kb % kStages) * kStageBytes + kABytes + kBBytes);
      s0 = sa[r0] * sb;
      s1 = sa[r0 + 8] * sb;
    };
    dbuf_loop(acc, t0r, t1r, k_blocks, issue, scales, [](int) {});
#pragma unroll
    for (int i = 0; i < 64; ++i) result += acc[i];
  } else if constexpr (V == 4) {
    float acc[96], tmp[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      uint8_t* st = smem + (kb % kStages) * kStageBytes;
      const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes);
      const float s0 = sa[r0] * sb, s1 = sa[r0 + 8] * sb;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + kABytes);
      fence_regs(tmp);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n192k32_e4m3(tmp, da + 2 * k, db + 2 * k, k > 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(tmp);
      promote<96>(acc, tmp, s0, s1);
    }
#pragma unroll
    for (int i = 0; i < 96; ++i) result += acc[i];
  } else if constexpr (V == 5) {
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      uint8_t* st = smem + (kb % kStages) * kStageBytes;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + kABytes);
      fence_regs(acc);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n256k32_e4m3(acc, da + 2 * k, db + 2 * k, 1);
      wg_commit();
      wg_wait<0>();
      fence_regs(acc);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) result += acc[i];
  } else if constexpr (V == 8) {
    // 64x256 per warpgroup as four N quarters of 64, two quarter scratches: quarter q+1's wgmma
    // runs while quarter q is promoted; drained once per K block.
    float acc[128], qa[32], qb[32];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const uint32_t zero = static_cast<uint32_t>(k_blocks) >> 31;
    for (int kb = 0; kb < k_blocks; ++kb) {
      uint8_t* st = smem + (kb % kStages) * kStageBytes;
      const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes);
      const float s0 = sa[r0] * sb, s1 = sa[r0 + 8] * sb;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + kABytes);
      auto issue = [&](float (&t)[32], int q) {
        fence_regs(t);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n64k32_e4m3(t, da + 2 * k, db + q * 64 * 128 / 16 + 2 * k, k > 0 ? 1u : zero);
        wg_commit();
      };
      issue(qa, 0);
      issue(qb, 1);
      wg_wait<1>();
      fence_regs(qa);
      promote<32>(acc + 0, qa, s0, s1);
      issue(qa, 2);
      wg_wait<1>();
      fence_regs(qb);
      promote<32>(acc + 32, qb, s0, s1);
      issue(qb, 3);
      wg_wait<1>();
      fence_regs(qa);
      promote<32>(acc + 64, qa, s0, s1);
      wg_wait<0>();
      fence_regs(qb);
      promote<32>(acc + 96, qb, s0, s1);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) result += acc[i];
  } else if constexpr (V == 7) {
    float acc[64], tmp[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      uint8_t* st = smem + (kb % kStages) * kStageBytes;
      const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes);
      const float s0 = sa[r0] * sb, s1 = sa[r0 + 8] * sb;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + kABytes);
      fence_regs(tmp);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n128k32_e4m3(tmp, da + 2 * k, db + 2 * k, k > 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(tmp);
      promote<64>(acc, tmp, s0, s1);
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) result += acc[i];
  }
  const long long t1 = clock64();
  out[blockIdx.x * 384 + threadIdx.x] = result;
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + mw] = t1 - t0;
}


// Variants 12-14: a feed and stage ring of their own (kSt stages of a kA + kB + scales layout).
// kWgs math warpgroups of 64 rows each, all reading the same 128-row B tile.
template <int V>
struct Ring {
  static constexpr int kWgs = V == 14 || V == 15 ? 2 : 3;
  static constexpr int kA = kWgs * 64 * 128;
  static constexpr int kN = V == 15 ? 192 : 128;
  static constexpr int kB = kN * 128;
  static constexpr int kStage = kA + kB + 4 * kWgs * 64;
  static constexpr int kSt = V == 14 ? 6 : 5;
  static constexpr int kSmem = kSt * kStage + 2 * kSt * 8 + 1024;
  static constexpr int kThreads = 128 * (kWgs + 1);
  static constexpr bool kFeed = V != 12;
};

template <int V>
__global__ void __launch_bounds__(Ring<V>::kThreads, 1) probe_ring_kernel(int k_blocks, float* out, long long* cycles,
                                                                         const uint8_t* feed_src) {
  using G = Ring<V>;
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  for (int i = threadIdx.x; i < G::kSt * G::kStage / 4; i += blockDim.x) {
    const uint32_t b = (i * 2654435761u) >> 8;
    reinterpret_cast<uint32_t*>(smem)[i] = b & 0x2F2F2F2Fu;
  }
  __syncthreads();
  for (int s = 0; s < G::kSt; ++s) {
    float* sa = reinterpret_cast<float*>(smem + s * G::kStage + G::kA + G::kB);
    for (int i = threadIdx.x; i < G::kWgs * 64; i += blockDim.x) sa[i] = 1.0f + 1e-3f * (i % 128);
  }
  const uint32_t bars = smem_u32(smem + G::kSt * G::kStage);  // full[kSt], empty[kSt]
  if (threadIdx.x == 0) {
    for (int s = 0; s < G::kSt; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bars + 8 * s), "r"(1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bars + 8 * (G::kSt + s)), "r"(4 * G::kWgs));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if constexpr (G::kWgs == 3)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    else
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (G::kFeed && threadIdx.x == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % G::kSt, round = kb / G::kSt;
        if (round > 0) wait_parity(bars + 8 * (G::kSt + s), uint32_t(round - 1) & 1u);
        asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bars + 8 * s),
                     "r"(G::kStage)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_u32(smem + s * G::kStage)),
            "l"(feed_src + size_t(kb % kFeedBuffers) * G::kStage), "r"(G::kStage), "r"(bars + 8 * s)
            : "memory");
      }
    }
    return;
  }
  if constexpr (G::kWgs == 3)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;");
  else
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int mw = wg - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int r0 = mw * 64 + warp * 16 + lane / 4;
  const float sb = 0.5f;
  float result = 0.0f;
  auto release = [&](int kb) {
    if constexpr (G::kFeed) {
      __syncwarp();
      if (lane == 0)
        asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bars + 8 * (G::kSt + kb % G::kSt))
                     : "memory");
    }
  };
  auto acquire = [&](int kb) {
    if constexpr (G::kFeed) wait_parity(bars + 8 * (kb % G::kSt), uint32_t(kb / G::kSt) & 1u);
  };
  auto scales = [&](int kb, float& s0, float& s1) {
    const float* sa = reinterpret_cast<const float*>(smem + (kb % G::kSt) * G::kStage + G::kA + G::kB);
    s0 = sa[r0] * sb;
    s1 = sa[r0 + 8] * sb;
  };
  const long long t0 = clock64();
  if constexpr (V == 12 || V == 13 || V == 15) {
    // One scratch and one drain per K block: 64 x 128 per warpgroup (12, 13) or 64 x 192 (15).
    constexpr int kAcc = G::kN / 2;
    float acc[kAcc], tmp[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      acquire(kb);
      uint8_t* st = smem + (kb % G::kSt) * G::kStage;
      float s0, s1;
      scales(kb, s0, s1);
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + G::kA);
      fence_regs(tmp);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (G::kN == 192)
          wgmma_m64n192k32_e4m3(tmp, da + 2 * k, db + 2 * k, k > 0);
        else
          wgmma_m64n128k32_e4m3(tmp, da + 2 * k, db + 2 * k, k > 0);
      }
      wg_commit();
      wg_wait<0>();
      fence_regs(tmp);
      release(kb);
      promote<kAcc>(acc, tmp, s0, s1);
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) result += acc[i];
  } else {
    float acc[64], t0r[64], t1r[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const uint32_t first_scale_d = static_cast<uint32_t>(k_blocks) >> 31;
    auto issue = [&](float (&t)[64], int kb) {
      acquire(kb);
      uint8_t* st = smem + (kb % G::kSt) * G::kStage;
      const uint64_t da = desc(st + mw * 64 * 128), db = desc(st + G::kA);
      fence_regs(t);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n128k32_e4m3(t, da + 2 * k, db + 2 * k, k > 0 ? 1u : first_scale_d);
      wg_commit();
    };
    dbuf_loop(acc, t0r, t1r, k_blocks, issue, scales, release);
#pragma unroll
    for (int i = 0; i < 64; ++i) result += acc[i];
  }
  const long long t1 = clock64();
  out[blockIdx.x * 512 + threadIdx.x] = result;
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 3 + mw] = t1 - t0;
}

// FLOPs per K block of one math warpgroup.
constexpr double flops_per_kb(int v) {
  return v == 2 || v == 3 || v == 7 ? 2.0 * 64 * 128 * 128 : v == 4 ? 2.0 * 64 * 192 * 128 : 2.0 * 64 * 256 * 128;
}

// One warm-up launch, then the best of 5 timed launches; FLOP per SM clock from the busiest math
// warpgroup's cycles (the `slots` per-warpgroup counters, zeroed first so that a warpgroup that
// does not run cannot leave an earlier variant's count behind).
template <class Launch>
void time_and_report(int v, const char* name, int sms, int slots, double flops, long long* cycles, Launch&& launch) {
  PROBE_CUDA(cudaMemset(cycles, 0, sizeof(long long) * slots));
  launch();  // warm-up
  PROBE_CUDA(cudaGetLastError());
  PROBE_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  PROBE_CUDA(cudaEventCreate(&a));
  PROBE_CUDA(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    PROBE_CUDA(cudaEventRecord(a));
    launch();
    PROBE_CUDA(cudaGetLastError());
    PROBE_CUDA(cudaEventRecord(b));
    PROBE_CUDA(cudaEventSynchronize(b));
    float ms;
    PROBE_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (ms < best) best = ms;
  }
  std::vector<long long> host_cycles(slots);
  PROBE_CUDA(cudaMemcpy(host_cycles.data(), cycles, sizeof(long long) * slots, cudaMemcpyDeviceToHost));
  long long cmax = 0;
  for (long long c : host_cycles) cmax = c > cmax ? c : cmax;
  // Per SM per clock: dense e4m3 peak is 8192 FLOP/clk (4 tensor cores x 2048).
  const double per_clk = flops / sms / cmax;
  std::printf("%d %-14s %8.3f ms %8.1f TFLOP/s  %6.0f FLOP/clk/SM  %5.1f%% of 8192  (~%.2f GHz)\n", v, name, best,
              flops / best / 1e9, per_clk, 100.0 * per_clk / 8192, cmax / (best * 1e6));
  PROBE_CUDA(cudaEventDestroy(a));
  PROBE_CUDA(cudaEventDestroy(b));
}

template <int V>
void run_variant(const char* name, int k_blocks, int sms, float* out, long long* cycles, const uint8_t* feed) {
  PROBE_CUDA(cudaFuncSetAttribute(probe_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int wgs = (V == 1 || V == 3) ? 1 : 2;
  time_and_report(V, name, sms, 2 * sms, flops_per_kb(V) * k_blocks * wgs * sms, cycles,
                  [&] { probe_kernel<V><<<sms, 384, kSmem>>>(k_blocks, out, cycles, feed); });
}

template <int V>
void run_ring_variant(const char* name, int k_blocks, int sms, float* out, long long* cycles, const uint8_t* feed) {
  using G = Ring<V>;
  PROBE_CUDA(cudaFuncSetAttribute(probe_ring_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmem));
  time_and_report(V, name, sms, 3 * sms, 2.0 * 64 * G::kN * 128 * double(k_blocks) * G::kWgs * sms, cycles,
                  [&] { probe_ring_kernel<V><<<sms, G::kThreads, G::kSmem>>>(k_blocks, out, cycles, feed); });
}

}  // namespace probe

int main(int argc, char** argv) {
  using namespace probe;
  const int k_blocks = argc > 1 ? std::atoi(argv[1]) : 4000;
  int sms = 0;
  PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms > 132) sms = 132;
  float* out;
  long long* cycles;
  PROBE_CUDA(cudaMalloc(&out, sizeof(float) * 512 * sms));
  PROBE_CUDA(cudaMalloc(&cycles, sizeof(long long) * 3 * sms));
  // The feed's source stages: small finite e4m3 codes like the smem fill, scales near 1.
  uint8_t* feed;
  PROBE_CUDA(cudaMalloc(&feed, size_t(kFeedBuffers) * kStageBytes));
  {
    std::vector<uint32_t> h(size_t(kFeedBuffers) * kStageBytes / 4);
    for (size_t i = 0; i < h.size(); ++i) h[i] = ((uint32_t(i) * 2654435761u) >> 8) & 0x2F2F2F2Fu;
    for (int b = 0; b < kFeedBuffers; ++b)
      for (int i = 0; i < 128; ++i) {
        const float v = 1.0f + 1e-3f * i;
        std::memcpy(&h[(size_t(b) * kStageBytes + kABytes + kBBytes) / 4 + i], &v, 4);
      }
    PROBE_CUDA(cudaMemcpy(feed, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  std::printf("wgmma probe: %d SMs, %d K blocks of 128 per warpgroup, operands in smem\n", sms, k_blocks);
  if (argc > 2 && std::strcmp(argv[2], "--fed") == 0) {
    // The fed structures only, twice each in turns (the GEMM's halves, A from registers early and
    // late, DeepGEMM's n192 tile, the n128 two-scratch tile).
    for (int round = 0; round < 2; ++round) {
      run_variant<9>("halves+feed", k_blocks, sms, out, cycles, feed);
      run_variant<10>("regA+feed", k_blocks, sms, out, cycles, feed);
      run_variant<16>("regA late+feed", k_blocks, sms, out, cycles, feed);
      run_ring_variant<15>("n192+feed", k_blocks, sms, out, cycles, feed);
      run_ring_variant<14>("n128 dbuf+feed", k_blocks, sms, out, cycles, feed);
      run_variant<0>("halves", k_blocks, sms, out, cycles, feed);
      run_variant<4>("n192 1drain", k_blocks, sms, out, cycles, feed);
    }
    return 0;
  }
  run_variant<5>("n256 nopromo", k_blocks, sms, out, cycles, feed);
  run_variant<0>("halves", k_blocks, sms, out, cycles, feed);
  run_variant<1>("halves 1wg", k_blocks, sms, out, cycles, feed);
  run_variant<6>("halves+skew", k_blocks, sms, out, cycles, feed);
  run_variant<7>("n128 1drain", k_blocks, sms, out, cycles, feed);
  run_variant<2>("n128 dbuf", k_blocks, sms, out, cycles, feed);
  run_variant<3>("n128 dbuf 1wg", k_blocks, sms, out, cycles, feed);
  run_variant<4>("n192 1drain", k_blocks, sms, out, cycles, feed);
  run_variant<8>("n64 quarters", k_blocks, sms, out, cycles, feed);
  run_variant<9>("halves+feed", k_blocks, sms, out, cycles, feed);
  run_variant<10>("regA+feed", k_blocks, sms, out, cycles, feed);
  run_variant<11>("regA", k_blocks, sms, out, cycles, feed);
  run_variant<0>("halves", k_blocks, sms, out, cycles, feed);
  run_variant<9>("halves+feed", k_blocks, sms, out, cycles, feed);
  run_variant<10>("regA+feed", k_blocks, sms, out, cycles, feed);
  run_ring_variant<12>("3wg n128", k_blocks, sms, out, cycles, feed);
  run_ring_variant<13>("3wg n128+feed", k_blocks, sms, out, cycles, feed);
  run_ring_variant<14>("n128 dbuf+feed", k_blocks, sms, out, cycles, feed);
  run_variant<9>("halves+feed", k_blocks, sms, out, cycles, feed);
  run_ring_variant<12>("3wg n128", k_blocks, sms, out, cycles, feed);
  run_ring_variant<13>("3wg n128+feed", k_blocks, sms, out, cycles, feed);
  run_ring_variant<14>("n128 dbuf+feed", k_blocks, sms, out, cycles, feed);
  return 0;
}
