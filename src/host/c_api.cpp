// The C interface of include/epmoe/c_api.h: thin wrappers that convert arguments, make the
// communicator's device current, call the C++ API and turn its Status into a code plus a
// thread-local message.
#include "epmoe/c_api.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "epmoe/comm.h"
#include "epmoe/config.h"
#include "epmoe/dispatch.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"
#include "epmoe/status.h"
#include "epmoe/version.h"
#include "host/c_api_handles.h"
#include "host/c_guard.h"
#include "host/check.h"
#include "host/comm_internal.h"
#include "host/dispatch_internal.h"
#include "host/layer_impl.h"

// The Python package mirrors the struct field by field (python/epmoe/_lib.py checks this size).
static_assert(sizeof(epmoe_layer_config) == 56, "epmoe_layer_config changed: bump EPMOE_C_API_VERSION and _lib.py");
// The Python package mirrors it too (python/epmoe/_lib.py: ForwardArgsC and the pack format "=7Qq2i",
// whose offsets python/tests/test_cpu.py checks against these).
static_assert(sizeof(epmoe_forward_args) == 72 && offsetof(epmoe_forward_args, x) == 0 &&
                  offsetof(epmoe_forward_args, topk_idx) == 8 && offsetof(epmoe_forward_args, topk_weights) == 16 &&
                  offsetof(epmoe_forward_args, y) == 24 && offsetof(epmoe_forward_args, expert_counts) == 32 &&
                  offsetof(epmoe_forward_args, expert_counts_total) == 40 && offsetof(epmoe_forward_args, stream) == 48 &&
                  offsetof(epmoe_forward_args, num_tokens) == 56 && offsetof(epmoe_forward_args, idx_type) == 64 &&
                  offsetof(epmoe_forward_args, path) == 68,
              "epmoe_forward_args changed: bump EPMOE_C_API_VERSION and _lib.py");
static_assert(sizeof(ncclUniqueId) == EPMOE_UNIQUE_ID_BYTES, "EPMOE_UNIQUE_ID_BYTES != sizeof(ncclUniqueId)");
static_assert(EPMOE_INVALID_ARGUMENT == int(epmoe::StatusCode::kInvalidArgument) &&
                  EPMOE_INTERNAL == int(epmoe::StatusCode::kInternal),
              "C status codes must equal epmoe::StatusCode");
static_assert(EPMOE_DTYPE_FP8 == int(epmoe::DType::kFP8) && EPMOE_DTYPE_BF16 == int(epmoe::DType::kBF16),
              "C dtype codes must equal epmoe::DType");
static_assert(EPMOE_PATH_PIPELINE == int(epmoe::Path::kPipeline) && EPMOE_PATH_FUSED == int(epmoe::Path::kFused) &&
                  EPMOE_PATH_AUTO == int(epmoe::Path::kAuto),
              "C path codes must equal epmoe::Path");

namespace {

using epmoe::Status;
using epmoe::StatusCode;
using epmoe::detail::invalid;

thread_local std::string t_last_error;

// Runs `body` (returning Status) under the C boundary's convention (host/c_guard.h).
template <class Body>
int guarded(Body&& body) {
  return epmoe::detail::guarded_call(t_last_error, std::forward<Body>(body));
}

[[maybe_unused]] Status unsupported_until(const char* what) {
  return Status(StatusCode::kUnsupported,
                std::string(what) + " is not in this build of libepmoe_c (its implementation had not "
                "landed when the library was configured); rebuild after it does");
}


Status to_config(const epmoe_layer_config* c, epmoe::LayerConfig* out) {
  if (!c) return invalid("config is null");
  if (c->dtype != EPMOE_DTYPE_FP8 && c->dtype != EPMOE_DTYPE_BF16)
    return invalid("dtype=", c->dtype, " must be EPMOE_DTYPE_FP8 (0) or EPMOE_DTYPE_BF16 (1)");
  out->num_ranks = c->num_ranks;
  out->num_experts = c->num_experts;
  out->hidden = c->hidden;
  out->intermediate = c->intermediate;
  out->topk = c->topk;
  out->max_tokens_per_rank = c->max_tokens_per_rank;
  out->dtype = static_cast<epmoe::DType>(c->dtype);
  out->activation_clamp = c->activation_clamp;
  out->pow2_scales = c->pow2_scales != 0;
  if (c->combine_partials != EPMOE_PARTIALS_FP32 && c->combine_partials != EPMOE_PARTIALS_BF16)
    return invalid("combine_partials=", c->combine_partials,
                   " must be EPMOE_PARTIALS_FP32 (0) or EPMOE_PARTIALS_BF16 (1)");
  out->combine_partials = c->combine_partials == EPMOE_PARTIALS_BF16 ? epmoe::PartialPrecision::kBFloat16
                                                                      : epmoe::PartialPrecision::kFloat32;
  // 0 keeps LayerConfig's default; any other value goes to validation as given.
  if (c->timeout_seconds != 0.0) out->timeout_seconds = c->timeout_seconds;
  out->strict_routing = c->strict_routing != 0;
  if (c->reserved != 0) return invalid("reserved=", c->reserved, " must be 0");
  return Status::Ok();
}

void from_config(const epmoe::LayerConfig& c, epmoe_layer_config* out) {
  out->num_ranks = c.num_ranks;
  out->num_experts = c.num_experts;
  out->hidden = c.hidden;
  out->intermediate = c.intermediate;
  out->topk = c.topk;
  out->max_tokens_per_rank = c.max_tokens_per_rank;
  out->dtype = static_cast<int32_t>(c.dtype);
  out->activation_clamp = c.activation_clamp;
  out->pow2_scales = c.pow2_scales ? 1 : 0;
  out->combine_partials = c.combine_partials == epmoe::PartialPrecision::kBFloat16 ? EPMOE_PARTIALS_BF16
                                                                                     : EPMOE_PARTIALS_FP32;
  out->timeout_seconds = c.timeout_seconds;
  out->strict_routing = c.strict_routing ? 1 : 0;
  out->reserved = 0;
}

Status check_device_index(int device) {
  int count = 0;
  EPMOE_CUDA_RETURN(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count)
    return invalid("device=", device, " must be in [0, ", count, ") (visible CUDA devices)");
  return Status::Ok();
}

Status to_dispatch_config(const epmoe_dispatch_config* c, epmoe::DispatchConfig* out) {
  if (!c) return invalid("config is null");
  if (c->dtype != EPMOE_DTYPE_FP8 && c->dtype != EPMOE_DTYPE_BF16)
    return invalid("dtype=", c->dtype, " must be EPMOE_DTYPE_FP8 (0) or EPMOE_DTYPE_BF16 (1)");
  if (c->combine_partials != EPMOE_PARTIALS_FP32 && c->combine_partials != EPMOE_PARTIALS_BF16)
    return invalid("combine_partials=", c->combine_partials,
                   " must be EPMOE_PARTIALS_FP32 (0) or EPMOE_PARTIALS_BF16 (1)");
  out->num_experts = c->num_experts;
  out->hidden = c->hidden;
  out->topk = c->topk;
  out->max_tokens_per_rank = c->max_tokens_per_rank;
  out->row_align = c->row_align;
  out->intermediate = c->intermediate;
  out->dtype = static_cast<epmoe::DType>(c->dtype);
  out->pow2_scales = c->pow2_scales != 0;
  out->combine_partials = c->combine_partials == EPMOE_PARTIALS_BF16
                              ? epmoe::PartialPrecision::kBFloat16
                              : epmoe::PartialPrecision::kFloat32;
  out->num_blocks = c->num_blocks;
  out->timeout_seconds = c->timeout_seconds;
  return Status::Ok();
}

// The device that holds `p` (device or managed memory CUDA knows), for messages naming `name`.
Status device_of(const void* p, const char* name, int* device) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return invalid(name, "=", p, " is not memory CUDA knows (", cudaGetErrorName(e), ")");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return invalid(name, "=", p, " must be device memory (it is ",
                   attr.type == cudaMemoryTypeHost ? "pinned host memory" : "unregistered host memory", ")");
  *device = attr.device;
  return Status::Ok();
}

Status check_dispatch(const epmoe_dispatch* h) {
  if (!h || !h->handle) return invalid("dispatch handle is null (destroyed or never created)");
  return Status::Ok();
}

Status check_layer(const epmoe_layer* layer) {
  if (!layer || !layer->layer) return invalid("layer is null (destroyed or never created)");
  return Status::Ok();
}

// Fills the wrapper (allocated before the collective create, so that nothing can fail on one
// rank after every rank created its communicator).
Status fill_comm(std::unique_ptr<epmoe::Communicator> c, std::unique_ptr<epmoe_comm> wrapper, epmoe_comm** out) {
  wrapper->rank = c->rank();
  wrapper->size = c->size();
  wrapper->device = c->device();
  wrapper->comm = c.release();
  *out = wrapper.release();
  return Status::Ok();
}

}  // namespace

extern "C" {

// ---- library ------------------------------------------------------------------------------------

int epmoe_c_api_version(void) { return EPMOE_C_API_VERSION; }

const char* epmoe_version_string(void) { return epmoe::version_string(); }

const char* epmoe_status_name(int status) {
  if (status < EPMOE_OK || status > EPMOE_INTERNAL) return "Unknown";
  return epmoe::status_code_name(static_cast<StatusCode>(status));
}

const char* epmoe_last_error(void) { return t_last_error.c_str(); }

int epmoe_nccl_runtime_version(int* version_code) {
  return guarded([&] { return epmoe::check_nccl_runtime_version(version_code); });
}

// ---- validation ---------------------------------------------------------------------------------

Status to_ws_config(const epmoe_workspace_config* c, epmoe::WorkspaceConfig* out) {
  if (!c) return invalid("workspace config is null");
  if (c->dtype != EPMOE_DTYPE_FP8 && c->dtype != EPMOE_DTYPE_BF16)
    return invalid("WorkspaceConfig.dtype=", c->dtype, " must be EPMOE_DTYPE_FP8 (0) or EPMOE_DTYPE_BF16 (1)");
  if (c->reserved != 0) return invalid("WorkspaceConfig.reserved=", c->reserved, " must be 0");
  out->num_ranks = c->num_ranks;
  out->max_experts_per_rank = c->max_experts_per_rank;
  out->max_hidden = c->max_hidden;
  out->max_intermediate = c->max_intermediate;
  out->max_topk = c->max_topk;
  out->max_tokens_per_rank = c->max_tokens_per_rank;
  out->dtype = static_cast<epmoe::DType>(c->dtype);
  out->timeout_seconds = c->timeout_seconds == 0 ? epmoe::WorkspaceConfig{}.timeout_seconds : c->timeout_seconds;
  return Status::Ok();
}

int epmoe_validate_workspace_config(const epmoe_workspace_config* cfg) {
  return guarded([&] {
    epmoe::WorkspaceConfig c;
    EPMOE_RETURN_IF_ERROR(to_ws_config(cfg, &c));
    return epmoe::validate(c);
  });
}

int epmoe_workspace_sizes(const epmoe_workspace_config* cfg, int64_t* symmetric, int64_t* local, int64_t* pool) {
  return guarded([&] {
    epmoe::WorkspaceConfig c;
    EPMOE_RETURN_IF_ERROR(to_ws_config(cfg, &c));
    EPMOE_RETURN_IF_ERROR(epmoe::validate(c));
    const epmoe::WorkspaceSizes z = epmoe::workspace_sizes(c);
    if (symmetric) *symmetric = z.symmetric;
    if (local) *local = z.local;
    if (pool) *pool = z.pool;
    return Status::Ok();
  });
}

int epmoe_check_layer_fits(const epmoe_workspace_config* ws, const epmoe_layer_config* layer) {
  return guarded([&] {
    epmoe::WorkspaceConfig w;
    EPMOE_RETURN_IF_ERROR(to_ws_config(ws, &w));
    EPMOE_RETURN_IF_ERROR(epmoe::validate(w));
    epmoe::LayerConfig l;
    EPMOE_RETURN_IF_ERROR(to_config(layer, &l));
    if (l.num_ranks == 0) l.num_ranks = w.num_ranks;
    return epmoe::check_fits(w, l);
  });
}

int epmoe_w13_transform_bytes(int dtype, int experts_per_rank, int intermediate, int hidden, int64_t* weight_bytes,
                              int64_t* scale_bytes) {
  return guarded([&]() -> Status {
    if (dtype != EPMOE_DTYPE_FP8 && dtype != EPMOE_DTYPE_BF16)
      return invalid("dtype=", dtype, " must be EPMOE_DTYPE_FP8 (0) or EPMOE_DTYPE_BF16 (1)");
    if (experts_per_rank < 1) return invalid("experts_per_rank=", experts_per_rank, " must be >= 1");
    if (intermediate <= 0 || intermediate % 128 != 0)
      return invalid("intermediate=", intermediate, " must be a positive multiple of 128");
    if (hidden <= 0 || hidden % 128 != 0) return invalid("hidden=", hidden, " must be a positive multiple of 128");
    const epmoe::W13Bytes b =
        epmoe::w13_transform_bytes(static_cast<epmoe::DType>(dtype), experts_per_rank, intermediate, hidden);
    if (weight_bytes) *weight_bytes = b.weight;
    if (scale_bytes) *scale_bytes = b.scale;
    return Status::Ok();
  });
}

int epmoe_transform_w13(int dtype, const void* w13, const float* w13_scale, void* out, float* out_scale,
                        int experts_per_rank, int intermediate, int hidden, void* stream) {
  return guarded([&]() -> Status {
    if (dtype != EPMOE_DTYPE_FP8 && dtype != EPMOE_DTYPE_BF16)
      return invalid("dtype=", dtype, " must be EPMOE_DTYPE_FP8 (0) or EPMOE_DTYPE_BF16 (1)");
    if (!w13) return invalid("transform_w13: w13 is null");
    if (!out) return invalid("transform_w13: out is null");
    // Why: the caller's current device may be another one (a framework's); the kernel runs where
    // the weights are, and every buffer must be there.
    int device = -1;
    EPMOE_RETURN_IF_ERROR(device_of(w13, "w13", &device));
    const struct { const void* p; const char* name; } others[3] = {{w13_scale, "w13_scale"}, {out, "out"},
                                                                  {out_scale, "out_scale"}};
    for (const auto& o : others) {
      if (!o.p) continue;
      int d = -1;
      EPMOE_RETURN_IF_ERROR(device_of(o.p, o.name, &d));
      if (d != device) return invalid("transform_w13: ", o.name, " is on device ", d, " but w13 on device ", device);
    }
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(device));
    return epmoe::transform_w13(static_cast<epmoe::DType>(dtype), w13, w13_scale, out, out_scale, experts_per_rank,
                                intermediate, hidden, static_cast<cudaStream_t>(stream));
  });
}

int epmoe_validate_config(const epmoe_layer_config* cfg) {
  return guarded([&] {
    epmoe::LayerConfig c;
    EPMOE_RETURN_IF_ERROR(to_config(cfg, &c));
    return epmoe::validate(c);
  });
}

int epmoe_validate_call(const epmoe_layer_config* cfg, int64_t num_tokens, const void* x,
                        const void* topk_idx, const void* topk_weights, const void* y) {
  return guarded([&] {
    epmoe::LayerConfig c;
    EPMOE_RETURN_IF_ERROR(to_config(cfg, &c));
    return epmoe::validate_call(c, num_tokens, x, topk_idx, topk_weights, y);
  });
}

int epmoe_validate_routing_host(const epmoe_layer_config* cfg, int64_t num_tokens,
                                const int32_t* topk_idx) {
  return guarded([&] {
    epmoe::LayerConfig c;
    EPMOE_RETURN_IF_ERROR(to_config(cfg, &c));
    return epmoe::validate_routing_host(c, num_tokens, topk_idx);
  });
}

// ---- communicator -------------------------------------------------------------------------------

int epmoe_get_unique_id(uint8_t* out) {
  return guarded([&]() -> Status {
    if (!out) return invalid("out is null");
    EPMOE_RETURN_IF_ERROR(epmoe::check_nccl_runtime_version());
    ncclUniqueId id;
    EPMOE_NCCL_RETURN(ncclGetUniqueId(&id));
    std::memcpy(out, &id, sizeof(id));
    return Status::Ok();
  });
}

int epmoe_comm_create(const uint8_t* unique_id, int rank, int size, int device, epmoe_comm** out) {
  return guarded([&]() -> Status {
    if (out) *out = nullptr;
    // Without these this rank cannot join the NCCL init: it fails alone, and its peers' init ends
    // with EPMOE_TIMEOUT after their bound.
    if (!unique_id) return invalid("unique_id is null");
    if (size < 1 || size > epmoe::kMaxCommRanks)
      return invalid("size=", size, " must be in [1, ", epmoe::kMaxCommRanks, "]");
    if (rank < 0 || rank >= size) return invalid("rank=", rank, " must be in [0, size=", size, ")");
    EPMOE_RETURN_IF_ERROR(check_device_index(device));
    ncclUniqueId id;
    std::memcpy(&id, unique_id, sizeof(id));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(device));
    // Everything else is agreed with every rank inside the create.
    std::unique_ptr<epmoe_comm> wrapper(new (std::nothrow) epmoe_comm());
    Status local = out ? Status::Ok() : invalid("out is null");
    if (local.ok() && !wrapper) local = Status(StatusCode::kInternal, "out of host memory for the epmoe_comm wrapper");
    std::unique_ptr<epmoe::Communicator> c;
    EPMOE_RETURN_IF_ERROR(
        epmoe::detail::CommAccess::create(id, rank, size, local, epmoe::kDefaultHostTimeoutSeconds, &c));
    return fill_comm(std::move(c), std::move(wrapper), out);
  });
}

int epmoe_comm_from_nccl(uintptr_t nccl_comm, epmoe_comm** out) {
  return guarded([&]() -> Status {
    if (out) *out = nullptr;
    // Without a communicator (and its device) this rank cannot take part: it fails alone.
    if (nccl_comm == 0) return invalid("nccl_comm is null");
    auto comm = reinterpret_cast<ncclComm_t>(nccl_comm);
    int device = -1;
    EPMOE_NCCL_RETURN(ncclCommCuDevice(comm, &device));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(device));
    std::unique_ptr<epmoe_comm> wrapper(new (std::nothrow) epmoe_comm());
    Status local = out ? Status::Ok() : invalid("out is null");
    if (local.ok() && !wrapper) local = Status(StatusCode::kInternal, "out of host memory for the epmoe_comm wrapper");
    std::unique_ptr<epmoe::Communicator> c;
    EPMOE_RETURN_IF_ERROR(epmoe::detail::CommAccess::wrap(comm, local, epmoe::kDefaultHostTimeoutSeconds, &c));
    return fill_comm(std::move(c), std::move(wrapper), out);
  });
}

int epmoe_comm_info(const epmoe_comm* comm, int* rank, int* size, int* device) {
  return guarded([&]() -> Status {
    if (!comm) return invalid("comm is null");
    if (rank) *rank = comm->rank;
    if (size) *size = comm->size;
    if (device) *device = comm->device;
    return Status::Ok();
  });
}

int epmoe_comm_destroy(epmoe_comm* comm) {
  return guarded([&]() -> Status {
    if (!comm) return Status::Ok();
    if (comm->comm) {
      epmoe::detail::DeviceScope guard;
      // Free even if the device switch failed, and report success: the object is gone either way, and
      // a non-OK return would tell the caller it still holds it (Python would free it again).
      (void)guard.enter(comm->device);
      // Why close first: it fails (and frees nothing) while a layer or dispatch handle made from this
      // communicator lives; the wrapper then stays valid.
      EPMOE_RETURN_IF_ERROR(comm->comm->close());
      delete comm->comm;
      comm->comm = nullptr;
      delete comm;
      return Status::Ok();
    }
    delete comm;
    return Status::Ok();
  });
}

// ---- layer --------------------------------------------------------------------------------------

int epmoe_layer_create(epmoe_comm* comm, const epmoe_layer_config* cfg, epmoe_layer** out) {
  return guarded([&]() -> Status {
    if (out) *out = nullptr;
    // Without a communicator (and its device) this rank cannot take part: it fails alone.
    if (!comm || !comm->comm) return invalid("comm is null");
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(comm->device));
    // Every other check joins the create's first agreement: a rank that returned here alone would
    // leave its peers waiting in it until their timeout.
    std::unique_ptr<epmoe_layer> wrapper(new (std::nothrow) epmoe_layer());
    Status local = out ? Status::Ok() : invalid("out is null");
    epmoe::LayerConfig c;
    if (local.ok()) local = to_config(cfg, &c);
    if (local.ok() && c.num_ranks == 0) c.num_ranks = comm->size;
    if (local.ok() && !wrapper) local = Status(StatusCode::kInternal, "out of host memory for the epmoe_layer wrapper");
    std::unique_ptr<epmoe::MoELayer> layer;
    EPMOE_RETURN_IF_ERROR(epmoe::detail::create_layer(*comm->comm, c, local, &layer));
    wrapper->layer = layer.release();
    wrapper->comm = comm;
    wrapper->cfg = c;
    *out = wrapper.release();
    return Status::Ok();
  });
}

int epmoe_layer_get_config(const epmoe_layer* layer, epmoe_layer_config* cfg) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    if (!cfg) return invalid("cfg is null");
    from_config(layer->cfg, cfg);
    return Status::Ok();
  });
}

int epmoe_layer_last_path(const epmoe_layer* layer, int* path) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    if (!path) return invalid("path is null");
    *path = static_cast<int>(layer->layer->last_path());
    return Status::Ok();
  });
}

int epmoe_layer_load_weights(epmoe_layer* layer, const void* w1, const float* w1_scale,
                             const void* w2, const float* w2_scale, int on_device, void* stream) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    if (!w1) return invalid("w1 is null");
    if (!w2) return invalid("w2 is null");
    const bool fp8 = layer->cfg.dtype == epmoe::DType::kFP8;
    if (fp8 && (!w1_scale || !w2_scale))
      return invalid("w1_scale and w2_scale are required in FP8 mode");
    if (!fp8 && (w1_scale || w2_scale))
      return invalid("w1_scale and w2_scale must be null in BF16 mode");
    epmoe::ExpertWeights w;
    w.w1 = w1;
    w.w1_scale = w1_scale;
    w.w2 = w2;
    w.w2_scale = w2_scale;
    w.on_device = on_device != 0;
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(layer->comm->device));
    return layer->layer->load_weights(w, static_cast<cudaStream_t>(stream));
  });
}

int epmoe_layer_forward(epmoe_layer* layer, const void* x, const int32_t* topk_idx,
                        const float* topk_weights, void* y, int64_t num_tokens, void* stream,
                        int path) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    if (path != EPMOE_PATH_PIPELINE && path != EPMOE_PATH_FUSED && path != EPMOE_PATH_AUTO)
      return invalid("path=", path, " must be EPMOE_PATH_PIPELINE (0), EPMOE_PATH_FUSED (1) or EPMOE_PATH_AUTO (2)");
    EPMOE_RETURN_IF_ERROR(epmoe::validate_call(layer->cfg, num_tokens, x, topk_idx, topk_weights, y));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(layer->comm->device));
    return layer->layer->forward(x, topk_idx, topk_weights, y, num_tokens,
                                 static_cast<cudaStream_t>(stream), static_cast<epmoe::Path>(path));
  });
}

int epmoe_layer_forward_ex(epmoe_layer* layer, const void* x, const void* topk_idx, int idx_type,
                           const float* topk_weights, void* y, int64_t num_tokens, int32_t* expert_counts,
                           int64_t* expert_counts_total, void* stream, int path) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    if (path != EPMOE_PATH_PIPELINE && path != EPMOE_PATH_FUSED && path != EPMOE_PATH_AUTO)
      return invalid("path=", path, " must be EPMOE_PATH_PIPELINE (0), EPMOE_PATH_FUSED (1) or EPMOE_PATH_AUTO (2)");
    if (idx_type != EPMOE_INDEX_INT32 && idx_type != EPMOE_INDEX_INT64)
      return invalid("idx_type=", idx_type, " must be EPMOE_INDEX_INT32 (0) or EPMOE_INDEX_INT64 (1)");
    epmoe::ForwardArgs a;
    a.x = x;
    a.topk_idx = topk_idx;
    a.idx_type = idx_type == EPMOE_INDEX_INT64 ? epmoe::IndexType::kInt64 : epmoe::IndexType::kInt32;
    a.topk_weights = topk_weights;
    a.y = y;
    a.num_tokens = num_tokens;
    a.expert_counts = expert_counts;
    a.expert_counts_total = expert_counts_total;
    EPMOE_RETURN_IF_ERROR(epmoe::validate_call(layer->cfg, num_tokens, x, topk_idx, a.idx_type, topk_weights, y));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(layer->comm->device));
    return layer->layer->forward(a, static_cast<cudaStream_t>(stream), static_cast<epmoe::Path>(path));
  });
}

int epmoe_layer_forward_args(epmoe_layer* layer, const epmoe_forward_args* args) {
  if (!args) return guarded([&]() -> Status { return invalid("args is null"); });
  return epmoe_layer_forward_ex(layer, args->x, args->topk_idx, args->idx_type, args->topk_weights, args->y,
                                args->num_tokens, args->expert_counts, args->expert_counts_total, args->stream,
                                args->path);
}

// ---- workspace ----------------------------------------------------------------------------------

int epmoe_workspace_create(epmoe_comm* comm, const epmoe_workspace_config* cfg, epmoe_workspace** out) {
  return guarded([&]() -> Status {
    if (!out) return invalid("out is null");
    *out = nullptr;
    if (!comm || !comm->comm) return invalid("comm is null");
    epmoe::WorkspaceConfig c;
    EPMOE_RETURN_IF_ERROR(to_ws_config(cfg, &c));
    if (c.num_ranks == 0) c.num_ranks = comm->size;
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(comm->device));
    std::unique_ptr<epmoe::Workspace> ws;
    EPMOE_RETURN_IF_ERROR(epmoe::Workspace::create(*comm->comm, c, &ws));
    auto wrapper = std::make_unique<epmoe_workspace>();
    wrapper->ws = ws.release();
    wrapper->comm = comm;
    *out = wrapper.release();
    return Status::Ok();
  });
}

int epmoe_workspace_get_config(const epmoe_workspace* ws, epmoe_workspace_config* cfg) {
  return guarded([&]() -> Status {
    if (!ws || !ws->ws) return invalid("workspace is null (destroyed or never created)");
    if (!cfg) return invalid("cfg is null");
    const epmoe::WorkspaceConfig& c = ws->ws->config();
    *cfg = epmoe_workspace_config{};
    cfg->num_ranks = c.num_ranks;
    cfg->max_experts_per_rank = c.max_experts_per_rank;
    cfg->max_hidden = c.max_hidden;
    cfg->max_intermediate = c.max_intermediate;
    cfg->max_topk = c.max_topk;
    cfg->max_tokens_per_rank = c.max_tokens_per_rank;
    cfg->dtype = static_cast<int32_t>(c.dtype);
    cfg->timeout_seconds = c.timeout_seconds;
    return Status::Ok();
  });
}

int epmoe_workspace_nbytes(const epmoe_workspace* ws, int64_t* bytes) {
  return guarded([&]() -> Status {
    if (!ws || !ws->ws) return invalid("workspace is null (destroyed or never created)");
    if (!bytes) return invalid("bytes is null");
    *bytes = ws->ws->nbytes();
    return Status::Ok();
  });
}

int epmoe_workspace_num_layers(const epmoe_workspace* ws, int32_t* count) {
  return guarded([&]() -> Status {
    if (!ws || !ws->ws) return invalid("workspace is null (destroyed or never created)");
    if (!count) return invalid("count is null");
    *count = ws->ws->num_layers();
    return Status::Ok();
  });
}

int epmoe_workspace_destroy(epmoe_workspace* ws) {
  return guarded([&]() -> Status {
    if (!ws) return Status::Ok();
    if (ws->ws) {
      epmoe::detail::DeviceScope guard;
      // Release even if the device switch failed (see epmoe_comm_destroy).
      (void)guard.enter(ws->comm->device);
      // Why close first: it fails (and releases nothing) while a layer created on this workspace
      // lives; the handle then stays valid.
      EPMOE_RETURN_IF_ERROR(ws->ws->close());
      delete ws->ws;
      ws->ws = nullptr;
    }
    delete ws;
    return Status::Ok();
  });
}

int epmoe_layer_create_on(epmoe_workspace* ws, const epmoe_layer_config* cfg, const epmoe_weight_refs* weights,
                          epmoe_layer** out) {
  return guarded([&]() -> Status {
    if (out) *out = nullptr;
    // Without a workspace (and its communicator) this rank cannot take part: it fails alone.
    if (!ws || !ws->ws) return invalid("workspace is null (destroyed or never created)");
    // Every other check joins the create's first agreement, as in epmoe_layer_create.
    Status local = out ? Status::Ok() : invalid("out is null");
    epmoe::LayerConfig c;
    if (local.ok()) local = to_config(cfg, &c);
    if (local.ok() && c.num_ranks == 0) c.num_ranks = ws->comm->size;
    epmoe::ExpertWeightRefs refs;
    if (weights) {
      refs.w13 = weights->w13;
      refs.w13_scale = weights->w13_scale;
      refs.w2 = weights->w2;
      refs.w2_scale = weights->w2_scale;
    }
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(ws->comm->device));
    std::unique_ptr<epmoe::MoELayer> layer;
    EPMOE_RETURN_IF_ERROR(epmoe::detail::create_layer_on(*ws->ws, c, local, &layer, weights ? &refs : nullptr));
    auto wrapper = std::make_unique<epmoe_layer>();
    wrapper->layer = layer.release();
    wrapper->comm = ws->comm;
    wrapper->cfg = c;
    *out = wrapper.release();
    return Status::Ok();
  });
}

int epmoe_layer_check_device_error(epmoe_layer* layer, void* stream) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_layer(layer));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(layer->comm->device));
    return layer->layer->check_device_error(static_cast<cudaStream_t>(stream));
  });
}

int epmoe_layer_destroy(epmoe_layer* layer) {
  return guarded([&]() -> Status {
    if (!layer) return Status::Ok();
    std::unique_ptr<epmoe_layer> owned(layer);
    if (owned->layer) {
      epmoe::detail::DeviceScope guard;
      // Free even if the device switch failed, and report success (see epmoe_comm_destroy).
      (void)guard.enter(owned->comm->device);
      delete owned->layer;
      return Status::Ok();
    }
    return Status::Ok();
  });
}

// ---- standalone dispatch / combine ---------------------------------------------------------------

int epmoe_dispatch_create(epmoe_comm* comm, const epmoe_dispatch_config* cfg, epmoe_dispatch** out) {
  return guarded([&]() -> Status {
    if (out) *out = nullptr;
    // Without a communicator (and its device) this rank cannot take part: it fails alone.
    if (!comm || !comm->comm) return invalid("comm is null");
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(comm->device));
    // Every other check joins the create's first agreement (see epmoe_layer_create).
    std::unique_ptr<epmoe_dispatch> wrapper(new (std::nothrow) epmoe_dispatch());
    Status local = out ? Status::Ok() : invalid("out is null");
    epmoe::DispatchConfig c;
    if (local.ok()) local = to_dispatch_config(cfg, &c);
    if (local.ok() && !wrapper)
      local = Status(StatusCode::kInternal, "out of host memory for the epmoe_dispatch wrapper");
    std::unique_ptr<epmoe::DispatchHandle> handle;
    EPMOE_RETURN_IF_ERROR(epmoe::detail::DispatchAccess::create(*comm->comm, c, local, &handle));
    wrapper->handle = handle.release();
    wrapper->comm = comm;
    *out = wrapper.release();
    return Status::Ok();
  });
}

int epmoe_dispatch_get_pool(const epmoe_dispatch* h, epmoe_pool_view* view) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_dispatch(h));
    if (!view) return invalid("view is null");
    const epmoe::ExpertPoolView p = h->handle->pool();
    view->base = p.base;
    view->bytes = p.bytes;
    view->max_rows = p.max_rows;
    view->scale_stride = p.scale_stride;
    view->x_pool = p.x_pool;
    view->x_scale = p.x_scale;
    view->row_weight = p.row_weight;
    view->row_source = p.row_source;
    view->a_pool = p.a_pool;
    view->a_scale = p.a_scale;
    view->o_pool = p.o_pool;
    view->expert_count = p.expert_count;
    view->expert_offset = p.expert_offset;
    return Status::Ok();
  });
}

int epmoe_dispatch_run(epmoe_dispatch* h, const void* x, const int32_t* topk_idx,
                       const float* topk_weights, int64_t num_tokens, void* stream) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_dispatch(h));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(h->comm->device));
    return h->handle->dispatch(x, topk_idx, topk_weights, num_tokens,
                               static_cast<cudaStream_t>(stream));
  });
}

int epmoe_combine_run(epmoe_dispatch* h, void* y, int64_t num_tokens, void* stream) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_dispatch(h));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(h->comm->device));
    return h->handle->combine(y, num_tokens, static_cast<cudaStream_t>(stream));
  });
}

int epmoe_dispatch_check_errors(epmoe_dispatch* h, void* stream) {
  return guarded([&]() -> Status {
    EPMOE_RETURN_IF_ERROR(check_dispatch(h));
    epmoe::detail::DeviceScope guard;
    EPMOE_RETURN_IF_ERROR(guard.enter(h->comm->device));
    return h->handle->check_errors(static_cast<cudaStream_t>(stream));
  });
}

int epmoe_dispatch_destroy(epmoe_dispatch* h) {
  return guarded([&]() -> Status {
    if (!h) return Status::Ok();
    std::unique_ptr<epmoe_dispatch> owned(h);
    if (owned->handle) {
      epmoe::detail::DeviceScope guard;
      // Free even if the device switch failed, and report success (see epmoe_comm_destroy).
      (void)guard.enter(owned->comm->device);
      delete owned->handle;
      return Status::Ok();
    }
    return Status::Ok();
  });
}

}  // extern "C"
