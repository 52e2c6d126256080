// Internal hooks of MoELayer for the benchmark, the tests and the C ABI (not public API).
#pragma once

#include <memory>

#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "epmoe/layer.h"
#include "epmoe/status.h"

namespace epmoe::detail {

class LayerInternals {
 public:
  virtual ~LayerInternals() = default;
  // Records events between the pipeline stages of the next forward calls.
  virtual void set_stage_timing(bool on) = 0;
  // Waits for the last timed forward; dispatch, L1, L2, combine in milliseconds.
  virtual Status stage_times_ms(float out[4]) = 0;
  virtual DispatchHandle& dispatcher() = 0;
};

LayerInternals* internals(MoELayer& layer);

// MoELayer::create with the checks a wrapper ran before it (the C ABI's conversion of its config
// struct): `caller` joins create's first agreement, so a rank whose wrapper rejected its arguments
// fails together with its peers, naming itself, instead of returning alone.
Status create_layer(Communicator& comm, const LayerConfig& cfg, const Status& caller, std::unique_ptr<MoELayer>* out);
// The same for MoELayer::create on a workspace.
Status create_layer_on(Workspace& workspace, const LayerConfig& cfg, const Status& caller,
                       std::unique_ptr<MoELayer>* out, const ExpertWeightRefs* weights);

}  // namespace epmoe::detail
