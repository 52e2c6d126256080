// The trace dump shared by the kernel translation units of a trace build (diag_dump.h).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "device/debug/diag_trace.cuh"

namespace epmoe::diag::detail {

inline const char* point_name(int p) {
  static const char* const names[] = {
      "disp.entry", "disp.phase0", "disp.staged(t0)", "disp.barrier", "disp.published(b0)", "disp.counts",
      "disp.layout", "disp.pulled(t0)", "disp.padding", "disp.arrived", "disp.end",
      "comb.entry", "comb.phase0", "comb.A(t0)", "comb.arrivedA", "comb.ready", "comb.B(t0)", "comb.end",
      "fused.entry", "fused.init", "fused.dispatched", "fused.gemm", "fused.barrier2", "fused.reset", "fused.end",
      "disp.unit.meta(t0)", "disp.unit.stored(t0)", "comb.unit.rows(t0)", "comb.unit.summed(t0)",
      "fused.prod.L1", "fused.prod.L2", "fused.math.L1(t128)", "fused.math.L2(t128)"};
  return p < int(sizeof(names) / sizeof(names[0])) ? names[p] : "?";
}

// A block's row belongs to the last call if it starts within this of the latest-starting row. Why:
// a block that the last call's grid did not have keeps an older call's row (only existing blocks
// clear theirs), and the blocks of one call start within microseconds of each other, while two
// calls of one kernel are at least a whole layer call apart.
inline constexpr unsigned long long kSameCallWindowNs = 20000;

// rows: kTraceBlocks x kTracePoints times in ns (0 = not reached).
inline void print_trace(std::FILE* out, const char* kernel, const unsigned long long* rows_in) {
  std::vector<unsigned long long> rows(rows_in, rows_in + size_t(kTraceBlocks) * kTracePoints);
  const auto row_start = [&](int b) {
    unsigned long long s = ~0ull;
    for (int p = 0; p < kTracePoints; ++p)
      if (rows[b * kTracePoints + p]) s = std::min(s, rows[b * kTracePoints + p]);
    return s;
  };
  unsigned long long latest = 0;
  for (int b = 0; b < kTraceBlocks; ++b)
    if (row_start(b) != ~0ull) latest = std::max(latest, row_start(b));
  for (int b = 0; b < kTraceBlocks; ++b) {
    const unsigned long long s = row_start(b);
    if (s != ~0ull && s + kSameCallWindowNs < latest)
      for (int p = 0; p < kTracePoints; ++p) rows[b * kTracePoints + p] = 0;  // an older call's row
  }
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < kTraceBlocks; ++b) t0 = std::min(t0, row_start(b));
  if (t0 == ~0ull) {
    std::fprintf(out, "[trace] %s: no points recorded\n", kernel);
    return;
  }
  std::fprintf(out, "[trace] %s (us after the earliest point of any block)\n", kernel);
  std::fprintf(out, "[trace]   %-20s %6s %9s %9s %9s %6s\n", "point", "blocks", "min", "median", "max", "maxblk");
  for (int p = 0; p < kTracePoints; ++p) {
    std::vector<std::pair<double, int>> v;
    for (int b = 0; b < kTraceBlocks; ++b)
      if (rows[b * kTracePoints + p]) v.emplace_back(double(rows[b * kTracePoints + p] - t0) / 1e3, b);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::fprintf(out, "[trace]   %-20s %6zu %9.2f %9.2f %9.2f %6d\n", point_name(p), v.size(), v.front().first,
                 v[v.size() / 2].first, v.back().first, v.back().second);
  }
}

// Tile rows: [2][kTraceBlocks][kTileSlots + 1][kTileFields] (start, mainloop end, epilogue end; slot
// kTileSlots: loop end). Per GEMM: tiles, the mainloop's duration per tile, the gap from one
// mainloop's end to the next tile's start (epilogue and handoff) and the epilogue's share of it, the
// first start and the loop ends over blocks, in us after the earliest first start of either GEMM;
// busy = mainloop time over the span it was spread across.
inline void print_tiles(std::FILE* out, const char* kernel, const unsigned long long* t) {
  const auto at = [&](int g, int b, int s, int f) {
    return t[((size_t(g) * kTraceBlocks + b) * (kTileSlots + 1) + s) * kTileFields + f];
  };
  unsigned long long t0 = ~0ull;
  for (int g = 0; g < 2; ++g)
    for (int b = 0; b < kTraceBlocks; ++b)
      if (at(g, b, 0, 0)) t0 = std::min(t0, at(g, b, 0, 0));
  if (t0 == ~0ull) {
    std::fprintf(out, "[tiles] %s: no tiles recorded\n", kernel);
    return;
  }
  const auto q = [](std::vector<double> v, double f) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(f * double(v.size())))];
  };
  for (int g = 0; g < 2; ++g) {
    std::vector<double> loop, gap, epi, stores, vals, first, end;
    double busy = 0, span_sum = 0;
    int tiles = 0, blocks = 0;
    for (int b = 0; b < kTraceBlocks; ++b) {
      if (!at(g, b, 0, 0)) continue;
      ++blocks;
      int s = 0;
      double block_busy = 0;
      for (; s < kTileSlots && at(g, b, s, 0) && at(g, b, s, 1); ++s) {
        ++tiles;
        const double l = double(at(g, b, s, 1) - at(g, b, s, 0)) / 1e3;
        loop.push_back(l);
        block_busy += l;
        if (s + 1 < kTileSlots && at(g, b, s + 1, 0)) gap.push_back(double(at(g, b, s + 1, 0) - at(g, b, s, 1)) / 1e3);
        if (at(g, b, s, 2) >= at(g, b, s, 1)) epi.push_back(double(at(g, b, s, 2) - at(g, b, s, 1)) / 1e3);
        if (at(g, b, s, 3) >= at(g, b, s, 1)) stores.push_back(double(at(g, b, s, 3) - at(g, b, s, 1)) / 1e3);
        if (at(g, b, s, 4) >= at(g, b, s, 1)) vals.push_back(double(at(g, b, s, 4) - at(g, b, s, 1)) / 1e3);
      }
      first.push_back(double(at(g, b, 0, 0) - t0) / 1e3);
      if (at(g, b, kTileSlots, 0)) {  // blocks without a loop end stay out of the ratio
        end.push_back(double(at(g, b, kTileSlots, 0) - t0) / 1e3);
        // A block with more tiles than slots: its span up to the last traced mainloop only.
        const unsigned long long span_end = s == kTileSlots ? at(g, b, s - 1, 1) : at(g, b, kTileSlots, 0);
        span_sum += double(span_end - at(g, b, 0, 0)) / 1e3;
        busy += block_busy;
      }
    }
    std::fprintf(out,
                 "[tiles] %s %s: %d tiles on %d blocks; mainloop per tile p10 / median / p90 %.2f / %.2f / %.2f us; "
                 "gap to the next tile %.2f / %.2f / %.2f us (of which the epilogue %.2f / %.2f / %.2f, its values "
                 "computed after %.2f / %.2f / %.2f, its own stores issued after %.2f / %.2f / %.2f); first start "
                 "%.1f / %.1f / %.1f; loop end %.1f / %.1f / %.1f us; mainloops over the blocks' spans %.3f\n",
                 kernel, g == 0 ? "L1" : "L2", tiles, blocks, q(loop, 0.1), q(loop, 0.5), q(loop, 0.9), q(gap, 0.1),
                 q(gap, 0.5), q(gap, 0.9), q(epi, 0.1), q(epi, 0.5), q(epi, 0.9), q(vals, 0.1), q(vals, 0.5),
                 q(vals, 0.9), q(stores, 0.1), q(stores, 0.5), q(stores, 0.9), q(first, 0.0), q(first, 0.5), q(first, 0.999), q(end, 0.0), q(end, 0.5),
                 q(end, 0.999), span_sum > 0 ? busy / span_sum : 0.0);
  }
}

// The device buffer `symbol` (an array of unsigned long long) into host memory; false (and a line
// on `out`, tagged) if the copy failed.
template <class Symbol>
inline bool copy_symbol(std::FILE* out, const char* tag, const char* kernel, const Symbol& symbol,
                        std::vector<unsigned long long>& v) {
  v.resize(sizeof(Symbol) / sizeof(unsigned long long));
  const cudaError_t e = cudaMemcpyFromSymbol(v.data(), symbol, sizeof(Symbol));
  if (e != cudaSuccess) std::fprintf(out, "%s %s: cudaMemcpyFromSymbol failed: %s\n", tag, kernel, cudaGetErrorString(e));
  return e == cudaSuccess;
}

template <class Symbol>
inline void dump_tiles(std::FILE* out, const char* kernel, const Symbol& symbol) {
  static_assert(sizeof(Symbol) == sizeof(unsigned long long) * 2 * kTraceBlocks * (kTileSlots + 1) * kTileFields, "g_tiles");
  std::vector<unsigned long long> t;
  if (copy_symbol(out, "[tiles]", kernel, symbol, t)) print_tiles(out, kernel, t.data());
}

template <class Symbol>
inline void dump(std::FILE* out, const char* kernel, const Symbol& symbol) {
  static_assert(sizeof(Symbol) == sizeof(unsigned long long) * kTraceBlocks * kTracePoints, "g_trace");
  std::vector<unsigned long long> rows;
  if (copy_symbol(out, "[trace]", kernel, symbol, rows)) print_trace(out, kernel, rows.data());
}

}  // namespace epmoe::diag::detail
