// epmoe: the MoE layer.
//
// A layer is created once per rank from a Communicator and a LayerConfig, loads its local
// experts' weights once (a one-time transform into the kernels' layout, see docs/LAYOUTS.md),
// then runs forward() any number of times on the same buffers. forward() never waits on the
// host for device data, so it can be captured in a CUDA graph.
//
// A layer runs on a Workspace (epmoe/workspace.h): its own private one (create(comm, cfg)), or one
// shared by many layers (create(workspace, cfg, ...)), which allocates nothing on the device but
// small per-layer metadata when the layer references the caller's weights (ExpertWeightRefs).
//
// Collective calls (every rank, same order): create, forward, and the destructor of a layer that
// holds the last share of its workspace. Each host-side collective step is bounded by
// LayerConfig::timeout_seconds, and every device-side wait too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epmoe/config.h"
#include "epmoe/status.h"
#include "epmoe/workspace.h"

namespace epmoe {

class Communicator;

/// Local experts' weights as the user holds them (SPEC.md layout), in host or device memory.
/// FP8: w1 e4m3 [E_loc][2I][H] with scales fp32 [E_loc][2I/128][H/128]; w2 e4m3 [E_loc][H][I]
/// with scales fp32 [E_loc][H/128][I/128]. BF16: w1 bf16 [E_loc][2I][H], w2 bf16 [E_loc][H][I],
/// scales null. Rows 0..I-1 of each W1 are the gate projection, rows I..2I-1 the up projection.
struct ExpertWeights {
  const void* w1 = nullptr;
  const float* w1_scale = nullptr;
  const void* w2 = nullptr;
  const float* w2_scale = nullptr;
  bool on_device = false;
};

/// Weights by reference: device pointers on the layer's device that the layer reads on every
/// forward and never copies; they must stay allocated and unchanged while the layer lives.
/// FP8: w13 e4m3 [E_loc][2I][H] in the kernels' layout (transform_w13's output: gate/up 128-row
/// blocks interleaved) with w13_scale fp32 [E_loc][2I/128][H/128] (transformed the same way);
/// w2 e4m3 [E_loc][H][I] with w2_scale fp32 [E_loc][H/128][I/128], exactly the checkpoint layout
/// (docs/LAYOUTS.md names the DeepSeek-V3 and Qwen3 tensors). BF16: bf16, scales null.
/// w13 and w2 16-byte aligned, scales 4-byte aligned.
struct ExpertWeightRefs {
  const void* w13 = nullptr;
  const float* w13_scale = nullptr;
  const void* w2 = nullptr;
  const float* w2_scale = nullptr;
};

/// Bytes of transform_w13's outputs for E_loc experts of shape (I, H): the weights and (FP8) the
/// scales. The same as the inputs' sizes.
struct W13Bytes {
  int64_t weight = 0;
  int64_t scale = 0;
};
W13Bytes w13_transform_bytes(DType dtype, int experts_per_rank, int intermediate, int hidden);

/// The one-time W1 transform (docs/GEMM.md, "The W1 interleave"): w13 in the checkpoint layout
/// (per expert rows 0..I-1 gate_proj, I..2I-1 up_proj; FP8 with its [2I/128][H/128] scales) into
/// the kernels' layout, written to `out` / `out_scale` (device memory the caller owns, sizes from
/// w13_transform_bytes, not aliasing the inputs). Stream-ordered, no sync, no allocation.
Status transform_w13(DType dtype, const void* w13, const float* w13_scale, void* out, float* out_scale,
                     int experts_per_rank, int intermediate, int hidden, cudaStream_t stream);

/// One forward call's arguments (device pointers).
struct ForwardArgs {
  const void* x = nullptr;              ///< [T][H] bf16, 16-byte aligned
  const void* topk_idx = nullptr;       ///< [T][K] int32 or int64 (idx_type), each in [-1, E)
  IndexType idx_type = IndexType::kInt32;
  const float* topk_weights = nullptr;  ///< [T][K] fp32
  void* y = nullptr;                    ///< [T][H] bf16, 16-byte aligned
  int64_t num_tokens = 0;               ///< T of this rank, 0 <= T <= T_max
  /// Optional [E_loc] int32: per local expert, the rows it received in this call (from every
  /// rank; one row per (token, slot)), written on the stream after the call, no host sync.
  int32_t* expert_counts = nullptr;
  /// Optional [E_loc] int64: the same counts added on (a running sum across calls; the caller
  /// zeroes it when it wants to start over).
  int64_t* expert_counts_total = nullptr;
};

class MoELayer {
 public:
  /// Validates `cfg` (see validate()) against the communicator's rank count and allocates every
  /// buffer a forward call needs, sized from cfg.max_tokens_per_rank. Collective: every rank
  /// calls it with the same cfg. If any rank fails (a bad config, a null `out`, out of memory, a
  /// GEMM plan), every rank returns an error naming the failing ranks and their causes, and frees
  /// what it allocated; a rank that does not arrive within cfg.timeout_seconds makes the others
  /// return kTimeout (the communicator is then unusable). The layer keeps a share of the
  /// communicator's state, so it stays valid even if `comm` is destroyed first.
  static Status create(Communicator& comm, const LayerConfig& cfg, std::unique_ptr<MoELayer>* out);

  /// A layer on a shared workspace: checks that cfg fits it (check_fits: the message names the
  /// field), agrees on cfg across ranks and plans the GEMMs. Collective (every rank, same cfg).
  /// With `weights` the layer references the caller's weights (no copy, no device allocation
  /// beyond small metadata; load_weights is then an error); without, it allocates its weights and
  /// load_weights copies them in. The layer holds a share of the workspace's buffers.
  static Status create(Workspace& workspace, const LayerConfig& cfg, std::unique_ptr<MoELayer>* out,
                       const ExpertWeightRefs* weights = nullptr);

  /// Collective when it holds the last share of its workspace's buffers: agrees with every rank
  /// (bounded by timeout_seconds) before it frees the symmetric memory. A rank whose peers never
  /// destroy their layers logs the timeout to stderr, leaks the memory, and leaves the communicator
  /// unusable: its next collective call returns that cause. After a device wait of this layer
  /// timed out (the context is lost) it frees nothing and returns at once.
  virtual ~MoELayer() = default;

  /// Copies and transforms this rank's local experts into the kernels' layout (layers created
  /// without ExpertWeightRefs).
  virtual Status load_weights(const ExpertWeights& weights, cudaStream_t stream) = 0;

  /// y[T][H] bf16 = the MoE layer of SPEC.md on x[T][H] bf16, topk_idx[T][K] int32,
  /// topk_weights[T][K] fp32, all device pointers. Collective: every rank calls it (T may be 0).
  /// Host-side checks run before any launch. Never synchronizes (except in strict_routing mode).
  ///
  /// Errors found on the device come back without a sync, from host memory the kernels write:
  /// - an out-of-range expert index masks its slot (the call completes); the next forward on this
  ///   rank that finds the report runs as usual and then returns kInvalidArgument naming the
  ///   earlier call, token, slot and value (once; not while `stream` is capturing a graph, where
  ///   an error would end this rank's capture only). That call has run on every rank: do not
  ///   repeat it (a repeat on one rank only would leave its peers waiting);
  /// - a device-side wait that timed out (its kernel trapped; the context is lost): the next
  ///   forward returns kTimeout with the record's line (rank, block, thread, role, the word waited
  ///   on, expected and seen) without launching.
  ///
  /// Calls are serialized whatever streams they come on: each call waits for the end of the
  /// previous one (an event, also under CUDA graph capture and across graph replays), so one
  /// layer may be used from several streams; its calls do not run concurrently.
  virtual Status forward(const void* x, const int32_t* topk_idx, const float* topk_weights,
                         void* y, int64_t num_tokens, cudaStream_t stream, Path path) = 0;
  /// The same with int32 or int64 routing and the optional expert counts (ForwardArgs).
  virtual Status forward(const ForwardArgs& args, cudaStream_t stream, Path path) = 0;

  /// The explicit check: synchronizes `stream` and reports an error the device recorded since the
  /// last check or forward (a bad expert index, a wait that timed out). Not for the forward path.
  virtual Status check_device_error(cudaStream_t stream) = 0;

  virtual const LayerConfig& config() const = 0;

  /// The path this rank's last forward call chose: kPipeline or kFused (Path::kAuto's choice), also
  /// when its launch then failed; a call rejected by its argument checks leaves it as it was. On the
  /// host, no sync; kPipeline before the first call.
  virtual Path last_path() const = 0;
};

}  // namespace epmoe
