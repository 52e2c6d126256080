// Plain epilogue (L2): one warpgroup's 64 x 256 (or 64 x 128) fp32 block -> bf16 rows of the output pool.
// Rows past the expert's count are padding and are not written.
//
// Through smem, one 64-column quarter at a time: each thread writes its bf16 pairs into the
// warpgroup's 8 KB staging tile, the warpgroup meets on its named barrier, then each thread reads
// back 16-byte chunks and stores them, 8 threads per 128-byte row segment.
// Why: stored straight from the wgmma fragment, every warp store instruction wrote 8 rows x 16 bytes
// (half sectors) and the 64 stores per thread kept the LSU busy while the tensor cores idled (ncu:
// ~6% of the L2 kernel at K = 7168, more at K = 2048). Staged, a thread issues 64 conflict-free
// 4-byte smem stores, 16 16-byte smem loads and 16 16-byte global stores; 8 threads write one
// 128-byte row segment (a full cache line when the output is 128-byte aligned, as the layer's
// cudaMalloc'd pool is; the API requires only 16 bytes).
// Staging layout: row r at r * 128 bytes, its 16-byte chunk c at ((c ^ (r % 8)) * 16): the 8 rows
// a warp writes per store instruction then fall into 8 different bank groups.
#pragma once

#include <cstdint>

#include "device/gemm/sm90_epilogue_tid.cuh"
#include "device/gemm/sm90_gemm_params.h"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

struct Sm90EpilogueStoreBf16 {
  // stage_s: this warpgroup's staging tile (shared-window address, 16-byte aligned, 8 KB);
  // barrier_id: this warpgroup's named barrier (128 threads).
  // acc: the warpgroup's 64 x 256 block as two n128 halves.
  __device__ static void run(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                             int wg, uint32_t stage_s, uint32_t barrier_id) {
    const int tid = int(epilogue_tid() % 128u);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int q = lane % 4;
    const int wg_rows = t.rows_valid - wg * kWarpgroupM;  // valid rows of this warpgroup's 64
    uint16_t* out = static_cast<uint16_t*>(p.out);
    const int64_t row_base = int64_t(t.row0) + wg * kWarpgroupM;
#pragma unroll
    for (int quarter = 0; quarter < kBlockN / 64; ++quarter) {
      const int h = quarter / 2;  // N half of the accumulator
      const int col_base = t.n_block * kBlockN + quarter * 64;
      if (col_base >= p.n) continue;  // N is a multiple of 128: a half is all in or all out
      // Fragment -> staging: row 16 warp + lane/4 (+ 8), columns 8 i + 2 q (+ 1) of the quarter.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + half * 8;
#pragma unroll
        for (int ii = 0; ii < 8; ++ii) {
          const int i = (quarter % 2) * 8 + ii;
          const uint32_t v = ptx::cvt_rn_bf16x2(acc[64 * h + 4 * i + 2 * half], acc[64 * h + 4 * i + 2 * half + 1]);
          ptx::st_shared_u32(stage_s + uint32_t(r) * 128u + uint32_t((ii ^ (r & 7)) * 16 + q * 4), v);
        }
      }
      ptx::named_barrier_sync(barrier_id, 128);
      // Staging -> global: 64 rows x 8 chunks, thread tid takes chunks tid, tid + 128, ...
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int idx = j * 128 + tid;
        const int r = idx / 8, c = idx % 8;
        if (r < wg_rows) {
          const uint4 v = ptx::ld_shared_v4(stage_s + uint32_t(r) * 128u + uint32_t((c ^ (r & 7)) * 16));
          *reinterpret_cast<uint4*>(out + (row_base + r) * p.out_ld + col_base + c * 8) = v;
        }
      }
      // Why: the next quarter overwrites the staging tile.
      ptx::named_barrier_sync(barrier_id, 128);
    }
  }
};

}  // namespace epmoe::gemm
