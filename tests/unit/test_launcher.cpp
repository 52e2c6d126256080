// The launcher on the CPU: ranks run in forked children, failures, hangs and ranks that exit before
// their function returned fail the run with the rank's message (unless the exit is expected), and
// no child survives the call.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "epmoe/launcher.h"

namespace {

epmoe::LaunchOptions cpu_options(int ranks, double timeout_s) {
  epmoe::LaunchOptions o;
  o.num_ranks = ranks;
  o.timeout_seconds = timeout_s;
  o.set_device = false;  // CPU-only test: never touch CUDA
  return o;
}

TEST(Launcher, AllRanksSucceed) {
  const auto r = epmoe::launch_ranks(cpu_options(3, 30), [](const epmoe::RankContext& c) {
    if (c.size != 3) return epmoe::Status(epmoe::StatusCode::kInternal, "wrong size");
    return epmoe::Status::Ok();
  });
  EXPECT_TRUE(r.ok) << r.message;
  ASSERT_EQ(r.ranks.size(), 3u);
  for (const auto& o : r.ranks) {
    EXPECT_EQ(o.exit_code, 0);
    EXPECT_TRUE(o.returned);
    EXPECT_TRUE(o.message.empty()) << o.message;
  }
}

TEST(Launcher, SameUniqueIdInEveryRank) {
  // Each rank checks the id bytes against what rank 0 would see: all children get one copy.
  const auto r = epmoe::launch_ranks(cpu_options(2, 30), [](const epmoe::RankContext& c) {
    unsigned sum = 0;
    for (char ch : c.id.internal) sum += static_cast<unsigned char>(ch);
    return sum == 0 ? epmoe::Status(epmoe::StatusCode::kInternal, "empty unique id") : epmoe::Status::Ok();
  });
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Launcher, FailingRankFailsRunWithItsMessageAndKillsTheOthers) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = epmoe::launch_ranks(cpu_options(2, 60), [](const epmoe::RankContext& c) {
    if (c.rank == 1) return epmoe::Status(epmoe::StatusCode::kInvalidArgument, "rank one says no");
    std::this_thread::sleep_for(std::chrono::seconds(50));  // would hang the run without the kill
    return epmoe::Status::Ok();
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("rank one says no"), std::string::npos) << r.message;
  EXPECT_EQ(r.message.rfind("rank 1", 0), 0u) << "the failing rank comes first: " << r.message;
  EXPECT_LT(s, 20.0);
  EXPECT_FALSE(r.ranks[0].finished);
}

TEST(Launcher, HangingRankHitsTheTimeLimit) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = epmoe::launch_ranks(cpu_options(2, 1.0), [](const epmoe::RankContext& c) {
    if (c.rank == 0) pause();  // never returns on its own
    return epmoe::Status::Ok();
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("did not finish"), std::string::npos) << r.message;
  EXPECT_LT(s, 10.0);
  // The killed child was reaped: its pid is gone.
  EXPECT_FALSE(r.ranks[0].finished);
}

TEST(Launcher, CrashingRankReportsItsSignal) {
  const auto r = epmoe::launch_ranks(cpu_options(2, 30), [](const epmoe::RankContext& c) {
    if (c.rank == 0) std::abort();
    return epmoe::Status::Ok();
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("signal"), std::string::npos) << r.message;
}

TEST(Launcher, ExceptionBecomesAMessage) {
  const auto r = epmoe::launch_ranks(cpu_options(1, 30), [](const epmoe::RankContext&) -> epmoe::Status {
    throw std::runtime_error("boom");
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("boom"), std::string::npos) << r.message;
}

TEST(Launcher, RankThatExitsBeforeReturningFailsTheRun) {
  const auto r = epmoe::launch_ranks(cpu_options(2, 30), [](const epmoe::RankContext& c) {
    if (c.rank == 1) _exit(0);  // code 0, but its function never returned
    return epmoe::Status::Ok();
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("rank 1: exited with code 0 before its function returned"), std::string::npos) << r.message;
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_FALSE(r.ranks[1].returned);
  EXPECT_TRUE(r.ranks[1].failed);
}

epmoe::LaunchOptions with_expected_exit(int rank, int code) {
  epmoe::LaunchOptions o = cpu_options(2, 30);
  o.expected_exits.push_back({rank, code});
  return o;
}

TEST(Launcher, ExpectedExitLetsTheOtherRanksFinish) {
  const auto r = epmoe::launch_ranks(with_expected_exit(1, 77), [](const epmoe::RankContext& c) {
    if (c.rank == 1) _exit(77);
    // Still running when rank 1 is gone: the launcher must not have killed it.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return epmoe::Status::Ok();
  });
  EXPECT_TRUE(r.ok) << r.message;
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_TRUE(r.ranks[0].finished && r.ranks[0].returned && !r.ranks[0].failed);
  EXPECT_TRUE(r.ranks[1].finished && !r.ranks[1].returned && !r.ranks[1].failed);
  EXPECT_EQ(r.ranks[1].exit_code, 77);
}

TEST(Launcher, ExpectedExitThatReturnsInsteadFailsTheRun) {
  const auto r = epmoe::launch_ranks(with_expected_exit(1, 77), [](const epmoe::RankContext&) {
    return epmoe::Status::Ok();
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("rank 1: was expected to exit with code 77"), std::string::npos) << r.message;
}

TEST(Launcher, ExpectedExitWithAnotherCodeFailsTheRun) {
  const auto r = epmoe::launch_ranks(with_expected_exit(1, 77), [](const epmoe::RankContext& c) {
    if (c.rank == 1) _exit(3);
    return epmoe::Status::Ok();
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("exited with code 3 before its function returned; expected code 77"), std::string::npos)
      << r.message;
}

TEST(Launcher, ExpectedExitStillFailsTheRunOnASignal) {
  const auto r = epmoe::launch_ranks(with_expected_exit(1, 77), [](const epmoe::RankContext& c) {
    if (c.rank == 1) std::abort();
    return epmoe::Status::Ok();
  });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("rank 1: died from signal"), std::string::npos) << r.message;
}

TEST(Launcher, RejectsZeroRanks) {
  const auto r = epmoe::launch_ranks(cpu_options(0, 30), [](const epmoe::RankContext&) { return epmoe::Status::Ok(); });
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("num_ranks"), std::string::npos);
}

TEST(Launcher, ParsesRanksFlag) {
  EXPECT_EQ(epmoe::parse_ranks_flag({}, 2), 2);
  EXPECT_EQ(epmoe::parse_ranks_flag({"--ranks", "4"}, 2), 4);
  EXPECT_EQ(epmoe::parse_ranks_flag({"--x", "--ranks=8"}, 2), 8);
  EXPECT_EQ(epmoe::parse_ranks_flag({"--ranks", "two"}, 2), -1);
  EXPECT_EQ(epmoe::parse_ranks_flag({"--ranks", "0"}, 2), -1);
}

}  // namespace
