// The host's rendering of a device timeout record (comm/timeout_record.h): the words the Status
// message and the log line carry, whatever the flag name's length.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "device/comm/timeout_record.h"

namespace {

using epmoe::comm::CommTimeoutRecord;

std::string render(const CommTimeoutRecord& r) {
  char line[256];
  epmoe::comm::format_timeout_record(r, line, sizeof(line));
  return line;
}

CommTimeoutRecord sample() {
  CommTimeoutRecord r{};
  r.valid = 1;
  r.rank = 1;
  r.block = 3;
  r.thread = 0;
  r.index = 0;
  r.expected = 42;
  r.seen = 41;
  r.waited_ns = 1000000123ull;
  r.timeout_ns = 1000000000ull;
  std::strcpy(r.flag, "dispatch_ready");
  return r;
}

TEST(TimeoutRecord, NamesRankBlockFlagExpectedSeenAndTimes) {
  EXPECT_EQ(render(sample()),
            "[epmoe] TIMEOUT rank 1 block 3 thread 0: flag dispatch_ready[0] expected >= 42, seen 41 after 1000 ms "
            "(timeout 1000 ms)");
}

TEST(TimeoutRecord, UnterminatedFlagNameIsCut) {
  CommTimeoutRecord r = sample();
  std::memset(r.flag, 'x', sizeof(r.flag));  // the device always terminates; the host must not rely on it
  const std::string s = render(r);
  EXPECT_NE(s.find("flag " + std::string(sizeof(r.flag) - 1, 'x') + "[0]"), std::string::npos) << s;
}

TEST(TimeoutRecord, FitsTheHostBuffer) {
  CommTimeoutRecord r = sample();
  r.expected = r.seen = r.waited_ns = r.timeout_ns = ~0ull;
  r.rank = r.block = r.thread = r.index = -2147483647 - 1;
  std::memset(r.flag, 'y', sizeof(r.flag));
  char line[256];
  EXPECT_LT(epmoe::comm::format_timeout_record(r, line, sizeof(line)), int(sizeof(line)));
}

}  // namespace
