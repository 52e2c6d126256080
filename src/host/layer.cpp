// MoELayer: the pipeline (dispatch -> L1 + SwiGLU -> L2 -> combine, four kernels) and the fused
// path (the same four stages in one cooperative megakernel, src/device/kernels/sm90_fused_moe.cuh).
// Both are stream-ordered with no host sync, so a forward call can be captured in a CUDA graph.
// A layer runs on a workspace's buffers (its own or a shared one: src/host/workspace_internal.h).
// Calls on one workspace are serialized (an event at the end of each call; the next call, on
// whatever stream, waits for it), and errors the kernels recorded in host memory come back from the
// next forward on that workspace without a sync.
#include "epmoe/layer.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "host/check.h"
#include "host/comm_internal.h"
#include "device/kernels/sm90_fused_launch.h"
#include "host/dispatch_internal.h"
#include "host/gemm.h"
#include "host/heuristics.h"
#include "host/layer_impl.h"
#include "host/workspace_internal.h"
#include "device/kernels/expert_counts.h"

namespace epmoe {

using detail::invalid;

namespace {

// Device buffer owned by the layer; freed on destruction unless leaked (see ~PipelineLayer).
struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
  void leak() { ptr = nullptr; }
  Status alloc(size_t bytes) {
    EPMOE_CUDA_RETURN(cudaMalloc(&ptr, bytes));
    return Status::Ok();
  }
};

class PipelineLayer final : public MoELayer, public detail::LayerInternals {
 public:
  PipelineLayer(std::shared_ptr<detail::WorkspaceState> ws, const LayerConfig& cfg, const ExpertWeightRefs* refs)
      : comm_(detail::CommAccess::share(*ws->comm)), ws_(std::move(ws)), cfg_(cfg), by_reference_(refs != nullptr) {
    if (refs) refs_ = *refs;
    ++ws_->num_layers;  // Workspace::close refuses while a layer lives
  }

  // Collective. Each step that can fail on one rank only ends in an agreement (a bounded
  // all-gather of every rank's Status), so every rank fails together, with the failing ranks and
  // causes in its message, and frees what it allocated.
  Status init() {
    DispatchConfig dc;
    dc.num_experts = cfg_.num_experts;
    dc.hidden = cfg_.hidden;
    dc.topk = cfg_.topk;
    dc.max_tokens_per_rank = cfg_.max_tokens_per_rank;
    dc.row_align = gemm::row_align(cfg_.dtype);
    dc.intermediate = cfg_.intermediate;
    dc.dtype = cfg_.dtype;
    dc.pow2_scales = cfg_.pow2_scales;
    dc.combine_partials = cfg_.combine_partials;
    dc.timeout_seconds = cfg_.timeout_seconds;
    // Why local allocations first: destroying a DispatchHandle is collective, so a rank that
    // fails after creating one would leave its peers waiting in their destructors.
    const Status local = [&]() -> Status {
      const int g = cfg_.experts_per_rank(), h = cfg_.hidden, i = cfg_.intermediate;
      const size_t elem = cfg_.dtype == DType::kFP8 ? 1 : 2;
      if (by_reference_) {
        EPMOE_RETURN_IF_ERROR(check_weight_refs());
        w1_ptr_ = refs_.w13;
        w1_scale_ptr_ = refs_.w13_scale;
        w2_ptr_ = refs_.w2;
        w2_scale_ptr_ = refs_.w2_scale;
      } else {
        EPMOE_RETURN_IF_ERROR(w1_.alloc(size_t(g) * 2 * i * h * elem));
        EPMOE_RETURN_IF_ERROR(w2_.alloc(size_t(g) * h * i * elem));
        if (cfg_.dtype == DType::kFP8) {
          EPMOE_RETURN_IF_ERROR(w1_scale_.alloc(size_t(g) * (2 * i / 128) * (h / 128) * sizeof(float)));
          EPMOE_RETURN_IF_ERROR(w2_scale_.alloc(size_t(g) * (h / 128) * (i / 128) * sizeof(float)));
        }
        w1_ptr_ = w1_.ptr;
        w1_scale_ptr_ = static_cast<const float*>(w1_scale_.ptr);
        w2_ptr_ = w2_.ptr;
        w2_scale_ptr_ = static_cast<const float*>(w2_scale_.ptr);
      }
      for (auto& e : stage_events_) EPMOE_CUDA_RETURN(cudaEventCreate(&e));
#ifdef EPMOE_TEST_HOOKS
      if (detail::debug_fail_create_rank() == comm_->rank())
        return Status(StatusCode::kCudaError, "out of memory (simulated by the fail-create test hook)");
#endif
      return Status::Ok();
    }();
    EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*comm_, local, "MoELayer::create (local allocations)",
                                                  cfg_.timeout_seconds));
    // A view of the workspace's buffers: allocates nothing; agrees on dc across ranks.
    EPMOE_RETURN_IF_ERROR(detail::DispatchAccess::create_on(ws_, dc, &dispatch_, /*collective=*/true));

    // Why plan here: every host step of the GEMMs that can fail (checks, the sm_90 check, tensor
    // maps, kernel attributes) runs now, so forward() cannot return between dispatch and combine
    // and leave the peers waiting. The pool and weight pointers are fixed from here on; the
    // expert counts/offsets are device arrays the kernels read at run time.
    const int g = cfg_.experts_per_rank(), h = cfg_.hidden, i = cfg_.intermediate;
    const ExpertPoolView pool = dispatch_->pool();
    const gemm::GroupedArgs args{g, pool.expert_count, pool.expert_offset, pool.max_rows, pool.scale_stride};
    Status planned = gemm::plan_l1(cfg_.dtype, args, pool.x_pool, pool.x_scale, w1_ptr_, w1_scale_ptr_,
                                   pool.row_weight, h, i,
                                   cfg_.activation_clamp, cfg_.pow2_scales, pool.a_pool, pool.a_scale, &plan_l1_);
    if (planned.ok())
      planned = gemm::plan_l2(cfg_.dtype, args, pool.a_pool, pool.a_scale, w2_ptr_, w2_scale_ptr_, i, h, pool.o_pool,
                              &plan_l2_);
    // Every GEMM wait of this layer is bounded by its timeout_seconds and reports into its error
    // record, as the comm waits do.
    layout::WatchdogParams watchdog = detail::DispatchAccess::watchdog(*dispatch_);
#ifdef EPMOE_TEST_HOOKS
    watchdog.debug_stall = detail::debug_stall_gemm_rank() == comm_->rank() ? 1 : 0;
#endif
    plan_l1_.params.watchdog = plan_l2_.params.watchdog = watchdog;
    // Why not fail create: the pipeline works without the megakernel; forward(kFused) reports this.
    fused_status_ = planned.ok() ? configure_fused() : Status::Ok();
    // The benchmark's and tests' forced choices (A/B measurements), as they stand now.
    overrides_ = detail::tuning_overrides();
    return agree_across_ranks(planned);
  }

  ~PipelineLayer() override {
    // Taken before the handle goes: a device wait of this layer timed out and trapped, so the
    // context is lost.
    const bool trapped = dispatch_ && detail::DispatchAccess::timeout_recorded(*dispatch_);
    // The dispatch handle and the workspace share first (the last share's release is the collective
    // step), then the local buffers.
    dispatch_.reset();
    const bool broken = detail::CommAccess::broken(*comm_);
    --ws_->num_layers;
    ws_.reset();
    if (trapped || broken) {
      // Why leak: on a lost context every CUDA call only fails; on a broken communicator cudaFree
      // waits for the device, where a collective a peer never joined may never end. The process is
      // expected to exit.
      for (DeviceBuffer* b : {&w1_, &w2_, &w1_scale_, &w2_scale_, &phase_ts_}) b->leak();
      return;
    }
    for (auto& e : stage_events_) if (e) cudaEventDestroy(e);
  }

  // Weights by reference: set, aligned as the tensor maps need, and memory of this device.
  Status check_weight_refs() const {
    const bool fp8 = cfg_.dtype == DType::kFP8;
    const struct { const void* p; const char* name; uintptr_t align; bool needed; } fields[4] = {
        {refs_.w13, "w13", 16, true}, {refs_.w13_scale, "w13_scale", 4, fp8},
        {refs_.w2, "w2", 16, true}, {refs_.w2_scale, "w2_scale", 4, fp8}};
    for (const auto& f : fields) {
      if (!f.needed) {
        if (f.p) return invalid("ExpertWeightRefs.", f.name, " must be null in BF16 mode (no weight scales)");
        continue;
      }
      if (!f.p) return invalid("ExpertWeightRefs.", f.name, " is null");
      if (reinterpret_cast<uintptr_t>(f.p) % f.align != 0)
        return invalid("ExpertWeightRefs.", f.name, "=", f.p, " must be ", f.align, "-byte aligned");
      cudaPointerAttributes attr{};
      const cudaError_t e = cudaPointerGetAttributes(&attr, f.p);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return invalid("ExpertWeightRefs.", f.name, "=", f.p, " is not memory CUDA knows (", cudaGetErrorName(e), ")");
      }
      if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) || attr.device != comm_->device())
        return invalid("ExpertWeightRefs.", f.name, "=", f.p, " must be device memory of the layer's device ",
                       comm_->device(), " (it is ", attr.type == cudaMemoryTypeHost ? "host memory" : "memory of device ",
                       attr.type == cudaMemoryTypeHost ? "" : std::to_string(attr.device), ")");
    }
    return Status::Ok();
  }

  Status load_weights(const ExpertWeights& w, cudaStream_t stream) override {
    if (by_reference_)
      return invalid("load_weights: this layer references the caller's weights (created with ExpertWeightRefs); it "
                     "copies nothing");
    const bool fp8 = cfg_.dtype == DType::kFP8;
    if (!w.w1 || !w.w2) return invalid("load_weights: w1 and w2 must be set");
    if (fp8 && (!w.w1_scale || !w.w2_scale))
      return invalid("load_weights: FP8 mode needs w1_scale and w2_scale");
    if (!fp8 && (w.w1_scale || w.w2_scale))
      return invalid("load_weights: BF16 mode takes no weight scales (w1_scale/w2_scale must be null)");
    const int g = cfg_.experts_per_rank(), h = cfg_.hidden, i = cfg_.intermediate;
    const size_t elem = fp8 ? 1 : 2;
    const size_t w1_bytes = size_t(g) * 2 * i * h * elem, w2_bytes = size_t(g) * h * i * elem;
    const size_t s1_bytes = fp8 ? size_t(g) * (2 * i / 128) * (h / 128) * 4 : 0;
    const size_t s2_bytes = fp8 ? size_t(g) * (h / 128) * (i / 128) * 4 : 0;

    // The transforms read device memory: stage host weights on the device first.
    DeviceBuffer staged[4];
    const void* src[4] = {w.w1, w.w1_scale, w.w2, w.w2_scale};
    const size_t bytes[4] = {w1_bytes, s1_bytes, w2_bytes, s2_bytes};
    if (!w.on_device) {
      for (int b = 0; b < 4; ++b) {
        if (!bytes[b]) continue;
        EPMOE_RETURN_IF_ERROR(staged[b].alloc(bytes[b]));
        EPMOE_CUDA_RETURN(cudaMemcpyAsync(staged[b].ptr, src[b], bytes[b], cudaMemcpyHostToDevice, stream));
        src[b] = staged[b].ptr;
      }
    }
    EPMOE_RETURN_IF_ERROR(gemm::prepare_w1(cfg_.dtype, src[0], static_cast<const float*>(src[1]), w1_.ptr,
                                           static_cast<float*>(w1_scale_.ptr), g, i, h, stream));
    EPMOE_RETURN_IF_ERROR(gemm::prepare_w2(cfg_.dtype, src[2], static_cast<const float*>(src[3]), w2_.ptr,
                                           static_cast<float*>(w2_scale_.ptr), g, h, i, stream));
    // Why sync: the staging buffers die at the end of this one-time call.
    EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    weights_loaded_ = true;
    return Status::Ok();
  }

  Status forward(const void* x, const int32_t* topk_idx, const float* topk_weights, void* y,
                 int64_t num_tokens, cudaStream_t stream, Path path) override {
    ForwardArgs a;
    a.x = x;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.y = y;
    a.num_tokens = num_tokens;
    return forward(a, stream, path);
  }

  Status forward(const ForwardArgs& a, cudaStream_t stream, Path path) override {
    const void* x = a.x;
    const void* topk_idx = a.topk_idx;
    const float* topk_weights = a.topk_weights;
    void* y = a.y;
    const int64_t num_tokens = a.num_tokens;
    EPMOE_RETURN_IF_ERROR(validate_call(cfg_, num_tokens, x, topk_idx, a.idx_type, topk_weights, y));
    if (reinterpret_cast<uintptr_t>(a.expert_counts) % 4 != 0)
      return invalid("forward: expert_counts=", static_cast<const void*>(a.expert_counts), " must be 4-byte aligned");
    if (reinterpret_cast<uintptr_t>(a.expert_counts_total) % 8 != 0)
      return invalid("forward: expert_counts_total=", static_cast<const void*>(a.expert_counts_total),
                     " must be 8-byte aligned");
    if (!by_reference_ && !weights_loaded_) return invalid("forward: load_weights() has not been called");
    const heuristics::Tuning tuned = tuning(num_tokens);
    if (path == Path::kAuto) path = fused_status_.ok() && tuned.auto_fused ? Path::kFused : Path::kPipeline;
    if (path == Path::kFused) {
      EPMOE_RETURN_IF_ERROR(fused_status_);
    }
    if (path != Path::kPipeline && path != Path::kFused) return invalid("forward: path=", static_cast<int>(path), " is unknown");

    // Why here: the plans and the pool belong to the layer's device; launching on another one
    // would fault, and this is the last point at which returning leaves no peer waiting.
    int device = -1;
    EPMOE_CUDA_RETURN(cudaGetDevice(&device));
    if (device != comm_->device())
      return invalid("forward: the current CUDA device is ", device, " but the layer lives on device ",
                     comm_->device(), "; call cudaSetDevice(", comm_->device(), ") before forward");
    // A communicator made unusable by a collective that timed out (an owned one is aborted, which
    // may unmap the symmetric buffers): return its error instead of launching on them.
    EPMOE_RETURN_IF_ERROR(detail::CommAccess::usable(*comm_, "forward"));

    // What the kernels recorded since the last call (host memory, no sync). A timeout means the
    // context is lost: return it instead of launching. Bad routing of an earlier call is returned
    // after this call has run as usual (its peers are waiting for it). Taken after the checks that
    // return without launching, and carried into any later error, so that the report is not lost.
    // Not during a stream capture: an error there ends this rank's capture while its peers'
    // captures go on; the report waits for the next call outside a capture.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPMOE_CUDA_RETURN(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    const Status earlier = ws_->take_device_error(!capturing);
    if (earlier.code() == StatusCode::kTimeout) return earlier;
    const auto with_earlier = [&](const Status& st) {
      return earlier.ok() ? st : Status(st.code(), st.message() + "; also: " + earlier.message());
    };

    // One call at a time: every call waits for the last one's end (WorkspaceState::serialize).
    if (const Status st = ws_->serialize(stream, capturing); !st.ok()) return with_earlier(st);
    if (cfg_.strict_routing) {
      if (const Status st = check_routing_strict(topk_idx, a.idx_type, num_tokens, stream, capturing); !st.ok())
        return with_earlier(st);
    }
    // The path this call runs, whatever happens next (last_path()).
    chosen_path_ = path;
    Status ran = run(x, topk_idx, a.idx_type, topk_weights, y, num_tokens, stream, path, tuned);
    // The expert counts: the pool's, written by this call's dispatch, copied (and summed) on the stream.
    if (ran.ok() && (a.expert_counts || a.expert_counts_total))
      ran = detail::cuda_status(kernels::launch_expert_counts(dispatch_->pool().expert_count, cfg_.experts_per_rank(),
                                                              a.expert_counts, a.expert_counts_total, stream),
                                "launch_expert_counts", __FILE__, __LINE__);
    // Recorded whatever happened: the next call waits for whatever this one enqueued.
    const Status ended = ws_->mark_end(stream, capturing);
    if (!ran.ok()) return with_earlier(ran);
    if (!ended.ok()) return with_earlier(ended);
    return earlier.ok() ? Status::Ok()
                        : Status(earlier.code(), earlier.message() + ". This call ran normally; the error is the "
                                                                     "earlier call's");
  }

  // The launches of one forward call (after its checks).
  Status run(const void* x, const void* topk_idx, IndexType idx_type, const float* topk_weights, void* y,
             int64_t num_tokens, cudaStream_t stream, Path path, const heuristics::Tuning& t) {
    timing_error_ = Status::Ok();
    if (timing_) {
      const Status st = detail::cuda_status(cudaEventRecord(stage_events_[0], stream), "cudaEventRecord",
                                            __FILE__, __LINE__);
      if (!st.ok()) return timing_failed(st);
    }
    if (detail::DispatchAccess::never_arrive(*dispatch_)) {
      // Debug injection (the never-arrive test hook): this rank launches nothing, so its peers' bounded
      // waits expire and report. Returns Ok, as a rank that silently fell behind would.
      detail::DispatchAccess::set_last_tokens(*dispatch_, num_tokens);
      last_path_ = Path::kPipeline;  // no phase stamps were written: report the (empty) events
      for (int i = 1; i <= 4; ++i) record(i, stream);
      return Status::Ok();
    }
    if (path == Path::kFused) {
      // One launch; if it fails nothing ran here, and the peers' calls time out as they would if
      // this rank had not called forward at all.
      fused::FusedMoeParams fp;
      fp.dispatch =
          detail::DispatchAccess::dispatch_params(*dispatch_, x, topk_idx, idx_type, topk_weights, num_tokens);
      fp.l1 = plan_l1_.params;
      fp.l2 = plan_l2_.params;
      fp.l1.weights_evict_first = fp.l2.weights_evict_first = t.weights_evict_first ? 1 : 0;
      fp.combine = detail::DispatchAccess::combine_params(*dispatch_, y);
      fp.combine.defer_done = 1;  // the next call's dispatch releases them (forward serializes calls)
      fp.phase_ts = nullptr;
      fp.prefetch_k_blocks = t.fused_prefetch_k_blocks;
      fp.b_first = t.fused_b_first ? 1 : 0;
      // heuristics.h stays free of device headers, so the two spellings of the tile order are tied here.
      static_assert(int(heuristics::ClaimTiles::kNever) == fused::kClaimNever &&
                        int(heuristics::ClaimTiles::kAlways) == fused::kClaimAlways &&
                        int(heuristics::ClaimTiles::kBeyondGrid) == fused::kClaimBeyondGrid,
                    "heuristics::ClaimTiles and FusedMoeParams::claim_tiles");
      fp.claim_tiles = int(t.fused_claim_tiles);
      fp.l1_split = t.fused_l1_split ? 1 : 0;
      if (timing_) {
        // Stage timing (benchmark only): the kernel stamps its phases; zeroed per call.
        const Status z = detail::cuda_status(
            cudaMemsetAsync(phase_ts_.ptr, 0, sizeof(unsigned long long) * fused::kFusedPhaseCount, stream),
            "cudaMemsetAsync(phase stamps)", __FILE__, __LINE__);
        if (!z.ok()) return timing_failed(z);
        fp.phase_ts = static_cast<unsigned long long*>(phase_ts_.ptr);
      }
      const fused::FusedMoeMaps maps{plan_l1_.map_a,  plan_l1_.map_b,   plan_l2_.map_a,  plan_l2_.map_b,
                                     plan_l1_.map_d,  plan_l2_.map_d,   plan_l1_.map_a64, plan_l2_.map_a64,
                                     plan_l1_.map_b64};
      const bool deferred = t.fused_deferred_epilogue;
      const cudaError_t e = cfg_.dtype == DType::kFP8
                                ? fused::launch_sm90_fused_moe_fp8(maps, fp, deferred, fused_grid_, stream)
                                : fused::launch_sm90_fused_moe_bf16(maps, fp, deferred, fused_grid_, stream);
      const Status launched = detail::cuda_status(e, "cudaLaunchKernelEx(sm90_fused_moe)", __FILE__, __LINE__);
      if (!launched.ok()) {
        // Nothing ran: no dispatch a later combine() could pair with, and the stage events still
        // hold the previous call's times, which stage_times_ms must not report as this call's.
        detail::DispatchAccess::set_last_tokens(*dispatch_, -1);
        return timing_failed(explain_cuda_error(launched, stream));
      }
      // The fused call dispatched num_tokens: dispatcher().combine() checks against this call.
      detail::DispatchAccess::set_last_tokens(*dispatch_, num_tokens);
      last_path_ = Path::kFused;
      // Stage timing: the whole call is reported as the first stage, the others as 0.
      for (int i = 1; i <= 4; ++i) record(i, stream);
      return Status::Ok();
    }
    last_path_ = Path::kPipeline;
    const Status dispatched = detail::DispatchAccess::dispatch_typed(*dispatch_, x, topk_idx, idx_type, topk_weights,
                                                                     num_tokens, stream);
    if (!dispatched.ok()) return timing_failed(explain_cuda_error(dispatched, stream));

    // From here on every peer waits for this rank's combine: an error no longer returns early.
    // It is kept, combine still runs (y is then undefined), and the first one is returned.
    record(1, stream);
    const bool evict_first = t.weights_evict_first;
    Status st = gemm::launch(plan_l1_, stream, evict_first);
    record(2, stream);
    if (st.ok()) st = gemm::launch(plan_l2_, stream, evict_first);
    record(3, stream);
    Status combined = detail::DispatchAccess::combine(*dispatch_, y, num_tokens, stream, /*defer_done=*/true);
    record(4, stream);
    if (!st.ok()) return explain_cuda_error(st, stream);
    if (!combined.ok()) return explain_cuda_error(combined, stream);
    return Status::Ok();
  }

  // A launch can fail because an earlier kernel of this call already trapped (a bounded wait for a
  // peer expired: the CUDA error is sticky). Then the timeout record says which wait, and that is
  // the error to return, not the launch's generic "unspecified launch failure".
  // Why the record first: check_errors synchronizes (which would break a stream capture) and
  // consumes the status word; only a written record makes it worth calling.
  Status explain_cuda_error(const Status& st, cudaStream_t stream) {
    if (st.code() != StatusCode::kCudaError || !detail::DispatchAccess::timeout_recorded(*dispatch_)) return st;
    Status device = dispatch_->check_errors(stream);
    return device.code() == StatusCode::kTimeout ? device : st;
  }

  Status check_device_error(cudaStream_t stream) override { return dispatch_->check_errors(stream); }

  // Strict mode (LayerConfig::strict_routing, a debugging aid): copies this call's routing to the
  // host, checks it, and agrees with every rank before any launch, so every rank returns the error
  // (naming the rank and the slot) and none launches. Synchronizes `stream`.
  // `capturing`: whether `stream` is capturing a graph (forward asks once per call).
  Status check_routing_strict(const void* topk_idx, IndexType idx_type, int64_t num_tokens, cudaStream_t stream,
                              bool capturing) {
    Status mine;
    if (capturing) {
      mine = invalid("forward: strict_routing copies the routing to the host and synchronizes, which a stream "
                     "capture does not allow; create the layer without strict_routing to capture it");
    } else {
      const size_t idx_bytes = idx_type == IndexType::kInt64 ? 8 : 4;
      routing_host_.resize(size_t(num_tokens) * cfg_.topk * (idx_bytes / 4));
      if (num_tokens > 0)
        mine = detail::cuda_status(cudaMemcpyAsync(routing_host_.data(), topk_idx,
                                                   size_t(num_tokens) * cfg_.topk * idx_bytes, cudaMemcpyDeviceToHost,
                                                   stream),
                                   "cudaMemcpyAsync(topk_idx)", __FILE__, __LINE__);
      if (mine.ok())
        mine = detail::cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__, __LINE__);
      if (mine.ok()) {
        const Status checked =
            idx_type == IndexType::kInt64
                ? validate_routing_host(cfg_, num_tokens, reinterpret_cast<const int64_t*>(routing_host_.data()))
                : validate_routing_host(cfg_, num_tokens, routing_host_.data());
        if (!checked.ok()) mine = Status(checked.code(), "rank " + std::to_string(comm_->rank()) + ": " + checked.message());
      }
    }
    return detail::agree_on_status(*comm_, mine, "forward (strict_routing): the routing check before launch",
                                   cfg_.timeout_seconds);
  }

  const LayerConfig& config() const override { return cfg_; }
  Path last_path() const override { return chosen_path_; }

  // detail::LayerInternals: for the benchmark and tests.
  void set_stage_timing(bool on) override {
    timing_ = on;
    // The megakernel's phase stamps, allocated only for the benchmark's timed calls.
    if (on && !phase_ts_.ptr) timing_error_ = phase_ts_.alloc(sizeof(unsigned long long) * fused::kFusedPhaseCount);
  }
  Status stage_times_ms(float out[4]) override {
    if (!timing_) return invalid("stage_times_ms: call set_stage_timing(true) before forward");
    EPMOE_RETURN_IF_ERROR(timing_error_);
    EPMOE_CUDA_RETURN(cudaEventSynchronize(stage_events_[4]));
    if (last_path_ == Path::kFused) {
      // The megakernel's own stamps: dispatch (to the end of its grid barrier), L1 (to the last
      // L1 tile), L2 (to the last L2 tile; the two overlap across blocks), combine (the GEMM ->
      // combine barrier included).
      unsigned long long ts[fused::kFusedPhaseCount];
      EPMOE_CUDA_RETURN(cudaMemcpy(ts, phase_ts_.ptr, sizeof(ts), cudaMemcpyDeviceToHost));
      const unsigned long long t0 = ~ts[fused::kPhaseStart];
      const unsigned long long at[4] = {ts[fused::kPhaseDispatchDone], ts[fused::kPhaseL1Done],
                                        ts[fused::kPhaseL2Done], ts[fused::kPhaseEnd]};
      unsigned long long prev = t0;
      for (int s = 0; s < 4; ++s) {
        out[s] = at[s] >= prev ? float(double(at[s] - prev) * 1e-6) : 0.0f;
        prev = at[s];
      }
      return Status::Ok();
    }
    for (int s = 0; s < 4; ++s)
      EPMOE_CUDA_RETURN(cudaEventElapsedTime(&out[s], stage_events_[s], stage_events_[s + 1]));
    return Status::Ok();
  }
  DispatchHandle& dispatcher() override { return *dispatch_; }

 private:
  // A forward call that ends before its stage events are all recorded: stage_times_ms reports this
  // error instead of the events' older times.
  Status timing_failed(const Status& st) {
    if (timing_ && timing_error_.ok()) timing_error_ = st;
    return st;
  }

  // Stage events after dispatch was launched: a failure must not end the call (see forward), so
  // the first one is kept for stage_times_ms.
  void record(int i, cudaStream_t stream) {
    if (!timing_) return;
    const Status st = detail::cuda_status(cudaEventRecord(stage_events_[i], stream), "cudaEventRecord",
                                          __FILE__, __LINE__);
    if (!st.ok() && timing_error_.ok()) timing_error_ = st;
  }

  std::unique_ptr<Communicator> comm_;  // a share of the caller's: it lives as long as this layer
  std::shared_ptr<detail::WorkspaceState> ws_;  // a share of the workspace's buffers
  LayerConfig cfg_;
  std::unique_ptr<DispatchHandle> dispatch_;
  bool by_reference_ = false;
  ExpertWeightRefs refs_;
  DeviceBuffer w1_, w2_, w1_scale_, w2_scale_;  // copied weights (not by reference)
  // What the GEMM plans read: the caller's weights or the copies.
  const void* w1_ptr_ = nullptr;
  const float* w1_scale_ptr_ = nullptr;
  const void* w2_ptr_ = nullptr;
  const float* w2_scale_ptr_ = nullptr;
  bool weights_loaded_ = false;
  bool timing_ = false;
  Status timing_error_;  // first failed stage-event record of the last forward call
  cudaEvent_t stage_events_[5] = {};
  std::vector<int32_t> routing_host_;  // strict mode's host copy of the routing
  DeviceBuffer phase_ts_;           // the megakernel's phase stamps (stage timing of Path::kFused)
  Path last_path_ = Path::kPipeline;  // how the stage events of the last call are to be read
  Path chosen_path_ = Path::kPipeline;  // the path the last call (past its argument checks) chose
  gemm::GemmPlan plan_l1_, plan_l2_;  // built in init() for comm_->device()
  Status fused_status_;               // why Path::kFused cannot run, or Ok
  int fused_grid_ = 0;                // cooperative grid of the megakernel
  heuristics::TuningOverrides overrides_;  // detail::tuning_overrides() at create

  // This call's tuning choices (src/host/heuristics.h), with the overrides copied at create.
  heuristics::Tuning tuning(int num_tokens) const {
    return heuristics::choose_layer_tuning(heuristics::LayerShape{cfg_.topk, cfg_.experts_per_rank(), cfg_.hidden}, num_tokens,
                                           overrides_);
  }

  // Collective, after DispatchHandle::create: every rank learns whether planning the GEMMs and
  // configuring the megakernel worked on every rank, and that strict_routing is the same
  // everywhere. Why: a rank that returned alone would leave its peers in the next collective step
  // (or in the handle's collective destructor), a fused kernel launched on some ranks only would
  // trap the ranks that did launch, and strict mode's per-call agreement must run on all or none.
  Status agree_across_ranks(const Status& planned) {
    EPMOE_RETURN_IF_ERROR(
        detail::agree_on_status(*comm_, planned, "MoELayer::create (planning the expert GEMMs)", cfg_.timeout_seconds));
    const int64_t mine[2] = {fused_status_.ok() ? 0 : 1, cfg_.strict_routing ? 1 : 0};
    std::vector<int64_t> all;
    const Status st = detail::all_gather_words(*comm_, mine, 2, &all, cfg_.timeout_seconds);
    if (!st.ok())
      return Status(st.code(), "MoELayer::create: agreeing on the megakernel across ranks: " + st.message());
    std::vector<int> fused_failed, strict_on;
    for (int r = 0; r < comm_->size(); ++r) {
      if (all[size_t(r) * 2]) fused_failed.push_back(r);
      if (all[size_t(r) * 2 + 1]) strict_on.push_back(r);
    }
    if (!strict_on.empty() && int(strict_on.size()) != comm_->size())
      return invalid("MoELayer::create on rank ", comm_->rank(), ": LayerConfig differs across ranks: strict_routing is "
                     "true on ", detail::rank_list(strict_on), " only (every rank must pass the same config)");
    if (!fused_failed.empty()) {
      std::string why = "forward: path=fused is unavailable: configuring the megakernel failed on " +
                        detail::rank_list(fused_failed) + ", so no rank runs it (path=pipeline works)";
      if (!fused_status_.ok()) why += "; here: " + fused_status_.message();
      fused_status_ = Status(StatusCode::kUnsupported, why);
    }
    return Status::Ok();
  }

  // The megakernel's attributes and co-resident grid, on the current (the layer's) device.
  Status configure_fused() {
    const cudaError_t e = cfg_.dtype == DType::kFP8 ? fused::configure_sm90_fused_moe_fp8(comm_->device(), &fused_grid_)
                                                    : fused::configure_sm90_fused_moe_bf16(comm_->device(), &fused_grid_);
    if (e != cudaSuccess)
      return Status(StatusCode::kUnsupported, std::string("forward: path=fused is unavailable on this device: "
                                                          "configuring the megakernel failed: ") +
                                                  cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
    return Status::Ok();
  }
};

}  // namespace

Status MoELayer::create(Communicator& comm, const LayerConfig& cfg, std::unique_ptr<MoELayer>* out) {
  return detail::create_layer(comm, cfg, Status::Ok(), out);
}

Status detail::create_layer(Communicator& comm, const LayerConfig& cfg, const Status& caller,
                            std::unique_ptr<MoELayer>* out) {
  // The exchanges below run on the communicator's device.
  EPMOE_CUDA_RETURN(cudaSetDevice(comm.device()));
  // Why the checks go through an agreement: a rank whose check fails and returns here would leave
  // its peers waiting in their first collective until the timeout; agreed, every rank fails at
  // once with every failing rank's message. The timeout of a config that failed is not used (the
  // default instead).
  Status local = caller;
  if (local.ok() && !out) local = invalid("MoELayer::create: out is null");
  if (local.ok()) local = validate(cfg);
  if (local.ok() && cfg.num_ranks != comm.size())
    local = invalid("num_ranks=", cfg.num_ranks, " must equal the communicator size ", comm.size());
  if (local.ok()) local = gemm::validate_shape(cfg.dtype, cfg.hidden, cfg.intermediate);
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(comm, local, "MoELayer::create (the configuration checks)",
                                                local.ok() ? cfg.timeout_seconds : LayerConfig{}.timeout_seconds));
  // A private workspace of exactly this layer's size; the layer keeps the only share.
  std::unique_ptr<Workspace> ws;
  EPMOE_RETURN_IF_ERROR(Workspace::create(comm, workspace_config_for(cfg), &ws));
  return MoELayer::create(*ws, cfg, out);
}

Status MoELayer::create(Workspace& workspace, const LayerConfig& cfg, std::unique_ptr<MoELayer>* out,
                        const ExpertWeightRefs* weights) {
  return detail::create_layer_on(workspace, cfg, Status::Ok(), out, weights);
}

Status detail::create_layer_on(Workspace& workspace, const LayerConfig& cfg, const Status& caller,
                               std::unique_ptr<MoELayer>* out, const ExpertWeightRefs* weights) {
  if (workspace.closed())
    return invalid("MoELayer::create: the workspace was closed (Workspace::close released its buffers); create the "
                   "layer on an open workspace");
  const std::shared_ptr<detail::WorkspaceState>& state = detail::WorkspaceAccess::state(workspace);
  EPMOE_CUDA_RETURN(cudaSetDevice(state->comm->device()));
  // Agreed for the same reason as above: a layer that fits the workspace on some ranks only must
  // fail on every rank at once, not leave the others waiting in their first collective.
  Status local = caller;
  if (local.ok() && !out) local = invalid("MoELayer::create: out is null");
  if (local.ok()) local = check_fits(workspace.config(), cfg);
  if (local.ok()) local = gemm::validate_shape(cfg.dtype, cfg.hidden, cfg.intermediate);
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*state->comm, local, "MoELayer::create (the workspace fit checks)",
                                                local.ok() ? cfg.timeout_seconds : LayerConfig{}.timeout_seconds));
  auto layer = std::make_unique<PipelineLayer>(state, cfg, weights);
  EPMOE_RETURN_IF_ERROR(layer->init());
  *out = std::move(layer);
  return Status::Ok();
}

W13Bytes w13_transform_bytes(DType dtype, int experts_per_rank, int intermediate, int hidden) {
  W13Bytes b;
  const bool fp8 = dtype == DType::kFP8;
  b.weight = int64_t(experts_per_rank) * 2 * intermediate * hidden * (fp8 ? 1 : 2);
  b.scale = fp8 ? int64_t(experts_per_rank) * (2 * intermediate / 128) * (hidden / 128) * 4 : 0;
  return b;
}

Status transform_w13(DType dtype, const void* w13, const float* w13_scale, void* out, float* out_scale,
                     int experts_per_rank, int intermediate, int hidden, cudaStream_t stream) {
  if (dtype != DType::kFP8 && dtype != DType::kBF16) return invalid("transform_w13: dtype=", int(dtype), " is unknown");
  if (experts_per_rank < 1 || experts_per_rank > Limits::kMaxExpertsPerRank)
    return invalid("transform_w13: experts_per_rank=", experts_per_rank, " must be in [1, ", Limits::kMaxExpertsPerRank,
                   "]");
  return gemm::prepare_w1(dtype, w13, w13_scale, out, out_scale, experts_per_rank, intermediate, hidden, stream);
}

namespace detail {
LayerInternals* internals(MoELayer& layer) { return dynamic_cast<LayerInternals*>(&layer); }
}  // namespace detail

}  // namespace epmoe
