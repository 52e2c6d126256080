// One dispatch + combine round on every rank, checked on the host against the reference semantics.
#pragma once

#include <string>
#include <vector>

#include "epmoe/dispatch.h"
#include "epmoe/launcher.h"
#include "reference/data.h"

namespace epmoe::mgpu {

struct CaseShape {
  int E = 16, H = 384, K = 4, T_max = 96, row_align = 64;
  DType dtype = DType::kFP8;
  bool pow2 = false;
  PartialPrecision partials = PartialPrecision::kFloat32;
};

// Duplicate experts inside a token, applied on top of the reference routing (which never makes
// them). SPEC counts every slot, so a duplicated expert gets one pool row and one term per slot.
enum class Duplicates {
  kNone,
  kSome,      // every third token with a valid slot 0: the last slot repeats slot 0's expert
  kAllSlots,  // every token with a valid slot 0: all K slots name slot 0's expert
};

struct RoutingCase {
  std::string name;
  ref::Routing routing = ref::Routing::kUniform;
  std::vector<int> tokens;  // T_r per rank; empty = T_max everywhere
  Duplicates duplicates = Duplicates::kNone;
};

// Creates one handle and runs every case on it in order (the handle is reused: no re-init).
Status run_cases(const RankContext& ctx, const CaseShape& shape, const std::vector<RoutingCase>& cases,
                 uint64_t seed);
// The same on an existing communicator (one communicator per process and unique id).
Status run_cases(const RankContext& ctx, Communicator& comm, const CaseShape& shape,
                 const std::vector<RoutingCase>& cases, uint64_t seed);

// The o_pool test pattern: the expert output of (source rank, token, slot) at channel h.
float expert_output_pattern(int src, int token, int slot, int h);

}  // namespace epmoe::mgpu
