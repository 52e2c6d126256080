// TMA stream probe: how fast can one block stream weight tiles through a ring of shared-memory
// stages, as a function of the ring's depth, the number of blocks, and the weights' layout?
//
// Each block reads 256 weight rows x all K (one GEMM tile's B operand, K blocks of 128 bytes) the
// way the grouped GEMM's producer does: one TMA box of 256 rows x 128 bytes per K block into the
// next stage, optionally with a 128 x 128 A box from a small (L2-resident) buffer. A consumer warp
// only waits for each stage and hands it back, so the loads alone set the pace. Layouts:
//   strided: the checkpoint layout [rows][K] (a box reads 256 lines at a K-byte pitch);
//   tiled:   the same bytes pre-tiled so that every (256-row, 128-byte K block) box is 32 KB of
//            contiguous memory.
// The L2 is flushed before every timed launch (cold: a 256 MB memset, which leaves dirty lines
// behind) unless --warm. Prints one line per configuration: microseconds (launch included), GB/s
// of everything that landed (weights and A boxes) over the grid and per block, and of the weights.
// --boxes and --bulk: the same bytes in smaller boxes, or by plain bulk copies (see main).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_cuda.h"
#include "device/ptx/mbarrier.cuh"
#include "device/ptx/tma.cuh"

namespace {

constexpr uint32_t kTileB = 256 * 128;
constexpr uint32_t kTileA = 128 * 128;

__global__ void __launch_bounds__(64, 1)
    stream_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap amap, int kblocks,
                  int stages, int tiled, int with_a, int box_rows, unsigned long long* sink,
                  const uint8_t* bulk_src = nullptr, int bulk_copies = 1) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  // box_rows < 256 (strided layout, no A): each K block's 256 rows come as 256 / box_rows boxes,
  // one per stage.
  const int per_kb = 256 / box_rows;
  const uint32_t stage_bytes = uint32_t(box_rows) * 128 + (with_a ? kTileA : 0);
  const int loads = kblocks * per_kb;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      epmoe::ptx::mbarrier_init(&full[s], 1);
      epmoe::ptx::mbarrier_init(&empty[s], 1);
    }
    epmoe::ptx::fence_mbarrier_init_release_cluster();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < loads; ++i) {
      const int s = i % stages, use = i / stages, kb = i / per_kb, j = i % per_kb;
      if (use > 0)
        while (!epmoe::ptx::mbarrier_try_wait_parity_acquire_cta_s(epmoe::ptx::smem_u32(&empty[s]), uint32_t(use - 1) & 1u)) {
        }
      epmoe::ptx::mbarrier_arrive_expect_tx_release_cta(&full[s], stage_bytes);
      const int32_t c0 = tiled ? 0 : kb * 128;
      const int32_t c1 =
          tiled ? (int32_t(blockIdx.x) * kblocks + kb) * 256 : int32_t(blockIdx.x) * 256 + j * box_rows;
      if (bulk_src) {
        // --bulk: the block's bytes as one contiguous region (pre-tiled weights), each stage in
        // bulk_copies plain bulk copies.
        const uint8_t* src = bulk_src + (int64_t(blockIdx.x) * loads + i) * stage_bytes;
        const uint32_t part = stage_bytes / uint32_t(bulk_copies);
        for (int c = 0; c < bulk_copies; ++c)
          epmoe::ptx::bulk_copy_g2s(smem + s * stage_bytes + c * part, src + c * part, part, &full[s]);
      } else {
        epmoe::ptx::tma_load_2d(smem + s * stage_bytes, &wmap, &full[s], c0, c1);
      }
      if (with_a) epmoe::ptx::tma_load_2d(smem + s * stage_bytes + kTileB, &amap, &full[s], kb * 128, 0);
    }
  } else if (threadIdx.x == 32) {
    uint32_t acc = 0;
    for (int i = 0; i < loads; ++i) {
      const int s = i % stages, use = i / stages;
      while (!epmoe::ptx::mbarrier_try_wait_parity_acquire_cta_s(epmoe::ptx::smem_u32(&full[s]), uint32_t(use) & 1u)) {
      }
      acc += *reinterpret_cast<volatile uint32_t*>(smem + s * stage_bytes);  // touch the stage
      epmoe::ptx::mbarrier_arrive_release_cta_s(epmoe::ptx::smem_u32(&empty[s]));
    }
    if (acc == 0xdeadbeefu) sink[blockIdx.x] = acc;
  }
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

CUtensorMap make_map(EncodeFn encode, void* base, uint64_t cols, uint64_t rows, uint32_t box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {128, box_rows};
  const cuuint32_t es[2] = {1, 1};
  const CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  bool warm = false, boxes = false, bulk = false;
  for (int i = 1; i < argc; ++i) {
    warm |= std::strcmp(argv[i], "--warm") == 0;
    boxes |= std::strcmp(argv[i], "--boxes") == 0;
    bulk |= std::strcmp(argv[i], "--bulk") == 0;
  }
  int sms = 0;
  PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  PROBE_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
  const EncodeFn encode = reinterpret_cast<EncodeFn>(p);
  const size_t wbytes = size_t(sms) * 256 * 7168;  // every block's 256 rows at the largest K
  uint8_t *w = nullptr, *a = nullptr, *flush = nullptr;
  unsigned long long* sink = nullptr;
  PROBE_CUDA(cudaMalloc(&w, wbytes));
  PROBE_CUDA(cudaMalloc(&a, size_t(128) * 7168));
  PROBE_CUDA(cudaMalloc(&flush, size_t(256) << 20));
  PROBE_CUDA(cudaMalloc(&sink, sizeof(unsigned long long) * 1024));
  PROBE_CUDA(cudaMemset(w, 0x11, wbytes));
  PROBE_CUDA(cudaMemset(a, 0x22, size_t(128) * 7168));
  PROBE_CUDA(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  cudaEvent_t e0, e1;
  PROBE_CUDA(cudaEventCreate(&e0));
  PROBE_CUDA(cudaEventCreate(&e1));
  std::printf("tma_stream_probe on %d SMs, %s L2; B box 256 x 128 B (32 KB) per K block, A box 128 x 128 B\n", sms,
              warm ? "warm" : "flushed");
  // The median of 5 timed launches (after one untimed), each after an L2 flush unless --warm.
  const auto median_us = [&](const auto& launch) {
    std::vector<float> times;
    for (int rep = 0; rep < 6; ++rep) {
      if (!warm) PROBE_CUDA(cudaMemsetAsync(flush, rep, size_t(256) << 20));
      PROBE_CUDA(cudaEventRecord(e0));
      launch();
      PROBE_CUDA(cudaEventRecord(e1));
      PROBE_CUDA(cudaEventSynchronize(e1));
      PROBE_CUDA(cudaGetLastError());
      float ms = 0;
      PROBE_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) times.push_back(ms * 1000.0f);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  if (bulk) {
    // --bulk: the same bytes per block (256 rows x K) from contiguous memory by plain bulk copies
    // (what a pre-tiled, pre-swizzled weight layout would allow), 32 KB stages in 1, 2 or 8 copies.
    std::printf("%5s %6s %7s %6s %9s %10s %12s\n", "K", "blocks", "copies", "stages", "us", "GB/s", "GB/s/block");
    for (int k : {2048, 7168})
      for (int blocks : {12, 48, sms})
        for (int copies : {1, 2, 8})
          for (int stages : {2, 4, 6}) {
            const size_t smem = size_t(stages) * kTileB + 2 * stages * 8 + 1024;
            const int kblocks = k / 128;
            const CUtensorMap wmap = make_map(encode, w, uint64_t(k), uint64_t(blocks) * 256, 256);
            const float us = median_us(
                [&] { stream_kernel<<<blocks, 64, smem>>>(wmap, wmap, kblocks, stages, 0, 0, 256, sink, w, copies); });
            const double bytes = double(blocks) * kblocks * kTileB;
            std::printf("%5d %6d %7d %6d %9.2f %10.1f %12.1f\n", k, blocks, copies, stages, us, bytes / us * 1e-3,
                        bytes / us * 1e-3 / blocks);
          }
    return 0;
  }
  if (boxes) {
    // --boxes: the same bytes per block in smaller boxes (256, 64 or 16 rows of 128 bytes, one per
    // stage) through deeper rings, weights only, strided layout: does a block stream faster with
    // more, smaller loads in flight (DeepGEMM's decode tiles are 16 rows wide with 12 stages)?
    std::printf("%5s %6s %9s %6s %9s %10s %12s\n", "K", "blocks", "box rows", "stages", "us", "GB/s", "GB/s/block");
    for (int k : {2048, 7168})
      for (int blocks : {12, 48, sms})
        for (int box_rows : {256, 64, 16})
          for (int stages : {4, 8, 16, 32}) {
            const uint32_t stage_bytes = uint32_t(box_rows) * 128;
            const size_t smem = size_t(stages) * stage_bytes + 2 * stages * 8 + 1024;
            if (smem > 227 * 1024) continue;
            const int kblocks = k / 128;
            const CUtensorMap wmap = make_map(encode, w, uint64_t(k), uint64_t(blocks) * 256, uint32_t(box_rows));
            const CUtensorMap amap = make_map(encode, a, uint64_t(k), 128, 128);
            const float us = median_us(
                [&] { stream_kernel<<<blocks, 64, smem>>>(wmap, amap, kblocks, stages, 0, 0, box_rows, sink); });
            const double bytes = double(blocks) * kblocks * 256 * 128;
            std::printf("%5d %6d %9d %6d %9.2f %10.1f %12.1f\n", k, blocks, box_rows, stages, us, bytes / us * 1e-3,
                        bytes / us * 1e-3 / blocks);
          }
    return 0;
  }
  std::printf("%-8s %5s %6s %6s %5s %9s %10s %12s %13s\n", "layout", "K", "blocks", "stages", "A", "us", "GB/s",
              "GB/s/block", "weights GB/s");
  for (int tiled : {0, 1})
    for (int k : {2048, 7168})
      for (int blocks : {12, 48, sms})
        for (int with_a : {0, 1})
          for (int stages : {1, 2, 4, 6}) {
            const uint32_t stage_bytes = kTileB + (with_a ? kTileA : 0);
            const size_t smem = size_t(stages) * stage_bytes + 2 * stages * 8 + 1024;
            if (smem > 227 * 1024) continue;
            const int kblocks = k / 128;
            const CUtensorMap wmap = tiled ? make_map(encode, w, 128, uint64_t(blocks) * kblocks * 256, 256)
                                           : make_map(encode, w, uint64_t(k), uint64_t(blocks) * 256, 256);
            const CUtensorMap amap = make_map(encode, a, uint64_t(k), 128, 128);
            const float us = median_us(
                [&] { stream_kernel<<<blocks, 64, smem>>>(wmap, amap, kblocks, stages, tiled, with_a, 256, sink); });
            const double bytes = double(blocks) * kblocks * stage_bytes;  // what landed, A boxes included
            const double weight_bytes = double(blocks) * kblocks * kTileB;
            std::printf("%-8s %5d %6d %6d %5d %9.2f %10.1f %12.1f %13.1f\n", tiled ? "tiled" : "strided", k, blocks,
                        stages, with_a, us, bytes / us * 1e-3, bytes / us * 1e-3 / blocks, weight_bytes / us * 1e-3);
          }
  return 0;
}
