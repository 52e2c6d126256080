// Host heuristics: every host-side tuning choice of the layer and of the comm kernels in one
// struct (Tuning), filled per call by the functions below from the call's shape. The choices were
// measured (docs/DESIGN.md, docs/MEGAKERNEL.md, docs/COMM.md say where); nothing here changes what
// a call computes, only how it is scheduled.
//
// Overrides (TuningOverrides) exist for A/B measurements and tests only: the library never reads
// the environment. The benchmark and the test binaries read their EPMOE_* variables and set the
// process-wide overrides through set_tuning_overrides before they create a layer or a dispatch
// handle; both take a copy at create (later changes reach only handles created later).
#pragma once

#include <cstdint>

namespace epmoe::heuristics {

// The megakernel's tile order (the values of fused::FusedMoeParams::claim_tiles).
enum class ClaimTiles : int { kNever = 0, kAlways = 1, kBeyondGrid = 2 };

// What one forward call (and one standalone dispatch or combine launch) runs with.
struct Tuning {
  // The GEMMs' weight tiles of single-m-block experts go through L2 with an evict-first policy
  // (GroupedGemmParams::weights_evict_first), in both paths.
  bool weights_evict_first = false;
  // The megakernel's throughput variant (full tiles stored by a storer thread with TMA) instead of
  // its decode variant (the math warpgroups' inline store).
  bool fused_deferred_epilogue = false;
  // K blocks of its first L1 weight tile each megakernel block prefetches into L2 during the pull.
  int fused_prefetch_k_blocks = 0;
  // The megakernel's producers load a tile's weights before its rows are ready (B-first).
  bool fused_b_first = false;
  // How the megakernel's blocks take their GEMM tiles (fused::FusedMoeParams::claim_tiles):
  // never claimed (the static order), always claimed from a grid-wide counter, or claimed only
  // when the call's L1 tiles exceed the grid (decided in the kernel from the segment layout).
  ClaimTiles fused_claim_tiles = ClaimTiles::kNever;
  // The megakernel's decode variant may run each L1 tile as two halves of 64 channels on two blocks
  // (fused::FusedMoeParams::l1_split; the kernel splits calls of at most two waves of L1 tiles).
  bool fused_l1_split = false;
  // Path::kAuto takes the megakernel for this call (if the layer has it).
  bool auto_fused = false;
};

// The layer's shape, as far as the choices depend on it.
struct LayerShape {
  int topk = 0;
  int experts_per_rank = 0;
  int hidden = 0;  // H, the L1 GEMM's K
};

// The megakernel splits L1 tiles (Tuning::fused_l1_split) in layers of at least this H.
inline constexpr int kL1SplitMinHidden = 4096;

// The comm kernels' shape: the grid's upper bound and the work per token.
struct CommShape {
  int num_ranks = 0;
  int hidden = 0;
  int max_blocks = 0;         // the SM count, or DispatchConfig::num_blocks when that is smaller
  bool fixed_blocks = false;  // DispatchConfig::num_blocks > 0: always max_blocks
};

// Forced choices (A/B measurements, tests). A negative value, or fused_epilogue 0 / comm_blocks 0,
// leaves the heuristic's choice.
struct TuningOverrides {
  int fused_epilogue = 0;            // 1: the decode (inline) variant, 2: the deferred one
  int fused_prefetch_k_blocks = -1;  // 0..64
  int fused_b_first = -1;            // 0 or 1
  int fused_claim_tiles = -1;        // 0 never, 1 always, 2 beyond the grid (ClaimTiles)
  int fused_l1_split = -1;           // 0 or 1
  int comm_blocks = 0;               // > 0: caps the dispatch and combine grids
  int auto_fused_max_tokens = -1;    // >= 0: Path::kAuto takes the megakernel up to this many tokens
};

// Path::kAuto takes the megakernel up to this many local tokens per call, the pipeline above
// (measured crossovers: docs/DESIGN.md, "Path::kAuto").
inline constexpr int64_t kAutoFusedMaxTokens = 512;

// The per-call choices of a forward call of num_tokens local tokens.
Tuning choose_layer_tuning(const LayerShape& s, int64_t num_tokens, const TuningOverrides& o);

// The grid of a standalone dispatch or combine launch of `tokens` tokens whose blocks have
// warps_per_block warps.
int choose_comm_blocks(const CommShape& s, int64_t tokens, int warps_per_block, const TuningOverrides& o);

}  // namespace epmoe::heuristics

namespace epmoe::detail {

// Process-wide overrides (benchmark and tests only; thread-safe). MoELayer::create and
// DispatchHandle::create copy them.
void set_tuning_overrides(const heuristics::TuningOverrides& o);
heuristics::TuningOverrides tuning_overrides();

#ifdef EPMOE_TEST_HOOKS
// Test hooks, compiled only with -DEPMOE_TEST_HOOKS=ON (tools/test.sh, tools/stage_gpu.sh); -1
// (the default): off. Each is read by the call named (the create calls read theirs once).
// never_arrive: the DispatchHandle created on this rank launches no dispatch, combine or fused
// kernel, so its peers' bounded waits expire (DispatchHandle::create).
void set_debug_never_arrive_rank(int rank);
int debug_never_arrive_rank();
// stall_gemm: the GEMM producers of the layer created on this rank issue nothing, so its GEMM
// pipeline waits expire (MoELayer::create).
void set_debug_stall_gemm_rank(int rank);
int debug_stall_gemm_rank();
// fail_create: MoELayer::create on this rank fails after its local allocations, as an out-of-memory
// error would (MoELayer::create).
void set_debug_fail_create_rank(int rank);
int debug_fail_create_rank();
// fail_symmetric: Communicator::alloc_symmetric on this rank fails at `step` as that call would (1:
// ncclMemAlloc, 2: the window registration, after it registered, 3: the peer pointers, 4: the
// NVLink write check reads a wrong tag); read at each call. rank -1: off.
void set_debug_fail_symmetric(int rank, int step);
void debug_fail_symmetric(int* rank, int* step);
#endif

}  // namespace epmoe::detail
