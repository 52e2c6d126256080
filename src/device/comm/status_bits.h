// Bits of the device status word that kernels set instead of failing silently (the forward path
// never syncs, so the host reads the word later in an explicit check call).
#pragma once

#include <cstdint>

#include "device/layout/error_record.h"

namespace epmoe::comm {

inline constexpr uint32_t kStatusBadExpert = 1u << 0;  // a topk_idx outside [-1, E): slot treated as masked
// Set by a bounded wait just before it traps (comm and GEMM waits alike); the thread that sets it
// first writes the timeout record (layout/error_record.h). The host never reads the bit: the trap
// kills the CUDA context, so the host reads the record in host memory instead.
inline constexpr uint32_t kStatusTimeout = layout::kTimeoutClaimBit;
// Bit 2 is retired (duplicate experts used to be masked; they are now computed, as SPEC asks).
inline constexpr uint32_t kStatusInternal = 1u << 3;  // an impossible row index (a bug): write skipped

}  // namespace epmoe::comm
