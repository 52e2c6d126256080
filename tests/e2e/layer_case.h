// The end-to-end layer check: one rank's side of a forward call against tests/reference.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/config.h"
#include "epmoe/launcher.h"
#include "epmoe/status.h"
#include "reference/data.h"

namespace epmoe::e2e {

// A model slice: experts per rank, H, I, K.
struct Shape {
  const char* name;
  int experts_per_rank, hidden, inter, topk;
};
inline constexpr Shape kDsv3{"dsv3", 32, 7168, 2048, 8};
inline constexpr Shape kQwen3{"qwen3", 64, 2048, 768, 8};
inline constexpr Shape kTop2{"top2", 16, 2048, 2048, 2};
// Small enough for 1,000-call loops and the sanitizer; 512+ tokens per rank give 256+ rows per
// expert (the megakernel's throughput variant).
inline constexpr Shape kSmall{"small", 8, 512, 256, 4};

struct LayerCase {
  Shape shape = kQwen3;
  ref::DType dtype = ref::DType::kFP8;
  ref::Routing routing = ref::Routing::kUniform;
  std::vector<int> tokens;      // T per rank; size = number of ranks
  int max_tokens = 0;           // T_max; 0 = max(tokens)
  int sample_per_rank = 64;     // tokens checked against the reference per rank and call
  int calls = 1;                // forward calls, each with fresh routing
  int check_every = 1;          // compare every n-th call (and the last)
  bool graph = false;           // capture one forward in a CUDA graph and replay it
  float clamp = 0.f;
  bool pow2_scales = false;
  bool duplicate_experts = false;  // every third token names its slot-0 expert again in slot 1
  bool bf16_partials = false;      // LayerConfig::combine_partials = kBFloat16
  Path path = Path::kPipeline;
  // Per rank (repeated cyclically over the ranks like `tokens`): each rank's own path in the same
  // calls; empty: `path` on every rank. The paths share one comm protocol, so ranks may differ.
  std::vector<Path> rank_paths;
  // With rank_paths: call i on rank r runs rank_paths[(r + i) % size] (each rank changes its path
  // from call to call, and the ranks of one call differ).
  bool rotate_paths = false;
  // >= 0: Path::kAuto takes the megakernel up to this many tokens (the tuning override, in this
  // rank's process while the layer is created); -1: the library's threshold.
  int auto_fused_max_tokens = -1;
  // When some rank's path is not the pipeline, on every checked call also: the pipeline on every
  // rank, on the same inputs, must give a bitwise identical y, and a second call of the case's
  // paths must too (determinism).
  bool cross_check_paths = true;
  // The megakernel's epilogue variant, through the tuning overrides (src/host/heuristics.h) of this
  // rank's process while the layer is created (restored afterwards): "inline", "deferred", or
  // nullptr for the per-call choice (or whatever EPMOE_FUSED_EPILOGUE set at the start of main).
  const char* fused_epilogue = nullptr;
  // The command line that replays this case (env + binary + gtest filter), named in every failure.
  std::string replay;
  // The FP8 evidence mode: every call is checked (FP8: both paths on the same inputs), no check
  // stops the run, and each rank prints the distributions at the end (then fails if a
  // kernel-consistent check or the paths' bitwise agreement failed on any call).
  bool evidence = false;
  std::string describe() const;
  // This rank's path in call `call` of the case.
  Path path_of(int rank, int call = 0) const {
    if (rank_paths.empty()) return path;
    return rank_paths[size_t(rank + (rotate_paths ? call : 0)) % rank_paths.size()];
  }
  // Whether any rank runs something other than the pipeline (then the paths are cross-checked).
  bool any_not_pipeline() const {
    if (rank_paths.empty()) return path != Path::kPipeline;
    for (Path q : rank_paths)
      if (q != Path::kPipeline) return true;
    return false;
  }
};

// Runs `c` on this rank; every rank of the launch calls it with the same case and seed.
Status run_layer_case(const RankContext& ctx, const LayerCase& c, uint64_t seed);
// The same on a Communicator that outlives the case (the in-process repeats of one launch share
// it): the layer and everything else is created and destroyed inside, collectively.
Status run_layer_case(Communicator& comm, const LayerCase& c, uint64_t seed);

// Bad inputs on a small layer: host-side rejections before launch, device-side index errors
// reported by check_device_error(), y left as it was when the call is rejected.
Status run_bad_input_case(const RankContext& ctx, uint64_t seed);

}  // namespace epmoe::e2e
