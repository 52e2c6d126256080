// Bits of the device status word that kernels set instead of failing silently (the forward path
// never syncs, so the host reads the word later in an explicit check call).
#pragma once

#include <cstdint>

namespace epmoe::comm {

inline constexpr uint32_t kStatusBadExpert = 1u << 0;  // a topk_idx outside [-1, E): slot treated as masked
inline constexpr uint32_t kStatusTimeout = 1u << 1;    // a bounded wait expired (the kernel trapped)

}  // namespace epmoe::comm

namespace epmoe::comm {
inline constexpr uint32_t kStatusDuplicateExpert = 1u << 2;  // one expert twice in a token: later slot masked
inline constexpr uint32_t kStatusInternal = 1u << 3;         // an impossible row index (a bug): write skipped
}  // namespace epmoe::comm
