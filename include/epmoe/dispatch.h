// epmoe: standalone dispatch and combine between ranks (the communication half of an MoE layer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epmoe/comm.h"
#include "epmoe/config.h"
#include "epmoe/status.h"

namespace epmoe {

namespace detail {
struct DispatchAccess;  // internal: the fused layer path reads the kernels' parameters
}  // namespace detail

/// Shapes and options of a DispatchHandle, identical on every rank.
struct DispatchConfig {
  int num_experts = 0;          ///< E in total; E % R == 0, rank r owns [r*E/R, (r+1)*E/R).
  int hidden = 0;               ///< H, a positive multiple of 128.
  int topk = 0;                 ///< K, 1 <= K <= min(E, 32).
  int max_tokens_per_rank = 0;  ///< T_max; every call has 0 <= T_r <= T_max. Sizes every buffer.
  int row_align = 128;          ///< Expert segments in the pool start at multiples of this (GEMM BLOCK_M).
  int intermediate = 0;         ///< I; only sizes the pool's a_pool region (0: no a_pool).
  DType dtype = DType::kFP8;    ///< kFP8: dispatch quantizes 1x128 in the kernel (SPEC step 1).
  bool pow2_scales = false;     ///< Round FP8 activation scales up to a power of two.
  PartialPrecision combine_partials = PartialPrecision::kFloat32;
  int num_blocks = 0;           ///< Blocks of the persistent comm kernels; 0 = automatic (fewer for
                                ///< small calls, at most one per SM).
  double timeout_seconds = 10.0;  ///< Bound of every device-side wait for a peer. On expiry the kernel
                                  ///< records a diagnostic in host memory (check_errors returns it)
                                  ///< and traps: fatal to the CUDA context.
};

/// Device pointers into the expert-major pool that dispatch fills and combine reads
/// (region layout: ExpertPoolLayout in src/device/layout/expert_pool.h).
struct ExpertPoolView {
  void* base = nullptr;
  int64_t bytes = 0;
  int64_t max_rows = 0;
  int64_t scale_stride = 0;       ///< row stride of the MN-major scales: scale[h/128][row]
  void* x_pool = nullptr;         ///< [rows][H] e4m3 or bf16
  float* x_scale = nullptr;       ///< [H/128][scale_stride] (FP8 only)
  float* row_weight = nullptr;    ///< [rows] routing weight of the row's (token, slot); 0 on padding
  uint32_t* row_source = nullptr; ///< [rows] RowSource::pack(src_rank, token, slot); 0xFFFFFFFF on padding
  void* a_pool = nullptr;         ///< [rows][I] for the pipeline
  float* a_scale = nullptr;
  uint16_t* o_pool = nullptr;     ///< [rows][H] bf16 expert outputs (routing weight applied): combine's input
  int32_t* expert_count = nullptr;   ///< [E_loc] rows of each local expert
  int32_t* expert_offset = nullptr;  ///< [E_loc + 1] segment starts (multiples of row_align), then the end
};

/// Moves tokens to the ranks of their experts and the expert outputs back. One handle serves any
/// number of calls on the same buffers; neither call synchronizes with the host, so both can be
/// captured in a CUDA graph. Calls on all ranks must alternate in the same order (dispatch, combine).
class DispatchHandle {
 public:
  /// Collective over `comm`: every rank must pass the same `cfg` (checked; every rank fails with a
  /// message naming the differing field and ranks). `external_pool` (optional) must hold
  /// pool_bytes_for(comm, cfg) bytes of 256-byte aligned device memory; otherwise the handle
  /// allocates its own pool. If any rank fails (an invalid config, a null `out`, an allocation),
  /// every rank fails with the failing ranks and causes; every exchange is bounded by
  /// cfg.timeout_seconds. The handle's destructor is collective too (it agrees with every rank,
  /// bounded, before it frees the symmetric memory): destroy it on every rank. The handle holds a
  /// share of the communicator's state, so the Communicator object may go first.
  static Status create(Communicator& comm, const DispatchConfig& cfg, std::unique_ptr<DispatchHandle>* out,
                       void* external_pool = nullptr);
  static int64_t pool_bytes_for(const Communicator& comm, const DispatchConfig& cfg);
  /// Checks `cfg` against the communicator's size and the kernels' limits.
  static Status validate(const Communicator& comm, const DispatchConfig& cfg);

  ~DispatchHandle();
  DispatchHandle(const DispatchHandle&) = delete;
  DispatchHandle& operator=(const DispatchHandle&) = delete;

  const DispatchConfig& config() const;
  ExpertPoolView pool() const;

  /// x [T][H] bf16 (16-byte aligned), topk_idx [T][K] int32 (each in [-1, E)), topk_weights [T][K]
  /// fp32 (both 4-byte aligned), all device memory. Fills the pool's x_pool (+ x_scale), row_weight,
  /// row_source, expert_count and expert_offset: one row per valid slot, so an expert listed twice in
  /// one token gets two rows (and counts twice in combine). An index outside [-1, E) masks that slot
  /// and is reported by check_errors().
  Status dispatch(const void* x, const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                  cudaStream_t stream);
  /// Reads the pool's o_pool and writes y [T][H] bf16 (16-byte aligned) for the T of the last dispatch:
  /// y[t] = bf16(sum over the token's valid slots); 0 for a token with none.
  Status combine(void* y, int64_t num_tokens, cudaStream_t stream);

  /// Synchronizes `stream` and reports (then clears) the errors the kernels recorded. A device-side
  /// wait that timed out has trapped (the CUDA context is lost); that shows up here as kTimeout with
  /// the kernel's record in the message ("[epmoe] TIMEOUT rank R block B thread T (comm): flag
  /// NAME[i] expected >= E, seen S after W ms"), also printed to stderr. Another sticky CUDA error:
  /// kCudaError. An out-of-range expert index: kInvalidArgument naming the call, token, slot and
  /// value (the latest call that had one).
  Status check_errors(cudaStream_t stream);

 private:
  friend struct detail::DispatchAccess;
  struct Impl;
  explicit DispatchHandle(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe
