// epmoe: the MoE layer.
//
// A layer is created once per rank from a Communicator and a LayerConfig, loads its local
// experts' weights once (a one-time transform into the kernels' layout, see docs/LAYOUTS.md),
// then runs forward() any number of times on the same buffers. forward() never waits on the
// host for device data, so it can be captured in a CUDA graph.
//
// Collective calls (every rank, same order): create, forward, and the destructor. Each host-side
// collective step is bounded by LayerConfig::timeout_seconds, and every device-side wait too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epmoe/config.h"
#include "epmoe/status.h"

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

  /// Collective: agrees with every rank (bounded by timeout_seconds) before it frees the symmetric
  /// memory. A rank whose peers never destroy their layers logs the timeout to stderr, leaks the
  /// memory, and leaves the communicator unusable: its next collective call returns that cause.
  /// After a device wait of this layer timed out (the context is lost) it frees nothing and
  /// returns at once.
  virtual ~MoELayer() = default;

  /// Copies and transforms this rank's local experts into the kernels' layout.
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

  /// The explicit check: synchronizes `stream` and reports an error the device recorded since the
  /// last check or forward (a bad expert index, a wait that timed out). Not for the forward path.
  virtual Status check_device_error(cudaStream_t stream) = 0;

  virtual const LayerConfig& config() const = 0;
};

}  // namespace epmoe
