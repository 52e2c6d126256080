// The phases of the combine (docs/COMM.md), as one device function that any cooperatively
// launched kernel of kWarps warps per block can call: the standalone combine kernel
// (sm90_combine.cu, 12 warps) and the fused megakernel (sm90_fused_moe.cuh, 12 warps).
//   0  wait until every source finished reading the partials we pushed last call (epoch - 1)
//   A  partial sums -> source ranks' symmetric buffers; last block flags combine_ready and
//      advances the epoch
//   B  wait for every expert rank's partials; y[t] = bf16(sum over ranks with a valid slot)
//   C  last block: tell every expert rank we are done reading (skipped in the layer's calls:
//      the next dispatch does it, CombineParams::defer_done)
// The result does not depend on kWarps or the grid: every token is summed in slot order, then
// in rank order, by one warp.
// Rows mode (a call in which every source has at most CommShape::rows_tokens() tokens, so every
// rank chooses alike from the sources' T): phase A sends each of our rows of a token to the token's
// home rank, into its receive buffer at [slot][token], and adds the row count to the home's
// arrival word of that (token, slice), in this rank's byte lane (layout::rows_word); phase B waits
// for each of its (token, slice) words to be complete, then sums the token's slots in slot order.
// No combine_ready handshake: a home rank waits for its own rows only, and the fused kernel's
// decode variant sends rows as soon as their L2 tiles are stored (push_rows_mblock, before its
// grid barrier; rows_pushed). Why: in decode the combine is latency, not bytes (docs/COMM.md).
#pragma once

#include <cuda_runtime.h>

#include "device/comm/dispatch_params.h"
#include "device/comm/grid_barrier.h"
#include "device/comm/wait.h"
#include "device/comm/work_units.h"
#include "device/debug/diag_trace.cuh"
#include "device/ptx/ld_st.cuh"

namespace epmoe::comm {
namespace combine_detail {

using layout::CommLocalLayout;
using layout::CommShape;
using layout::CommSymLayout;
using layout::SlotMeta;

constexpr int kVecs = 4;  // 8-channel vectors per lane per pass

__device__ __forceinline__ void add_bf16x8(float* acc, const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float* a) {
  return make_uint4(ptx::cvt_rn_bf16x2(a[0], a[1]), ptx::cvt_rn_bf16x2(a[2], a[3]),
                    ptx::cvt_rn_bf16x2(a[4], a[5]), ptx::cvt_rn_bf16x2(a[6], a[7]));
}

// Partial row storage: 8 channels are one bf16 vector or two fp32 vectors.
template <int kPartialBytes>
__device__ __forceinline__ void store_partial8(char* row, int v, const float* a) {
  if constexpr (kPartialBytes == 4) {
    float4* p = reinterpret_cast<float4*>(row) + 2 * v;
    p[0] = make_float4(a[0], a[1], a[2], a[3]);
    p[1] = make_float4(a[4], a[5], a[6], a[7]);
  } else {
    reinterpret_cast<uint4*>(row)[v] = pack_bf16x8(a);
  }
}
template <int kPartialBytes>
__device__ __forceinline__ void add_partial8(float* acc, const char* row, int v) {
  if constexpr (kPartialBytes == 4) {
    const float4* p = reinterpret_cast<const float4*>(row) + 2 * v;
    const float4 a = p[0], b = p[1];
    acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
    acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
  } else {
    add_bf16x8(acc, reinterpret_cast<const uint4*>(row)[v]);
  }
}

constexpr int kSliceVecs = 32 * kVecs;  // one work unit covers this many 8-channel vectors of a row
static_assert(kSliceVecs * 8 == CommShape::kCombineSliceChannels, "combine slices as CommShape counts them");

// Phase A for one slice of one (source, token): sum our rows of it in slot order, push one partial.
// Why rows in groups of kRowsInFlight: their loads are in flight together (a token has ~K/R rows
// here; measured 3.5-9% faster at 4096 tokens than pairs); the sum order stays the slot order.
constexpr int kRowsInFlight = 4;
template <int kPartialBytes>
__device__ __forceinline__ void push_partial_slice(const CombineParams& p, const CommSymLayout& sym, int src, int t,
                                                   int slice, const int32_t* token_rows) {
  const CommShape& s = p.shape;
  const int K = s.topk, lane = threadIdx.x & 31, nvec = s.hidden / 8, v0 = slice * kSliceVecs;
  const int row = lane < K ? token_rows[(int64_t(src) * s.max_tokens + t) * K + lane] : -1;
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, row >= 0);
  diag::trace(diag::kCombUnitRows);
  if (mask == 0) return;
  const char* o_pool = p.pool + p.pool_layout.o_pool_offset();
  const int64_t row_bytes = int64_t(s.hidden) * 2;
  float acc[kVecs][8] = {};
  // mask is warp-uniform, so every branch on it below is too (the shuffles need the whole warp).
  for (unsigned mk = mask; mk;) {
    const uint4* r[kRowsInFlight];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      r[i] = nullptr;
      if (mk) {
        const int k = __ffs(mk) - 1;
        mk &= mk - 1;
        r[i] = reinterpret_cast<const uint4*>(o_pool + int64_t(__shfl_sync(0xFFFFFFFFu, row, k)) * row_bytes);
      }
    }
    uint4 buf[kRowsInFlight][kVecs];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int v = v0 + j * 32 + lane;
        if (r[i] && v < nvec) buf[i][j] = r[i][v];
      }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j)
        if (r[i] && v0 + j * 32 + lane < nvec) add_bf16x8(acc[j], buf[i][j]);
  }
  diag::trace(diag::kCombUnitSummed);
  char* dst = p.sym.ptr[src] + sym.partials_offset() + (int64_t(p.rank) * s.max_tokens + t) * sym.partial_row_bytes();
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = v0 + j * 32 + lane;
    if (v < nvec) store_partial8<kPartialBytes>(dst, v, acc[j]);
  }
}

// Rows mode: one row's slice of vectors (this lane's kVecs) to its token's home rank, [slot][token].
__device__ __forceinline__ char* rows_dest(const CombineParams& p, const CommSymLayout& sym, int home, int t, int slot) {
  return p.sym.ptr[home] + sym.rows_recv_offset() + (int64_t(slot) * p.shape.rows_tokens() + t) * p.shape.hidden * 2;
}
__device__ __forceinline__ uint64_t* rows_word_at(const CombineParams& p, const CommSymLayout& sym, int home, int t,
                                                  int slice) {
  return p.sym.at<uint64_t>(home, sym.rows_arrived_offset()) + int64_t(t) * p.shape.combine_slices() + slice;
}

// Rows mode, phase A for one slice of one (source, token): our rows of it, kRowsInFlight at a time,
// to the source's receive buffer; then one arrival add (after a system-scope fence that covers the
// whole warp's stores, through __syncwarp).
__device__ __forceinline__ void push_rows_slice(const CombineParams& p, const CommSymLayout& sym, int src, int t,
                                                int slice, const int32_t* token_rows) {
  const CommShape& s = p.shape;
  const int K = s.topk, lane = threadIdx.x & 31, nvec = s.hidden / 8, v0 = slice * kSliceVecs;
  const int row = lane < K ? token_rows[(int64_t(src) * s.max_tokens + t) * K + lane] : -1;
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, row >= 0);
  diag::trace(diag::kCombUnitRows);
  if (mask == 0) return;
  const char* o_pool = p.pool + p.pool_layout.o_pool_offset();
  const int64_t row_bytes = int64_t(s.hidden) * 2;
  for (unsigned mk = mask; mk;) {
    const uint4* r[kRowsInFlight];
    uint4* d[kRowsInFlight];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      r[i] = nullptr;
      d[i] = nullptr;
      if (mk) {
        const int k = __ffs(mk) - 1;
        mk &= mk - 1;
        r[i] = reinterpret_cast<const uint4*>(o_pool + int64_t(__shfl_sync(0xFFFFFFFFu, row, k)) * row_bytes);
        d[i] = reinterpret_cast<uint4*>(rows_dest(p, sym, src, t, k));
      }
    }
    uint4 buf[kRowsInFlight][kVecs];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int v = v0 + j * 32 + lane;
        if (r[i] && v < nvec) buf[i][j] = r[i][v];
      }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int v = v0 + j * 32 + lane;
        if (d[i] && v < nvec) d[i][v] = buf[i][j];
      }
  }
  diag::trace(diag::kCombUnitSummed);
  __syncwarp();
  if (lane == 0) {
    ptx::fence_acq_rel_sys();
    ptx::red_add_relaxed_sys(rows_word_at(p, sym, src, t, slice), layout::rows_word(p.rank, __popc(mask)));
  }
}

// Rows mode, the fused kernel's early form: one slice of the valid rows of one pool m-block, once
// that m-block's L2 tiles are all stored (l2done[m] >= l2_target, gpu scope). Rows [row0, row0 + n)
// of the m-block are valid (the caller knows its segments); each row's token, home and slot come
// from row_source, which the dispatch's pull wrote before the releases that l2done's acquire
// follows. One arrival add per row.
__device__ __forceinline__ void push_rows_mblock(const CombineParams& p, const CommSymLayout& sym, int row0, int n,
                                                 int slice, const uint32_t* l2done, uint32_t l2_target,
                                                 const WaitSite& site) {
  const CommShape& s = p.shape;
  const int lane = threadIdx.x & 31, nvec = s.hidden / 8, v0 = slice * kSliceVecs;
  if (lane == 0) wait_geq_acquire_gpu_u32(site, l2done + (row0 >> 7), l2_target, "l2_done", row0 >> 7);
  __syncwarp();
  const char* o_pool = p.pool + p.pool_layout.o_pool_offset();
  const uint32_t* row_source = reinterpret_cast<const uint32_t*>(p.pool + p.pool_layout.row_source_offset());
  const int64_t row_bytes = int64_t(s.hidden) * 2;
  for (int base = 0; base < n; base += 32) {
    const uint32_t src_word = base + lane < n ? row_source[row0 + base + lane] : kInvalidRowSource;
    const int m = min(32, n - base);
    for (int i0 = 0; i0 < m; i0 += kRowsInFlight) {
      uint4 buf[kRowsInFlight][kVecs];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int v = v0 + j * 32 + lane;
          if (i0 + i < m && v < nvec)
            buf[i][j] = reinterpret_cast<const uint4*>(o_pool + int64_t(row0 + base + i0 + i) * row_bytes)[v];
        }
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        const uint32_t w = __shfl_sync(0xFFFFFFFFu, src_word, (i0 + i) & 31);
        if (i0 + i >= m || w == kInvalidRowSource) continue;
        uint4* d = reinterpret_cast<uint4*>(rows_dest(p, sym, layout::RowSource::rank(w), layout::RowSource::token(w),
                                                      layout::RowSource::slot(w)));
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int v = v0 + j * 32 + lane;
          if (v < nvec) d[v] = buf[i][j];
        }
      }
    }
    __syncwarp();
    if (lane < m && src_word != kInvalidRowSource) {
      ptx::fence_acq_rel_sys();
      ptx::red_add_relaxed_sys(
          rows_word_at(p, sym, layout::RowSource::rank(src_word), layout::RowSource::token(src_word), slice),
          layout::rows_word(p.rank, 1));
    }
  }
}

// Rows mode, phase B for one slice of one of our tokens: once every expert rank's rows of it have
// arrived, y[t] = bf16(sum of its slots' rows, in slot order); then the arrival word back to 0.
__device__ __forceinline__ void reduce_rows_slice(const CombineParams& p, const CommSymLayout& sym, int t, int slice,
                                                  const WaitSite& site) {
  const CommShape& s = p.shape;
  const int K = s.topk, lane = threadIdx.x & 31, nvec = s.hidden / 8, E_loc = s.experts_per_rank();
  const int v0 = slice * kSliceVecs;
  const SlotMeta* meta = reinterpret_cast<const SlotMeta*>(p.sym.ptr[p.rank] + sym.stage_meta_offset());
  const int e = lane < K ? meta[int64_t(t) * K + lane].expert : -1;
  const unsigned valid = __ballot_sync(0xFFFFFFFFu, e >= 0);
  uint64_t expected = 0;
  for (int d = 0; d < s.num_ranks; ++d)
    expected += layout::rows_word(d, __popc(__ballot_sync(0xFFFFFFFFu, e >= 0 && e / E_loc == d)));
  uint64_t* word = rows_word_at(p, sym, p.rank, t, slice);
  if (lane == 0 && expected) wait_rows_arrived(site, word, expected);
  __syncwarp();
  float acc[kVecs][8] = {};
  for (unsigned mk = valid; mk;) {
    const uint4* r[kRowsInFlight];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      r[i] = nullptr;
      if (mk) {
        const int k = __ffs(mk) - 1;
        mk &= mk - 1;
        r[i] = reinterpret_cast<const uint4*>(rows_dest(p, sym, p.rank, t, k));
      }
    }
    uint4 buf[kRowsInFlight][kVecs];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int v = v0 + j * 32 + lane;
        if (r[i] && v < nvec) buf[i][j] = r[i][v];
      }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
      for (int j = 0; j < kVecs; ++j)
        if (r[i] && v0 + j * 32 + lane < nvec) add_bf16x8(acc[j], buf[i][j]);
  }
  uint4* y = reinterpret_cast<uint4*>(p.y + int64_t(t) * s.hidden);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = v0 + j * 32 + lane;
    if (v < nvec) y[v] = pack_bf16x8(acc[j]);
  }
  // Every rank's rows of this (token, slice) are in (nothing more comes this call), and the next
  // call's come only after our next dispatch has published (after this kernel).
  if (lane == 0 && expected) *word = 0;
}

// Phase B for one slice of one of our tokens: y[t] = bf16(sum over expert ranks, in rank order).
template <int kPartialBytes>
__device__ __forceinline__ void reduce_token_slice(const CombineParams& p, const CommSymLayout& sym, int t,
                                                   int slice) {
  const CommShape& s = p.shape;
  const int K = s.topk, lane = threadIdx.x & 31, nvec = s.hidden / 8, E_loc = s.experts_per_rank();
  const int v0 = slice * kSliceVecs;
  const SlotMeta* meta = reinterpret_cast<const SlotMeta*>(p.sym.ptr[p.rank] + sym.stage_meta_offset());
  const int e = lane < K ? meta[int64_t(t) * K + lane].expert : -1;
  const unsigned ranks = __reduce_or_sync(0xFFFFFFFFu, e >= 0 ? 1u << (e / E_loc) : 0u);
  const char* partials = p.sym.ptr[p.rank] + sym.partials_offset();
  uint4* y = reinterpret_cast<uint4*>(p.y + int64_t(t) * s.hidden);
  float acc[kVecs][8] = {};
  // Up to two ranks' partial rows in flight together (rank order kept); ranks is warp-uniform.
  for (unsigned rk = ranks; rk;) {
    const char* row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = nullptr;
      if (rk) {
        const int d = __ffs(rk) - 1;
        rk &= rk - 1;
        row[i] = partials + (int64_t(d) * s.max_tokens + t) * sym.partial_row_bytes();
      }
    }
    // Why two forms: without the explicit buffer ptxas interleaves the bf16 rows' loads with the
    // first row's adds (checked in the SASS); the fp32 rows would need twice the buffer registers.
    if constexpr (kPartialBytes == 4) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          if (row[i] && v0 + j * 32 + lane < nvec) add_partial8<kPartialBytes>(acc[j], row[i], v0 + j * 32 + lane);
    } else {
      uint4 buf[2][kVecs];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          if (row[i] && v0 + j * 32 + lane < nvec) buf[i][j] = reinterpret_cast<const uint4*>(row[i])[v0 + j * 32 + lane];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          if (row[i] && v0 + j * 32 + lane < nvec) add_bf16x8(acc[j], buf[i][j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = v0 + j * 32 + lane;
    if (v < nvec) y[v] = pack_bf16x8(acc[j]);
  }
}

// rows_pushed: the caller (the fused kernel's decode variant) already sent this call's rows, if the
// call is in rows mode (push_rows_mblock); phase A then has nothing to do.
template <int kPartialBytes, int kWarps>
__device__ __forceinline__ void combine_phases(const CombineParams& p, bool rows_pushed = false) {
  const CommShape& s = p.shape;
  const CommSymLayout sym{s};
  const CommLocalLayout loc{s};
  const int R = s.num_ranks;
  const int nwarps = gridDim.x * kWarps;
  char* me = p.sym.ptr[p.rank];
  char* ws = p.local_ws;
  uint32_t* status = reinterpret_cast<uint32_t*>(ws + loc.status_offset());
  // Why two counters: phase C must not depend on phase A's last block having reset the first one.
  uint32_t* arrive_a = reinterpret_cast<uint32_t*>(ws + loc.combine_arrive_offset());
  uint32_t* arrive_c = reinterpret_cast<uint32_t*>(ws + loc.combine_done_arrive_offset());
  uint64_t* epoch_word = reinterpret_cast<uint64_t*>(ws + loc.combine_epoch_offset());
  const int32_t* recv_tokens = reinterpret_cast<const int32_t*>(ws + loc.recv_tokens_offset());
  const WaitSite site{p.rank, p.timeout_ns, status, p.timeout_record};
  const uint64_t epoch = ptx::ld_ca_u64(epoch_word) + 1;
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kCombineStart, true);
  diag::trace(diag::kCombEntry);

  // Phase 0: a source may still be reading the partials we pushed into its buffer last call.
  if (threadIdx.x < R)
    wait_geq_acquire_sys(site, reinterpret_cast<uint64_t*>(me + sym.flag_offset(layout::kFlagCombineDone, threadIdx.x)),
                         epoch - 1, "combine_done", threadIdx.x);
  __syncthreads();
  diag::trace(diag::kCombPhase0);

  // Phase A.
  int max_t = 0;
  for (int r = 0; r < R; ++r) max_t = max(max_t, recv_tokens[r]);
  const bool rows = max_t <= s.rows_tokens();
  const int32_t* token_rows = reinterpret_cast<const int32_t*>(ws + loc.token_rows_offset());
  const int slices = s.combine_slices();
  const int64_t units_a = rows && rows_pushed ? 0 : int64_t(max_t) * R * slices;
  const int64_t first_a = first_unit<kWarps>(units_a);
  const bool had_a = first_a < units_a;
  // Why two loops: one loop with both unit kinds made ptxas spill the partials' buffers.
  if (rows) {
    for (int64_t u = first_a; u < units_a; u += nwarps) {
      const SourceTokenSlice w = source_token_slice(u, slices, R, p.rank);
      if (w.t < recv_tokens[w.src]) push_rows_slice(p, sym, w.src, w.t, w.slice, token_rows);
    }
  } else {
    for (int64_t u = first_a; u < units_a; u += nwarps) {
      const SourceTokenSlice w = source_token_slice(u, slices, R, p.rank);
      if (w.t < recv_tokens[w.src]) push_partial_slice<kPartialBytes>(p, sym, w.src, w.t, w.slice, token_rows);
    }
  }
  if (stamps_phase_end(had_a)) stamp_phase(p.phase_ts, kCombinePartials);
  diag::trace(diag::kCombA);
  if (arrive_is_last_block(arrive_a)) {
    if (threadIdx.x < R)
      ptx::st_release_sys(p.sym.at<uint64_t>(threadIdx.x, sym.flag_offset(layout::kFlagCombineReady, p.rank)), epoch);
    // Every block has read the epoch word (at its start, before this arrival): the next call may
    // find the new one. Here rather than in phase C, which a deferred call skips.
    if (threadIdx.x == 0) ptx::st_relaxed_gpu(epoch_word, epoch);
  }
  diag::trace(diag::kCombArrivedA);

  // Phase B (rows mode: each unit waits for its own rows instead).
  if (!rows && threadIdx.x < R)
    wait_geq_acquire_sys(site, reinterpret_cast<uint64_t*>(me + sym.flag_offset(layout::kFlagCombineReady, threadIdx.x)),
                         epoch, "combine_ready", threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kCombineReady);
  diag::trace(diag::kCombReady);
  const int T = recv_tokens[p.rank];
  const int64_t units_b = int64_t(T) * slices;
  const int64_t first_b = first_unit<kWarps>(units_b);
  const bool had_b = first_b < units_b;
  if (rows) {
    for (int64_t u = first_b; u < units_b; u += nwarps) reduce_rows_slice(p, sym, int(u / slices), int(u % slices), site);
  } else {
    for (int64_t u = first_b; u < units_b; u += nwarps)
      reduce_token_slice<kPartialBytes>(p, sym, int(u / slices), int(u % slices));
  }
  if (stamps_phase_end(had_b)) stamp_phase(p.phase_ts, kCombineEnd);
  diag::trace(diag::kCombB);

  // Phase C (unless deferred to the next dispatch, CombineParams::defer_done).
  if (!p.defer_done && arrive_is_last_block(arrive_c) && threadIdx.x < R)
    ptx::st_release_sys(p.sym.at<uint64_t>(threadIdx.x, sym.flag_offset(layout::kFlagCombineDone, p.rank)), epoch);
  diag::trace(diag::kCombEnd);
}

}  // namespace combine_detail

using combine_detail::combine_phases;

}  // namespace epmoe::comm
