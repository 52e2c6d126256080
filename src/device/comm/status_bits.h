// Bits of the device status word that kernels set instead of failing silently (the forward path
// never syncs, so the host reads the word later in an explicit check call).
#pragma once

#include <cstdint>

namespace epmoe::comm {

inline constexpr uint32_t kStatusBadExpert = 1u << 0;  // a topk_idx outside [-1, E): slot treated as masked
// Set by a bounded wait just before it traps; the thread that sets it first writes the timeout
// record (comm/wait.h). The host never reads the bit: the trap kills the CUDA context, so
// check_errors reads the record in host memory instead.
inline constexpr uint32_t kStatusTimeout = 1u << 1;
// Bit 2 is retired (duplicate experts used to be masked; they are now computed, as SPEC asks).
inline constexpr uint32_t kStatusInternal = 1u << 3;  // an impossible row index (a bug): write skipped

}  // namespace epmoe::comm
