// The phases of the dispatch (docs/COMM.md), as one device function that any cooperatively
// launched kernel of kWarps warps per block can call: the standalone dispatch kernel
// (sm90_dispatch.cu, 16 warps) and the fused megakernel (sm90_fused_moe.cuh, 12 warps).
//   -- last block: tell every expert rank we are done reading the last combine's partials (the
//      combine's phase C when that combine deferred it; a repeat is harmless)
//   0  wait until every destination finished pulling our previous staging (epoch - 1)
//   1  mask out-of-range experts, take row positions per (this source, expert), quantize/stage tokens
//   -- grid barrier; block 0 publishes per-destination counts and T, then flags dispatch_ready
//   2  wait for every source's counts; lay out expert segments (aligned to row_align)
//   3  pull tokens, write x_pool / x_scale / row_weight / row_source / token_rows
//   4  last block: tell every source we are done reading, reset cursors, advance the epoch
// smem: (R + 1) * E_loc + 1 ints of scratch (dynamic shared memory of the caller).
//
// In the megakernel (kMegakernel) a block goes from its own pull straight to its GEMM tiles, with
// no grid barrier in between (docs/MEGAKERNEL.md), so three things differ:
// - the last block writes the pool's counts and offsets right after the segment layout (for the
//   code after the kernel's next grid barrier); the GEMMs schedule from each block's own layout
//   (segment_rows_used);
// - every pull unit adds 1 per (row, slice) it wrote to the row's m-block arrival counter, with a
//   gpu-scope release after a proxy fence (the GEMM's TMA reads the rows next);
// - phase 4 is not run here: the kernel calls dispatch_finish from block 0 after a later grid
//   barrier (the sources' staging is free once every block has pulled).
#pragma once

#include <cuda_runtime.h>

#include "device/comm/dispatch_device.cuh"
#include "device/comm/grid_barrier.h"
#include "device/comm/wait.h"
#include "device/comm/work_units.h"
#include "device/debug/diag_trace.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"

namespace epmoe::comm {

// Scratch ints dispatch_phases needs in shared memory.
__host__ __device__ __forceinline__ int dispatch_smem_ints(const layout::CommShape& s) {
  return (s.num_ranks + 1) * s.experts_per_rank() + 1;
}

namespace dispatch_detail {

// The default for dispatch_phases' after_layout hook: nothing.
// after_layout(segment_rows): called by lane 0 of the last warp of every block once the expert
// segments are laid out and before the pull, with segment_rows(e) = the rows of local expert e's
// segment this call (its row count rounded up to row_align), read from the block's own smem: no
// global loads, no grid-wide ordering. The fused kernel prefetches weights there.
struct NoLayoutHook {
  template <class CountOf>
  __device__ void operator()(const CountOf&) const {}
};

// Local expert e's rows in this call, from the block's segment layout in its smem scratch (`smem`
// as dispatch_phases left it: base [R][E_loc], then seg [E_loc + 1]) and the last source's counts
// (this rank's symmetric buffer). seg[e] is the expert's first pool row.
__device__ __forceinline__ int segment_rows_used(const DispatchParams& p, const int* smem, int e) {
  const CommShape& s = p.shape;
  const layout::CommOffsets& sym = p.off;
  const int R = s.num_ranks, E_loc = s.experts_per_rank();
  const int32_t* counts = reinterpret_cast<const int32_t*>(p.sym.ptr[p.rank] + sym.counts_offset());
  return smem[(R - 1) * E_loc + e] + counts[(R - 1) * sym.counts_stride() + e] - smem[R * E_loc + e];
}

// The pool's expert counts and offsets (E_loc + 1) and recv_tokens, from the block's layout.
__device__ __forceinline__ void write_pool_counts(const DispatchParams& p, const int* smem, const int* tokens_of) {
  const int R = p.shape.num_ranks, E_loc = p.shape.experts_per_rank();
  const int* seg = smem + R * E_loc;
  const layout::CommOffsets& pl = p.off;
  int32_t* ecount = reinterpret_cast<int32_t*>(p.pool + pl.expert_count_offset());
  int32_t* eoff = reinterpret_cast<int32_t*>(p.pool + pl.expert_offset_offset());
  int32_t* recv_tokens = reinterpret_cast<int32_t*>(p.local_ws + p.off.recv_tokens_offset());
  for (int e = threadIdx.x; e <= E_loc; e += blockDim.x) {
    eoff[e] = seg[e];
    if (e < E_loc) ecount[e] = segment_rows_used(p, smem, e);
  }
  if (threadIdx.x < R) recv_tokens[threadIdx.x] = tokens_of[threadIdx.x];
}

// Phase 4, by every thread of one block once every block has pulled: tell every source we are done
// reading its staging, reset the cursors, advance the epoch (this call's, `epoch`).
__device__ __forceinline__ void dispatch_finish(const DispatchParams& p, uint64_t epoch) {
  const CommShape& s = p.shape;
  const layout::CommOffsets& sym = p.off;
  const layout::CommOffsets& loc = p.off;
  if (threadIdx.x < s.num_ranks)
    ptx::st_release_sys(p.sym.at<uint64_t>(threadIdx.x, sym.flag_offset(layout::kFlagDispatchReadDone, p.rank)), epoch);
  int32_t* cursor = reinterpret_cast<int32_t*>(p.local_ws + loc.cursor_offset());
  for (int e = threadIdx.x; e < s.num_experts; e += blockDim.x) cursor[e] = 0;
  if (threadIdx.x == 0)
    ptx::st_relaxed_gpu(reinterpret_cast<uint64_t*>(p.local_ws + loc.dispatch_epoch_offset()), epoch);
}

// The megakernel's form: the epoch is read again here (nothing writes the word between the call's
// start and dispatch_finish), so that no register holds it through the GEMM phase.
__device__ __forceinline__ void dispatch_finish_reread(const DispatchParams& p) {
  const auto* epoch_word =
      reinterpret_cast<const uint64_t*>(p.local_ws + p.off.dispatch_epoch_offset());
  const uint64_t epoch = ptx::ld_ca_u64(epoch_word) + 1;
  __syncthreads();  // every thread has read the word before thread 0 advances it
  dispatch_finish(p, epoch);
}

template <bool kFp8, int kWarps, bool kMegakernel = false, class AfterLayout = NoLayoutHook>
__device__ __forceinline__ void dispatch_phases(const DispatchParams& p, int* smem,
                                                const AfterLayout& after_layout = AfterLayout{}) {
  const CommShape& s = p.shape;
  const layout::CommOffsets& sym = p.off;
  const layout::CommOffsets& loc = p.off;
  const int R = s.num_ranks, E_loc = s.experts_per_rank();
  const int nwarps = gridDim.x * kWarps;
  char* me = p.sym.ptr[p.rank];
  char* ws = p.local_ws;
  uint32_t* status = reinterpret_cast<uint32_t*>(ws + loc.status_offset());
  int32_t* cursor = reinterpret_cast<int32_t*>(ws + loc.cursor_offset());
  uint64_t* epoch_word = reinterpret_cast<uint64_t*>(ws + loc.dispatch_epoch_offset());
  const WaitSite site{p.rank, p.timeout_ns, status, p.timeout_record};
  const uint64_t epoch = ptx::ld_ca_u64(epoch_word) + 1;
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kDispatchStart, true);
  diag::trace(diag::kDispEntry);

  // The previous combine's "done reading your partials" flags, if it deferred them
  // (CombineParams::defer_done): that kernel ended before this one started, so every read of it is
  // ordered before these releases. A repeated release of an epoch already released is harmless
  // (the flags only grow). From the last block: a small call's work sits on the first ones.
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < R) {
    const uint64_t combined = ptx::ld_ca_u64(reinterpret_cast<const uint64_t*>(ws + loc.combine_epoch_offset()));
    ptx::st_release_sys(p.sym.at<uint64_t>(threadIdx.x, sym.flag_offset(layout::kFlagCombineDone, p.rank)), combined);
  }

  // Phase 0: our staging and the counts we wrote last call may still be read by a destination.
  if (threadIdx.x < R)
    wait_geq_acquire_sys(site, flag_ptr(me, sym, layout::kFlagDispatchReadDone, threadIdx.x), epoch - 1,
                         "dispatch_read_done", threadIdx.x);
  __syncthreads();
  diag::trace(diag::kDispPhase0);

  // Phase 1: stage our tokens in (token, chunk) units; the chunk-0 warp also stages the routing.
  SlotMeta* meta = reinterpret_cast<SlotMeta*>(me + sym.stage_meta_offset());
  const int chunks = stage_chunks<kFp8>(s);
  const int64_t stage_units = int64_t(p.num_tokens) * chunks;
  for (int64_t u = first_unit<kWarps>(stage_units); u < stage_units; u += nwarps) {
    const int t = int(u / chunks), chunk = int(u % chunks);
    // Why the routing in two halves around the chunk: its loads and the chunk's are then in flight
    // together instead of one after the other (a decode call's staging ~0.5 us shorter in the
    // per-block trace).
    RoutingSlot slot;
    if (chunk == 0) slot = load_routing(p, t);
    stage_token_chunk<kFp8>(p, t, chunk, me + sym.stage_x_offset(),
                            reinterpret_cast<float*>(me + sym.stage_scale_offset()));
    if (chunk == 0)
      stage_routing(p, t, slot, meta, cursor, status,
                    reinterpret_cast<unsigned long long*>(ws + loc.routing_report_offset()), epoch);
  }
  diag::trace(diag::kDispStaged);
  grid_barrier(reinterpret_cast<uint32_t*>(ws + loc.grid_barrier_offset()), site);
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kDispatchStaged);
  diag::trace(diag::kDispBarrier);

  // Publish how many rows we send to each destination's experts, and our T.
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < R * (E_loc + 1); i += blockDim.x) {
      const int d = i / (E_loc + 1), e = i % (E_loc + 1);
      const int v = e < E_loc ? cursor[d * E_loc + e] : p.num_tokens;
      p.sym.at<int32_t>(d, sym.counts_offset())[p.rank * sym.counts_stride() + e] = v;
    }
    __syncthreads();
    if (threadIdx.x < R) {
      ptx::fence_acq_rel_sys();
      ptx::st_release_sys(p.sym.at<uint64_t>(threadIdx.x, sym.flag_offset(layout::kFlagDispatchReady, p.rank)), epoch);
    }
    diag::trace(diag::kDispPublished);
  }

  // Phase 2: every source's counts -> our expert segments.
  if (threadIdx.x < R)
    wait_geq_acquire_sys(site, flag_ptr(me, sym, layout::kFlagDispatchReady, threadIdx.x), epoch,
                         "dispatch_ready", threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) stamp_phase(p.phase_ts, kDispatchCounts);
  diag::trace(diag::kDispCounts);
  int* base = smem;            // [R][E_loc]
  int* seg = smem + R * E_loc;  // [E_loc + 1]
  const int32_t* counts = reinterpret_cast<const int32_t*>(me + sym.counts_offset());
  // Warp 0 lays out the segments while warp 1 reads every source's T: one round trip of loads and
  // one block barrier instead of two each (a decode call's critical path runs through here).
  __shared__ int tokens_of[layout::kCommMaxRanks];
  static_assert(kWarps >= 2, "warp 1 reads the sources' token counts");
  layout_segments(s, counts, sym.counts_stride(), p.pool_layout.s.row_align, base, seg);
  if (threadIdx.x >= 32 && threadIdx.x < 32 + R) {
    const int r = int(threadIdx.x) - 32;
    tokens_of[r] = counts[r * sym.counts_stride() + E_loc];
  }
  __syncthreads();
  int max_tokens_seen = 0;
  for (int r = 0; r < R; ++r) max_tokens_seen = max(max_tokens_seen, tokens_of[r]);
  if constexpr (kMegakernel) {
    // Why the last block: a small call's pull units sit on the first blocks (first_unit). Read
    // after the kernel's next grid barrier (the GEMMs schedule from each block's own layout).
    if (blockIdx.x == gridDim.x - 1) write_pool_counts(p, smem, tokens_of);
  }
  diag::trace(diag::kDispLayout);

  const layout::CommOffsets& pl = p.off;
  // Why the last warp: the hook's weight prefetch (the fused kernel, off by default) then does not
  // delay warp 0's pull unit (unit 0 of a small call). (Its bytes still delay the pull's loads:
  // measured in the per-block trace.)
  if (threadIdx.x == (kWarps - 1) * 32) after_layout([&](int e) { return seg[e + 1] - seg[e]; });

  // Phase 3: pull. Units are (source, token, slice); sources interleave so NVLink reads and the
  // local copies overlap, and slices keep a small call's latency chain short.
  int32_t* token_rows = reinterpret_cast<int32_t*>(ws + loc.token_rows_offset());
  uint32_t* arrive = kMegakernel ? reinterpret_cast<uint32_t*>(ws + loc.mblock_arrive_offset()) : nullptr;
  const int slices = pull_slices(s);
  const int64_t units = int64_t(max_tokens_seen) * R * slices;
  const int64_t first_pull = first_unit<kWarps>(units);
  const bool had_pull = first_pull < units;
  for (int64_t u = first_pull; u < units; u += nwarps) {
    const SourceTokenSlice w = source_token_slice(u, slices, R, p.rank);
    if (w.t < tokens_of[w.src])
      pull_token_slice<kFp8, kMegakernel>(p, sym, w.src, w.t, w.slice, base, token_rows, status, arrive);
  }
  if (stamps_phase_end(had_pull)) stamp_phase(p.phase_ts, kDispatchPulled);
  diag::trace(diag::kDispPulled);

  // The pool's expert counts and offsets, recv_tokens and the segments' padding rows. Why after the
  // pull: nothing in this kernel reads them (the GEMM, combine and, in the megakernel, the code
  // after the next grid barrier do), and before it they delayed a small call's pull units on the
  // blocks that write them. Why from the last blocks: a small call's pull units sit on the first
  // blocks (first_unit), so the two kinds of work land on different SMs.
  if (!kMegakernel && blockIdx.x == gridDim.x - 1) write_pool_counts(p, smem, tokens_of);
  // Padding rows of each segment: weight 0 and an invalid source, so nothing reads garbage.
  // Why the clamp: counts from peers that disagree with our pool size must not write past it
  // (pull_token_slice drops such rows the same way and reports them).
  const int max_rows = int(pl.max_rows());
  for (int e = int(gridDim.x - 1 - blockIdx.x); e < E_loc; e += int(gridDim.x)) {
    const int end = base[(R - 1) * E_loc + e] + counts[(R - 1) * sym.counts_stride() + e];
    const int pad_end = min(seg[e + 1], max_rows);
    for (int r = end + threadIdx.x; r < pad_end; r += blockDim.x) {
      reinterpret_cast<float*>(p.pool + pl.row_weight_offset())[r] = 0.f;
      reinterpret_cast<uint32_t*>(p.pool + pl.row_source_offset())[r] = kInvalidRowSource;
    }
  }

  diag::trace(diag::kDispPadding);

  // Phase 4 (the megakernel runs it after a later grid barrier).
  if constexpr (!kMegakernel) {
    const bool last = arrive_is_last_block(reinterpret_cast<uint32_t*>(ws + loc.dispatch_arrive_offset()));
    diag::trace(diag::kDispArrived);
    if (last) dispatch_finish(p, epoch);
  }
  diag::trace(diag::kDispEnd);
}


}  // namespace dispatch_detail

using dispatch_detail::dispatch_finish_reread;
using dispatch_detail::dispatch_phases;
using dispatch_detail::segment_rows_used;

}  // namespace epmoe::comm
