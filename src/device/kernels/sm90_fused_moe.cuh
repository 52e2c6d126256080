// The fused MoE megakernel, v0: one persistent cooperative launch per layer call that runs the
// pipeline's four stages back to back, separated by grid barriers:
//
//   dispatch (comm/dispatch_phases.cuh) -> L1 + SwiGLU tiles -> L2 tiles -> combine
//   (comm/combine_phases.cuh), with gemm::sm90_grouped_gemm_tiles for both GEMMs.
//
// Every stage is the standalone kernels' own device code, so y is bitwise the pipeline's.
// Block = the GEMM's 3 warpgroups (384 threads: producer + 2 math): the comm phases run on all 12
// warps at the entry budget of 168 registers per thread (their results do not depend on the
// split); inside each GEMM phase each warpgroup switches to its role's budget (producer 40, math
// 232) and back to 168 (gemm::sm90_grouped_gemm_tiles).
// One smem ring and one set of mbarriers serve L1 and L2: the L2 tile loop continues from the
// producer/consumer pipeline states where L1 stopped, so no barrier is re-initialised mid-phase.
// The dispatch's scratch ((R + 1) * E_loc + 1 ints, <= 37 KB) lives in the ring's A tiles,
// which TMA first writes after the dispatch -> L1 barrier.
//
// Memory ordering between stages (all inside one kernel, so no kernel boundary helps):
// - dispatch writes x_pool / x_scale with generic stores and L1 reads them through TMA (async
//   proxy); the L1 epilogue writes a_pool / a_scale that L2 reads through TMA. The writers issue
//   fence.proxy.async.global before the grid barrier (which is a gpu/sys-scope release/acquire),
//   and the producer thread issues it again after the barrier before its first TMA.
// - the smem scratch of dispatch is read with generic loads, then overwritten by TMA:
//   fence.proxy.async.shared::cta before the barrier.
// - L2's generic o_pool stores -> combine's generic loads: the grid barrier alone.
// - expert_count / expert_offset / row_weight are written by dispatch and read by the GEMM with
//   ld.global.cg (L2, coherent across SMs after the barrier), not the non-coherent path, so the
//   order stays right when v1 replaces the barrier with per-block counters.
//
// Why no printf anywhere: a call in a kernel that issues wgmma serializes all wgmma (C7510),
// hence EPMOE_COMM_WAIT_NO_PRINTF (timeouts are recorded in a device global, then trap).
#pragma once

#ifndef EPMOE_COMM_WAIT_NO_PRINTF
#define EPMOE_COMM_WAIT_NO_PRINTF 1
#endif

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "device/comm/combine_phases.cuh"
#include "device/comm/dispatch_phases.cuh"
#include "device/comm/grid_barrier.h"
#include "device/comm/wait.h"
#include "device/kernels/sm90_fused_launch.h"
#include "device/kernels/sm90_grouped_gemm.cuh"
#include "device/ptx/fence.cuh"
#include "epmoe/config.h"

namespace epmoe::fused {

template <bool kFp8>
struct FusedMoeConfig {
  // Why 4 stages: as in the standalone GEMMs (4 x 48.5 KB fills the 227 KB of smem).
  using L1 = gemm::Sm90GroupedGemmConfig<kFp8, gemm::Sm90Epilogue::kSwiGLU, 4>;
  using L2 = gemm::Sm90GroupedGemmConfig<kFp8, gemm::Sm90Epilogue::kStoreBf16, 4>;
  using Layout = typename L1::Layout;
  using Mainloop = typename L1::Mainloop;
  static_assert(std::is_same_v<Layout, typename L2::Layout>, "L1 and L2 share one smem ring");
  static_assert(std::is_same_v<typename Mainloop::State, typename L2::Mainloop::State> &&
                    std::is_same_v<typename Mainloop::Pipe, typename L2::Mainloop::Pipe>,
                "L2 continues L1's pipeline state");
  static constexpr int kThreads = gemm::kNumThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSmemBytes = int(Layout::kAllocBytes);
  // The dispatch scratch sits in the A tiles of the ring: (R + 1) * E_loc + 1 ints at most.
  static constexpr int kDispatchScratchBytes =
      ((Limits::kMaxRanks + 1) * Limits::kMaxExpertsPerRank + 1) * int(sizeof(int));
  static_assert(kDispatchScratchBytes <= int(Layout::b_offset(0)), "dispatch scratch must fit in the A tiles");
};

template <bool kFp8>
__global__ void __launch_bounds__(gemm::kNumThreads, 1)
    sm90_fused_moe_kernel(const __grid_constant__ CUtensorMap map_a1, const __grid_constant__ CUtensorMap map_b1,
                          const __grid_constant__ CUtensorMap map_a2, const __grid_constant__ CUtensorMap map_b2,
                          const __grid_constant__ FusedMoeParams p) {
  using Cfg = FusedMoeConfig<kFp8>;
  using Layout = typename Cfg::Layout;
  using Mainloop = typename Cfg::Mainloop;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Layout::kBarOffset);
  const typename Mainloop::Pipe pipe{bars, bars + Cfg::L1::kStages};
  if (threadIdx.x == 0) pipe.init(gemm::kMathWarpgroups * 4);  // one arrive per math warp
  __syncthreads();

  const layout::CommLocalLayout loc{p.dispatch.shape};
  uint32_t* status = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.status_offset());
  uint32_t* barrier_word = reinterpret_cast<uint32_t*>(p.dispatch.local_ws + loc.grid_barrier_offset());
  const comm::WaitSite site{p.dispatch.rank, p.dispatch.timeout_ns, status};

  // Dispatch: tokens from every source into this rank's expert pool.
  comm::dispatch_phases<kFp8, Cfg::kWarps>(p.dispatch, reinterpret_cast<int*>(smem));
  ptx::fence_proxy_async_shared_cta();
  ptx::fence_proxy_async_global();
  comm::grid_barrier(barrier_word, site);

  // L1: x_pool W1'^T -> SwiGLU -> a_pool.
  typename Mainloop::State producer_st{}, consumer_st{};
  if (threadIdx.x == 0) ptx::fence_proxy_async_global();
  gemm::sm90_grouped_gemm_tiles<typename Cfg::L1>(&map_a1, &map_b1, p.l1, pipe, smem, producer_st, consumer_st);
  ptx::fence_proxy_async_global();
  comm::grid_barrier(barrier_word, site);

  // L2: a_pool W2^T -> o_pool, on the same ring, continuing its phases.
  if (threadIdx.x == 0) ptx::fence_proxy_async_global();
  gemm::sm90_grouped_gemm_tiles<typename Cfg::L2>(&map_a2, &map_b2, p.l2, pipe, smem, producer_st, consumer_st);
  comm::grid_barrier(barrier_word, site);

  // Combine: partial sums to the source ranks, y at home.
  if (p.combine.shape.partial_bytes == 4) {
    comm::combine_phases<4, Cfg::kWarps>(p.combine);
  } else {
    comm::combine_phases<2, Cfg::kWarps>(p.combine);
  }
}

}  // namespace epmoe::fused
