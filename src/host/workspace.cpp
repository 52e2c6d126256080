// Workspace: the device buffers that every layer on it shares (src/host/workspace_internal.h).
#include "epmoe/workspace.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "device/layout/comm_layout.h"
#include "device/layout/expert_pool.h"
#include "epmoe/comm.h"
#include "host/check.h"
#include "host/comm_internal.h"
#include "host/gemm.h"
#include "host/workspace_internal.h"

namespace epmoe {

using detail::invalid;

namespace detail {

// The room of a workspace: regions sized for the largest shape, FP8 scales always reserved, bf16
// rows where BF16 layers fit, fp32 partials (either precision fits).
layout::CommShape workspace_shape(const WorkspaceConfig& c) {
  const bool bf16 = c.dtype == DType::kBF16;
  layout::CommShape s{c.num_ranks, c.num_ranks * c.max_experts_per_rank, c.max_hidden, c.max_topk,
                      c.max_tokens_per_rank, !bf16, 4};
  s.cap = layout::CommCapacity{c.max_experts_per_rank, c.max_hidden, c.max_topk, c.max_hidden * (bf16 ? 2 : 1),
                               c.max_hidden / layout::kScaleGroup, 4};
  return s;
}

int64_t workspace_pool_bytes(const WorkspaceConfig& c) {
  int64_t bytes = 0;
  for (const DType d : {DType::kFP8, DType::kBF16}) {
    if (d == DType::kBF16 && c.dtype != DType::kBF16) continue;
    const layout::ExpertPoolShape p{c.num_ranks,          c.max_experts_per_rank, c.max_hidden, c.max_intermediate,
                                    c.max_topk,           c.max_tokens_per_rank,  gemm::row_align(d),
                                    d == DType::kFP8};
    bytes = std::max(bytes, layout::ExpertPoolLayout{p}.num_bytes());
  }
  return bytes;
}

}  // namespace detail

Status validate(const WorkspaceConfig& c) {
  if (c.num_ranks < 1 || c.num_ranks > Limits::kMaxRanks)
    return invalid("WorkspaceConfig.num_ranks=", c.num_ranks, " must be in [1, ", Limits::kMaxRanks, "]");
  if (c.max_experts_per_rank < 1 || c.max_experts_per_rank > Limits::kMaxExpertsPerRank)
    return invalid("WorkspaceConfig.max_experts_per_rank=", c.max_experts_per_rank, " must be in [1, ",
                   Limits::kMaxExpertsPerRank, "]");
  if (c.max_hidden <= 0 || c.max_hidden % 128 != 0 || c.max_hidden > Limits::kMaxHidden)
    return invalid("WorkspaceConfig.max_hidden=", c.max_hidden, " must be a positive multiple of 128, at most ",
                   Limits::kMaxHidden);
  if (c.max_intermediate <= 0 || c.max_intermediate % 128 != 0 || c.max_intermediate > Limits::kMaxIntermediate)
    return invalid("WorkspaceConfig.max_intermediate=", c.max_intermediate,
                   " must be a positive multiple of 128, at most ", Limits::kMaxIntermediate);
  if (c.max_topk < 1 || c.max_topk > Limits::kMaxTopK)
    return invalid("WorkspaceConfig.max_topk=", c.max_topk, " must be in [1, ", Limits::kMaxTopK, "]");
  if (c.max_tokens_per_rank < 1 || c.max_tokens_per_rank > Limits::kMaxTokensPerRank)
    return invalid("WorkspaceConfig.max_tokens_per_rank=", c.max_tokens_per_rank, " must be in [1, ",
                   Limits::kMaxTokensPerRank, "]");
  if (c.dtype != DType::kFP8 && c.dtype != DType::kBF16)
    return invalid("WorkspaceConfig.dtype=", int(c.dtype), " must be kFP8 or kBF16");
  if (!(c.timeout_seconds > 0 && c.timeout_seconds <= 3600))
    return invalid("WorkspaceConfig.timeout_seconds=", c.timeout_seconds, " must be in (0, 3600]");
  return Status::Ok();
}

Status check_fits(const WorkspaceConfig& ws, const LayerConfig& l) {
  EPMOE_RETURN_IF_ERROR(validate(l));
  if (l.num_ranks != ws.num_ranks)
    return invalid("LayerConfig.num_ranks=", l.num_ranks, " must equal the workspace's num_ranks=", ws.num_ranks);
  const int e_loc = l.experts_per_rank();
  if (e_loc > ws.max_experts_per_rank)
    return invalid("LayerConfig.num_experts=", l.num_experts, " gives ", e_loc,
                   " experts per rank, more than the workspace's max_experts_per_rank=", ws.max_experts_per_rank);
  if (l.hidden > ws.max_hidden)
    return invalid("LayerConfig.hidden=", l.hidden, " exceeds the workspace's max_hidden=", ws.max_hidden);
  if (l.intermediate > ws.max_intermediate)
    return invalid("LayerConfig.intermediate=", l.intermediate, " exceeds the workspace's max_intermediate=",
                   ws.max_intermediate);
  if (l.topk > ws.max_topk)
    return invalid("LayerConfig.topk=", l.topk, " exceeds the workspace's max_topk=", ws.max_topk);
  if (l.max_tokens_per_rank > ws.max_tokens_per_rank)
    return invalid("LayerConfig.max_tokens_per_rank=", l.max_tokens_per_rank,
                   " exceeds the workspace's max_tokens_per_rank=", ws.max_tokens_per_rank);
  if (l.dtype == DType::kBF16 && ws.dtype != DType::kBF16)
    return invalid("LayerConfig.dtype=kBF16 does not fit a workspace created with dtype=kFP8 (a kBF16 workspace "
                   "serves both)");
  return Status::Ok();
}

WorkspaceConfig workspace_config_for(const LayerConfig& l) {
  WorkspaceConfig w;
  w.num_ranks = l.num_ranks;
  w.max_experts_per_rank = l.experts_per_rank();
  w.max_hidden = l.hidden;
  w.max_intermediate = l.intermediate;
  w.max_topk = l.topk;
  w.max_tokens_per_rank = l.max_tokens_per_rank;
  w.dtype = l.dtype;
  w.timeout_seconds = l.timeout_seconds;
  return w;
}

WorkspaceSizes workspace_sizes(const WorkspaceConfig& c) {
  const layout::CommShape s = detail::workspace_shape(c);
  WorkspaceSizes z;
  // Why rounded: alloc_symmetric registers whole 4 KiB pages (NCCL's window alignment).
  z.symmetric = (layout::CommSymLayout{s}.num_bytes() + 4095) / 4096 * 4096;
  z.local = layout::CommLocalLayout{s}.num_bytes();
  z.pool = detail::workspace_pool_bytes(c);
  return z;
}

namespace {

// Collective: every rank learns whether every rank passed the same config (then each validates it
// alike). Why before any allocation: a rank that returned early would leave its peers blocked.
Status agree_on_config(Communicator& comm, const WorkspaceConfig& c) {
  constexpr int n = 7;
  constexpr const char* names[n] = {"num_ranks", "max_experts_per_rank", "max_hidden", "max_intermediate",
                                    "max_topk",  "max_tokens_per_rank",  "dtype"};
  const int64_t mine[n] = {c.num_ranks, c.max_experts_per_rank, c.max_hidden, c.max_intermediate,
                           c.max_topk,  c.max_tokens_per_rank,  int64_t(c.dtype)};
  const double timeout = c.timeout_seconds > 0 && c.timeout_seconds <= 3600 ? c.timeout_seconds
                                                                            : kDefaultHostTimeoutSeconds;
  std::vector<int64_t> all;
  const Status st = detail::all_gather_words(comm, mine, n, &all, timeout);
  if (!st.ok()) return Status(st.code(), "Workspace::create: exchanging the config across ranks: " + st.message());
  std::ostringstream os;
  for (int f = 0; f < n; ++f) {
    std::vector<int> differ;
    for (int r = 0; r < comm.size(); ++r)
      if (all[size_t(r) * n + f] != mine[f]) differ.push_back(r);
    if (!differ.empty())
      os << (os.tellp() > 0 ? "; " : "") << names[f] << "=" << mine[f] << " here, other values on "
         << detail::rank_list(differ);
  }
  if (os.tellp() > 0)
    return invalid("Workspace::create on rank ", comm.rank(),
                   ": WorkspaceConfig differs across ranks (every rank must pass the same one): ", os.str());
  return Status::Ok();
}

}  // namespace

Workspace::Workspace(const WorkspaceConfig& cfg, std::shared_ptr<detail::WorkspaceState> state)
    : cfg_(cfg), state_(std::move(state)) {}
Workspace::~Workspace() = default;
const WorkspaceConfig& Workspace::config() const { return cfg_; }
int64_t Workspace::nbytes() const { return state_ ? state_->device_bytes() : 0; }
int Workspace::num_layers() const { return state_ ? state_->num_layers.load() : 0; }
bool Workspace::closed() const { return !state_; }

Status Workspace::close() {
  if (!state_) return Status::Ok();
  const int live = state_->num_layers.load();
  if (live > 0)
    return invalid("Workspace::close on rank ", state_->comm ? state_->comm->rank() : -1, ": ", live, " layer",
                   live == 1 ? " created on this workspace still lives" : "s created on this workspace still live",
                   "; destroy them first (on every rank), then close it");
  // The last share (no layer holds one): its release frees the buffers, collectively.
  state_.reset();
  return Status::Ok();
}

Status Workspace::create(Communicator& comm, const WorkspaceConfig& cfg, std::unique_ptr<Workspace>* out) {
  if (!out) return invalid("Workspace::create: out is null");
  EPMOE_RETURN_IF_ERROR(agree_on_config(comm, cfg));
  EPMOE_RETURN_IF_ERROR(validate(cfg));
  if (cfg.num_ranks != comm.size())
    return invalid("WorkspaceConfig.num_ranks=", cfg.num_ranks, " must equal the communicator size ", comm.size());
  EPMOE_CUDA_RETURN(cudaSetDevice(comm.device()));
  detail::WorkspaceSpec spec;
  spec.shape = detail::workspace_shape(cfg);
  spec.pool_bytes = detail::workspace_pool_bytes(cfg);
  spec.timeout_seconds = cfg.timeout_seconds;
  std::shared_ptr<detail::WorkspaceState> state;
  EPMOE_RETURN_IF_ERROR(detail::create_workspace_state(comm, spec, &state));
  out->reset(new Workspace(cfg, std::move(state)));
  return Status::Ok();
}

namespace detail {
const std::shared_ptr<WorkspaceState>& WorkspaceAccess::state(const Workspace& ws) { return ws.state_; }
std::unique_ptr<Workspace> WorkspaceAccess::wrap(const WorkspaceConfig& cfg, std::shared_ptr<WorkspaceState> state) {
  return std::unique_ptr<Workspace>(new Workspace(cfg, std::move(state)));
}
}  // namespace detail

}  // namespace epmoe
