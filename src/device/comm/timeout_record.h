// The record a bounded wait leaves when it gives up, shared by the kernels (writers) and the host
// (reader). It lives in mapped pinned host memory, one per DispatchHandle, so the host can still read
// it after the trap has killed the CUDA context; check_errors turns it into the Status message.
// Plain C++ on purpose: host-only translation units include it.
#pragma once

#include <cstdint>
#include <cstdio>

namespace epmoe::comm {

inline constexpr int kTimeoutFlagNameBytes = 32;

struct CommTimeoutRecord {
  // 0 until the reporting thread has written every field below; then 1 (written last, after a
  // system-scope fence, so a host that sees 1 sees the whole record).
  uint32_t valid;
  uint32_t printed;   // 1: the kernel also printed the line (kernels that may printf)
  int32_t rank, block, thread, index;
  uint64_t expected, seen, waited_ns, timeout_ns;
  char flag[kTimeoutFlagNameBytes];  // the flag's name, NUL-terminated (truncated if longer)
};

// One line, the same words as the kernels' printf, so logs and Status messages read alike.
inline int format_timeout_record(const CommTimeoutRecord& r, char* out, size_t size) {
  char flag[kTimeoutFlagNameBytes];
  for (int i = 0; i < kTimeoutFlagNameBytes; ++i) flag[i] = r.flag[i];
  flag[kTimeoutFlagNameBytes - 1] = '\0';
  return std::snprintf(out, size,
                       "[epmoe] TIMEOUT rank %d block %d thread %d: flag %s[%d] expected >= %llu, seen %llu after "
                       "%llu ms (timeout %llu ms)",
                       int(r.rank), int(r.block), int(r.thread), flag, int(r.index),
                       static_cast<unsigned long long>(r.expected), static_cast<unsigned long long>(r.seen),
                       static_cast<unsigned long long>(r.waited_ns / 1000000ull),
                       static_cast<unsigned long long>(r.timeout_ns / 1000000ull));
}

}  // namespace epmoe::comm
