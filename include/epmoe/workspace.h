// epmoe: one workspace, many layers.
//
// A Workspace holds every device buffer a forward call needs (the expert pool, the symmetric comm
// window, the local comm workspace with its epochs and counters, the error record), sized once for
// the largest layer of a model. Any number of layers (MoELayer::create(Workspace&, ...)) run on it,
// one after another: the GPU memory epmoe holds for N layers is one workspace, whatever N.
//
// The rule: calls on one workspace are serialized (one at a time, in stream order; a call issued on
// another stream than the previous one waits for it), and every rank issues the same sequence of
// layer calls on it. The dispatch and combine epochs and flags belong to the workspace, so two
// different layers back to back are ordered exactly as two calls of one layer.
#pragma once

#include <cstdint>
#include <memory>

#include "epmoe/config.h"
#include "epmoe/status.h"

namespace epmoe {

class Communicator;

namespace detail {
struct WorkspaceState;
struct WorkspaceAccess;
}  // namespace detail

/// The largest layer a workspace serves, identical on every rank.
struct WorkspaceConfig {
  int num_ranks = 0;             ///< R, the communicator's size.
  int max_experts_per_rank = 0;  ///< largest E_loc = E / R, in [1, Limits::kMaxExpertsPerRank].
  int max_hidden = 0;            ///< largest H, a positive multiple of 128.
  int max_intermediate = 0;      ///< largest I, a positive multiple of 128.
  int max_topk = 0;              ///< largest K, in [1, Limits::kMaxTopK].
  int max_tokens_per_rank = 0;   ///< T_max of every call of every layer on it.
  /// kFP8: FP8 layers only. kBF16: BF16 and FP8 layers (the buffers are sized for either).
  DType dtype = DType::kFP8;
  /// Bound of the create/destroy collectives, in (0, 3600]. Each layer keeps its own bound for
  /// its device waits (LayerConfig::timeout_seconds).
  double timeout_seconds = 10.0;
};

/// Device memory a workspace of this config holds on each rank (host arithmetic, no GPU).
struct WorkspaceSizes {
  int64_t symmetric = 0;  ///< the symmetric window (flags, counts, staging, combine partials)
  int64_t local = 0;      ///< the local comm workspace (epochs, cursors, per-slot rows, counters)
  int64_t pool = 0;       ///< the expert pool (x, scales, activations, expert outputs)
  int64_t total() const { return symmetric + local + pool; }
};

/// Checks every field; the message names the field, its value and the allowed range.
Status validate(const WorkspaceConfig& cfg);
/// Checks that a layer fits a workspace: same R, each shape field within the maximum, a dtype the
/// workspace admits. The message names the field ("LayerConfig.hidden=7168 exceeds the
/// workspace's max_hidden=4096").
Status check_fits(const WorkspaceConfig& ws, const LayerConfig& layer);
/// The smallest workspace that fits `layer` (what MoELayer::create(comm, cfg) makes for itself).
WorkspaceConfig workspace_config_for(const LayerConfig& layer);
/// The buffer sizes a workspace of `cfg` allocates (cfg must validate).
WorkspaceSizes workspace_sizes(const WorkspaceConfig& cfg);

class Workspace {
 public:
  /// Collective over `comm` (every rank, same cfg: checked, every rank fails with a message naming
  /// the differing field). Allocates and zero-fills every buffer; bounded by cfg.timeout_seconds.
  static Status create(Communicator& comm, const WorkspaceConfig& cfg, std::unique_ptr<Workspace>* out);

  /// Drops this object's share of the buffers. The buffers go, collectively (a bounded barrier over
  /// every rank before the symmetric window is freed), with the last share: this object or the last
  /// layer created on it, whichever is destroyed last. Destroy them in the same order on every rank.
  /// A layer never outlives the buffers it runs on (as a layer keeps its Communicator's state).
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  /// Releases the buffers now. Fails (kInvalidArgument naming the live layers, nothing released)
  /// while a layer created on this workspace lives, as Communicator::close does: destroy the layers
  /// first. Collective (the symmetric window is freed after a bounded barrier): close on every rank.
  /// After Ok, config() still answers, nbytes() and num_layers() are 0, MoELayer::create on it
  /// fails, and a second close() is Ok.
  Status close();
  /// Whether close() has released the buffers.
  bool closed() const;

  const WorkspaceConfig& config() const;
  /// GPU memory the workspace holds on this rank, in bytes (symmetric + local + pool); 0 once closed.
  int64_t nbytes() const;
  /// Layers created on this workspace that are still alive.
  int num_layers() const;

 private:
  friend struct detail::WorkspaceAccess;
  Workspace(const WorkspaceConfig& cfg, std::shared_ptr<detail::WorkspaceState> state);
  WorkspaceConfig cfg_;
  std::shared_ptr<detail::WorkspaceState> state_;
};

}  // namespace epmoe
