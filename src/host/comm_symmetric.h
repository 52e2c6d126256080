// The thin layer between NCCL's symmetric windows / device API and epmoe: everything that needs
// nccl_device.h lives in comm_symmetric.cu, so kernels and the rest of the host code see only plain
// peer pointers.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>

#include "epmoe/status.h"

namespace epmoe::detail {

// An ncclDevComm created with no requirements: proves the device API works with this libnccl and
// tells us the NVLink (LSA) team. Opaque to callers.
struct DevCommInfo {
  void* handle = nullptr;  // heap-allocated ncclDevComm
  int lsa_rank = -1;
  int lsa_size = 0;
};
Status create_dev_comm(ncclComm_t comm, DevCommInfo* out);
void destroy_dev_comm(ncclComm_t comm, DevCommInfo* info);

// peers[r] = rank r's copy of the window, for world ranks 0..size-1 (the LSA team must be the world).
Status resolve_peer_pointers(ncclWindow_t win, const DevCommInfo& info, int rank, int size, void** peers,
                             cudaStream_t stream);

// *dst = value from a kernel (dst may be a peer pointer): the NVLink write of the init check.
Status write_word_from_device(uint64_t* dst, uint64_t value, cudaStream_t stream);

}  // namespace epmoe::detail
