// epmoe: a C interface over the C++ API, for language bindings (the Python package loads it
// through ctypes from libepmoe_c.so).
//
// Conventions:
//  - Every fallible function returns an `int` status: EPMOE_OK (0) or one of the codes below,
//    which equal the values of epmoe::StatusCode. On failure, epmoe_last_error() returns the
//    library's message for the failing call on the calling thread.
//  - Handles are opaque. Streams are cudaStream_t values passed as `void*` (NULL is the legacy
//    default stream). Device pointers are plain `void*`.
//  - No function throws; a C++ exception inside becomes EPMOE_INTERNAL with its what().
//  - Collective functions (comm create and wrap, layer and dispatch create and destroy) never
//    return early on one rank while its peers wait: every check of their arguments that one rank
//    can fail alone goes through a cross-rank agreement, and every rank returns an error naming
//    the failing ranks and causes. Only a rank that cannot take part at all (no communicator, no
//    valid rank, size, unique id or device) fails alone; its peers then fail with EPMOE_TIMEOUT
//    after their bound. docs/ARCHITECTURE.md ("Process model and errors") has the whole picture.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define EPMOE_C_EXPORT __attribute__((visibility("default")))
#else
#define EPMOE_C_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/// Bumped whenever a signature or a struct below changes; bindings check it at load time.
#define EPMOE_C_API_VERSION 5

/// Size of an ncclUniqueId, the token that bootstraps a communicator.
#define EPMOE_UNIQUE_ID_BYTES 128

/// Status codes (the values of epmoe::StatusCode).
enum {
  EPMOE_OK = 0,
  EPMOE_INVALID_ARGUMENT = 1,
  EPMOE_UNSUPPORTED = 2,
  EPMOE_CUDA_ERROR = 3,
  EPMOE_NCCL_ERROR = 4,
  EPMOE_TIMEOUT = 5,
  EPMOE_INTERNAL = 6,
};

/// Numeric mode (epmoe::DType).
enum { EPMOE_DTYPE_FP8 = 0, EPMOE_DTYPE_BF16 = 1 };

/// Implementation of a forward call (epmoe::Path).
enum { EPMOE_PATH_PIPELINE = 0, EPMOE_PATH_FUSED = 1, EPMOE_PATH_AUTO = 2 };

/// Mirror of epmoe::LayerConfig with fixed-width fields (see config.h for the allowed ranges).
typedef struct epmoe_layer_config {
  int32_t num_ranks;  ///< R; in epmoe_layer_create, 0 means "the communicator's size".
  int32_t num_experts;
  int32_t hidden;
  int32_t intermediate;
  int32_t topk;
  int32_t max_tokens_per_rank;
  int32_t dtype;             ///< EPMOE_DTYPE_*
  float activation_clamp;    ///< <= 0 disables the clamp
  int32_t pow2_scales;       ///< nonzero: round FP8 activation scales up to a power of two
  int32_t combine_partials;  ///< EPMOE_PARTIALS_* (0 = fp32, the default)
  double timeout_seconds;    ///< bound of every device wait and host collective, in (0, 3600]; 0: the default (10 s)
  int32_t strict_routing;    ///< nonzero: check the routing of every forward on the host first (debugging; syncs)
  int32_t reserved;          ///< 0
} epmoe_layer_config;

/// Precision of combine's partial sums (epmoe::PartialPrecision).
enum { EPMOE_PARTIALS_FP32 = 0, EPMOE_PARTIALS_BF16 = 1 };

/// Mirror of epmoe::DispatchConfig (see dispatch.h).
typedef struct epmoe_dispatch_config {
  int32_t num_experts;
  int32_t hidden;
  int32_t topk;
  int32_t max_tokens_per_rank;
  int32_t row_align;         ///< expert segments start at multiples of this (128 by default)
  int32_t intermediate;      ///< only sizes the pool's a_pool region (0: none)
  int32_t dtype;             ///< EPMOE_DTYPE_*
  int32_t pow2_scales;
  int32_t combine_partials;  ///< EPMOE_PARTIALS_*
  int32_t num_blocks;        ///< 0: one per SM
  double timeout_seconds;    ///< bound of every device-side wait for a peer
} epmoe_dispatch_config;

/// Mirror of epmoe::ExpertPoolView: device pointers into the expert-major pool.
typedef struct epmoe_pool_view {
  void* base;
  int64_t bytes;
  int64_t max_rows;
  int64_t scale_stride;
  void* x_pool;            ///< [max_rows][H] e4m3 or bf16
  float* x_scale;          ///< [H/128][scale_stride] (FP8 only, else NULL)
  float* row_weight;       ///< [max_rows]
  uint32_t* row_source;    ///< [max_rows]
  void* a_pool;            ///< [max_rows][I] (NULL when intermediate == 0)
  float* a_scale;
  uint16_t* o_pool;        ///< [max_rows][H] bf16, combine's input
  int32_t* expert_count;   ///< [E_loc]
  int32_t* expert_offset;  ///< [E_loc + 1]
} epmoe_pool_view;

/// Integer type of topk_idx in epmoe_layer_forward_ex (epmoe::IndexType).
enum { EPMOE_INDEX_INT32 = 0, EPMOE_INDEX_INT64 = 1 };

/// Mirror of epmoe::WorkspaceConfig (see workspace.h): the largest layer a workspace serves.
typedef struct epmoe_workspace_config {
  int32_t num_ranks;  ///< R; in epmoe_workspace_create, 0 means "the communicator's size".
  int32_t max_experts_per_rank;
  int32_t max_hidden;
  int32_t max_intermediate;
  int32_t max_topk;
  int32_t max_tokens_per_rank;
  int32_t dtype;            ///< EPMOE_DTYPE_FP8: FP8 layers only; EPMOE_DTYPE_BF16: BF16 and FP8 layers
  int32_t reserved;         ///< 0
  double timeout_seconds;   ///< bound of the create/destroy collectives; 0: the default (10 s)
} epmoe_workspace_config;

/// Weights by reference (epmoe::ExpertWeightRefs): device pointers the layer reads on every call.
/// w13 and w13_scale in the kernels' layout (epmoe_transform_w13's output), w2 and w2_scale in the
/// checkpoint layout. Scales NULL in BF16 mode.
typedef struct epmoe_weight_refs {
  const void* w13;
  const float* w13_scale;
  const void* w2;
  const float* w2_scale;
} epmoe_weight_refs;

typedef struct epmoe_workspace epmoe_workspace;  ///< an epmoe::Workspace
typedef struct epmoe_comm epmoe_comm;          ///< an epmoe::Communicator (owning or borrowed NCCL comm)
typedef struct epmoe_layer epmoe_layer;        ///< an epmoe::MoELayer plus the device it lives on
typedef struct epmoe_dispatch epmoe_dispatch;  ///< an epmoe::DispatchHandle

// ---- library ------------------------------------------------------------------------------------

/// EPMOE_C_API_VERSION of the loaded library.
EPMOE_C_EXPORT int epmoe_c_api_version(void);
/// "0.1.0".
EPMOE_C_EXPORT const char* epmoe_version_string(void);
/// "InvalidArgument", "CudaError", ... for a status code.
EPMOE_C_EXPORT const char* epmoe_status_name(int status);
/// The message of the last failing call on this thread ("" if none). Valid until the next epmoe
/// call on this thread.
EPMOE_C_EXPORT const char* epmoe_last_error(void);
/// Checks that the libnccl the loader picked is new enough; writes its version code (may be NULL).
EPMOE_C_EXPORT int epmoe_nccl_runtime_version(int* version_code);

// ---- validation (host only: usable without a GPU) ----------------------------------------------

/// epmoe::validate() on `cfg`.
EPMOE_C_EXPORT int epmoe_validate_config(const epmoe_layer_config* cfg);
/// epmoe::validate_call(): token count against T_max, pointers present for num_tokens > 0.
EPMOE_C_EXPORT int epmoe_validate_call(const epmoe_layer_config* cfg, int64_t num_tokens,
                                       const void* x, const void* topk_idx,
                                       const void* topk_weights, const void* y);
/// epmoe::validate_routing_host() on a host array topk_idx[num_tokens][cfg->topk].
EPMOE_C_EXPORT int epmoe_validate_routing_host(const epmoe_layer_config* cfg, int64_t num_tokens,
                                               const int32_t* topk_idx);

// ---- communicator -------------------------------------------------------------------------------

/// ncclGetUniqueId into `out` (EPMOE_UNIQUE_ID_BYTES bytes). One rank calls it and shares the bytes.
EPMOE_C_EXPORT int epmoe_get_unique_id(uint8_t* out);
/// Collective over `size` ranks: makes `device` current and creates an NCCL communicator from the
/// shared unique id. The returned communicator owns it and destroys it in epmoe_comm_destroy.
/// Bounded: a rank that does not join the NCCL init within 60 s makes the others fail with
/// EPMOE_TIMEOUT. A NULL unique_id, or a rank, size or device out of range, fails on that rank at
/// once (it cannot join); a NULL `out` or an old libnccl fails every rank, naming the rank.
EPMOE_C_EXPORT int epmoe_comm_create(const uint8_t* unique_id, int rank, int size, int device,
                                     epmoe_comm** out);
/// Collective: wraps an existing ncclComm_t (passed as an integer). The caller keeps ownership and
/// keeps it alive until epmoe_comm_destroy and every layer made from it are gone. A NULL `out` on
/// any rank fails every rank, naming it; a NULL nccl_comm fails on its rank alone. Each exchange
/// is bounded by 60 s.
EPMOE_C_EXPORT int epmoe_comm_from_nccl(uintptr_t nccl_comm, epmoe_comm** out);
/// Rank, size and CUDA device of a communicator (any output may be NULL).
EPMOE_C_EXPORT int epmoe_comm_info(const epmoe_comm* comm, int* rank, int* size, int* device);
/// Destroys the wrapper (and the NCCL communicator if it owns it). Fails with
/// EPMOE_INVALID_ARGUMENT, destroying nothing, while a layer, workspace or dispatch handle made from
/// it lives.
/// Collective when it destroys the NCCL communicator. NULL is a no-op.
EPMOE_C_EXPORT int epmoe_comm_destroy(epmoe_comm* comm);

// ---- layer --------------------------------------------------------------------------------------

/// Collective: epmoe::MoELayer::create. If any rank fails (a field of `cfg`, `reserved`, a NULL
/// `cfg` or `out`, an allocation), every rank fails with a message naming the failing ranks and
/// causes; only a NULL `comm` fails on its rank alone. `comm` cannot be destroyed while the layer
/// lives.
EPMOE_C_EXPORT int epmoe_layer_create(epmoe_comm* comm, const epmoe_layer_config* cfg,
                                      epmoe_layer** out);
/// The configuration the layer was created with (num_ranks filled in).
EPMOE_C_EXPORT int epmoe_layer_get_config(const epmoe_layer* layer, epmoe_layer_config* cfg);
/// MoELayer::last_path: the path this rank's last forward chose (EPMOE_PATH_PIPELINE or
/// EPMOE_PATH_FUSED, the choice EPMOE_PATH_AUTO made), into *path. Host only, no sync.
EPMOE_C_EXPORT int epmoe_layer_last_path(const epmoe_layer* layer, int* path);
/// MoELayer::load_weights. Layouts are those of epmoe::ExpertWeights; scales are NULL in BF16
/// mode. `on_device`: nonzero when the four pointers are device memory, else host memory.
EPMOE_C_EXPORT int epmoe_layer_load_weights(epmoe_layer* layer, const void* w1,
                                            const float* w1_scale, const void* w2,
                                            const float* w2_scale, int on_device, void* stream);
/// MoELayer::forward on `stream`: y[T][H] bf16 from x[T][H] bf16, topk_idx[T][K] int32 and
/// topk_weights[T][K] fp32 (device pointers). Collective; never synchronizes (graph-capturable)
/// unless strict_routing is set. Returns an error an earlier call recorded on the device (a bad
/// expert index: after running this call; a timeout: without launching). Calls on different
/// streams are serialized.
EPMOE_C_EXPORT int epmoe_layer_forward(epmoe_layer* layer, const void* x, const int32_t* topk_idx,
                                       const float* topk_weights, void* y, int64_t num_tokens,
                                       void* stream, int path);
/// MoELayer::check_device_error: synchronizes `stream`, reports an error the device recorded.
EPMOE_C_EXPORT int epmoe_layer_check_device_error(epmoe_layer* layer, void* stream);
/// Frees the layer. Collective when it holds the last share of its workspace's buffers: an
/// agreement over every rank (bounded by the layer's timeout_seconds) before the symmetric memory
/// is released. Returns EPMOE_OK once the layer is gone, also when that agreement failed: then the
/// memory stays with the communicator, and a timeout (a peer that never destroyed its layer) leaves
/// the communicator unusable, which every later collective call on it reports with the cause. NULL
/// is a no-op.
EPMOE_C_EXPORT int epmoe_layer_destroy(epmoe_layer* layer);

/// MoELayer::forward with int32 or int64 routing (idx_type: EPMOE_INDEX_*) and the optional expert
/// counts: expert_counts [E_loc] int32 (rows each local expert received in this call) and
/// expert_counts_total [E_loc] int64 (the counts added on); either may be NULL. No sync.
EPMOE_C_EXPORT int epmoe_layer_forward_ex(epmoe_layer* layer, const void* x, const void* topk_idx, int idx_type,
                                          const float* topk_weights, void* y, int64_t num_tokens,
                                          int32_t* expert_counts, int64_t* expert_counts_total, void* stream,
                                          int path);

/// The arguments of epmoe_layer_forward_ex in one struct (fixed layout, 72 bytes).
typedef struct epmoe_forward_args {
  const void* x;
  const void* topk_idx;
  const float* topk_weights;
  void* y;
  int32_t* expert_counts;        ///< may be NULL
  int64_t* expert_counts_total;  ///< may be NULL
  void* stream;
  int64_t num_tokens;
  int32_t idx_type;  ///< EPMOE_INDEX_*
  int32_t path;      ///< EPMOE_PATH_*
} epmoe_forward_args;

/// epmoe_layer_forward_ex with its arguments in a struct: the same checks, the same call. For
/// bindings whose per-argument conversion costs more than filling a struct (Python's ctypes: ~1 us
/// less per call than eleven arguments).
EPMOE_C_EXPORT int epmoe_layer_forward_args(epmoe_layer* layer, const epmoe_forward_args* args);

// ---- workspace (one set of device buffers, many layers) ------------------------------------------

/// epmoe::validate() on a workspace config (host only).
EPMOE_C_EXPORT int epmoe_validate_workspace_config(const epmoe_workspace_config* cfg);
/// epmoe::workspace_sizes(): the device bytes a workspace of `cfg` allocates per rank (host only;
/// any output may be NULL).
EPMOE_C_EXPORT int epmoe_workspace_sizes(const epmoe_workspace_config* cfg, int64_t* symmetric, int64_t* local,
                                         int64_t* pool);
/// epmoe::check_fits(): whether a layer fits a workspace (host only); the message names the field.
EPMOE_C_EXPORT int epmoe_check_layer_fits(const epmoe_workspace_config* ws, const epmoe_layer_config* layer);
/// Collective: epmoe::Workspace::create. `comm` cannot be destroyed while the workspace (or a layer
/// on it) lives.
EPMOE_C_EXPORT int epmoe_workspace_create(epmoe_comm* comm, const epmoe_workspace_config* cfg,
                                          epmoe_workspace** out);
/// The configuration (num_ranks filled in).
EPMOE_C_EXPORT int epmoe_workspace_get_config(const epmoe_workspace* ws, epmoe_workspace_config* cfg);
/// GPU memory the workspace holds on this rank, in bytes.
EPMOE_C_EXPORT int epmoe_workspace_nbytes(const epmoe_workspace* ws, int64_t* bytes);
/// Layers created on the workspace that are still alive.
EPMOE_C_EXPORT int epmoe_workspace_num_layers(const epmoe_workspace* ws, int32_t* count);
/// Releases the workspace's buffers (Workspace::close, then the handle). Fails with
/// EPMOE_INVALID_ARGUMENT, releasing nothing (the handle stays valid), while a layer created on it
/// lives: destroy the layers first. Collective (a bounded barrier over every rank before the
/// symmetric window is freed). NULL is a no-op.
EPMOE_C_EXPORT int epmoe_workspace_destroy(epmoe_workspace* ws);
/// Collective: MoELayer::create(workspace, cfg, weights). `weights` NULL: the layer allocates its
/// weights (epmoe_layer_load_weights copies them in); else the layer references them (no copy). The
/// layer holds a share of the workspace's buffers: epmoe_workspace_destroy refuses while it lives.
EPMOE_C_EXPORT int epmoe_layer_create_on(epmoe_workspace* ws, const epmoe_layer_config* cfg,
                                         const epmoe_weight_refs* weights, epmoe_layer** out);
/// epmoe::w13_transform_bytes (host only; either output may be NULL).
EPMOE_C_EXPORT int epmoe_w13_transform_bytes(int dtype, int experts_per_rank, int intermediate, int hidden,
                                             int64_t* weight_bytes, int64_t* scale_bytes);
/// epmoe::transform_w13 on the device that holds w13 (made current for the call; every buffer must
/// be there, and `stream` a stream of that device): checkpoint w13 (+ scales) into the kernels'
/// layout, into `out` (+ `out_scale`), caller-owned device memory. Stream-ordered, no sync.
EPMOE_C_EXPORT int epmoe_transform_w13(int dtype, const void* w13, const float* w13_scale, void* out,
                                       float* out_scale, int experts_per_rank, int intermediate, int hidden,
                                       void* stream);

// ---- standalone dispatch / combine ---------------------------------------------------------------

/// Collective: epmoe::DispatchHandle::create (the handle allocates its own pool). Its checks are
/// agreed as in epmoe_layer_create. `comm` cannot be destroyed while the handle lives.
EPMOE_C_EXPORT int epmoe_dispatch_create(epmoe_comm* comm, const epmoe_dispatch_config* cfg,
                                         epmoe_dispatch** out);
/// The pool's regions (device pointers, valid while the handle lives).
EPMOE_C_EXPORT int epmoe_dispatch_get_pool(const epmoe_dispatch* handle, epmoe_pool_view* view);
/// DispatchHandle::dispatch: x[T][H] bf16, topk_idx[T][K] int32, topk_weights[T][K] fp32.
EPMOE_C_EXPORT int epmoe_dispatch_run(epmoe_dispatch* handle, const void* x, const int32_t* topk_idx,
                                      const float* topk_weights, int64_t num_tokens, void* stream);
/// DispatchHandle::combine: y[T][H] bf16 for the T of the last dispatch.
EPMOE_C_EXPORT int epmoe_combine_run(epmoe_dispatch* handle, void* y, int64_t num_tokens, void* stream);
/// DispatchHandle::check_errors: synchronizes `stream`, reports and clears recorded errors.
EPMOE_C_EXPORT int epmoe_dispatch_check_errors(epmoe_dispatch* handle, void* stream);
/// Frees the handle. Collective, as epmoe_layer_destroy. NULL is a no-op.
EPMOE_C_EXPORT int epmoe_dispatch_destroy(epmoe_dispatch* handle);

#ifdef __cplusplus
}  // extern "C"
#endif
