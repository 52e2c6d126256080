// DispatchHandle: buffers, validation and launches of the standalone dispatch/combine kernels.
#include "epmoe/dispatch.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "device/comm/dispatch_params.h"
#include "device/comm/status_bits.h"
#include "device/layout/comm_layout.h"
#include "device/layout/error_record.h"
#include "device/layout/expert_pool.h"
#include "host/check.h"
#include "host/comm_internal.h"
#include "host/dispatch_internal.h"
#include "host/heuristics.h"
#include "host/workspace_internal.h"

namespace epmoe {
namespace {

layout::CommShape comm_shape(int ranks, const DispatchConfig& c) {
  return layout::CommShape{ranks, c.num_experts, c.hidden, c.topk, c.max_tokens_per_rank, c.dtype == DType::kFP8,
                           c.combine_partials == PartialPrecision::kFloat32 ? 4 : 2};
}

layout::ExpertPoolLayout pool_layout(int ranks, const DispatchConfig& c) {
  return layout::ExpertPoolLayout{layout::pool_shape_for(comm_shape(ranks, c), c.intermediate, c.row_align)};
}

bool misaligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; }

// The config fields that every rank must agree on (they size the symmetric buffer and decide what
// the kernels exchange), plus this rank's verdict on its external pool, gathered over NCCL.
constexpr int kConfigFields = 9;
constexpr const char* kConfigFieldNames[kConfigFields] = {
    "num_experts", "hidden", "topk", "max_tokens_per_rank", "row_align", "intermediate", "dtype", "pow2_scales",
    "combine_partials"};

std::string config_field_value(int field, int64_t v) {
  switch (field) {
    case 6: return v == int64_t(DType::kFP8) ? "kFP8" : v == int64_t(DType::kBF16) ? "kBF16" : std::to_string(v);
    case 7: return v ? "true" : "false";
    case 8: return v == int64_t(PartialPrecision::kFloat32)    ? "kFloat32"
                   : v == int64_t(PartialPrecision::kBFloat16) ? "kBFloat16"
                                                               : std::to_string(v);
    default: return std::to_string(v);
  }
}

#ifdef EPMOE_TEST_HOOKS
// The test hook detail::set_debug_never_arrive_rank: that rank's handle never launches its
// kernels (docs/COMM.md). Read once at create.
bool read_never_arrive(int rank) {
  if (detail::debug_never_arrive_rank() != rank) return false;
  std::fprintf(stderr,
               "[epmoe] rank %d: the never-arrive test hook names this rank: it launches no dispatch/combine/fused "
               "kernel; its peers will time out (debug only)\n",
               rank);
  return true;
}
#endif

}  // namespace

namespace {

using detail::rank_list;

// The bound of the create-time exchanges: the config's own, or the default where it is invalid
// (validate() reports that, after the exchange, on every rank alike).
double host_timeout(const DispatchConfig& c) {
  return c.timeout_seconds > 0 && c.timeout_seconds <= 3600 ? c.timeout_seconds : kDefaultHostTimeoutSeconds;
}

// Collective (host sync is fine at create). Why before any local check that can fail: a rank that
// returned early would leave the others blocked in this all-gather or in alloc_symmetric.
Status check_config_across_ranks(Communicator& comm, const DispatchConfig& c, const void* external_pool) {
  constexpr int n = kConfigFields + 1;
  const int64_t mine[n] = {c.num_experts,
                           c.hidden,
                           c.topk,
                           c.max_tokens_per_rank,
                           c.row_align,
                           c.intermediate,
                           int64_t(c.dtype),
                           c.pow2_scales ? 1 : 0,
                           int64_t(c.combine_partials),
                           external_pool && misaligned(external_pool, layout::kRegionAlign) ? 1 : 0};
  const int R = comm.size();
  std::vector<int64_t> all;
  const Status st = detail::all_gather_words(comm, mine, n, &all, host_timeout(c));
  if (!st.ok()) return Status(st.code(), "DispatchHandle::create: exchanging the config across ranks: " + st.message());

  std::ostringstream os;
  for (int f = 0; f < kConfigFields; ++f) {
    std::vector<int64_t> values;
    std::vector<std::vector<int>> ranks;
    for (int r = 0; r < R; ++r) {
      const int64_t v = all[size_t(r) * n + f];
      size_t i = 0;
      while (i < values.size() && values[i] != v) ++i;
      if (i == values.size()) {
        values.push_back(v);
        ranks.emplace_back();
      }
      ranks[i].push_back(r);
    }
    if (values.size() < 2) continue;
    os << (os.tellp() > 0 ? "; " : "") << kConfigFieldNames[f] << " is ";
    for (size_t i = 0; i < values.size(); ++i)
      os << (i ? ", " : "") << config_field_value(f, values[i]) << " on " << rank_list(ranks[i]);
  }
  if (os.tellp() > 0)
    return detail::invalid("DispatchHandle::create on rank ", comm.rank(),
                           ": DispatchConfig differs across ranks (every rank must pass the same one): ", os.str());
  std::vector<int> bad_pool;
  for (int r = 0; r < R; ++r)
    if (all[size_t(r) * n + kConfigFields]) bad_pool.push_back(r);
  if (!bad_pool.empty()) {
    std::ostringstream where;
    if (mine[kConfigFields]) where << " (here: " << external_pool << ")";
    return detail::invalid("DispatchHandle::create on rank ", comm.rank(), ": external_pool must be ",
                           layout::kRegionAlign, "-byte aligned; it is not on ", rank_list(bad_pool), where.str());
  }
  return Status::Ok();
}

}  // namespace

struct DispatchHandle::Impl {
  std::shared_ptr<detail::WorkspaceState> ws;  // the buffers (own, or a Workspace's)
  DispatchConfig cfg;
  layout::CommShape shape{};
  layout::ExpertPoolLayout pool_layout{};
  layout::CommOffsets offsets{};  // layout::comm_offsets(shape, pool_layout), resolved at create
  int num_blocks = 0;
  heuristics::TuningOverrides overrides;  // detail::tuning_overrides(), copied at create
  int64_t last_tokens = -1;
  unsigned long long* phase_ts = nullptr;  // benchmark only (DispatchAccess::set_phase_stamps)

  Communicator& comm() const { return *ws->comm; }
  comm::PeerPtrs peers() const {
    comm::PeerPtrs p{};
    for (int r = 0; r < shape.num_ranks; ++r) p.ptr[r] = static_cast<char*>(ws->sym->peers[r]);
    return p;
  }
  uint64_t timeout_ns() const { return uint64_t(cfg.timeout_seconds * 1e9); }
  // The grid of a dispatch or combine launch (heuristics::choose_comm_blocks).
  int blocks_for(int64_t tokens, int warps_per_block) const {
    heuristics::CommShape s;
    s.num_ranks = shape.num_ranks;
    s.hidden = shape.hidden;
    s.max_blocks = num_blocks;
    s.fixed_blocks = cfg.num_blocks > 0;
    return heuristics::choose_comm_blocks(s, tokens, warps_per_block, overrides);
  }
};

namespace detail {

WorkspaceState::~WorkspaceState() {
  // Collective, like alloc_symmetric. Why log: a destructor cannot return a Status, and a failed
  // free only leaks until the Communicator goes away.
  if (sym) {
    const Status st = comm->free_symmetric(sym, timeout_seconds);
    if (!st.ok()) std::fprintf(stderr, "[epmoe] workspace release on rank %d: %s\n", comm->rank(), st.to_string().c_str());
  }
  // Why not after a device timeout (the context is lost: cudaFree would only fail) or on a
  // broken communicator (cudaFree waits for the device, where a collective may never end).
  const bool lost = (record && record->timeout.valid) || (comm && CommAccess::broken(*comm));
  if (!lost) {
    if (local_ws) cudaFree(local_ws);
    if (owns_pool && pool) cudaFree(pool);
    if (done_event) cudaEventDestroy(done_event);
    // Not when lost either: cudaFreeHost synchronizes the device as cudaFree does.
    if (record) cudaFreeHost(record);
  }
}

uint32_t* WorkspaceState::status_word() const {
  return reinterpret_cast<uint32_t*>(local_ws + layout::CommLocalLayout{shape}.status_offset());
}

// The timeout record's line (also printed to stderr once when the kernel could not print it).
std::string WorkspaceState::timeout_line() {
  layout::TimeoutRecord r;
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(&r, const_cast<const layout::TimeoutRecord*>(&record->timeout), sizeof(r));
  char line[320];
  layout::format_timeout_record(r, line, sizeof(line));
  if (!r.printed && !timeout_printed) std::fprintf(stderr, "%s\n", line);
  timeout_printed = true;
  return line;
}

bool WorkspaceState::timeout_recorded() const {
  const volatile layout::TimeoutRecord* r = record ? &record->timeout : nullptr;
  return r && r->valid;
}

// The routing report the host has not returned yet, if any (the seqlock's reader). Returns how
// many calls reported bad routing since the last one returned (the record keeps the latest).
uint32_t WorkspaceState::take_routing(layout::RoutingRecord* out) {
  if (!record) return 0;
  const volatile layout::RoutingRecord* v = &record->routing;
  const uint32_t seq = v->seq;
  if ((seq & 1u) || seq == routing_seq_reported) return 0;  // nothing new, or being written
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(out, const_cast<const layout::RoutingRecord*>(&record->routing), sizeof(*out));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (v->seq != seq) return 0;  // rewritten meanwhile: the next look gets the newer one
  const uint32_t calls = (seq - routing_seq_reported) / 2u;
  routing_seq_reported = seq;
  return calls;
}

Status WorkspaceState::take_device_error(bool routing) {
  if (timeout_recorded())
    return Status(StatusCode::kTimeout,
                  "rank " + std::to_string(comm->rank()) + ": an earlier call's device-side wait timed out and " +
                      "trapped: " + timeout_line() +
                      ". The CUDA context is lost; restart the process (every rank's record names what it waited on)");
  if (!routing) return Status::Ok();
  layout::RoutingRecord r;
  const uint32_t calls = take_routing(&r);
  if (calls == 0) return Status::Ok();
  char line[256];
  layout::format_routing_record(r, line, sizeof(line));
  std::string message = line;
  if (calls > 1) message += "; " + std::to_string(calls) + " calls had bad routing since the last report";
  return Status(StatusCode::kInvalidArgument, message);
}

// Why a wait even on the last call's stream: a graph replayed on another stream since then recorded
// the event there, which the host never sees (a same-stream wait on an event already behind is
// cheap).
Status WorkspaceState::serialize(cudaStream_t stream, bool capturing) {
  if (has_last)
    EPMOE_CUDA_RETURN(
        cudaStreamWaitEvent(stream, done_event, capturing ? cudaEventWaitExternal : cudaEventWaitDefault));
  return Status::Ok();
}

Status WorkspaceState::mark_end(cudaStream_t stream, bool capturing) {
  EPMOE_CUDA_RETURN(
      cudaEventRecordWithFlags(done_event, stream, capturing ? cudaEventRecordExternal : cudaEventRecordDefault));
  has_last = true;
  return Status::Ok();
}

Status create_workspace_state(Communicator& comm, const WorkspaceSpec& spec, std::shared_ptr<WorkspaceState>* out) {
  auto m = std::make_shared<WorkspaceState>();
  m->comm = CommAccess::share(comm);
  m->shape = spec.shape;
  m->timeout_seconds = spec.timeout_seconds > 0 && spec.timeout_seconds <= 3600 ? spec.timeout_seconds
                                                                                : kDefaultHostTimeoutSeconds;
#ifdef EPMOE_TEST_HOOKS
  m->never_arrive = read_never_arrive(comm.rank());
#endif
  // This rank's own allocations, then every rank learns whether all of them worked: a rank that
  // returned alone would leave the others in alloc_symmetric. A failed rank's state frees what it got.
  const Status local = [&]() -> Status {
    int max_blocks = 0;
    EPMOE_CUDA_RETURN(cudaDeviceGetAttribute(&max_blocks, cudaDevAttrMultiProcessorCount, comm.device()));
    m->num_blocks = spec.num_blocks > 0 && spec.num_blocks < max_blocks ? spec.num_blocks : max_blocks;
    const layout::CommLocalLayout loc{m->shape};
    m->local_bytes = loc.num_bytes();
    EPMOE_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&m->local_ws), size_t(m->local_bytes)));
    EPMOE_CUDA_RETURN(cudaMemset(m->local_ws, 0, size_t(m->local_bytes)));
    // The error record: one per workspace, zeroed, the device address of its timeout part in the
    // params and in the workspace slot that WaitSites built from the status word alone read (comm/wait.h).
    EPMOE_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&m->record), sizeof(layout::DeviceErrorRecord),
                                    cudaHostAllocMapped));
    std::memset(static_cast<void*>(m->record), 0, sizeof(layout::DeviceErrorRecord));
    EPMOE_CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(&m->record_dev), m->record, 0));
    layout::TimeoutRecord* timeout_dev = &m->record_dev->timeout;
    EPMOE_CUDA_RETURN(cudaMemcpy(m->local_ws + loc.timeout_record_offset(), &timeout_dev, sizeof(timeout_dev),
                                 cudaMemcpyHostToDevice));
    EPMOE_CUDA_RETURN(cudaEventCreateWithFlags(&m->done_event, cudaEventDisableTiming));
    if (spec.external_pool) {
      m->pool = static_cast<char*>(spec.external_pool);
      m->pool_bytes = spec.pool_bytes;
    } else {
      m->pool_bytes = spec.pool_bytes;
      EPMOE_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&m->pool), size_t(m->pool_bytes)));
      m->owns_pool = true;
      // Counts and offsets read before the first dispatch are zeros, not garbage, whatever layer
      // lays the pool out.
      EPMOE_CUDA_RETURN(cudaMemset(m->pool, 0, size_t(m->pool_bytes)));
    }
    EPMOE_CUDA_RETURN(cudaDeviceSynchronize());
    return Status::Ok();
  }();
  EPMOE_RETURN_IF_ERROR(agree_on_status(comm, local, "workspace (local allocations)", m->timeout_seconds));
  // Last, so that no rank-local failure above leaves the peers holding a symmetric buffer.
  const layout::CommSymLayout sym{m->shape};
  EPMOE_RETURN_IF_ERROR(comm.alloc_symmetric(size_t(sym.num_bytes()), &m->sym, m->timeout_seconds));
  *out = std::move(m);
  return Status::Ok();
}

}  // namespace detail

DispatchHandle::DispatchHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DispatchHandle::~DispatchHandle() = default;
const DispatchConfig& DispatchHandle::config() const { return impl_->cfg; }

Status DispatchHandle::validate(const Communicator& comm, const DispatchConfig& c) {
  const int R = comm.size();
  if (c.num_experts < R || c.num_experts % R != 0)
    return detail::invalid("DispatchConfig.num_experts=", c.num_experts, " must be a positive multiple of the rank count ", R);
  if (c.num_experts / R > Limits::kMaxExpertsPerRank)
    return detail::invalid("DispatchConfig: experts per rank=", c.num_experts / R, " exceeds ", Limits::kMaxExpertsPerRank);
  if (c.hidden <= 0 || c.hidden % 128 != 0 || c.hidden > Limits::kMaxHidden)
    return detail::invalid("DispatchConfig.hidden=", c.hidden, " must be a positive multiple of 128, at most ", Limits::kMaxHidden);
  if (c.topk < 1 || c.topk > c.num_experts || c.topk > Limits::kMaxTopK)
    return detail::invalid("DispatchConfig.topk=", c.topk, " must be in [1, min(E=", c.num_experts, ", ", Limits::kMaxTopK, ")]");
  if (c.max_tokens_per_rank < 1 || c.max_tokens_per_rank > Limits::kMaxTokensPerRank)
    return detail::invalid("DispatchConfig.max_tokens_per_rank=", c.max_tokens_per_rank, " must be in [1, ",
                           Limits::kMaxTokensPerRank, "]");
  if (c.row_align < 1 || c.row_align > 1024)
    return detail::invalid("DispatchConfig.row_align=", c.row_align, " must be in [1, 1024]");
  if (c.intermediate < 0 || c.intermediate % 128 != 0)
    return detail::invalid("DispatchConfig.intermediate=", c.intermediate, " must be 0 or a multiple of 128");
  if (!(c.timeout_seconds > 0) || c.timeout_seconds > 3600)
    return detail::invalid("DispatchConfig.timeout_seconds=", c.timeout_seconds, " must be in (0, 3600]");
  if (c.num_blocks < 0) return detail::invalid("DispatchConfig.num_blocks=", c.num_blocks, " must be >= 0");
  return Status::Ok();
}

int64_t DispatchHandle::pool_bytes_for(const Communicator& comm, const DispatchConfig& cfg) {
  return pool_layout(comm.size(), cfg).num_bytes();
}

Status DispatchHandle::create(Communicator& comm, const DispatchConfig& cfg, std::unique_ptr<DispatchHandle>* out,
                              void* external_pool) {
  return detail::DispatchAccess::create(comm, cfg, Status::Ok(), out, external_pool);
}

Status detail::DispatchAccess::create(Communicator& comm, const DispatchConfig& cfg, const Status& caller,
                                      std::unique_ptr<DispatchHandle>* out, void* external_pool) {
  // Every rank fails together, naming the failing ranks: on its caller's checks, a null `out` or
  // an invalid config (agreed first: a rank that returned alone would leave the others in the
  // exchange below), then on a config that differs between ranks or any rank's misaligned
  // external pool.
  Status checked = caller;
  if (checked.ok() && !out) checked = detail::invalid("DispatchHandle::create: out is null");
  if (checked.ok()) checked = DispatchHandle::validate(comm, cfg);
  EPMOE_RETURN_IF_ERROR(
      detail::agree_on_status(comm, checked, "DispatchHandle::create (the argument checks)", host_timeout(cfg)));
  EPMOE_RETURN_IF_ERROR(check_config_across_ranks(comm, cfg, external_pool));
  detail::WorkspaceSpec spec;
  spec.shape = comm_shape(comm.size(), cfg);
  spec.pool_bytes = pool_layout(comm.size(), cfg).num_bytes();
  spec.external_pool = external_pool;
  spec.num_blocks = cfg.num_blocks;
  spec.timeout_seconds = host_timeout(cfg);
  std::shared_ptr<detail::WorkspaceState> ws;
  EPMOE_RETURN_IF_ERROR(detail::create_workspace_state(comm, spec, &ws));
  return detail::DispatchAccess::create_on(std::move(ws), cfg, out, /*collective=*/false);
}

ExpertPoolView DispatchHandle::pool() const {
  const auto& pl = impl_->pool_layout;
  char* b = impl_->ws->pool;
  ExpertPoolView v;
  v.base = b;
  v.bytes = pl.num_bytes();
  v.max_rows = pl.max_rows();
  v.scale_stride = pl.scale_stride();
  v.x_pool = b + pl.x_pool_offset();
  v.x_scale = pl.x_scale_bytes() ? reinterpret_cast<float*>(b + pl.x_scale_offset()) : nullptr;
  v.row_weight = reinterpret_cast<float*>(b + pl.row_weight_offset());
  v.row_source = reinterpret_cast<uint32_t*>(b + pl.row_source_offset());
  v.a_pool = pl.a_pool_bytes() ? b + pl.a_pool_offset() : nullptr;
  v.a_scale = pl.a_scale_bytes() ? reinterpret_cast<float*>(b + pl.a_scale_offset()) : nullptr;
  v.o_pool = reinterpret_cast<uint16_t*>(b + pl.o_pool_offset());
  v.expert_count = reinterpret_cast<int32_t*>(b + pl.expert_count_offset());
  v.expert_offset = reinterpret_cast<int32_t*>(b + pl.expert_offset_offset());
  return v;
}

Status DispatchHandle::dispatch(const void* x, const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                                cudaStream_t stream) {
  return detail::DispatchAccess::dispatch_typed(*this, x, topk_idx, IndexType::kInt32, topk_weights, num_tokens, stream);
}

Status detail::DispatchAccess::dispatch_typed(DispatchHandle& h, const void* x, const void* topk_idx,
                                              IndexType idx_type, const float* topk_weights, int64_t num_tokens,
                                              cudaStream_t stream) {
  DispatchHandle::Impl& m = *h.impl_;
  if (num_tokens < 0 || num_tokens > m.cfg.max_tokens_per_rank)
    return detail::invalid("dispatch: num_tokens=", num_tokens, " must be in [0, max_tokens_per_rank=",
                           m.cfg.max_tokens_per_rank, "]");
  if (num_tokens > 0 && (!x || !topk_idx || !topk_weights))
    return detail::invalid("dispatch: x, topk_idx and topk_weights must be non-null when num_tokens=", num_tokens, " > 0");
  // Why: the kernels load x in 16-byte vectors and the routing in 4- or 8-byte words.
  const uintptr_t idx_bytes = idx_type == IndexType::kInt64 ? 8 : 4;
  if (misaligned(x, 16)) return detail::invalid("dispatch: x=", x, " must be 16-byte aligned");
  if (misaligned(topk_idx, idx_bytes))
    return detail::invalid("dispatch: topk_idx=", topk_idx, " must be ", idx_bytes, "-byte aligned");
  if (misaligned(topk_weights, 4))
    return detail::invalid("dispatch: topk_weights=", topk_weights, " must be 4-byte aligned");
  if (m.ws->never_arrive) {  // debug injection: the peers' waits for this rank expire
    m.last_tokens = num_tokens;
    return Status::Ok();
  }
  const comm::DispatchParams p = dispatch_params(h, x, topk_idx, idx_type, topk_weights, num_tokens);
  EPMOE_CUDA_RETURN(comm::launch_dispatch(p, m.blocks_for(num_tokens, comm::kCommThreads / 32), stream));
  m.last_tokens = num_tokens;
  return Status::Ok();
}

Status DispatchHandle::combine(void* y, int64_t num_tokens, cudaStream_t stream) {
  return detail::DispatchAccess::combine(*this, y, num_tokens, stream, /*defer_done=*/false);
}

namespace detail {
Status DispatchAccess::combine(DispatchHandle& h, void* y, int64_t num_tokens, cudaStream_t stream, bool defer_done) {
  DispatchHandle::Impl& m = *h.impl_;
  // Why: the kernel stores y in 16-byte vectors.
  if (misaligned(y, 16)) return invalid("combine: y=", y, " must be 16-byte aligned");
  if (m.last_tokens < 0) return invalid("combine: no dispatch has been issued on this handle");
  if (num_tokens != m.last_tokens)
    return invalid("combine: num_tokens=", num_tokens, " must equal the last dispatch's ", m.last_tokens);
  if (num_tokens > 0 && !y) return invalid("combine: y must be non-null when num_tokens=", num_tokens, " > 0");
  if (m.ws->never_arrive) return Status::Ok();
  comm::CombineParams p = combine_params(h, y);
  p.defer_done = defer_done ? 1 : 0;
  EPMOE_CUDA_RETURN(comm::launch_combine(p, m.blocks_for(num_tokens, comm::kCombineThreads / 32), stream));
  return Status::Ok();
}
}  // namespace detail

namespace detail {

comm::DispatchParams DispatchAccess::dispatch_params(const DispatchHandle& h, const void* x, const void* topk_idx,
                                                     IndexType idx_type, const float* topk_weights, int64_t num_tokens) {
  const DispatchHandle::Impl& m = *h.impl_;
  comm::DispatchParams p{};
  p.shape = m.shape;
  p.rank = m.comm().rank();
  p.x = static_cast<const uint16_t*>(x);
  p.topk_idx = topk_idx;
  p.topk_idx_bytes = idx_type == IndexType::kInt64 ? 8 : 4;
  p.topk_w = topk_weights;
  p.num_tokens = int(num_tokens);
  p.pool = m.ws->pool;
  p.pool_layout = m.pool_layout;
  p.off = m.offsets;
  p.sym = m.peers();
  p.local_ws = m.ws->local_ws;
  p.pow2_scales = m.cfg.pow2_scales;
  p.timeout_ns = m.timeout_ns();
  p.timeout_record = &m.ws->record_dev->timeout;
  p.routing_record = &m.ws->record_dev->routing;
  p.phase_ts = m.phase_ts;
  return p;
}

comm::CombineParams DispatchAccess::combine_params(const DispatchHandle& h, void* y) {
  const DispatchHandle::Impl& m = *h.impl_;
  comm::CombineParams p{};
  p.shape = m.shape;
  p.rank = m.comm().rank();
  p.pool = m.ws->pool;
  p.pool_layout = m.pool_layout;
  p.off = m.offsets;
  p.y = static_cast<uint16_t*>(y);
  p.sym = m.peers();
  p.local_ws = m.ws->local_ws;
  p.timeout_ns = m.timeout_ns();
  p.timeout_record = &m.ws->record_dev->timeout;
  p.phase_ts = m.phase_ts;
  return p;
}

bool DispatchAccess::never_arrive(const DispatchHandle& h) { return h.impl_->ws->never_arrive; }

bool DispatchAccess::timeout_recorded(const DispatchHandle& h) { return h.impl_->ws->timeout_recorded(); }

Status DispatchAccess::take_device_error(DispatchHandle& h, bool routing) {
  return h.impl_->ws->take_device_error(routing);
}

layout::WatchdogParams DispatchAccess::watchdog(const DispatchHandle& h) {
  const DispatchHandle::Impl& m = *h.impl_;
  layout::WatchdogParams w{};
  w.timeout_ns = m.timeout_ns();
  w.record = &m.ws->record_dev->timeout;
  w.status = m.ws->status_word();
  w.rank = m.comm().rank();
  return w;
}

const std::shared_ptr<WorkspaceState>& DispatchAccess::state(const DispatchHandle& h) { return h.impl_->ws; }

Status DispatchAccess::create_on(std::shared_ptr<WorkspaceState> ws, const DispatchConfig& cfg,
                                 std::unique_ptr<DispatchHandle>* out, bool collective) {
  Communicator& comm = *ws->comm;
  if (collective) {
    EPMOE_RETURN_IF_ERROR(check_config_across_ranks(comm, cfg, nullptr));
    EPMOE_RETURN_IF_ERROR(DispatchHandle::validate(comm, cfg));
  }
  auto m = std::make_unique<DispatchHandle::Impl>();
  m->cfg = cfg;
  m->shape = comm_shape(comm.size(), cfg);
  // The buffers' room: offsets follow it, so every handle on this state finds each region at the
  // same place (layout::CommCapacity). T_max is the state's.
  m->shape.max_tokens = ws->shape.max_tokens;
  m->shape.cap = ws->shape.cap;
  m->pool_layout = layout::ExpertPoolLayout{layout::pool_shape_for(m->shape, cfg.intermediate, cfg.row_align)};
  m->offsets = layout::comm_offsets(m->shape, m->pool_layout);
  const layout::CommSymLayout mine{m->shape}, room{ws->shape};
  const layout::CommLocalLayout mine_loc{m->shape}, room_loc{ws->shape};
  if (mine.num_bytes() != room.num_bytes() || mine_loc.num_bytes() != room_loc.num_bytes() ||
      m->pool_layout.num_bytes() > ws->pool_bytes)
    return Status(StatusCode::kInternal,
                  "DispatchHandle on a workspace: the shape's buffers (symmetric " + std::to_string(mine.num_bytes()) +
                      ", local " + std::to_string(mine_loc.num_bytes()) + ", pool " +
                      std::to_string(m->pool_layout.num_bytes()) + " bytes) do not match the workspace's (" +
                      std::to_string(room.num_bytes()) + ", " + std::to_string(room_loc.num_bytes()) + ", " +
                      std::to_string(ws->pool_bytes) + "); a bug in the fit check");
  m->num_blocks = cfg.num_blocks > 0 && cfg.num_blocks < ws->num_blocks ? cfg.num_blocks : ws->num_blocks;
  m->overrides = tuning_overrides();
  m->ws = std::move(ws);
  out->reset(new DispatchHandle(std::move(m)));
  return Status::Ok();
}

void DispatchAccess::set_last_tokens(DispatchHandle& h, int64_t num_tokens) { h.impl_->last_tokens = num_tokens; }
void DispatchAccess::set_phase_stamps(DispatchHandle& h, unsigned long long* stamps) { h.impl_->phase_ts = stamps; }

}  // namespace detail

Status DispatchHandle::check_errors(cudaStream_t stream) {
  Impl& m = *impl_;
  const cudaError_t sync = cudaStreamSynchronize(stream);
  if (sync != cudaSuccess) {
    std::ostringstream os;
    os << "rank " << m.comm().rank() << ": ";
    // Why read the record now: a bounded wait that expires writes it (host memory) and traps, which
    // kills the context; the status word can no longer be read, the record still can.
    if (m.ws->timeout_recorded()) {
      os << "a device-side wait timed out and trapped: " << m.ws->timeout_line()
         << ". Likely a peer rank stalled, died, skipped the call or issued dispatch/combine/forward calls in a "
         << "different order. cudaStreamSynchronize failed: " << cudaGetErrorName(sync) << " ("
         << cudaGetErrorString(sync) << "). The CUDA context is unusable after this; restart the process";
      return Status(StatusCode::kTimeout, os.str());
    }
    os << "cudaStreamSynchronize failed: " << cudaGetErrorName(sync) << " (" << cudaGetErrorString(sync)
       << "). No wait of this handle's kernels recorded a timeout (timeout_seconds=" << m.cfg.timeout_seconds
       << "), so this is another device fault, or a timeout in a kernel of another handle or layer "
       << "(its check_errors / check_device_error names it). The CUDA context is unusable after such an "
       << "error; restart the process";
    return Status(StatusCode::kCudaError, os.str());
  }
  const layout::CommLocalLayout loc{m.shape};
  uint32_t word = 0;
  EPMOE_CUDA_RETURN(cudaMemcpy(&word, m.ws->local_ws + loc.status_offset(), 4, cudaMemcpyDeviceToHost));
  if (word != 0) EPMOE_CUDA_RETURN(cudaMemset(m.ws->local_ws + loc.status_offset(), 0, 4));
  // Bad routing comes from the host record (it names the slot); the status bit only says that
  // some call had it, and a forward may have returned that report already.
  const Status routing = detail::DispatchAccess::take_device_error(*this);
  if ((word & comm::kStatusInternal) == 0) return routing;
  std::ostringstream os;
  os << "rank " << m.comm().rank() << ": dispatch/combine recorded an internal row-index error (status 0x" << std::hex
     << word << std::dec << "; a bug)";
  if (!routing.ok()) os << "; also: " << routing.message();
  return Status(StatusCode::kInternal, os.str());
}

}  // namespace epmoe
