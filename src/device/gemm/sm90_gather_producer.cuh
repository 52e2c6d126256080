// The gathered A operand of the FP8 L1 kernel (GemmStage::kL1Gather): the rows of a tile are not
// contiguous pool rows but rows of a token array picked by index (GatherParams),
// so the dispatch no longer has to copy every token once per local expert slot (docs/GEMM.md,
// "Gathered L1 rows"). TMA on sm_90 copies boxes and cannot gather; the rows come with cp.async
// from two warps of the producer warpgroup, while thread 0 still loads the weights with TMA.
//
// Per K block and stage, each of the 64 gathering threads copies 16 bytes of 16 rows (4 rows per
// warp instruction, each row's 128 bytes contiguous: 4 lines per instruction) into the stage's A
// tile, at the position TMA's 128-byte swizzle would have put them, plus the 1x128 scales of 2 rows;
// then cp.async.mbarrier.arrive.noinc gives the stage's full barrier one arrival once those copies
// have landed. The full barrier therefore counts 1 + kThreads arrivals per phase (thread 0's, with
// the weights' transaction bytes, and one per gathering thread). The math warps issue
// fence.proxy.async after their wait (Sm90Fp8Mainloop with kGatherA): cp.async writes shared
// memory through the generic proxy and wgmma reads it through the async proxy.
// Rows past the tile's valid rows read row 0 of the token array: their outputs are never stored
// (each output row depends on its own A row only), so no zero fill is needed.
// Why lean address math: these warps share their SM sub-partitions with math warps (warps 2 and 3
// with math warps 6, 10 and 7, 11), so every instruction here takes an issue slot from them. Per copy
// it is one shuffle (the row's index, from a fixed lane of an 8-lane segment), one wide multiply-add
// (the source address) and the copy.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/cp_async.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/mbarrier.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

// The gathering threads: warps 2 and 3 of the producer warpgroup.
inline constexpr int kGatherFirstThread = 64;
inline constexpr int kGatherThreads = 64;

// Where the proxy fence runs (EPMOE_GATHER_FENCE, experiments): 1 (default) in the gathering
// threads: each waits for its copies of a stage kLag stages later (cp.async.wait_group), fences and
// arrives; 0 in the math warps after their wait (cp.async.mbarrier.arrive.noinc here).
#ifndef EPMOE_GATHER_FENCE
#define EPMOE_GATHER_FENCE 1
#endif
inline constexpr bool kGatherProducerFence = EPMOE_GATHER_FENCE != 0;

template <int kStages, class Layout, class Scheduler>
struct Sm90GatherA {
  static constexpr bool kProducerFence = kGatherProducerFence;
  static constexpr int kLag = 2;  // stages in flight per thread before its oldest is announced
  static_assert(kLag < kStages, "the lagged announcement must not wait for a stage it holds back");
  static constexpr int kFirstThread = kGatherFirstThread;
  static constexpr int kThreads = kGatherThreads;
  static constexpr int kRowsPerWarp = kBlockM / (kThreads / 32);
  static constexpr int kRowsPerStep = 4;  // rows per warp instruction: 8 lanes x 16 bytes each
  static_assert(Layout::kRowBytes == 128 && kRowsPerWarp == 64, "two warps, 64 rows of 128 bytes each");
  static_assert(Layout::kScaleA == kBlockM * 4, "FP8: one scale per tile row and K block");
  using Pipe = pipeline::TmaPipeline<kStages>;

  // Every thread in [kFirstThread, kFirstThread + kThreads), at the producer register budget.
  __device__ static void run(const GroupedGemmParams& p, const GatherParams& g, const Pipe& pipe, int n_tiles) {
    const int warp = int(threadIdx.x - kFirstThread) / 32;  // 0 or 1: rows [64 warp, 64 warp + 64)
    const int lane = int(threadIdx.x % 32);
    const int sub = lane / 8;    // which of a step's 4 rows this lane copies
    const int chunk = lane % 8;  // which 16-byte chunk of that row's 128 bytes
    const int num_k_blocks = p.k / kScaleBlock;
    const uint32_t k = uint32_t(p.k);  // bytes per gathered row
    const uint32_t sld = uint32_t(g.scale_ld);
    // Step i copies row 4 (i % 8) + sub of this warp's first (i < 8) or second 32 rows. The
    // 128-byte swizzle puts chunk c of row r at chunk c ^ (r % 8) (the tile is 1024-byte aligned, as
    // for TMA); r % 8 is sub for even steps and sub + 4 for odd ones.
    const uint32_t dst_even = uint32_t(warp * kRowsPerWarp + sub) * Layout::kRowBytes + uint32_t((chunk ^ sub) << 4);
    const uint32_t dst_odd = uint32_t(warp * kRowsPerWarp + sub) * Layout::kRowBytes + uint32_t((chunk ^ sub ^ 4) << 4);
    // Lane L holds the gather index of rows 4 (L % 8) + L / 8 and that + 32 of this warp's 64, so
    // that step i finds its rows' indices in lane i of its own 8-lane segment (a shuffle with an
    // immediate source lane), and copies those two rows' scales.
    const int r_mine = warp * kRowsPerWarp + 4 * chunk + sub;
    const uint64_t x_col = reinterpret_cast<uint64_t>(g.x) + uint32_t(chunk * 16);
    const uint32_t smem_s = dyn_smem_base_s();
    Scheduler sched(p.expert_count, p.expert_offset, p.num_groups, n_tiles);
    pipeline::PipelineState<kStages> st{};
    pipeline::PipelineState<kStages> done{};  // kProducerFence: the oldest stage not yet announced
    int in_flight = 0;                         // kProducerFence: stages issued and not yet announced
    scheduler::GemmTile tile;
    while (sched.next(tile)) {
      const uint32_t idx_a = r_mine < tile.rows_valid ? uint32_t(__ldg(g.idx + tile.row0 + r_mine)) : 0u;
      const uint32_t idx_b =
          r_mine + 32 < tile.rows_valid ? uint32_t(__ldg(g.idx + tile.row0 + r_mine + 32)) : 0u;
      const float* s_a = g.scale + uint64_t(idx_a) * sld;
      const float* s_b = g.scale + uint64_t(idx_b) * sld;
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        if (!pipe.producer_acquire(st))
          pipeline::report_timeout(pipeline::WaitSite::kProducerEmpty, st.index, st.phase ^ 1u, sched.next_linear);
        const uint32_t a_s = smem_s + Layout::a_offset(st.index);
        const uint64_t col = x_col + uint32_t(kb) * uint32_t(kScaleBlock);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp / kRowsPerStep; ++i) {
          const uint32_t idx = __shfl_sync(0xFFFFFFFFu, i < 8 ? idx_a : idx_b, i % 8, 8);
          uint64_t src;
          asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(src) : "r"(idx), "r"(k), "l"(col));
          ptx::cp_async_16(a_s + (i % 2 ? dst_odd : dst_even) + uint32_t(i * kRowsPerStep) * Layout::kRowBytes,
                           reinterpret_cast<const void*>(src));
        }
        const uint32_t sa_s = smem_s + Layout::sa_offset(st.index) + uint32_t(r_mine) * 4u;
        ptx::cp_async_4(sa_s, s_a + kb);
        ptx::cp_async_4(sa_s + 32u * 4u, s_b + kb);
        if constexpr (kProducerFence) {
          ptx::cp_async_commit_group();
          if (++in_flight > kLag) {
            ptx::cp_async_wait_group<kLag>();
            ptx::fence_proxy_async_shared_cta();
            ptx::mbarrier_arrive_release_cta_s(ptx::smem_u32(pipe.producer_barrier(done)));
            ++done;
            --in_flight;
          }
        } else {
          ptx::cp_async_mbarrier_arrive_noinc(ptx::smem_u32(pipe.producer_barrier(st)));
        }
        ++st;
      }
    }
    if constexpr (kProducerFence) {
      ptx::cp_async_wait_group<0>();
      ptx::fence_proxy_async_shared_cta();
      for (; in_flight > 0; --in_flight, ++done) ptx::mbarrier_arrive_release_cta_s(ptx::smem_u32(pipe.producer_barrier(done)));
    }
  }
};

}  // namespace epmoe::gemm
