// Host-callable entry points of the fused MoE megakernel (one translation unit per dtype keeps
// the heavy template instantiations apart). Called by src/host/layer.cpp.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "device/comm/dispatch_params.h"
#include "device/gemm/sm90_gemm_params.h"

namespace epmoe::fused {

// Everything one fused call needs besides its tensor maps (FusedMoeMaps): the standalone kernels'
// params, unchanged (built by the DispatchHandle and the GEMM plans), so both paths read the same buffers.
struct FusedMoeParams {
  comm::DispatchParams dispatch;
  gemm::GroupedGemmParams l1;
  gemm::GroupedGemmParams l2;
  comm::CombineParams combine;
  // Optional (nullptr = off; the benchmark's stage timing): kFusedPhaseCount globaltimer stamps,
  // zeroed by the host before the call. Slots marked "first" hold ~t of the earliest block (so
  // that one atomicMax serves both), the others t of the latest block.
  unsigned long long* phase_ts;
  // Tuning, chosen by the host per call (docs/MEGAKERNEL.md, Configuration per call; the reasons
  // in docs/DESIGN.md, "The megakernel's schedule"):
  // prefetch_k_blocks: K blocks of its first L1 weight tile that each block asks L2 for once the
  //   expert segments are known (0: none);
  // b_first: a GEMM producer whose tile's rows are not ready yet loads the tile's weights first
  //   (gemm::Sm90TmaProducer::run);
  // claim_tiles: each block claims its GEMM tiles from a grid-wide counter instead of taking them
  //   in the static order (gemm::Sm90TmaProducer::run): kClaimNever, kClaimAlways, or
  //   kClaimBeyondGrid (claims only when this call's L1 tiles exceed the grid, which every block
  //   reads from its own copy of the segment layout, so that all blocks agree).
  // l1_split: the FP8 decode variant may run each L1 tile as two halves of 64 channels on two
  //   blocks (decided in the kernel: calls of at most two waves of L1 tiles; docs/MEGAKERNEL.md).
  int prefetch_k_blocks;
  int b_first;
  int claim_tiles;
  int l1_split;
};

// FusedMoeParams::claim_tiles.
inline constexpr int kClaimNever = 0;
inline constexpr int kClaimAlways = 1;
inline constexpr int kClaimBeyondGrid = 2;

// Phase stamps of one fused call (see FusedMoeParams::phase_ts).
enum FusedPhase : int {
  kPhaseStart = 0,         // first block starts (~t)
  kPhaseDispatchDone = 1,  // last block leaves the dispatch -> GEMM grid barrier
  kPhaseL1Done = 2,        // last math warpgroup finishes its L1 tiles
  kPhaseL2Done = 3,        // last math warpgroup finishes its L2 tiles
  kPhaseCombineStart = 4,  // last block leaves the GEMM -> combine grid barrier
  kPhaseEnd = 5,           // last block finishes combine
  kFusedPhaseCount = 6
};

// Sets the kernel's dynamic shared-memory attribute on `device` (which must be current) and
// returns in *grid the cooperative grid: SM count x resident blocks per SM from the occupancy
// API (1 with the GEMM's ~195 KB ring). Thread-safe; cheap after the first call per device.
cudaError_t configure_sm90_fused_moe_fp8(int device, int* grid);
cudaError_t configure_sm90_fused_moe_bf16(int device, int* grid);

// The tensor maps of one fused call, as built by the GEMM plans: a1/b1 L1's operands (pool x
// rows, W1'), a2/b2 L2's (pool a rows, W2), d1/d2 the L1 / L2 output pools as the deferred
// epilogues store them (d1 is read only by the FP8 kernel: the fused BF16 L1 stores inline).
struct FusedMoeMaps {
  CUtensorMap a1, b1, a2, b2, d1, d2;
  CUtensorMap a1_64, a2_64;  // a1 / a2 with 64-row boxes (tiles of at most 64 rows; GemmPlan::map_a64)
  CUtensorMap b1_64;         // b1 with 64-row boxes (the split L1 units; GemmPlan::map_b64)
};

// One cooperative cudaLaunchKernelEx; returns its result and makes no other CUDA call.
// deferred: the throughput variant (full tiles stored by the deferred epilogues' storer thread)
// instead of the decode variant (inline stores); see FusedMoeConfig.
cudaError_t launch_sm90_fused_moe_fp8(const FusedMoeMaps& maps, const FusedMoeParams& p, bool deferred, int grid,
                                      cudaStream_t stream);
cudaError_t launch_sm90_fused_moe_bf16(const FusedMoeMaps& maps, const FusedMoeParams& p, bool deferred, int grid,
                                       cudaStream_t stream);

}  // namespace epmoe::fused
