// comm::first_unit_of: every warp of the grid starts a grid-stride loop at a distinct unit, so
// every work unit is done exactly once, with either numbering and at the switch between them.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "device/comm/work_units.h"

namespace {

using epmoe::comm::first_unit_of;
using epmoe::comm::source_token_slice;

// How many times each of `units` units is visited by a grid of blocks x warps.
std::vector<int> visits(int64_t units, int blocks, int warps) {
  std::vector<int> seen(size_t(units), 0);
  const int64_t stride = int64_t(blocks) * warps;
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < warps; ++w)
      for (int64_t u = first_unit_of(units, w, b, blocks, warps); u < units; u += stride) ++seen[size_t(u)];
  return seen;
}

TEST(WorkUnits, EveryUnitExactlyOnce) {
  for (int blocks : {1, 16, 56, 132})
    for (int warps : {12, 16}) {
      const int64_t n = int64_t(blocks) * warps;
      for (int64_t units : {int64_t(0), int64_t(1), int64_t(7), n / 2 - 1, n / 2, n / 2 + 1, n - 1, n, n + 1, 3 * n + 5}) {
        if (units < 0) continue;
        const std::vector<int> seen = visits(units, blocks, warps);
        for (int64_t u = 0; u < units; ++u)
          ASSERT_EQ(seen[size_t(u)], 1) << "unit " << u << " of " << units << ", grid " << blocks << " x " << warps;
      }
    }
}

TEST(WorkUnits, FewUnitsSpreadOverBlocks) {
  // At most half as many units as warps: unit u goes to block u % blocks, so 16 units on a grid of
  // 56 blocks use 16 blocks (block by block they were the 16 warps of block 0).
  const int blocks = 56, warps = 16;
  std::vector<int> per_block(blocks, 0);
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < warps; ++w)
      if (first_unit_of(16, w, b, blocks, warps) < 16) ++per_block[size_t(b)];
  for (int b = 0; b < blocks; ++b) EXPECT_EQ(per_block[size_t(b)], b < 16 ? 1 : 0) << "block " << b;
  // More units than that: block by block, so a block's warps take consecutive units.
  const int64_t many = int64_t(blocks) * warps;
  EXPECT_EQ(first_unit_of(many, 3, 2, blocks, warps), 2 * warps + 3);
}

TEST(WorkUnits, SourceTokenSliceCoversEveryUnitOnce) {
  for (int R : {1, 2, 3, 8})
    for (int rank = 0; rank < R; ++rank)
      for (int slices : {1, 2, 7}) {
        const int T = 5;
        std::vector<int> seen(size_t(R) * T * slices, 0);
        for (int64_t u = 0; u < int64_t(T) * R * slices; ++u) {
          const auto w = source_token_slice(u, slices, R, rank);
          ASSERT_TRUE(w.src >= 0 && w.src < R && w.t >= 0 && w.t < T && w.slice >= 0 && w.slice < slices)
              << "u " << u << " R " << R << " slices " << slices;
          ++seen[(size_t(w.src) * T + size_t(w.t)) * slices + size_t(w.slice)];
          // A token's slices are consecutive units, and its first source is rank + 1.
          if (u % (int64_t(R) * slices) == 0) EXPECT_EQ(w.src, (rank + 1) % R);
          EXPECT_EQ(w.slice, int(u % slices));
        }
        for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "R " << R << " rank " << rank << " unit " << i;
      }
}

}  // namespace
