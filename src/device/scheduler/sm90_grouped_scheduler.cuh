// Persistent tile scheduler over the expert-major pool. Expert e owns pool rows
// [offset[e], offset[e] + count[e]); its output is cut into ceil(count/kBlockM) x n_tiles tiles.
// In the static order (next) block b takes linear tiles b, b + gridDim.x, ...; the per-expert
// counts are read on the device, so the grid (one block per SM) never depends on routing. Every
// role of a block walks its own copy of the scheduler and sees the same tile sequence. The fused
// kernel's producer may instead claim tiles from a grid-wide counter and publish them to the math
// warpgroups, whose copies then seek to each published index (Sm90TmaProducer::run).
#pragma once

#include <cstdint>

#include "device/ptx/ld_st.cuh"

namespace epmoe::scheduler {

struct GemmTile {
  int expert;
  int m_block;     // within the expert
  int n_block;     // within the expert, in units of the tile's N
  int row0;        // first pool row of the tile
  int rows_valid;  // 1..kBlockM rows of the tile hold real tokens
};

template <int kBlockM, int kGroupN>
struct GroupedTileScheduler {
  static_assert(kBlockM % 64 == 0, "BLOCK_M must be a multiple of the wgmma M of one warpgroup");
  static_assert(kGroupN >= 1, "the N raster group holds at least one tile");
  static constexpr int kTileM = kBlockM;

  const int* count;
  const int* offset;
  int num_groups;
  int n_tiles;

  int next_linear = -1;
  int expert = -1;
  int expert_first = 0;  // linear index of the expert's first tile
  int expert_tiles = 0;
  int expert_m_blocks = 0;
  int expert_rows = 0;

  // Counts read per round trip while walking past experts. Why: the walk was one dependent L2 load
  // per expert (~0.5-1 us each), so every role of every block spent ~E_loc round trips finding its
  // first and last tile. Why ld_ca_s32 (L1-cached) for the counts and offsets: see there; with
  // L2-only loads every warp of the grid queued on the same line.
  static constexpr int kCountBatch = 8;

  __device__ GroupedTileScheduler(const int* count_, const int* offset_, int num_groups_, int n_tiles_)
      : count(count_), offset(offset_), num_groups(num_groups_), n_tiles(n_tiles_) {}

  // Tile `local` of an expert with m_blocks x n_tiles tiles -> (m_block, n_block).
  // Raster: tiles walk N fastest within a group of kGroupN N-blocks, then M. Blocks running at the
  // same time share a few weight N-blocks and activation M-blocks, which stay in L2.
  __device__ __forceinline__ static void locate(int local, int m_blocks, int n_tiles, int& m_block, int& n_block) {
    const int group_span = m_blocks * kGroupN;
    const int group = local / group_span;
    const int first_n = group * kGroupN;
    const int width = min(kGroupN, n_tiles - first_n);
    const int within = local - group * group_span;
    n_block = first_n + within % width;
    m_block = within / width;
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
    // Why a walk and not a prefix array: a block's tile index only grows, so the walk is
    // amortised O(1) per tile and needs no extra kernel or workspace.
    while (next_linear >= expert_first + expert_tiles) {
      int c[kCountBatch];
#pragma unroll
      for (int i = 0; i < kCountBatch; ++i)
        c[i] = expert + 1 + i < num_groups ? ptx::ld_ca_s32(count + expert + 1 + i) : 0;
#pragma unroll
      for (int i = 0; i < kCountBatch; ++i) {
        expert_first += expert_tiles;
        if (++expert >= num_groups) return false;
        expert_rows = c[i];
        expert_m_blocks = (expert_rows + kBlockM - 1) / kBlockM;
        expert_tiles = expert_m_blocks * n_tiles;
        if (next_linear < expert_first + expert_tiles) break;
      }
    }
    t.expert = expert;
    locate(next_linear - expert_first, expert_m_blocks, n_tiles, t.m_block, t.n_block);
    t.row0 = ptx::ld_ca_s32(offset + expert) + t.m_block * kBlockM;
    t.rows_valid = min(kBlockM, expert_rows - t.m_block * kBlockM);
    return true;
  }
};

}  // namespace epmoe::scheduler
