// The verdicts of the cross-rank agreements, on the CPU: what every rank returns from the gathered
// Status of each rank, and alloc_symmetric's check of the gathered arguments.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/status.h"
#include "host/comm_internal.h"

namespace {

using epmoe::Status;
using epmoe::StatusCode;
using epmoe::detail::agreement_verdict;
using epmoe::detail::symmetric_argument_errors;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

TEST(Agreement, OkOnlyWhenEveryRankIsOk) {
  const std::vector<Status> all(4, Status::Ok());
  for (int self = 0; self < 4; ++self) EXPECT_TRUE(agreement_verdict(all, self, "step").ok());
}

TEST(Agreement, EveryRankNamesTheFailingRankAndItsCause) {
  std::vector<Status> all(4, Status::Ok());
  all[1] = Status(StatusCode::kInvalidArgument, "reserved=1 must be 0");
  for (int self = 0; self < 4; ++self) {
    const Status v = agreement_verdict(all, self, "epmoe_layer_create (the checks)");
    ASSERT_FALSE(v.ok()) << "rank " << self;
    // The peers take the failing rank's code; the message is the same everywhere but for the reporter.
    EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(v.message(), "epmoe_layer_create (the checks) failed on rank 1 (reported on rank " +
                                          std::to_string(self) + ";"))
        << v.message();
    EXPECT_TRUE(contains(v.message(), "rank 1: InvalidArgument: reserved=1 must be 0")) << v.message();
  }
}

TEST(Agreement, SeveralFailingRanksAreListedInOrderAndEachKeepsItsCode) {
  std::vector<Status> all(3, Status::Ok());
  all[2] = Status(StatusCode::kCudaError, "out of memory");
  all[0] = Status(StatusCode::kInvalidArgument, "hidden=100");
  const Status on1 = agreement_verdict(all, 1, "create");
  EXPECT_EQ(on1.code(), StatusCode::kInvalidArgument);  // the first failing rank's
  EXPECT_TRUE(contains(on1.message(), "failed on ranks 0, 2")) << on1.message();
  EXPECT_TRUE(contains(on1.message(), "rank 0: InvalidArgument: hidden=100; rank 2: CudaError: out of memory"))
      << on1.message();
  EXPECT_EQ(agreement_verdict(all, 2, "create").code(), StatusCode::kCudaError);  // its own
}

std::vector<int64_t> words(const std::vector<std::vector<int64_t>>& per_rank) {
  std::vector<int64_t> all;
  for (const auto& w : per_rank) {
    EXPECT_EQ(int(w.size()), epmoe::detail::kSymmetricArgWords);
    all.insert(all.end(), w.begin(), w.end());
  }
  return all;
}

TEST(Agreement, SymmetricArgumentsAlikeAndValidPass) {
  EXPECT_EQ(symmetric_argument_errors(words({{4096, 0, 0}, {4096, 0, 0}, {4096, 0, 0}}), 3), "");
}

TEST(Agreement, SymmetricArgumentsNameEveryProblemAndItsRanks) {
  const std::string e = symmetric_argument_errors(words({{4096, 0, 0}, {8192, 1, 0}, {4096, 0, 1}, {0, 0, 0}}), 4);
  EXPECT_TRUE(contains(e, "out is null on rank 1")) << e;
  EXPECT_TRUE(contains(e, "bytes is 0 on rank 3")) << e;
  EXPECT_TRUE(contains(e, "bytes differ across ranks (every rank must allocate the same size): 4096 on ranks 0, 2, "
                          "8192 on rank 1, 0 on rank 3"))
      << e;
  EXPECT_TRUE(contains(e, "timeout_seconds is outside (0, 3600] on rank 2")) << e;
}

TEST(Agreement, SymmetricZeroBytesEverywhereIsAnError) {
  const std::string e = symmetric_argument_errors(words({{0, 0, 0}, {0, 0, 0}}), 2);
  EXPECT_EQ(e, "bytes is 0 on ranks 0, 1 (it must be > 0)");
}

}  // namespace
