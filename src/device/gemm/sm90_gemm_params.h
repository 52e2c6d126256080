// Arguments of the sm90 grouped GEMM kernels, shared by the host launchers and the kernels.
// Plain data only, so host-only translation units can fill it.
#pragma once

#include <cstdint>

#include "device/layout/error_record.h"

namespace epmoe::gemm {

// The tile every grouped GEMM kernel computes: 128 pool rows x 256 weight rows (B rows), as two
// math warpgroups of 64 rows x 256 columns each. Why 256 columns: the L1 epilogue needs the 128
// gate and the 128 up columns of one output group in the same thread (gate in columns 0..127,
// up in 128..255 of the tile, see the W1 interleave in docs/GEMM.md). Why 128 rows: a larger
// tile halves the L2->SM traffic per FLOP against 64 x 256, which bounded the first version.
inline constexpr int kBlockM = 128;
inline constexpr int kBlockN = 256;
inline constexpr int kWarpgroupM = 64;  // wgmma M of one warpgroup
inline constexpr int kHalfN = 128;      // FP8 promotes the tile's N in two halves of 128 (or four quarters)
inline constexpr int kScaleBlock = 128;  // FP8 weight scales cover 128 x 128, activation scales 1 x 128

struct GroupedGemmParams {
  int num_groups;
  const int* expert_count;   // [num_groups] valid rows of each expert (device)
  const int* expert_offset;  // [num_groups + 1] first pool row of each expert, multiples of kBlockM
  int n;                     // B rows per expert: L1 2*I (gate/up interleaved), L2 H
  int k;                     // reduction length: L1 H, L2 I

  const float* a_scale;  // FP8: [k/128][scale_stride] MN-major activation scales
  int64_t scale_stride;
  const float* b_scale;  // FP8: [num_groups][n/128][k/128] weight block scales

  void* out;       // L2: bf16 [rows][n]; L1: fp8 or bf16 [rows][n/2]
  int64_t out_ld;  // elements
  float* out_scale;          // L1 FP8: [n/256][scale_stride]
  const float* row_weight;   // L1: [rows] routing weight of each pool row
  float clamp;               // L1: > 0 enables the SwiGLU clamp
  int pow2_scales;           // L1 FP8: round requant scales up to powers of two
  // Per call (0 in a plan): the weight tiles of experts with a single m-block are loaded with an
  // L2 evict-first policy (gemm::Sm90TmaProducer::load_b). Set for the smallest decode calls.
  int weights_evict_first;
  // The bound of every pipeline wait and where a timeout reports (pipeline/sm90_watchdog.cuh).
  // The layer sets it from LayerConfig::timeout_seconds and its error record; zero: the default
  // bound, no record.
  layout::WatchdogParams watchdog;
};

}  // namespace epmoe::gemm
