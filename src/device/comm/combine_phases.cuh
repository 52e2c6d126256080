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

using layout::CommShape;
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

// Phase A for one slice of one (source, token): sum our rows of it in slot order, push one partial.
// Why rows in groups of kRowsInFlight: their loads are in flight together (a token has ~K/R rows
// here; measured 3.5-9% faster at 4096 tokens than pairs); the sum order stays the slot order.
constexpr int kRowsInFlight = 4;
template <int kPartialBytes>
__device__ __forceinline__ void push_partial_slice(const CombineParams& p, const layout::CommOffsets& sym, int src, int t,
                                                   int slice, const int32_t* token_rows) {
  const CommShape& s = p.shape;
  const int K = s.topk, lane = threadIdx.x & 31, nvec = s.hidden / 8, v0 = slice * kSliceVecs;
  const int row = lane < K ? token_rows[(int64_t(src) * s.max_tokens + t) * K + lane] : -1;
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, row >= 0);
  diag::trace(diag::kCombUnitRows);
  if (mask == 0) return;
  const char* o_pool = p.pool + p.off.o_pool_offset();
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

// Phase B for one slice of one of our tokens: y[t] = bf16(sum over expert ranks, in rank order).
template <int kPartialBytes>
__device__ __forceinline__ void reduce_token_slice(const CombineParams& p, const layout::CommOffsets& sym, int t,
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

template <int kPartialBytes, int kWarps>
__device__ __forceinline__ void combine_phases(const CombineParams& p) {
  const CommShape& s = p.shape;
  const layout::CommOffsets& sym = p.off;
  const layout::CommOffsets& loc = p.off;
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
  const int32_t* token_rows = reinterpret_cast<const int32_t*>(ws + loc.token_rows_offset());
  const int slices = (s.hidden / 8 + kSliceVecs - 1) / kSliceVecs;
  const int64_t units_a = int64_t(max_t) * R * slices;
  const int64_t first_a = first_unit<kWarps>(units_a);
  const bool had_a = first_a < units_a;
  for (int64_t u = first_a; u < units_a; u += nwarps) {
    const SourceTokenSlice w = source_token_slice(u, slices, R, p.rank);
    if (w.t < recv_tokens[w.src]) push_partial_slice<kPartialBytes>(p, sym, w.src, w.t, w.slice, token_rows);
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

  // Phase B.
  if (threadIdx.x < R)
    wait_geq_acquire_sys(site, reinterpret_cast<uint64_t*>(me + sym.flag_offset(layout::kFlagCombineReady, threadIdx.x)),
                         epoch, "combine_ready", threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kCombineReady);
  diag::trace(diag::kCombReady);
  const int T = recv_tokens[p.rank];
  const int64_t units_b = int64_t(T) * slices;
  const int64_t first_b = first_unit<kWarps>(units_b);
  const bool had_b = first_b < units_b;
  for (int64_t u = first_b; u < units_b; u += nwarps)
    reduce_token_slice<kPartialBytes>(p, sym, int(u / slices), int(u % slices));
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
