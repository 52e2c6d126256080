// A rank that leaves the others, at mgpu::test_ranks(2) ranks (EPMOE_TEST_RANKS=4 for four), both
// paths, in the style of test_layer_faults.cpp (each case in its own forked ranks, within its
// bound, the message checked on every rank):
// - a rank that exits (_exit) in the middle of a call, after publishing its dispatch flag: every
//   other rank gets kTimeout naming itself and a flag of the rank that exited, from a later forward
//   without a sync (the launcher expects that rank's exit);
// - a layer destroyed on one rank only while the others call forward: the others get kTimeout
//   naming its dispatch flag and destroy theirs in bounded time; the destroying rank's destroy
//   ends after its timeout, and its next collective call returns that cause.
// No test hook is needed: the ranks themselves exit or destroy.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "e2e/fault_rig.h"
#include "epmoe/comm.h"
#include "epmoe/launcher.h"
#include "epmoe/layer.h"
#include "mgpu/mgpu_util.h"

namespace epmoe::e2e {
namespace {

using namespace faults;

// ---- a rank that exits in the middle of a call ------------------------------------------------------

constexpr int kExitingRank = 1;
constexpr int kExitCode = 77;

// Where the exiting rank records that it is about to exit, and its pid (shared with its peers).
class ExitRecord {
 public:
  ExitRecord() {
    void* m = mmap(nullptr, sizeof(Words), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    w_ = m == MAP_FAILED ? nullptr : static_cast<Words*>(m);
    if (w_) *w_ = Words{};
  }
  ~ExitRecord() { if (w_) munmap(w_, sizeof(Words)); }
  bool ok() const { return w_ != nullptr; }
  void mark(pid_t pid) {
    __atomic_store_n(&w_->pid, int(pid), __ATOMIC_SEQ_CST);
    __atomic_store_n(&w_->exiting, 1, __ATOMIC_SEQ_CST);
  }
  // Until the exiting rank's process is gone (reaped by the launcher), or false after `seconds`.
  bool wait_gone(double seconds) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (__atomic_load_n(&w_->exiting, __ATOMIC_SEQ_CST) &&
          kill(pid_t(__atomic_load_n(&w_->pid, __ATOMIC_SEQ_CST)), 0) != 0 && errno == ESRCH)
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

 private:
  struct Words {
    int exiting = 0;
    int pid = 0;
  };
  Words* w_ = nullptr;
};

Status rank_exits_rank(const RankContext& ctx, Path path, ExitRecord& exits) {
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, kWaitSeconds), &r));
  // One complete call on every rank first: the kernels are loaded, so the exiting rank's next
  // launch is quick, and every flag of call 1 has been published.
  RANK_OK(forward(r, path));
  RANK_OK(r.layer->check_device_error(r.stream));
  if (ctx.rank == kExitingRank) {
    // Call 2: its kernel stages, publishes dispatch_ready and waits for its peers, which have not
    // called yet; the process ends with the kernel running (and without returning from this
    // function: the launcher expects exactly that).
    RANK_OK(forward(r, path));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::printf("[faults] rank %d exits in the middle of call 2 (%s)\n", ctx.rank, path_name(path));
    std::fflush(stdout);
    std::fflush(stderr);
    exits.mark(getpid());
    _exit(kExitCode);
  }
  RANK_CHECK(exits.wait_gone(20.0), ctx, "rank " << kExitingRank << " did not exit");
  // Call 2 here, with the peer gone: the bounded waits for its flags expire and trap.
  const auto t0 = std::chrono::steady_clock::now();
  const Status first = forward(r, path);
  RANK_CHECK(first.ok() || first.code() == StatusCode::kTimeout, ctx, "forward: " << first.to_string());
  Status st;
  RANK_OK(timeout_without_sync(r, path, first, &st));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[faults] rank %d forward after rank %d exited (%.2f s): %s\n", ctx.rank, kExitingRank, s,
              st.to_string().c_str());
  (void)r.layer.release();  // the context is lost: collective destructors could only fail
  (void)r.comm.release();
  const std::string& m = st.message();
  RANK_CHECK(st.code() == StatusCode::kTimeout, ctx, "expected kTimeout, got " << st.to_string());
  RANK_CHECK(contains(m, "TIMEOUT rank " + std::to_string(ctx.rank) + " "), ctx, "no waiter rank in: " << m);
  // It died after publishing its dispatch_ready of call 2, so the wait that expires is expected on
  // its combine_ready; dispatch_ready is accepted too (should its kernel not have got that far).
  const std::string gone = "[" + std::to_string(kExitingRank) + "]";
  RANK_CHECK(contains(m, "(comm): flag combine_ready" + gone) || contains(m, "(comm): flag dispatch_ready" + gone), ctx,
             "the record does not name a flag of the rank that exited: " << m);
  RANK_CHECK(contains(m, "expected >= 2, seen 1"), ctx, "not a wait of call 2 on a flag of call 1: " << m);
  RANK_CHECK(s < kWaitSeconds * 10 + 5, ctx, "the error took " << s << " s");
  return Status::Ok();
}

void rank_exits(Path path) {
  ExitRecord exits;
  ASSERT_TRUE(exits.ok());
  run_case((std::string("rank exits mid-call ") + path_name(path)).c_str(),
           [&](const RankContext& ctx) { return rank_exits_rank(ctx, path, exits); },
           {ExpectedExit{kExitingRank, kExitCode}});
}

TEST(LayerFaults, RankExitsMidCallPipeline) { rank_exits(Path::kPipeline); }
TEST(LayerFaults, RankExitsMidCallFused) { rank_exits(Path::kFused); }

// ---- a layer destroyed on one rank only ------------------------------------------------------------

constexpr int kDestroyingRank = 1;

Status destroyed_on_one_rank(const RankContext& ctx, Path path, Checked& checked) {
  Rig r;
  RANK_OK(make_rig(ctx, small_config(ctx.size, kWaitSeconds), &r));
  RANK_OK(forward(r, path));
  RANK_OK(r.layer->check_device_error(r.stream));
  if (ctx.rank == kDestroyingRank) {
    // Collective, but its peers call forward instead: its agreement before releasing the
    // symmetric memory times out, and the communicator becomes unusable.
    const auto t0 = std::chrono::steady_clock::now();
    r.layer.reset();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A destructor returns nothing: the next collective call on the communicator returns the cause.
    const Status st = r.comm->barrier(r.stream, 10.0);
    std::printf("[faults] rank %d destroyed its layer alone (%.2f s); then barrier: %s\n", ctx.rank, s,
                st.to_string().c_str());
    checked.mark();
    // Stays up until every peer has checked (its memory is mapped into their processes).
    RANK_CHECK(checked.wait_for(ctx.size, 25.0), ctx, "a peer never reported");
    const std::string& m = st.message();
    RANK_CHECK(s < kWaitSeconds + 5.0, ctx, "destroying the layer took " << s << " s");
    RANK_CHECK(!st.ok() && contains(m, "the communicator is unusable"), ctx, "barrier: " << st.to_string());
    RANK_CHECK(contains(m, "free_symmetric (every rank synchronized)") &&
                   contains(m, "did not complete within timeout_seconds=1"),
               ctx, "the cause is not the destroy's timed-out agreement: " << m);
    r.comm.reset();  // unusable: it frees nothing on the device and destroys nothing that waits
    return Status::Ok();
  }
  const Status first = forward(r, path);
  RANK_CHECK(first.ok() || first.code() == StatusCode::kTimeout, ctx, "forward: " << first.to_string());
  Status st;
  RANK_OK(timeout_without_sync(r, path, first, &st));
  // Then this rank destroys its layer too, as a caller would: on a lost context, bounded.
  const auto t0 = std::chrono::steady_clock::now();
  r.layer.reset();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[faults] rank %d forward after rank %d destroyed its layer: %s; destroy %.2f s\n", ctx.rank,
              kDestroyingRank, st.to_string().c_str(), s);
  (void)r.comm.release();  // the context is lost
  checked.mark();
  RANK_CHECK(checked.wait_for(ctx.size, 25.0), ctx, "a rank never reported");
  const std::string& m = st.message();
  RANK_CHECK(st.code() == StatusCode::kTimeout, ctx, "expected kTimeout, got " << st.to_string());
  RANK_CHECK(contains(m, "TIMEOUT rank " + std::to_string(ctx.rank) + " "), ctx, "no waiter rank in: " << m);
  RANK_CHECK(contains(m, "(comm): flag dispatch_ready[" + std::to_string(kDestroyingRank) + "]"), ctx,
             "the record does not name the flag of the rank that destroyed its layer: " << m);
  RANK_CHECK(s < 5.0, ctx, "destroying the layer after the trap took " << s << " s");
  return Status::Ok();
}

void destroyed_on_one(Path path) {
  Checked checked;
  ASSERT_TRUE(checked.ok());
  run_case((std::string("layer destroyed on one rank ") + path_name(path)).c_str(),
           [&](const RankContext& ctx) { return destroyed_on_one_rank(ctx, path, checked); });
}

TEST(LayerFaults, LayerDestroyedOnOneRankPipeline) { destroyed_on_one(Path::kPipeline); }
TEST(LayerFaults, LayerDestroyedOnOneRankFused) { destroyed_on_one(Path::kFused); }

}  // namespace
}  // namespace epmoe::e2e
