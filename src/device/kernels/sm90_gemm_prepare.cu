// One-time weight transforms into the grouped GEMM's internal layouts (docs/GEMM.md).
#include <cstdint>

#include "device/kernels/sm90_gemm_launch.h"

namespace epmoe::gemm::detail {

namespace {

constexpr int kBlockRows = 128;

// Internal 128-row block 2j is gate block j, block 2j+1 is up block j (user block I/128 + j).
__host__ __device__ inline int64_t w1_source_row(int64_t row, int inter) {
  const int64_t two_i = 2 * int64_t(inter);
  const int64_t e = row / two_i;
  const int64_t r = row % two_i;
  const int64_t blk = r / kBlockRows;
  const int64_t src_blk = (blk % 2 == 0) ? blk / 2 : inter / kBlockRows + blk / 2;
  return e * two_i + src_blk * kBlockRows + r % kBlockRows;
}

// One block per internal row; 16-byte vectors (row_bytes is a multiple of 128).
__global__ void w1_interleave_rows(const uint4* src, uint4* dst, int inter, int64_t row_vecs) {
  const int64_t row = blockIdx.x;
  const int64_t s = w1_source_row(row, inter);
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[row * row_vecs + i] = src[s * row_vecs + i];
}

// One thread per scale; scale row b of expert e covers weight rows [128b, 128b + 128).
__global__ void w1_interleave_scales(const float* src, float* dst, int num_groups, int inter, int k_blocks) {
  const int64_t n_blocks = 2 * int64_t(inter) / kBlockRows;
  const int64_t total = num_groups * n_blocks * k_blocks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t kb = i % k_blocks;
    const int64_t blk_row = i / k_blocks;  // over all experts
    const int64_t src_row = w1_source_row(blk_row * kBlockRows, inter) / kBlockRows;
    dst[i] = src[src_row * k_blocks + kb];
  }
}

}  // namespace

cudaError_t launch_w1_interleave(const void* w_user, void* w_internal, int num_groups, int inter,
                                 int64_t row_bytes, const float* s_user, float* s_internal, int k_blocks,
                                 cudaStream_t stream) {
  const int64_t rows = int64_t(num_groups) * 2 * inter;
  if (rows > 0) {
    w1_interleave_rows<<<unsigned(rows), 256, 0, stream>>>(static_cast<const uint4*>(w_user),
                                                            static_cast<uint4*>(w_internal), inter, row_bytes / 16);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (s_user != nullptr && rows > 0) {
    w1_interleave_scales<<<256, 256, 0, stream>>>(s_user, s_internal, num_groups, inter, k_blocks);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace epmoe::gemm::detail
