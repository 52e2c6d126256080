// Internal hooks of MoELayer for the benchmark and tests (not public API).
#pragma once

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

}  // namespace epmoe::detail
