// epmoe_mgpu_tests: multi-GPU tests. The parent process only forks; every rank is a child.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "mgpu/mgpu_util.h"
#include "tuning_env.h"

namespace epmoe::mgpu {

int& gpu_count() {
  static int n = 0;
  return n;
}

void run_on_ranks(int ranks, const std::function<Status(const RankContext&)>& fn, double timeout_s) {
  LaunchOptions o;
  o.num_ranks = ranks;
  o.timeout_seconds = timeout_s;
  const LaunchResult r = launch_ranks(o, fn);
  ASSERT_TRUE(r.ok) << r.message;
}

Status make_comm(const RankContext& ctx, std::unique_ptr<Communicator>* out) {
  return Communicator::create(ctx.id, ctx.rank, ctx.size, out);
}

}  // namespace epmoe::mgpu

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // The EPMOE_* tuning switches (the replay commands name them); the forked ranks inherit them.
  epmoe::testing_env::apply_tuning_env();
  // Why a forked probe: CUDA is not fork-safe, so this process must never initialise it.
  epmoe::mgpu::gpu_count() = epmoe::probe_gpu_count();
  std::printf("[epmoe] %d GPU(s) visible%s\n", epmoe::mgpu::gpu_count(),
              epmoe::mgpu::gpu_count() < 2 ? ": multi-GPU tests will be skipped" : "");
  return RUN_ALL_TESTS();
}
