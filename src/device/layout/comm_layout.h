// Buffers of the standalone dispatch/combine kernels. One symmetric allocation (same offsets on
// every rank, reachable by peers over NVLink) and one local workspace; docs/COMM.md shows the
// protocol that moves data between them.
#pragma once

#include <cstdint>

#include "device/layout/expert_pool.h"
#include "device/layout/hd.h"

namespace epmoe::layout {

inline constexpr int kCommMaxRanks = 8;

// What the buffers hold room for when several shapes share them (a Workspace: layers of different
// E, H, K and dtype run one after another on the same symmetric and local buffers). Every region
// is sized, and every offset computed, from the larger of these and the shape's own needs, so each
// region sits at the same place for every layer: the flag protocol that orders two calls of one
// layer then orders two calls of different layers too (docs/ARCHITECTURE.md, "One workspace, many
// layers"). Strides inside a region follow the shape's own fields. All zero: the shape's own.
struct CommCapacity {
  int experts_per_rank;  // E_loc
  int hidden;            // H
  int topk;              // K
  int x_row_bytes;       // bytes of one staged token row (H x 1 for FP8, H x 2 for BF16)
  int scale_groups;      // FP8 scales per staged token (H / 128), 0 when only BF16 layers fit
  int partial_bytes;     // bytes of one combine partial element (4 or 2)
};

struct CommShape {
  int num_ranks;      // R
  int num_experts;    // E (global)
  int hidden;         // H, a multiple of 128
  int topk;           // K
  int max_tokens;     // T_max per rank
  bool fp8;           // dispatch sends e4m3 + 1x128 scales, else bf16
  int partial_bytes;  // combine sends fp32 (4) or bf16 (2) partial sums per (token, expert rank)
  CommCapacity cap = {};  // the shared buffers' room (zero: this shape's own)

  EPMOE_HD int experts_per_rank() const { return num_experts / num_ranks; }
  EPMOE_HD int scale_groups() const { return hidden / kScaleGroup; }
  EPMOE_HD int64_t x_row_bytes() const { return int64_t(hidden) * (fp8 ? 1 : 2); }

  // Sizes the regions are laid out for: max(own, cap). Only region sizes and offsets use them.
  EPMOE_HD int room_experts_per_rank() const { return imax(experts_per_rank(), cap.experts_per_rank); }
  EPMOE_HD int room_hidden() const { return imax(hidden, cap.hidden); }
  EPMOE_HD int room_topk() const { return imax(topk, cap.topk); }
  EPMOE_HD int64_t room_x_row_bytes() const { return x_row_bytes() > cap.x_row_bytes ? x_row_bytes() : cap.x_row_bytes; }
  EPMOE_HD int room_scale_groups() const { return imax(fp8 ? scale_groups() : 0, cap.scale_groups); }
  EPMOE_HD int room_partial_bytes() const { return imax(partial_bytes, cap.partial_bytes); }

 private:
  EPMOE_HD static int imax(int a, int b) { return a > b ? a : b; }
};

// What a source rank stages for each (token, slot): the sanitized expert (-1 = masked or invalid),
// the row's position inside the (source, expert) run, and the routing weight.
struct alignas(16) SlotMeta {
  int32_t expert;
  int32_t pos;
  float weight;
  int32_t pad;
};
static_assert(sizeof(SlotMeta) == 16, "SlotMeta is loaded as one 16-byte vector");

// Flags live in the symmetric allocation; array f, entry r is written by (or about) rank r.
enum CommFlag : int {
  kFlagDispatchReady = 0,     // on dest d, [s]: source s staged its tokens and counts for epoch e
  kFlagDispatchReadDone = 1,  // on source s, [d]: dest d finished pulling s's staging of epoch e
  kFlagCombineReady = 2,      // on source s, [d]: dest d wrote its partial sums of epoch e
  kFlagCombineDone = 3,       // on dest d, [s]: source s finished reading d's partials of epoch e
  kFlagBarrier = 4,           // generic cross-rank barrier slots
  kNumFlags = 5,
};

struct CommSymLayout {
  CommShape s;

  EPMOE_HD int64_t flag_offset(int flag, int rank) const { return (int64_t(flag) * kCommMaxRanks + rank) * 8; }
  EPMOE_HD int64_t flags_bytes() const { return int64_t(kNumFlags) * kCommMaxRanks * 8; }
  // [R][E_loc + 1] int32 on each dest: counts of source s per local expert, then T_s.
  EPMOE_HD int64_t counts_stride() const { return s.experts_per_rank() + 1; }
  // Region sizes follow the shape's room (CommShape::room_*), strides its own fields.
  EPMOE_HD int64_t counts_bytes() const { return int64_t(s.num_ranks) * (s.room_experts_per_rank() + 1) * 4; }
  EPMOE_HD int64_t stage_x_bytes() const { return int64_t(s.max_tokens) * s.room_x_row_bytes(); }
  EPMOE_HD int64_t stage_scale_bytes() const { return int64_t(s.max_tokens) * s.room_scale_groups() * 4; }
  EPMOE_HD int64_t stage_meta_bytes() const { return int64_t(s.max_tokens) * s.room_topk() * int64_t(sizeof(SlotMeta)); }
  // [R][T_max][H] partial sums, on the source rank, indexed by the expert rank that computed them.
  EPMOE_HD int64_t partial_row_bytes() const { return int64_t(s.hidden) * s.partial_bytes; }
  EPMOE_HD int64_t partials_bytes() const {
    return int64_t(s.num_ranks) * s.max_tokens * s.room_hidden() * s.room_partial_bytes();
  }

  EPMOE_HD int64_t counts_offset() const { return next(0, flags_bytes()); }
  EPMOE_HD int64_t stage_x_offset() const { return next(counts_offset(), counts_bytes()); }
  EPMOE_HD int64_t stage_scale_offset() const { return next(stage_x_offset(), stage_x_bytes()); }
  EPMOE_HD int64_t stage_meta_offset() const { return next(stage_scale_offset(), stage_scale_bytes()); }
  EPMOE_HD int64_t partials_offset() const { return next(stage_meta_offset(), stage_meta_bytes()); }
  EPMOE_HD int64_t num_bytes() const { return next(partials_offset(), partials_bytes()); }

 private:
  EPMOE_HD static int64_t next(int64_t offset, int64_t bytes) { return round_up<int64_t>(offset + bytes, kRegionAlign); }
};

// Per-rank workspace that no peer touches. Zero-filled once at creation; the kernels leave every
// counter as they found it (or advance an epoch), so no per-call reset is needed.
struct CommLocalLayout {
  CommShape s;

  // Control words.
  EPMOE_HD int64_t status_offset() const { return 0; }             // u32: kStatus* bits
  EPMOE_HD int64_t grid_barrier_offset() const { return 4; }       // u32
  EPMOE_HD int64_t dispatch_arrive_offset() const { return 8; }    // u32: last-block counter
  EPMOE_HD int64_t combine_arrive_offset() const { return 12; }    // u32: last-block counter, phase A
  EPMOE_HD int64_t dispatch_epoch_offset() const { return 16; }    // u64: calls completed
  EPMOE_HD int64_t combine_epoch_offset() const { return 24; }     // u64
  EPMOE_HD int64_t combine_done_arrive_offset() const { return 32; }  // u32: last-block counter, phase C
  // u64: device address of this handle's layout::TimeoutRecord (mapped pinned host memory),
  // written once at create. Why here too (the params carry it as well): a WaitSite built only from
  // (rank, timeout, status word) finds it next to the status word (see comm/wait.h).
  EPMOE_HD int64_t timeout_record_offset() const { return 40; }
  // Bytes 48-55 are free.
  // u64: the last dispatch epoch whose first out-of-range expert index was reported (atomicMax
  // elects one reporter per call; layout::RoutingRecord). Never reset.
  EPMOE_HD int64_t routing_report_offset() const { return 56; }
  EPMOE_HD int64_t control_bytes() const { return 64; }

  // [E] int32: per global expert, rows this rank sends there in the current call (atomic cursor).
  EPMOE_HD int64_t cursor_bytes() const { return int64_t(s.num_ranks) * s.room_experts_per_rank() * 4; }
  // [R][T_max][K] int32: for source s's token t, slot k, the local pool row or -1 (what combine reads).
  // One entry per slot, so a token may own up to K rows here, several of them in one expert.
  EPMOE_HD int64_t token_rows_bytes() const { return int64_t(s.num_ranks) * s.max_tokens * s.room_topk() * 4; }
  // [R] int32: T_s of the last dispatch, per source.
  EPMOE_HD int64_t recv_tokens_bytes() const { return int64_t(s.num_ranks) * 4; }

  // [pool m-blocks] u32: the fused kernel's L1 -> L2 readiness counter per 128-row block of the
  // expert pool (docs/MEGAKERNEL.md). Zero between calls: the kernel resets what it used.
  // Sized for the layer's pool (row_align 128): max_rows / 128 of ExpertPoolLayout.
  static constexpr int kReadyBlockRows = 128;
  EPMOE_HD int64_t mblock_ready_count() const {
    const int64_t rows = int64_t(s.num_ranks) * s.max_tokens * s.room_topk() +
                         int64_t(s.room_experts_per_rank()) * (kReadyBlockRows - 1);
    return (rows + kReadyBlockRows - 1) / kReadyBlockRows;
  }
  EPMOE_HD int64_t mblock_ready_bytes() const { return mblock_ready_count() * 4; }
  // [pool m-blocks] u32: the fused kernel's dispatch -> L1 arrival counter per 128-row block of the
  // pool: +1 per (row, pull slice) written, so an m-block of n valid rows has arrived at n x slices.
  // Same count as ready[], reset with it.
  // [2] u32: the fused kernel's grid-wide tile counters (L1, L2): each block claims its next tile
  // there. Zero between calls: block 0 resets them after the grid barrier that follows the GEMMs
  // (docs/MEGAKERNEL.md).
  EPMOE_HD int64_t tile_claim_bytes() const { return 8; }
  // The megakernel's split L1 units (gemm::SplitExchange): per L1 tile (a pair of halves) and math
  // warpgroup a u32 counter (0 between calls: the kernel zeroes what it used), then per pair,
  // warpgroup and half 64 floats of row maxima. A call splits only if its L1 tiles fit.
  static constexpr int kSplitMaxPairs = 512;
  EPMOE_HD static constexpr int64_t split_counter_bytes() { return int64_t(kSplitMaxPairs) * 2 * 4; }
  EPMOE_HD static constexpr int64_t split_exchange_bytes() {
    return split_counter_bytes() + int64_t(kSplitMaxPairs) * 2 * 2 * 64 * 4;
  }

  EPMOE_HD int64_t cursor_offset() const { return next(0, control_bytes()); }
  EPMOE_HD int64_t token_rows_offset() const { return next(cursor_offset(), cursor_bytes()); }
  EPMOE_HD int64_t recv_tokens_offset() const { return next(token_rows_offset(), token_rows_bytes()); }
  EPMOE_HD int64_t mblock_ready_offset() const { return next(recv_tokens_offset(), recv_tokens_bytes()); }
  EPMOE_HD int64_t mblock_arrive_offset() const { return next(mblock_ready_offset(), mblock_ready_bytes()); }
  EPMOE_HD int64_t tile_claim_offset() const { return next(mblock_arrive_offset(), mblock_ready_bytes()); }
  EPMOE_HD int64_t split_exchange_offset() const { return next(tile_claim_offset(), tile_claim_bytes()); }
  EPMOE_HD int64_t num_bytes() const { return next(split_exchange_offset(), split_exchange_bytes()); }

 private:
  EPMOE_HD static int64_t next(int64_t offset, int64_t bytes) { return round_up<int64_t>(offset + bytes, kRegionAlign); }
};

// Every shape-dependent offset and stride that the comm phases (in their kernels and in the
// megakernel) read, resolved on the host from the three layouts above (comm_offsets) and passed in
// the kernels' parameters. The accessors keep the layouts' names, so device code reads
// `off.stage_x_offset()` as it read `sym.stage_x_offset()`; the constant ones forward to the
// layouts. Why: computed from the shape at each use, the region chains (each offset the rounded sum
// of every region before it, the pool's row count a 64-bit division by row_align) came to ~1,500 of
// the ~9,400 distinct SASS instructions that a megakernel decode call runs. The code an SM runs once
// per call comes from its instruction caches, whose capacity such a call exceeds (epmoe-icache-probe:
// straight-line code of 128 KB stays cached from pass to pass and launch to launch, 160 KB does not),
// so each instruction costs its fetch (docs/DESIGN.md, "What bounds the layer now").
struct CommOffsets {
  // CommSymLayout
  int64_t counts, stage_x, stage_scale, stage_meta, partials, counts_stride_, partial_row_bytes_;
  // CommLocalLayout
  int64_t cursor, token_rows, recv_tokens, mblock_ready, mblock_arrive, tile_claim, mblock_ready_count_,
      split_exchange;
  // ExpertPoolLayout
  int64_t x_pool, x_scale, row_weight, row_source, expert_count, expert_offset, o_pool, scale_stride_, max_rows_;

  EPMOE_HD int64_t flag_offset(int flag, int rank) const { return CommSymLayout{}.flag_offset(flag, rank); }
  EPMOE_HD int64_t counts_offset() const { return counts; }
  EPMOE_HD int64_t stage_x_offset() const { return stage_x; }
  EPMOE_HD int64_t stage_scale_offset() const { return stage_scale; }
  EPMOE_HD int64_t stage_meta_offset() const { return stage_meta; }
  EPMOE_HD int64_t partials_offset() const { return partials; }
  EPMOE_HD int64_t counts_stride() const { return counts_stride_; }
  EPMOE_HD int64_t partial_row_bytes() const { return partial_row_bytes_; }

  EPMOE_HD int64_t status_offset() const { return CommLocalLayout{}.status_offset(); }
  EPMOE_HD int64_t grid_barrier_offset() const { return CommLocalLayout{}.grid_barrier_offset(); }
  EPMOE_HD int64_t dispatch_arrive_offset() const { return CommLocalLayout{}.dispatch_arrive_offset(); }
  EPMOE_HD int64_t combine_arrive_offset() const { return CommLocalLayout{}.combine_arrive_offset(); }
  EPMOE_HD int64_t dispatch_epoch_offset() const { return CommLocalLayout{}.dispatch_epoch_offset(); }
  EPMOE_HD int64_t combine_epoch_offset() const { return CommLocalLayout{}.combine_epoch_offset(); }
  EPMOE_HD int64_t combine_done_arrive_offset() const { return CommLocalLayout{}.combine_done_arrive_offset(); }
  EPMOE_HD int64_t routing_report_offset() const { return CommLocalLayout{}.routing_report_offset(); }
  EPMOE_HD int64_t cursor_offset() const { return cursor; }
  EPMOE_HD int64_t token_rows_offset() const { return token_rows; }
  EPMOE_HD int64_t recv_tokens_offset() const { return recv_tokens; }
  EPMOE_HD int64_t mblock_ready_offset() const { return mblock_ready; }
  EPMOE_HD int64_t mblock_arrive_offset() const { return mblock_arrive; }
  EPMOE_HD int64_t tile_claim_offset() const { return tile_claim; }
  EPMOE_HD int64_t split_exchange_offset() const { return split_exchange; }
  EPMOE_HD int64_t mblock_ready_count() const { return mblock_ready_count_; }

  EPMOE_HD int64_t x_pool_offset() const { return x_pool; }
  EPMOE_HD int64_t x_scale_offset() const { return x_scale; }
  EPMOE_HD int64_t row_weight_offset() const { return row_weight; }
  EPMOE_HD int64_t row_source_offset() const { return row_source; }
  EPMOE_HD int64_t expert_count_offset() const { return expert_count; }
  EPMOE_HD int64_t expert_offset_offset() const { return expert_offset; }
  EPMOE_HD int64_t o_pool_offset() const { return o_pool; }
  EPMOE_HD int64_t scale_stride() const { return scale_stride_; }
  EPMOE_HD int64_t max_rows() const { return max_rows_; }
};

// The host's side of CommOffsets: the layouts' own values, once.
inline CommOffsets comm_offsets(const CommShape& s, const ExpertPoolLayout& pool) {
  const CommSymLayout sym{s};
  const CommLocalLayout loc{s};
  CommOffsets o{};
  o.counts = sym.counts_offset();
  o.stage_x = sym.stage_x_offset();
  o.stage_scale = sym.stage_scale_offset();
  o.stage_meta = sym.stage_meta_offset();
  o.partials = sym.partials_offset();
  o.counts_stride_ = sym.counts_stride();
  o.partial_row_bytes_ = sym.partial_row_bytes();
  o.cursor = loc.cursor_offset();
  o.token_rows = loc.token_rows_offset();
  o.recv_tokens = loc.recv_tokens_offset();
  o.mblock_ready = loc.mblock_ready_offset();
  o.mblock_arrive = loc.mblock_arrive_offset();
  o.tile_claim = loc.tile_claim_offset();
  o.split_exchange = loc.split_exchange_offset();
  o.mblock_ready_count_ = loc.mblock_ready_count();
  o.x_pool = pool.x_pool_offset();
  o.x_scale = pool.x_scale_offset();
  o.row_weight = pool.row_weight_offset();
  o.row_source = pool.row_source_offset();
  o.expert_count = pool.expert_count_offset();
  o.expert_offset = pool.expert_offset_offset();
  o.o_pool = pool.o_pool_offset();
  o.scale_stride_ = pool.scale_stride();
  o.max_rows_ = pool.max_rows();
  return o;
}

// The expert pool that a dispatch with this shape fills (a_pool sized for `intermediate`).
inline ExpertPoolShape pool_shape_for(const CommShape& s, int intermediate, int row_align) {
  return ExpertPoolShape{s.num_ranks, s.experts_per_rank(), s.hidden, intermediate, s.topk, s.max_tokens, row_align, s.fp8};
}

}  // namespace epmoe::layout
