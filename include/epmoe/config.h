// epmoe: the layer configuration and its validation.
#pragma once

#include <cstdint>

#include "epmoe/status.h"

namespace epmoe {

/// Numeric mode of the layer (see SPEC.md).
enum class DType {
  kFP8,   ///< e4m3 activations with 1x128 scales, e4m3 weights with 128x128 scales.
  kBF16,  ///< bf16 activations and weights.
};

/// Precision of the per-(token, expert rank) partial sums that combine sends back: each expert
/// rank first adds the outputs of a token's experts that it holds (in fp32), then sends that one
/// partial to the token's rank, which adds the partials in fp32 and writes y in bf16.
enum class PartialPrecision {
  kFloat32,   ///< fp32 partials: y differs from the SPEC summation only by fp32 reassociation.
  kBFloat16,  ///< bf16 partials: half the NVLink bytes of combine, one extra bf16 rounding of each
              ///< partial (relative 2^-9), within SPEC's accuracy bound.
};

/// Which implementation a forward call runs. All compute the same function, bitwise: y does not
/// depend on the path, and ranks may take different paths in the same call.
enum class Path {
  kPipeline,  ///< dispatch -> L1 + SwiGLU -> L2 -> combine, a chain of kernels.
  kFused,     ///< the persistent megakernel.
  kAuto,      ///< per call and rank from its own token count: the megakernel up to 512 tokens (faster
              ///< there on the shapes measured, and one launch instead of four), the pipeline above;
              ///< the pipeline wherever the megakernel is unavailable.
};

/// Integer type of a forward call's topk_idx.
enum class IndexType {
  kInt32,  ///< int32 (4-byte aligned).
  kInt64,  ///< int64, as torch.topk returns it (8-byte aligned). A value outside [-1, E) is masked
           ///< and reported like an int32 one; it is never narrowed into range.
};

/// Shapes and options of one MoE layer, identical on every rank.
struct LayerConfig {
  int num_ranks = 0;            ///< R, one GPU each. 1..8 on one NVLink node.
  int num_experts = 0;          ///< E in total; E % R == 0, rank r owns [r*E/R, (r+1)*E/R).
  int hidden = 0;               ///< H, a positive multiple of 128.
  int intermediate = 0;         ///< I of one expert, a positive multiple of 128.
  int topk = 0;                 ///< K, 1 <= K <= E.
  int max_tokens_per_rank = 0;  ///< T_max, >= 1; every call has 0 <= T_r <= T_max.
  DType dtype = DType::kFP8;
  float activation_clamp = 0.f;  ///< c; <= 0 disables the clamp. Must be finite.
  bool pow2_scales = false;      ///< Round FP8 activation scales up to a power of two.
  /// Combine's partial sums: fp32 (default) or bf16 (half the combine bytes over NVLink).
  PartialPrecision combine_partials = PartialPrecision::kFloat32;
  /// Bound of every wait, in seconds, (0, 3600]: the device-side waits (for a peer's flags, the
  /// grid and cross-rank barriers, the GEMM pipelines' stages and readiness counters) and the
  /// host-side collectives of create, destroy and strict mode. A device wait that expires records
  /// who waited on what (rank, block, warp role, the word, expected and seen values) in host memory
  /// and traps: the next forward (or check_device_error) returns that line as kTimeout, and the
  /// CUDA context is lost. A last resort against hangs: it must exceed the longest time one rank's
  /// host may lag behind the others.
  double timeout_seconds = 10.0;
  /// Debugging aid, off by default: every forward copies its topk_idx to the host, checks it and
  /// agrees with every rank before launching (each rank returns kInvalidArgument naming the rank and
  /// the slot, and none launches). It synchronizes the stream and all ranks, so it is slow and cannot
  /// be captured in a CUDA graph. Without it, a bad index masks its slot and the next forward on
  /// that rank returns the error.
  bool strict_routing = false;

  int experts_per_rank() const { return num_ranks > 0 ? num_experts / num_ranks : 0; }
};

/// Upper limits that validation enforces (the kernels' index arithmetic and buffers rely on them).
struct Limits {
  static constexpr int kMaxRanks = 8;
  static constexpr int kMaxExpertsPerRank = 1024;
  static constexpr int kMaxTopK = 32;
  static constexpr int kMaxHidden = 32768;
  static constexpr int kMaxIntermediate = 32768;
  static constexpr int kMaxTokensPerRank = 1 << 20;
};

/// Checks every field of `cfg`. The message names the field, its value and the allowed range.
Status validate(const LayerConfig& cfg);

/// Checks the per-call arguments that the host knows without reading device memory:
/// the token count against T_max, that the pointers needed for `num_tokens` are set, and their
/// alignment (x and y 16 bytes, topk_idx and topk_weights 4 bytes).
Status validate_call(const LayerConfig& cfg, int64_t num_tokens, const void* x,
                     const void* topk_idx, const void* topk_weights, const void* y);

/// The same for a topk_idx of type `idx_type` (int64 must be 8-byte aligned).
Status validate_call(const LayerConfig& cfg, int64_t num_tokens, const void* x, const void* topk_idx,
                     IndexType idx_type, const void* topk_weights, const void* y);

/// Checks a routing table held in host memory: every index in [-1, E). Costs a pass over
/// T*K integers; the forward path itself never reads device data on the host.
Status validate_routing_host(const LayerConfig& cfg, int64_t num_tokens, const int32_t* topk_idx);
Status validate_routing_host(const LayerConfig& cfg, int64_t num_tokens, const int64_t* topk_idx);

}  // namespace epmoe
