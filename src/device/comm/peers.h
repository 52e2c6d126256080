// Plain peer pointers into one symmetric allocation: what kernels see of NCCL's windows.
#pragma once

#include <cstdint>

#include "device/layout/hd.h"

namespace epmoe::comm {

inline constexpr int kMaxPeers = 8;

struct PeerPtrs {
  char* ptr[kMaxPeers];  // ptr[r]: rank r's copy of the allocation, mapped into this process (NVLink)

  template <class T>
  EPMOE_HD T* at(int rank, int64_t byte_offset) const {
    return reinterpret_cast<T*>(ptr[rank] + byte_offset);
  }
};

}  // namespace epmoe::comm
