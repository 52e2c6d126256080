// The grouped GEMM scheduler's arithmetic, host-callable so that the unit tests check it
// (tests/unit/test_tile_search.cpp): which expert a linear tile belongs to, and where in the
// expert's tiles it lies. The device scheduler (sm90_grouped_scheduler.cuh) reads mb(e) from its
// shared-memory tables.
#pragma once

#include "device/layout/hd.h"

namespace epmoe::scheduler {

// The expert of linear tile t, given mb(e) = m-blocks of the experts before e (mb(0) = 0,
// non-decreasing) and that t < mb(num_groups) x n_tiles: the last e in [from, num_groups) with
// mb(e) x n_tiles <= t. Experts without rows share their successor's mb(e) and are passed over.
// `from` is any expert at or before the answer (a block's tile indices only grow, so the previous
// tile's expert). Binary search: shifts and compares only.
template <class MbOf>
EPMOE_HD int tile_expert(const MbOf& mb, int from, int num_groups, int n_tiles, int t) {
  int lo = from, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (mb(mid) * n_tiles <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Tile `local` of an expert with m_blocks x n_tiles tiles -> (m_block, n_block).
// Raster: tiles walk N fastest within a group of kGroupN N-blocks, then M. Blocks running at the
// same time share a few weight N-blocks and activation M-blocks, which stay in L2.
template <int kGroupN>
EPMOE_HD void locate_tile(int local, int m_blocks, int n_tiles, int& m_block, int& n_block) {
  const int group_span = m_blocks * kGroupN;
  const int group = local / group_span;
  const int first_n = group * kGroupN;
  const int width = kGroupN < n_tiles - first_n ? kGroupN : n_tiles - first_n;
  const int within = local - group * group_span;
  n_block = first_n + within % width;
  m_block = within / width;
}

}  // namespace epmoe::scheduler
