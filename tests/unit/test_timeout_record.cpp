// The host's rendering of the device error record (layout/error_record.h): the words the Status
// message and the log line carry, for comm waits, GEMM pipeline waits and bad routing, whatever
// the name's length.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "device/layout/error_record.h"

namespace {

using epmoe::layout::RoutingRecord;
using epmoe::layout::TimeoutRecord;
using epmoe::layout::WaitKind;
using epmoe::layout::WaitRole;

std::string render(const TimeoutRecord& r) {
  char line[320];
  epmoe::layout::format_timeout_record(r, line, sizeof(line));
  return line;
}

TimeoutRecord comm_sample() {
  TimeoutRecord r{};
  r.valid = 1;
  r.rank = 1;
  r.block = 3;
  r.thread = 0;
  r.index = 0;
  r.role = uint32_t(WaitRole::kComm);
  r.kind = uint32_t(WaitKind::kFlag);
  r.tile = -1;
  r.expected = 42;
  r.seen = 41;
  r.waited_ns = 1000000123ull;
  r.timeout_ns = 1000000000ull;
  std::strcpy(r.what, "dispatch_ready");
  return r;
}

TEST(TimeoutRecord, CommWaitNamesRankBlockRoleFlagExpectedSeenAndTimes) {
  EXPECT_EQ(render(comm_sample()),
            "[epmoe] TIMEOUT rank 1 block 3 thread 0 (comm): flag dispatch_ready[0] expected >= 42, seen 41 after "
            "1000 ms (timeout 1000 ms)");
}

TEST(TimeoutRecord, GemmMbarrierWaitNamesRoleStageParityAndTile) {
  TimeoutRecord r = comm_sample();
  r.role = uint32_t(WaitRole::kMath);
  r.kind = uint32_t(WaitKind::kMbarrier);
  r.thread = 130;
  r.index = 2;
  r.tile = 17;
  r.expected = 1;
  r.seen = 0;
  r.site = uint32_t(epmoe::layout::GemmWait::kConsumerFull);  // the kernels store the number, not the name
  EXPECT_EQ(render(r),
            "[epmoe] TIMEOUT rank 1 block 3 thread 130 (GEMM math): mbarrier full[2] (tile 17): the phase of parity 1 "
            "never completed after 1000 ms (timeout 1000 ms)");
}

TEST(TimeoutRecord, GemmCounterWaitNamesTheCounter) {
  TimeoutRecord r = comm_sample();
  r.role = uint32_t(WaitRole::kProducer);
  r.kind = uint32_t(WaitKind::kCounter);
  r.index = 5;
  r.tile = 40;
  r.expected = 64;
  r.seen = 12;
  r.site = uint32_t(epmoe::layout::GemmWait::kProducerArrive);
  EXPECT_EQ(render(r),
            "[epmoe] TIMEOUT rank 1 block 3 thread 0 (GEMM producer): counter mblock_arrive[5] (tile 40) expected >= "
            "64, seen 12 after 1000 ms (timeout 1000 ms)");
}

TEST(TimeoutRecord, UnterminatedNameIsCut) {
  TimeoutRecord r = comm_sample();
  std::memset(r.what, 'x', sizeof(r.what));  // the device always terminates; the host must not rely on it
  const std::string s = render(r);
  EXPECT_NE(s.find("flag " + std::string(sizeof(r.what) - 1, 'x') + "[0]"), std::string::npos) << s;
}

TEST(TimeoutRecord, FitsTheHostBuffer) {
  TimeoutRecord r = comm_sample();
  r.expected = r.seen = r.waited_ns = r.timeout_ns = ~0ull;
  r.rank = r.block = r.thread = r.index = r.tile = -2147483647 - 1;
  r.tile = 2147483647;
  r.role = 77;  // unknown values still render
  std::memset(r.what, 'y', sizeof(r.what));
  char line[320];
  EXPECT_LT(epmoe::layout::format_timeout_record(r, line, sizeof(line)), int(sizeof(line)));
  EXPECT_NE(std::string(line).find("(unknown role)"), std::string::npos) << line;
}

TEST(RoutingRecord, NamesRankCallTokenSlotValueAndRange) {
  RoutingRecord r{};
  r.seq = 2;
  r.rank = 3;
  r.call = 7;
  r.token = 12;
  r.slot = 1;
  r.value = 64;
  r.num_experts = 64;
  char line[256];
  epmoe::layout::format_routing_record(r, line, sizeof(line));
  EXPECT_EQ(std::string(line),
            "rank 3: forward call 7 had topk_idx[12][1]=64 outside [-1, 64) (the first bad slot of that call; its bad "
            "slots were treated as masked)");
}

}  // namespace
