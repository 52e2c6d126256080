// Helpers for multi-GPU tests: each test body runs in one forked process per rank (the gtest
// process itself never touches CUDA) and reports failure as a Status message.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

#include "epmoe/comm.h"
#include "epmoe/launcher.h"
#include "epmoe/status.h"

namespace epmoe::mgpu {

// Set once in main() from a forked probe.
int& gpu_count();

// Runs fn on `ranks` forked processes (device = rank) and fails the test with the first failing
// rank's message.
void run_on_ranks(int ranks, const std::function<Status(const RankContext&)>& fn, double timeout_s = 180.0);

// Communicator for a child.
Status make_comm(const RankContext& ctx, std::unique_ptr<Communicator>* out);

inline Status fail(const std::string& what) { return Status(StatusCode::kInternal, what); }

// Ranks for a test written for `ranks`: EPMOE_TEST_RANKS=N (N >= 1) overrides it, for the 4- and
// 8-GPU runs and for N = 1 on a one-GPU machine (no NVLink traffic, every kernel still runs).
inline int test_ranks(int ranks) {
  if (const char* env = std::getenv("EPMOE_TEST_RANKS")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  return ranks;
}

}  // namespace epmoe::mgpu

// Skip (not fail) with fewer GPUs than needed, e.g. on CI.
#define EPMOE_REQUIRE_RANKS(n)                                                              \
  do {                                                                                      \
    if (::epmoe::mgpu::gpu_count() < (n))                                                   \
      GTEST_SKIP() << "needs " << (n) << " GPUs, " << ::epmoe::mgpu::gpu_count() << " visible"; \
  } while (0)

// Inside a rank's body: return a failure Status naming the rank and the check.
#define RANK_CHECK(cond, ctx, msg)                                                               \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::ostringstream _os;                                                                    \
      _os << "rank " << (ctx).rank << " " << __FILE__ << ":" << __LINE__ << ": " << #cond << ": " << msg; \
      return ::epmoe::mgpu::fail(_os.str());                                                     \
    }                                                                                            \
  } while (0)
#define RANK_OK(expr)                          \
  do {                                         \
    ::epmoe::Status _st = (expr);              \
    if (!_st.ok()) return _st;                 \
  } while (0)
#define RANK_CUDA(call)                                                                              \
  do {                                                                                               \
    cudaError_t _e = (call);                                                                         \
    if (_e != cudaSuccess)                                                                           \
      return ::epmoe::Status(::epmoe::StatusCode::kCudaError,                                        \
                             std::string(#call) + ": " + cudaGetErrorString(_e) + " at " + __FILE__ + \
                                 ":" + std::to_string(__LINE__));                                   \
  } while (0)
