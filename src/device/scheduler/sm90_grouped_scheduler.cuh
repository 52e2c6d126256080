// Persistent tile scheduler over the expert-major pool. Expert e owns pool rows
// [offset[e], offset[e] + count[e]); its output is cut into ceil(count/kBlockM) x n_tiles tiles.
// In the static order (next) block b takes linear tiles b, b + gridDim.x, ...; the per-expert
// counts are read on the device (into shared-memory tables), so the grid (one block per SM) never
// depends on routing. Every role of a block walks its own copy of the scheduler and sees the same
// tile sequence. The fused kernel's producer may instead claim tiles from a grid-wide counter and
// publish them to the math warpgroups, whose copies then seek to each published index
// (Sm90TmaProducer::run).
#pragma once

#include <cstdint>

#include "device/ptx/ld_st.cuh"
#include "device/scheduler/tile_search.h"

namespace epmoe::scheduler {

struct GemmTile {
  int expert;
  int m_block;     // within the expert
  int n_block;     // within the expert, in units of the tile's N
  int row0;        // first pool row of the tile
  int rows_valid;  // 1..kBlockM rows of the tile hold real tokens
};

// The scheduler's tables in shared memory, filled once per GEMM call by every thread of the block
// (fill_tile_tables) from the pool's counts and offsets (the fused kernel: from the block's own
// segment layout): mb[e] = m-blocks of the experts before e
// (e = 0..num_groups), count[e], offset[e]. Why tables: walking the counts in global memory cost a
// dependent load per 8 experts for every role of every block (each role walks from expert 0), up to
// ~6 us before a decode call's first tile with 64 experts per rank (per-block trace).
struct TileTables {
  uint32_t mb_s;      // smem address of mb[0]; count at + 4 * max_groups + 4, offset after it
  uint32_t max_groups;
  __device__ __forceinline__ int mb(int e) const { return int(ptx::ld_shared_u32(mb_s + uint32_t(e) * 4u)); }
  __device__ __forceinline__ int count(int e) const {
    return int(ptx::ld_shared_u32(mb_s + (max_groups + 1u + uint32_t(e)) * 4u));
  }
  __device__ __forceinline__ int offset(int e) const {
    return int(ptx::ld_shared_u32(mb_s + (2u * max_groups + 1u + uint32_t(e)) * 4u));
  }
};

// Every thread of the block calls it (two __syncthreads); then any role may schedule.
// count_of(e) / offset_of(e): expert e's rows and first pool row, read by one thread each.
template <class CountOf, class OffsetOf>
__device__ __forceinline__ void fill_tile_tables(const TileTables& t, const CountOf& count_of, const OffsetOf& offset_of,
                                                 int num_groups, int block_m) {
  for (int e = int(threadIdx.x); e < num_groups; e += int(blockDim.x)) {
    ptx::st_shared_u32(t.mb_s + (t.max_groups + 1u + uint32_t(e)) * 4u, uint32_t(count_of(e)));
    ptx::st_shared_u32(t.mb_s + (2u * t.max_groups + 1u + uint32_t(e)) * 4u, uint32_t(offset_of(e)));
  }
  __syncthreads();
  // Exclusive scan of the m-block counts by warp 0: each lane sums a run of experts, then a shuffle scan.
  if (threadIdx.x < 32) {
    const int lane = int(threadIdx.x);
    const int run = (num_groups + 31) / 32, lo = min(num_groups, lane * run), hi = min(num_groups, lo + run);
    int sum = 0;
    for (int e = lo; e < hi; ++e) sum += (t.count(e) + block_m - 1) / block_m;
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    int at = incl - sum;
    for (int e = lo; e < hi; ++e) {
      ptx::st_shared_u32(t.mb_s + uint32_t(e) * 4u, uint32_t(at));
      at += (t.count(e) + block_m - 1) / block_m;
    }
    if (lane == 31) ptx::st_shared_u32(t.mb_s + uint32_t(num_groups) * 4u, uint32_t(incl));
  }
  __syncthreads();
}

template <int kBlockM, int kGroupN>
struct GroupedTileScheduler {
  static_assert(kBlockM % 64 == 0, "BLOCK_M must be a multiple of the wgmma M of one warpgroup");
  static_assert(kGroupN >= 1, "the N raster group holds at least one tile");
  static constexpr int kTileM = kBlockM;

  TileTables tab;
  int num_groups;
  int n_tiles;

  int next_linear = -1;
  int expert = 0;           // the expert of the last tile found (a block's tile index only grows)
  int expert_m_blocks = 0;  // of that expert

  __device__ GroupedTileScheduler(const TileTables& tab_, int num_groups_, int n_tiles_)
      : tab(tab_), num_groups(num_groups_), n_tiles(n_tiles_) {}

  // The call's tiles (from the tables).
  __device__ __forceinline__ int num_tiles() const { return tab.mb(num_groups) * n_tiles; }

  // Tile `local` of an expert with m_blocks x n_tiles tiles -> (m_block, n_block) (locate_tile).
  __device__ __forceinline__ static void locate(int local, int m_blocks, int n_tiles, int& m_block, int& n_block) {
    locate_tile<kGroupN>(local, m_blocks, n_tiles, m_block, n_block);
  }

  // Static order: block b takes linear tiles b, b + gridDim.x, ... (the standalone kernels).
  __device__ __forceinline__ bool next(GemmTile& t) {
    next_linear = next_linear < 0 ? int(blockIdx.x) : next_linear + int(gridDim.x);
    return walk(t);
  }

  // Linear tile `linear`, which must not be below any index this copy was asked before (the fused
  // kernel's tiles, claimed from a grid-wide counter; docs/MEGAKERNEL.md). False past the last tile.
  __device__ __forceinline__ bool seek(int linear, GemmTile& t) {
    next_linear = linear;
    return walk(t);
  }

 private:
  __device__ __forceinline__ bool walk(GemmTile& t) {
    if (next_linear >= num_tiles()) return false;
    // Searched from the previous tile's expert (tile_expert). Why a copy in the capture: with a
    // reference ptxas allocated registers differently in the K loops' neighbourhood (same
    // instructions, other registers); the copy gives the SASS of the search written inline.
    const int lo = tile_expert([t = tab](int e) { return t.mb(e); }, expert, num_groups, n_tiles, next_linear);
    expert = lo;
    const int mb0 = tab.mb(lo);
    expert_m_blocks = tab.mb(lo + 1) - mb0;
    t.expert = lo;
    locate(next_linear - mb0 * n_tiles, expert_m_blocks, n_tiles, t.m_block, t.n_block);
    t.row0 = tab.offset(lo) + t.m_block * kBlockM;
    t.rows_valid = min(kBlockM, tab.count(lo) - t.m_block * kBlockM);
    return true;
  }
};

}  // namespace epmoe::scheduler
