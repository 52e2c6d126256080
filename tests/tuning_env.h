// The EPMOE_* tuning switches of the benchmark and the test binaries (docs/DEVELOPING.md): read
// here, outside the library, and applied through detail::set_tuning_overrides
// (src/host/heuristics.h) before any layer or dispatch handle is created.
//   EPMOE_FUSED_EPILOGUE=inline|deferred   the megakernel's epilogue variant (else per call)
//   EPMOE_FUSED_PREFETCH=<0..64>           K blocks of weight prefetch (else 0)
//   EPMOE_FUSED_B_FIRST=0|1                the megakernel's weights-first loads (else per call)
//   EPMOE_FUSED_CLAIM=0|1|2                the megakernel's tile claims (else per call)
//   EPMOE_FUSED_L1_SPLIT=0|1               the megakernel's split L1 units (else from H = 4096)
//   EPMOE_COMM_BLOCKS=<n>                  caps the dispatch and combine grids (n > 0)
//   EPMOE_AUTO_FUSED_MAX=<n>               Path::kAuto's threshold in tokens (n >= 0; else 512)
// Out-of-range values are ignored, as the library did when it read them itself.
#pragma once

#include <cstdlib>
#include <string>

#include "host/heuristics.h"

namespace epmoe::testing_env {

inline heuristics::TuningOverrides tuning_overrides_from_env() {
  heuristics::TuningOverrides o;
  if (const char* env = std::getenv("EPMOE_FUSED_EPILOGUE")) {
    const std::string v(env);
    o.fused_epilogue = v == "inline" ? 1 : v == "deferred" ? 2 : 0;
  }
  const auto env_switch = [](const char* name, int lo, int hi, int& out) {
    if (const char* env = std::getenv(name)) {
      const int v = std::atoi(env);
      if (v >= lo && v <= hi) out = v;
    }
  };
  env_switch("EPMOE_FUSED_PREFETCH", 0, 64, o.fused_prefetch_k_blocks);
  env_switch("EPMOE_FUSED_B_FIRST", 0, 1, o.fused_b_first);
  env_switch("EPMOE_FUSED_CLAIM", 0, 2, o.fused_claim_tiles);
  env_switch("EPMOE_FUSED_L1_SPLIT", 0, 1, o.fused_l1_split);
  if (const char* env = std::getenv("EPMOE_COMM_BLOCKS")) o.comm_blocks = std::atoi(env);
  env_switch("EPMOE_AUTO_FUSED_MAX", 0, 1 << 30, o.auto_fused_max_tokens);
  return o;
}

// Once at the start of main.
inline void apply_tuning_env() { detail::set_tuning_overrides(tuning_overrides_from_env()); }

}  // namespace epmoe::testing_env
