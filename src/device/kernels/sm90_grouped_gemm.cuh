// The sm90 persistent, TMA-pipelined grouped GEMM: D[rows][n] = A[rows][k] * B[e][n][k]^T per
// expert e of the expert-major pool, with an FP8 (promoted, block-scaled) or BF16 mainloop and
// a plain-bf16 (L2) or SwiGLU (L1) epilogue. Only roles live here; the pieces are in
// device/{pipeline,scheduler,gemm}.
//
// Block = 2 warpgroups (256 threads), each running wgmma on 64 rows x 256 columns of the
// 128 x 256 tile and then the epilogue of those rows. Lane 0 of warp 0 is also the TMA producer:
// it refills each stage right after its warpgroup released it.
// Why no separate producer warp(group): registers are split per SM sub-partition, so any ninth
// warp caps every thread at 168 registers (ptxas 13.0 does not allocate beyond the entry cap
// after setmaxnreg.inc either), and an FP8 math thread needs ~245: 128 accumulators plus a
// 64-float promotion scratch. With 8 warps every thread may use 255.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "device/gemm/sm90_epilogue_store.cuh"
#include "device/gemm/sm90_epilogue_swiglu.cuh"
#include "device/gemm/sm90_gemm_params.h"
#include "device/gemm/sm90_mainloop_bf16.cuh"
#include "device/gemm/sm90_mainloop_fp8.cuh"
#include "device/gemm/sm90_smem_layout.cuh"
#include "device/gemm/sm90_tma_producer.cuh"
#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/tma.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

enum class Sm90Epilogue { kStoreBf16, kSwiGLU };

inline constexpr int kNumThreads = 256;
inline constexpr int kMathWarpgroups = 2;
inline constexpr int kRasterGroupN = 8;

template <bool kFp8_, Sm90Epilogue kEpi, int kStages_>
struct Sm90GroupedGemmConfig {
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSwiGLU = kEpi == Sm90Epilogue::kSwiGLU;
  using Layout = Sm90SmemLayout<kFp8_, kStages_>;
  using Mainloop = std::conditional_t<kFp8_, Sm90Fp8Mainloop<kStages_, Layout>, Sm90Bf16Mainloop<kStages_, Layout>>;
  static constexpr int kBlockK = Mainloop::kBlockK;
  using Scheduler = scheduler::GroupedTileScheduler<kBlockM, kRasterGroupN>;
  using Producer = Sm90TmaProducer<kFp8_, kStages_, kBlockK, Layout, Scheduler>;
  static_assert(kMathWarpgroups * kWarpgroupM == kBlockM, "the math warpgroups split the tile's M");
  static_assert(kMathWarpgroups * 128 == kNumThreads, "every warp is a math warp (see the header comment)");
};

// The persistent tile loop of one grouped GEMM on an initialised pipeline: every thread of the
// block calls it. `producer_st` (meaningful in thread 0, the producer) and `consumer_st` (every
// math thread) are where the ring stands; both come back advanced by the K blocks this block
// loaded and consumed, which are equal. Why carried states: the fused kernel runs L1 and then L2
// on the same ring and barriers, so L2 continues at the phase L1 stopped at instead of
// re-initialising barriers that may still be mid-phase.
template <class Cfg>
__device__ __forceinline__ void sm90_grouped_gemm_tiles(const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                                        const GroupedGemmParams& p,
                                                        const typename Cfg::Mainloop::Pipe& pipe, uint8_t* smem,
                                                        typename Cfg::Mainloop::State& producer_st,
                                                        typename Cfg::Mainloop::State& consumer_st) {
  using Mainloop = typename Cfg::Mainloop;
  const int n_tiles = (p.n + kBlockN - 1) / kBlockN;
  const bool is_producer = threadIdx.x == 0;
  typename Cfg::Producer producer{tmap_a, tmap_b, &p, pipe, smem, typename Cfg::Scheduler(p.expert_count, p.expert_offset, p.num_groups, n_tiles)};
  producer.st = producer_st;
  if (is_producer) producer.start();
  __syncwarp();
  // Why __syncwarp: the producer lane diverged; wgmma needs the whole warp converged.
  auto after_release = [&] {
    if (is_producer) producer.issue_next();
    __syncwarp();
  };

  const int wg = threadIdx.x / 128;
  const int num_k_blocks = p.k / Cfg::kBlockK;
  typename Cfg::Scheduler sched(p.expert_count, p.expert_offset, p.num_groups, n_tiles);
  typename Mainloop::State& st = consumer_st;
  scheduler::GemmTile tile;
  float acc[128];
  while (sched.next(tile)) {
    const float* b_scale[2] = {nullptr, nullptr};
    if constexpr (Cfg::kFp8) {
      static_assert(Cfg::kBlockK == kScaleBlock, "one weight scale per K block: num_k_blocks is k / 128");
      // Why the empty asm: it keeps n / 128 from becoming a loop invariant held across the tile
      // loop; the fused kernel's FP8 loop sits at 255 registers, and that one value spilled.
      int n_weight_rows = p.n;
      asm volatile("" : "+r"(n_weight_rows));
      const int n_blocks128 = n_weight_rows / kScaleBlock;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nb = tile.n_block * (kBlockN / kScaleBlock) + h;
        // Why a 32-bit index (< 2^27 by the limits E_loc <= 1024, N <= 65536, K <= 32768) and
        // num_k_blocks: extra 64-bit loop invariants here pushed the fused kernel's FP8 tile loop
        // into spills.
        if (nb < n_blocks128) b_scale[h] = p.b_scale + (tile.expert * n_blocks128 + nb) * num_k_blocks;
      }
    }
    if (!Mainloop::run(acc, pipe, st, smem, num_k_blocks, b_scale, wg, after_release))
      pipeline::report_timeout(pipeline::WaitSite::kConsumerFull, st.index, st.phase, sched.next_linear);
    if constexpr (Cfg::kSwiGLU) {
      Sm90EpilogueSwiGLU<Cfg::kFp8>::run(acc, p, tile, wg);
    } else {
      Sm90EpilogueStoreBf16::run(acc, p, tile, wg);
    }
  }
  producer_st = producer.st;
}

template <class Cfg>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                             const GroupedGemmParams p) {
  using Layout = typename Cfg::Layout;
  using Mainloop = typename Cfg::Mainloop;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Layout::kBarOffset);
  const typename Mainloop::Pipe pipe{bars, bars + Cfg::kStages};
  if (threadIdx.x == 0) pipe.init(kMathWarpgroups * 4);  // one arrive per math warp
  __syncthreads();
  typename Mainloop::State producer_st{}, consumer_st{};
  sm90_grouped_gemm_tiles<Cfg>(&tmap_a, &tmap_b, p, pipe, smem, producer_st, consumer_st);
}

}  // namespace epmoe::gemm
