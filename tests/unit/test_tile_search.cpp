// The grouped GEMM scheduler's arithmetic (device/scheduler/tile_search.h): every linear tile of a
// call maps to exactly one (expert, m-block, n-block) of an expert that has rows, whether a block
// walks the tiles in the static order (b, b + grid, ...) or one after another, with experts
// without rows at the start, in the middle and at the end, and 1 to 1024 experts.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "device/scheduler/tile_search.h"

namespace {

using epmoe::scheduler::locate_tile;
using epmoe::scheduler::tile_expert;

constexpr int kBlockM = 128;
constexpr int kGroupN = 8;  // the kernels' raster group (gemm::kRasterGroupN)

struct Call {
  std::vector<int> count;
  std::vector<int> mb;  // mb[e] = m-blocks before expert e, mb[G] = all
  int total() const { return mb.back(); }
};

Call make_call(const std::vector<int>& count) {
  Call c{count, std::vector<int>(count.size() + 1, 0)};
  for (size_t e = 0; e < count.size(); ++e) c.mb[e + 1] = c.mb[e] + (count[e] + kBlockM - 1) / kBlockM;
  return c;
}

// Walks tiles first, first + stride, ... as one scheduler copy does (the search starts at the
// previous tile's expert) and records each tile's (expert, m_block, n_block) into `seen`.
void walk(const Call& c, int n_tiles, int first, int stride, std::set<std::tuple<int, int, int>>& seen) {
  const int G = int(c.count.size());
  const auto mb = [&](int e) { return c.mb[size_t(e)]; };
  int expert = 0;
  for (int t = first; t < c.total() * n_tiles; t += stride) {
    const int e = tile_expert(mb, expert, G, n_tiles, t);
    ASSERT_GE(e, expert) << "tile " << t;
    ASSERT_LT(e, G) << "tile " << t;
    ASSERT_GT(c.count[size_t(e)], 0) << "tile " << t << " went to expert " << e << ", which has no rows";
    ASSERT_LE(c.mb[size_t(e)] * n_tiles, t);
    ASSERT_LT(t, c.mb[size_t(e) + 1] * n_tiles);
    expert = e;
    const int m_blocks = c.mb[size_t(e) + 1] - c.mb[size_t(e)];
    int m_block = -1, n_block = -1;
    locate_tile<kGroupN>(t - c.mb[size_t(e)] * n_tiles, m_blocks, n_tiles, m_block, n_block);
    ASSERT_GE(m_block, 0);
    ASSERT_LT(m_block, m_blocks);
    ASSERT_GE(n_block, 0);
    ASSERT_LT(n_block, n_tiles);
    ASSERT_TRUE(seen.insert({e, m_block, n_block}).second) << "tile " << t << " repeats a tile";
  }
}

// Every tile once, in the static order of a grid of `grid` blocks and walked one by one.
void check(const std::vector<int>& count, int n_tiles) {
  SCOPED_TRACE(::testing::Message() << count.size() << " experts, " << n_tiles << " N tiles");
  const Call c = make_call(count);
  for (int grid : {1, 7, 132}) {
    std::set<std::tuple<int, int, int>> seen;
    for (int b = 0; b < grid; ++b) walk(c, n_tiles, b, grid, seen);
    ASSERT_EQ(int64_t(seen.size()), int64_t(c.total()) * n_tiles) << "grid " << grid;
  }
}

TEST(TileSearch, EveryTileOnceWithEmptyExperts) {
  for (int n_tiles : {1, 6, 8, 9, 28}) {
    check({5}, n_tiles);
    check({0, 0, 300, 0}, n_tiles);                      // rows in one expert only, empty at both ends
    check({1, 0, 0, 129, 128, 0, 1000, 0, 0}, n_tiles);  // runs of empty experts in the middle
    check({128, 256, 1, 127}, n_tiles);                  // m-block boundaries
  }
}

TEST(TileSearch, ManyExpertsRandomCounts) {
  std::mt19937 rng(12345);
  for (int G : {2, 33, 64, 1024}) {
    std::vector<int> count(static_cast<size_t>(G), 0);
    for (int& n : count) n = rng() % 3 == 0 ? 0 : int(rng() % 300);  // a third of the experts empty
    count.front() = 0;
    count.back() = 0;
    for (int n_tiles : {6, 16, 28}) check(count, n_tiles);
  }
}

}  // namespace
