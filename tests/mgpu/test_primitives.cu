// Device primitives on 2 GPUs: symmetric memory through the Communicator, the epoch-driven
// cross-rank barrier and the grid barrier, each run many times back to back.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "device/comm/cross_rank_barrier.h"
#include "device/comm/grid_barrier.h"
#include "device/comm/peers.h"
#include "mgpu/mgpu_util.h"

namespace epmoe::mgpu {
namespace {

constexpr int64_t kSlots = 0;       // barrier slots: 8 u64
constexpr int64_t kMailbox = 4096;  // each rank's inbox: [rank][round] u64

// Every round: write a value into every peer's mailbox, barrier, check what arrived, barrier again
// (so nobody overwrites a mailbox before its owner read it).
__global__ void barrier_rounds_kernel(comm::PeerPtrs peers, int rank, int R, int rounds, uint64_t epoch0,
                                      uint32_t* errors) {
  const comm::WaitSite site{rank, 5000000000ull, nullptr};
  for (int i = 0; i < rounds; ++i) {
    if (threadIdx.x < R) peers.at<uint64_t>(threadIdx.x, kMailbox)[rank] = uint64_t(i) * 131 + rank + 1;
    comm::cross_rank_barrier(peers, kSlots, rank, R, epoch0 + 2 * i + 1, site);
    if (threadIdx.x < R && peers.at<uint64_t>(rank, kMailbox)[threadIdx.x] != uint64_t(i) * 131 + threadIdx.x + 1)
      atomicAdd(errors, 1u);
    comm::cross_rank_barrier(peers, kSlots, rank, R, epoch0 + 2 * i + 2, site);
  }
}

// Each phase every block adds 1 to counts[phase]; after the grid barrier all must see gridDim.x.
__global__ void grid_barrier_kernel(uint32_t* bar, uint32_t* counts, int phases, uint32_t* errors) {
  const comm::WaitSite site{0, 5000000000ull, nullptr};
  for (int p = 0; p < phases; ++p) {
    if (threadIdx.x == 0) atomicAdd(&counts[p], 1u);
    comm::grid_barrier(bar, site);
    if (threadIdx.x == 0 && *(volatile uint32_t*)&counts[p] != gridDim.x) atomicAdd(errors, 1u);
  }
}

TEST(Primitives, SymmetricMemoryAndCrossRankBarrier) {
  EPMOE_REQUIRE_RANKS(2);
  run_on_ranks(2, [](const RankContext& ctx) {
    std::unique_ptr<Communicator> comm;
    RANK_OK(make_comm(ctx, &comm));
    SymmetricBuffer* a = nullptr;
    SymmetricBuffer* b = nullptr;
    RANK_OK(comm->alloc_symmetric(1 << 20, &a));
    RANK_OK(comm->alloc_symmetric(3 << 20, &b));  // a second, differently sized window
    RANK_CHECK(a->local == a->peers[ctx.rank] || a->local != nullptr, ctx, "local pointer");
    comm::PeerPtrs peers{};
    for (int r = 0; r < ctx.size; ++r) peers.ptr[r] = static_cast<char*>(b->peers[r]);
    uint32_t* errors = nullptr;
    RANK_CUDA(cudaMalloc(&errors, 4));
    RANK_CUDA(cudaMemset(errors, 0, 4));
    // 1,000 rounds in one launch, then 200 launches of 5 rounds: epochs keep growing across calls.
    barrier_rounds_kernel<<<1, 64>>>(peers, ctx.rank, ctx.size, 1000, 0, errors);
    RANK_CUDA(cudaGetLastError());
    for (int i = 0; i < 200; ++i) barrier_rounds_kernel<<<1, 64>>>(peers, ctx.rank, ctx.size, 5, 2000 + 10 * i, errors);
    RANK_CUDA(cudaDeviceSynchronize());
    uint32_t h = 0;
    RANK_CUDA(cudaMemcpy(&h, errors, 4, cudaMemcpyDeviceToHost));
    RANK_CHECK(h == 0, ctx, h << " mailbox mismatches");
    cudaFree(errors);
    return comm->barrier(nullptr);
  });
}

TEST(Primitives, GridBarrierRepeatedAndAcrossGridSizes) {
  EPMOE_REQUIRE_RANKS(1);
  run_on_ranks(1, [](const RankContext& ctx) {
    int sms = 0;
    RANK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint32_t *bar, *counts, *errors;
    const int phases = 64;
    RANK_CUDA(cudaMalloc(&bar, 4));
    RANK_CUDA(cudaMalloc(&counts, phases * 4));
    RANK_CUDA(cudaMalloc(&errors, 4));
    RANK_CUDA(cudaMemset(bar, 0, 4));
    RANK_CUDA(cudaMemset(errors, 0, 4));
    for (int grid : {1, 7, sms, sms / 2, sms}) {
      for (int rep = 0; rep < 20; ++rep) {
        RANK_CUDA(cudaMemset(counts, 0, phases * 4));
        void* args[] = {&bar, &counts, (void*)&phases, &errors};
        RANK_CUDA(cudaLaunchCooperativeKernel((void*)grid_barrier_kernel, grid, 256, args, 0, nullptr));
      }
    }
    RANK_CUDA(cudaDeviceSynchronize());
    uint32_t h = 0;
    RANK_CUDA(cudaMemcpy(&h, errors, 4, cudaMemcpyDeviceToHost));
    RANK_CHECK(h == 0, ctx, h << " blocks passed a grid barrier early");
    return Status::Ok();
  });
}

TEST(Primitives, CommunicatorRejectsBadArguments) {
  EPMOE_REQUIRE_RANKS(1);
  run_on_ranks(1, [](const RankContext& ctx) {
    std::unique_ptr<Communicator> comm;
    Status st = Communicator::create(ctx.id, 3, 2, &comm);
    RANK_CHECK(!st.ok() && st.message().find("rank=3") != std::string::npos, ctx, st.to_string());
    Status st2 = Communicator::create(ctx.id, 0, 9, &comm);
    RANK_CHECK(!st2.ok() && st2.message().find("size=9") != std::string::npos, ctx, st2.to_string());
    Status st3 = Communicator::wrap(nullptr, &comm);
    RANK_CHECK(!st3.ok(), ctx, "wrap(nullptr) accepted");
    return Status::Ok();
  });
}

}  // namespace
}  // namespace epmoe::mgpu
