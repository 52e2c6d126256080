// Device pieces of the dispatch kernel: routing sanitization, token staging, segment layout and the
// sliced pull. Each works with one warp.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "device/comm/dispatch_params.h"
#include "device/comm/status_bits.h"
#include "device/debug/diag_trace.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/quant/fp8_quant.cuh"
#include "device/quant/fp8_scale.cuh"

namespace epmoe::comm::dispatch_detail {

using layout::CommLocalLayout;
using layout::CommShape;
using layout::SlotMeta;

constexpr int kPullVecs = 8;                 // 16-byte vectors per lane in flight while pulling
constexpr int kSliceVecs = 32 * kPullVecs;   // one work unit pulls this many vectors of a token row
constexpr int kQuantPairs = 8;               // 128-channel group pairs loaded before quantizing

__device__ __forceinline__ uint64_t* flag_ptr(char* base, const layout::CommOffsets& sym, int flag, int rank) {
  return reinterpret_cast<uint64_t*>(base + sym.flag_offset(flag, rank));
}

// Work units per token row when pulling: slices of kSliceVecs vectors.
__host__ __device__ __forceinline__ int pull_slices(const CommShape& s) {
  return int((s.x_row_bytes() / 16 + kSliceVecs - 1) / kSliceVecs);
}

// Phase 1 for one token: sanitized routing into SlotMeta, positions from the per-expert cursors.
// Every valid slot gets its own row, also when a token lists one expert several times (SPEC: any
// routing is legal and counts each slot); the pool holds K rows per token for that reason.
// Split in two: load_routing issues the loads, stage_routing uses them, so that a caller can put
// other loads in between.
struct RoutingSlot {
  int expert = -1;
  float weight = 0.f;
};
__device__ __forceinline__ RoutingSlot load_routing(const DispatchParams& p, int t) {
  const int K = p.shape.topk, lane = threadIdx.x & 31;
  RoutingSlot r;
  if (lane < K) {
    const int64_t i = int64_t(t) * K + lane;
    if (p.topk_idx_bytes == 8) {
      // Why saturate: an int64 index outside int32 must stay out of range (never wrap into
      // [0, E)), so stage_routing masks and reports it.
      const long long v = static_cast<const long long*>(p.topk_idx)[i];
      r.expert = v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : int(v);
    } else {
      r.expert = static_cast<const int32_t*>(p.topk_idx)[i];
    }
    r.weight = p.topk_w[int64_t(t) * K + lane];
  }
  return r;
}
// An out-of-range index masks its slot and sets kStatusBadExpert; the first one of the call
// (atomicMax of the call's epoch on `reported`) also goes to the host's routing record, which the
// next forward reads without a sync.
__device__ __forceinline__ void stage_routing(const DispatchParams& p, int t, const RoutingSlot& slot, SlotMeta* meta,
                                              int32_t* cursor, uint32_t* status, unsigned long long* reported,
                                              uint64_t epoch) {
  const int K = p.shape.topk, E = p.shape.num_experts, lane = threadIdx.x & 31;
  if (lane >= K) return;
  int e = slot.expert;
  const float w = slot.weight;
  const bool bad = e < -1 || e >= E;
  if (bad) {
    ptx::red_or_relaxed_gpu(status, kStatusBadExpert);
    if (p.routing_record && atomicMax(reported, static_cast<unsigned long long>(epoch)) < epoch)
      layout::write_routing_record(p.routing_record, p.rank, epoch, t, lane, e, E);
    e = -1;
  }
  const int pos = e >= 0 ? atomicAdd(&cursor[e], 1) : 0;
  SlotMeta m;
  m.expert = e;
  m.pos = pos;
  m.weight = w;
  m.pad = 0;
  meta[int64_t(t) * K + lane] = m;
}

// Phase-1 work units per token: chunks of 32 x kPullVecs bf16 vectors (copy) or of 2 x kQuantPairs
// 128-channel groups (FP8), 4 of either at H = 7168. Why chunks: at small T a warp that staged a
// whole token ran its load -> amax -> divide chain four times in a row (measured: FP8 staging of
// 128 tokens 20 us against 8 us for the bf16 copy); chunks spread a token over four warps.
template <bool kFp8>
__host__ __device__ __forceinline__ int stage_chunks(const CommShape& s) {
  return kFp8 ? (s.hidden / layout::kScaleGroup + 2 * kQuantPairs - 1) / (2 * kQuantPairs)
              : (s.hidden / 8 + 32 * kPullVecs - 1) / (32 * kPullVecs);
}

// Phase 1 data, one chunk of x[t] (bf16) -> staging: e4m3 + one scale per 128 channels, or a copy.
template <bool kFp8>
__device__ __forceinline__ void stage_token_chunk(const DispatchParams& p, int t, int chunk, char* stage_x,
                                                  float* stage_scale) {
  const int H = p.shape.hidden, lane = threadIdx.x & 31;
  const uint4* src = reinterpret_cast<const uint4*>(p.x + int64_t(t) * H);
  if constexpr (!kFp8) {
    uint4* dst = reinterpret_cast<uint4*>(stage_x + int64_t(t) * H * 2);
    const int nvec = H / 8, v0 = chunk * 32 * kPullVecs;
    uint4 buf[kPullVecs];
#pragma unroll
    for (int j = 0; j < kPullVecs; ++j)
      if (v0 + j * 32 + lane < nvec) buf[j] = src[v0 + j * 32 + lane];
#pragma unroll
    for (int j = 0; j < kPullVecs; ++j)
      if (v0 + j * 32 + lane < nvec) dst[v0 + j * 32 + lane] = buf[j];
  } else {
    // A half-warp owns one 128-channel group: 16 lanes x 8 channels. Why batch kQuantPairs: the loads
    // of a whole chunk are in flight together instead of one latency per group pair.
    const int G = H / layout::kScaleGroup, g0 = chunk * 2 * kQuantPairs;
    uint2* dst = reinterpret_cast<uint2*>(stage_x + int64_t(t) * H);
    uint4 val[kQuantPairs];
#pragma unroll
    for (int j = 0; j < kQuantPairs; ++j) {
      const int g = g0 + 2 * j + (lane >> 4);
      val[j] = g < G ? src[g * 16 + (lane & 15)] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kQuantPairs; ++j) {
      const int g = g0 + 2 * j + (lane >> 4);
      float amax = quant::absmax8_bf16(val[j]);
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      const float s = quant::scale_1x128(amax, p.pow2_scales);
      if (g < G) {
        dst[g * 16 + (lane & 15)] = quant::quantize8_e4m3(val[j], s);
        if ((lane & 15) == 0) stage_scale[int64_t(t) * G + g] = s;
      }
    }
  }
}

// Phase 2: segment starts and per-source bases of our local experts, into shared memory.
// base[s * E_loc + e] = first row of source s's run inside expert e; seg[e] = segment start.
__device__ inline void layout_segments(const CommShape& s, const int32_t* counts, int64_t counts_stride, int row_align,
                                       int* base, int* seg) {
  const int E_loc = s.experts_per_rank(), R = s.num_ranks, lane = threadIdx.x & 31;
  if (threadIdx.x >= 32) return;
  const int per_lane = (E_loc + 31) / 32;
  const int e0 = lane * per_lane, e1 = min(E_loc, e0 + per_lane);
  int mine = 0;
  for (int e = e0; e < e1; ++e) {
    int total = 0;
    for (int r = 0; r < R; ++r) total += counts[r * counts_stride + e];
    mine += (total + row_align - 1) / row_align * row_align;
  }
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += n;
  }
  int run = incl - mine;
  for (int e = e0; e < e1; ++e) {
    seg[e] = run;
    int b = run;
    for (int r = 0; r < R; ++r) {
      base[r * E_loc + e] = b;
      b += counts[r * counts_stride + e];
    }
    run += (b - run + row_align - 1) / row_align * row_align;
  }
  if (lane == 31) seg[E_loc] = incl;
}

// Phase 3 for one slice of one (source, token): pull it once, fan it out to every local slot.
// Why speculative: the slice's data (and in FP8 the scales of its 128-channel groups) are requested
// together with the routing metadata, so a token costs one NVLink round trip, not three. A token
// with no slot here wastes that read; with real routings that is rare (uniform K=8 over 2 ranks:
// 0.2% of tokens). Slice 0 also writes token_rows (for combine), row_weight and row_source.
// Why each slice its own groups' scales (an FP8 slice is 32 groups, one per lane): the scale
// stores are scattered (x_scale is [group][row]), and at H = 7168 slice 0 storing all 56 groups
// for every local row took ~1.7 us of a decode call's critical path (per-block trace).
static_assert(kSliceVecs * 16 == 32 * layout::kScaleGroup, "an FP8 pull slice holds 32 scale groups, one per lane");
// kArrive (the megakernel): once the slice and its scales are stored, each slot lane adds 1 to
// arrive[row / 128], its pool m-block's arrival counter (docs/MEGAKERNEL.md). Why the proxy fence
// in every lane before the warp barrier and the one release per row: the next reader is the GEMM's
// TMA (async proxy) on any SM, and each release covers what the whole warp stored.
template <bool kFp8, bool kArrive = false>
__device__ __forceinline__ void pull_token_slice(const DispatchParams& p, const layout::CommOffsets& sym, int src, int t,
                                                 int slice, const int* base, int32_t* token_rows, uint32_t* status,
                                                 uint32_t* arrive = nullptr) {
  const CommShape& s = p.shape;
  const int K = s.topk, E_loc = s.experts_per_rank(), lane = threadIdx.x & 31;
  const int e_first = p.rank * E_loc;
  const char* peer = p.sym.ptr[src];
  const layout::CommOffsets& pl = p.off;
  const int64_t row_bytes = s.x_row_bytes();
  const int nvec = int(row_bytes / 16), v0 = slice * kSliceVecs;
  const int G = s.scale_groups();

  SlotMeta m{-1, 0, 0.f, 0};
  if (lane < K) m = reinterpret_cast<const SlotMeta*>(peer + sym.stage_meta_offset())[int64_t(t) * K + lane];
  const uint4* from = reinterpret_cast<const uint4*>(peer + sym.stage_x_offset() + int64_t(t) * row_bytes);
  uint4 buf[kPullVecs];
#pragma unroll
  for (int j = 0; j < kPullVecs; ++j)
    if (v0 + j * 32 + lane < nvec) buf[j] = from[v0 + j * 32 + lane];
  const float* sc = reinterpret_cast<const float*>(peer + sym.stage_scale_offset()) + int64_t(t) * G;
  const int g = slice * 32 + lane;  // FP8: this lane's scale group
  float scale = 0.f;
  if (kFp8 && g < G) scale = sc[g];

  const bool local = m.expert >= e_first && m.expert < e_first + E_loc;
  int row = local ? base[src * E_loc + (m.expert - e_first)] + m.pos : -1;
  if (row >= pl.max_rows()) {  // cannot happen with sane counts; never write out of bounds
    ptx::red_or_relaxed_gpu(status, kStatusInternal);
    row = -1;
  }
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, row >= 0);
  diag::trace(diag::kDispUnitMeta);
  if (slice == 0) {
    if (lane < K) token_rows[(int64_t(src) * s.max_tokens + t) * K + lane] = row;
    if (row >= 0) {
      reinterpret_cast<float*>(p.pool + pl.row_weight_offset())[row] = m.weight;
      reinterpret_cast<uint32_t*>(p.pool + pl.row_source_offset())[row] = layout::RowSource::pack(src, t, lane);
    }
  }
  if (mask == 0) return;

  char* x_pool = p.pool + pl.x_pool_offset();
  for (unsigned mk = mask; mk; mk &= mk - 1) {
    const int r = __shfl_sync(0xFFFFFFFFu, row, __ffs(mk) - 1);
    uint4* to = reinterpret_cast<uint4*>(x_pool + int64_t(r) * row_bytes);
#pragma unroll
    for (int j = 0; j < kPullVecs; ++j)
      if (v0 + j * 32 + lane < nvec) to[v0 + j * 32 + lane] = buf[j];
  }
  diag::trace(diag::kDispUnitStored);
  if constexpr (kFp8) {
    float* x_scale = reinterpret_cast<float*>(p.pool + pl.x_scale_offset());
    // Why every lane in the loop: the shuffle needs the slot lanes active even where g >= G.
    for (unsigned mk = mask; mk; mk &= mk - 1) {
      const int r = __shfl_sync(0xFFFFFFFFu, row, __ffs(mk) - 1);
      if (g < G) x_scale[int64_t(g) * pl.scale_stride() + r] = scale;
    }
  }
  if constexpr (kArrive) {
    static_assert(CommLocalLayout::kReadyBlockRows == 128, "arrival counters per 128-row pool block");
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (row >= 0) ptx::red_add_release_gpu(arrive + (row >> 7), 1u);
  }
}

}  // namespace epmoe::comm::dispatch_detail
