// CUTLASS's sm90 ptr-array FP8 grouped GEMM with block-scaled accumulation
// (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum), through its public
// collective builders, and a runner that sets its arguments up once and then only launches it.
// Included by one translation unit per kernel: each instantiation takes minutes to compile.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "sm90_grouped_fp8_probe.h"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) || !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the CUTLASS sm90 grouped GEMM needs CUDA >= 12.3 (modifiable TMA descriptors)"
#endif

namespace epmoe_cutlass_probe {

// The mainloop schedule and the epilogue schedule that goes with it.
struct Cooperative {  // both consumer warpgroups on one tile, each on half its rows
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {  // each consumer warpgroup on its own tile; one's epilogue overlaps the other's MMA
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <int kTileM, int kTileN, int kClusterM, int kClusterN, class Schedule>
struct Sm90GroupedFp8Gemm {
  static_assert(kTileN % 128 == 0, "a tile must cover whole 128-column weight-scale blocks");
  static constexpr int kTileK = 128;  // one scale block of K per stage

  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  static constexpr int kAlignAB = 16;  // elements per 16-byte TMA access
  static constexpr int kAlignD = 8;

  // Scale granularity M x N x K = 1 x 128 x 128: one activation scale per row and K block
  // (MN-major, [K/128][rows] per group), one weight scale per 128 x 128 block, K-major as our
  // [n/128][k/128] layout (CUTLASS's example 68 "sparse groups" variant uses the same pair).
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // M, N, K per group

  // D = acc in bf16: alpha 1, no source (C is void).
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD,
      typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  // A row-major (K contiguous), B "column-major" (K x N with K contiguous: our [n][k]).
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignAB,
      ElementAB, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// cudaMalloc'd bytes, freed with the owner.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t alloc(std::size_t bytes) { return cudaMalloc(&ptr_, bytes < 16 ? 16 : bytes); }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

inline std::string cuda_failure(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

inline std::string cutlass_failure(const char* what, cutlass::Status st) {
  return std::string(what) + ": CUTLASS " + cutlassGetStatusString(st);
}

// A host array copied into a new device array (synchronous: the host array may go right after).
template <class T>
std::string upload(const std::vector<T>& host, DeviceBuffer* buf, const char* what) {
  if (cudaError_t e = buf->alloc(host.size() * sizeof(T)); e != cudaSuccess) return cuda_failure(what, e);
  if (cudaError_t e = cudaMemcpy(buf->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
      e != cudaSuccess)
    return cuda_failure(what, e);
  return {};
}

template <class G>
class Sm90GroupedFp8Runner final : public GemmRunner {
 public:
  // Every host step, once: the per-group arrays on the device, the workspace, can_implement,
  // initialize (which also sets the kernel's shared-memory attribute).
  std::string init(const GroupedProblem& p) {
    using Kernel = typename G::Kernel;
    using ElementAB = typename G::ElementAB;
    using ElementD = typename G::ElementD;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;
    using LayoutSFA = typename G::LayoutSFA;
    using LayoutSFB = typename G::LayoutSFB;
    const int groups = static_cast<int>(p.rows.size());

    std::vector<StrideA> stride_a(groups);
    std::vector<StrideB> stride_b(groups);
    std::vector<StrideD> stride_d(groups);
    std::vector<LayoutSFA> layout_sfa(groups);
    std::vector<LayoutSFB> layout_sfb(groups);
    std::vector<const ElementAB*> ptr_a(groups), ptr_b(groups);
    std::vector<ElementD*> ptr_d(groups);
    shapes_host_.resize(groups);
    for (int g = 0; g < groups; ++g) {
      const int m = p.rows[g];
      shapes_host_[g] = {m, p.n, p.k};
      // Row strides: A and B are K-contiguous with k per row, D N-contiguous with n per row.
      cute::get<0>(stride_a[g]) = p.k;
      cute::get<0>(stride_b[g]) = p.k;
      cute::get<0>(stride_d[g]) = p.n;
      // The grouped mainloop rebuilds these from (m, n, k) on the device; set them the same way.
      layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, p.n, p.k, 1));
      layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, p.n, p.k, 1));
      ptr_a[g] = static_cast<const ElementAB*>(p.a[g]);
      ptr_b[g] = static_cast<const ElementAB*>(p.b[g]);
      ptr_d[g] = static_cast<ElementD*>(p.d[g]);
    }
    std::string err;
    if (!(err = upload(shapes_host_, &shapes_, "problem shapes")).empty() ||
        !(err = upload(ptr_a, &ptr_a_, "A pointers")).empty() ||
        !(err = upload(ptr_b, &ptr_b_, "B pointers")).empty() ||
        !(err = upload(p.a_scale, &ptr_sfa_, "A scale pointers")).empty() ||
        !(err = upload(p.b_scale, &ptr_sfb_, "B scale pointers")).empty() ||
        !(err = upload(ptr_d, &ptr_d_, "D pointers")).empty() ||
        !(err = upload(stride_a, &stride_a_, "A strides")).empty() ||
        !(err = upload(stride_b, &stride_b_, "B strides")).empty() ||
        !(err = upload(stride_d, &stride_d_, "D strides")).empty() ||
        !(err = upload(layout_sfa, &layout_sfa_, "A scale layouts")).empty() ||
        !(err = upload(layout_sfb, &layout_sfb_, "B scale layouts")).empty())
      return err;

    typename G::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, static_cast<typename G::ProblemShape::UnderlyingProblemShape*>(shapes_.get()),
         shapes_host_.data()},
        {static_cast<const ElementAB**>(ptr_a_.get()), static_cast<StrideA*>(stride_a_.get()),
         static_cast<const ElementAB**>(ptr_b_.get()), static_cast<StrideB*>(stride_b_.get()),
         static_cast<const float**>(ptr_sfa_.get()), static_cast<LayoutSFA*>(layout_sfa_.get()),
         static_cast<const float**>(ptr_sfb_.get()), static_cast<LayoutSFB*>(layout_sfb_.get())},
        {{}, nullptr, nullptr, static_cast<ElementD**>(ptr_d_.get()), static_cast<StrideD*>(stride_d_.get())},
        cutlass::KernelHardwareInfo{p.device, p.sm_count, 0}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    using RasterOrder = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = p.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
    args.scheduler.max_swizzle_size = p.max_swizzle;

    if (cutlass::Status st = gemm_.can_implement(args); st != cutlass::Status::kSuccess)
      return cutlass_failure("can_implement", st);
    if (cudaError_t e = workspace_.alloc(G::Gemm::get_workspace_size(args)); e != cudaSuccess)
      return cuda_failure("workspace", e);
    if (cutlass::Status st = gemm_.initialize(args, workspace_.get()); st != cutlass::Status::kSuccess)
      return cutlass_failure("initialize", st);
    // Why: with clusters, the persistent grid is sized from the number of clusters that fit at once;
    // CUTLASS otherwise guesses it from a GH100 GPC model. The query needs the shared-memory size
    // attribute, which initialize has just set; the second initialize only rebuilds the params.
    constexpr int kClusterSize = cute::size(typename G::ClusterShape{});
    if constexpr (kClusterSize > 1) {
      int clusters = 0;
      if (std::string q = max_active_clusters(&clusters); !q.empty()) return q;
      args.hw_info.max_active_clusters = clusters;
      if (cutlass::Status st = gemm_.initialize(args, workspace_.get()); st != cutlass::Status::kSuccess)
        return cutlass_failure("initialize (with the cluster occupancy)", st);
    }
    return {};
  }

  std::string run(cudaStream_t stream) override {
    const cutlass::Status st = gemm_.run(stream);
    if (st == cutlass::Status::kSuccess) return {};
    // CUTLASS has already consumed the CUDA error with cudaGetLastError.
    return cutlass_failure("run (kernel launch)", st);
  }

 private:
  static std::string max_active_clusters(int* clusters) {
    using Kernel = typename G::Kernel;
    constexpr unsigned cm = cute::size<0>(typename G::ClusterShape{});
    constexpr unsigned cn = cute::size<1>(typename G::ClusterShape{});
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cm;
    attr[0].val.clusterDim.y = cn;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cm, cn, 1);
    cfg.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
    cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const void* fn = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
    if (cudaError_t e = cudaOccupancyMaxActiveClusters(clusters, fn, &cfg); e != cudaSuccess)
      return cuda_failure("cudaOccupancyMaxActiveClusters", e);
    if (*clusters <= 0) return "cudaOccupancyMaxActiveClusters: no cluster of this kernel fits";
    return {};
  }

  // Read by every run(): with host problem shapes, CUTLASS sizes the grid from them at each launch.
  std::vector<typename G::ProblemShape::UnderlyingProblemShape> shapes_host_;
  DeviceBuffer shapes_, ptr_a_, ptr_b_, ptr_sfa_, ptr_sfb_, ptr_d_;
  DeviceBuffer stride_a_, stride_b_, stride_d_, layout_sfa_, layout_sfb_, workspace_;
  typename G::Gemm gemm_;
};

template <class G>
std::string make_runner(const GroupedProblem& p, std::unique_ptr<GemmRunner>* out) {
  auto runner = std::make_unique<Sm90GroupedFp8Runner<G>>();
  std::string err = runner->init(p);
  if (err.empty()) *out = std::move(runner);
  return err;
}

}  // namespace epmoe_cutlass_probe
