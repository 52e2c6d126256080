#include "host/heuristics.h"

#include <mutex>

namespace epmoe::heuristics {

namespace {

// The smallest decode calls: an expert holds at most one row on average (num_tokens x topk <=
// experts_per_rank, with every rank at num_tokens), so the pull is a few units, the weight
// stream is the critical path and every weight tile is read once. Both paths then load weights
// with an L2 evict-first policy (gemm::launch), and the megakernel's producers load a tile's
// weights before its rows are ready (B-first). Measured at R = 1 (docs/DESIGN.md): each
// gains at 1 token and costs at 8 or 128.
bool tiny_call(const LayerShape& s, int64_t num_tokens) {
  return num_tokens * s.topk <= int64_t(s.experts_per_rank);
}

}  // namespace

Tuning choose_layer_tuning(const LayerShape& s, int64_t num_tokens, const TuningOverrides& o) {
  Tuning t;
  const bool tiny = tiny_call(s, num_tokens);
  t.weights_evict_first = tiny;
  // The megakernel's variant: the throughput variant (TMA stores of full tiles by a storer thread)
  // once an expert holds 256 rows on average (num_tokens x topk / experts_per_rank, with every rank
  // at num_tokens), i.e. most tiles are full; below that most tiles are partial, which only the
  // inline store handles, and the decode variant spills less (docs/MEGAKERNEL.md, Configuration per
  // call; docs/DESIGN.md).
  t.fused_deferred_epilogue = o.fused_epilogue != 0 ? o.fused_epilogue == 2
                                                    : num_tokens * s.topk >= int64_t(256) * s.experts_per_rank;
  // Why no prefetch: since the GEMM tiles wait for their rows and not for a grid barrier, the
  // prefetch's 34 MB (8 K blocks) only delayed the pull; no prefetch was fastest of 0-16 K blocks
  // at 1, 8 and 128 tokens at R = 1, and faster than 8 at R = 4 (docs/DESIGN.md, "The
  // megakernel's schedule").
  t.fused_prefetch_k_blocks = o.fused_prefetch_k_blocks >= 0 ? o.fused_prefetch_k_blocks : 0;
  t.fused_b_first = o.fused_b_first >= 0 ? o.fused_b_first == 1 : tiny;
  // Claims, measured at R = 1 (three rounds, docs/DESIGN.md, "The megakernel's schedule"): they
  // took 90 us off 4096 tokens, 70 off 8192, 35 off 1024 and 17 off 8; in tiny calls whose L1
  // tiles fit one wave they were 2-10 us slower at 1-2 tokens (means of two calls; also with each
  // block's first tile static) and level at 4, so tiny calls claim only when their L1 tiles exceed
  // the grid, which the kernel reads from its segment layout: at R = 4 (4x H100) the DSV3 slice at
  // 2 tokens (~12.5 active experts x 16 tiles) was 12-16 us faster with claims.
  t.fused_claim_tiles = o.fused_claim_tiles >= 0 && o.fused_claim_tiles <= 2 ? ClaimTiles(o.fused_claim_tiles)
                        : tiny ? ClaimTiles::kBeyondGrid
                               : ClaimTiles::kAlways;
  // Split L1 units in layers whose L1 tiles are long (H >= 4096: 32 K blocks or more). Measured on
  // 4x H200 at R = 4 and 2 (docs/DESIGN.md, "The megakernel's schedule"): one DSV3 token (H 7168,
  // 56 K blocks) 4-8 us faster; the Qwen3-like shape (H 2048, 16 K blocks) level at one token and
  // 1-7 us slower at 2-128 tokens, where a half tile's exchange and second epilogue cost more than
  // its shorter stream saves.
  t.fused_l1_split = o.fused_l1_split == 0 || o.fused_l1_split == 1 ? o.fused_l1_split == 1
                                                                  : s.hidden >= kL1SplitMinHidden;
  // Path::kAuto, per rank from its own T (the paths are interchangeable per rank: the same comm
  // protocol, bitwise the same y). Measured on 4x H200 at R = 4 and 2 (docs/DESIGN.md, "Path::kAuto"):
  // the megakernel is faster up to 512 tokens on the DSV3 slice and up to 1280 on the Qwen3-like
  // shape, slower from 1024 and 1536; 512 serves both. One launch also costs the host ~3 us against
  // the pipeline's four at ~15 us, which decode calls pay in full.
  t.auto_fused = num_tokens <= (o.auto_fused_max_tokens >= 0 ? int64_t(o.auto_fused_max_tokens) : kAutoFusedMaxTokens);
  return t;
}

// Why fewer blocks for few tokens: every block pays for the grid barrier, the flag waits and a
// system-scope fence; a small call has too little work to hide that. Any size is correct.
int choose_comm_blocks(const CommShape& s, int64_t tokens, int warps_per_block, const TuningOverrides& o) {
  if (s.fixed_blocks) return s.max_blocks;
  if (o.comm_blocks > 0) return o.comm_blocks < s.max_blocks ? o.comm_blocks : s.max_blocks;
  // About one warp per (token, rank, 1024-channel slice): the kernels' unit of work.
  const int64_t slices = (s.hidden + 1023) / 1024;
  const int64_t want = (tokens * s.num_ranks * slices + warps_per_block - 1) / warps_per_block;
  return int(want < 16 ? 16 : (want > s.max_blocks ? s.max_blocks : want));
}

}  // namespace epmoe::heuristics

namespace epmoe::detail {

namespace {
std::mutex g_mu;
heuristics::TuningOverrides g_overrides;
#ifdef EPMOE_TEST_HOOKS
int g_never_arrive_rank = -1;
int g_stall_gemm_rank = -1;
int g_fail_create_rank = -1;
int g_fail_symmetric_rank = -1;
int g_fail_symmetric_step = 0;
#endif
}  // namespace

void set_tuning_overrides(const heuristics::TuningOverrides& o) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_overrides = o;
}

heuristics::TuningOverrides tuning_overrides() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_overrides;
}

#ifdef EPMOE_TEST_HOOKS
void set_debug_never_arrive_rank(int rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_never_arrive_rank = rank;
}

int debug_never_arrive_rank() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_never_arrive_rank;
}

void set_debug_stall_gemm_rank(int rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_stall_gemm_rank = rank;
}

int debug_stall_gemm_rank() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stall_gemm_rank;
}

void set_debug_fail_create_rank(int rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_create_rank = rank;
}

int debug_fail_create_rank() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_fail_create_rank;
}

void set_debug_fail_symmetric(int rank, int step) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_symmetric_rank = rank;
  g_fail_symmetric_step = step;
}

void debug_fail_symmetric(int* rank, int* step) {
  std::lock_guard<std::mutex> lock(g_mu);
  *rank = g_fail_symmetric_rank;
  *step = g_fail_symmetric_step;
}
#endif

}  // namespace epmoe::detail
