#include "host/comm_symmetric.h"

#include <nccl_device.h>

#include <initializer_list>
#include <sstream>

#include "host/check.h"

namespace epmoe::detail {
namespace {

struct LsaIndex {
  int of_rank[8];
};

__global__ void resolve_peers_kernel(ncclWindow_t win, int size, LsaIndex idx, void** out) {
  const int r = threadIdx.x;
  if (r < size) out[r] = ncclGetLsaPointer(win, 0, idx.of_rank[r]);
}

__global__ void write_word_kernel(uint64_t* dst, uint64_t value) { *dst = value; }

}  // namespace

Status create_dev_comm(ncclComm_t comm, DevCommInfo* out) {
  ncclDevCommRequirements reqs = {};  // no barriers, no multimem, no GIN: only the LSA team
  auto* dc = new ncclDevComm();
  const ncclResult_t res = ncclDevCommCreate(comm, &reqs, dc);
  if (res != ncclSuccess) {
    delete dc;
    std::ostringstream os;
    os << "ncclDevCommCreate failed: " << ncclGetErrorString(res)
       << ". epmoe needs the NCCL device API (NCCL >= 2.28.9 loaded at run time, GPUs with symmetric "
          "memory support); check LD_LIBRARY_PATH / RUNPATH and NCCL_DEBUG=WARN output";
    return Status(StatusCode::kNcclError, os.str());
  }
  out->handle = dc;
  out->lsa_rank = dc->lsaRank;
  out->lsa_size = dc->lsaSize;
  return Status::Ok();
}

void destroy_dev_comm(ncclComm_t comm, DevCommInfo* info) {
  if (!info->handle) return;
  auto* dc = static_cast<ncclDevComm*>(info->handle);
  ncclDevCommDestroy(comm, dc);
  delete dc;
  info->handle = nullptr;
}

Status resolve_peer_pointers(ncclWindow_t win, const DevCommInfo& info, int rank, int size, void** peers,
                             cudaStream_t stream) {
  if (info.lsa_size != size || info.lsa_rank != rank) {
    std::ostringstream os;
    os << "NCCL's load/store-accessible (NVLink) team has " << info.lsa_size << " ranks (this rank is "
       << info.lsa_rank << " in it) but the communicator has " << size << " (this rank " << rank
       << "): epmoe needs every rank reachable over NVLink (one node)";
    return Status(StatusCode::kUnsupported, os.str());
  }
  LsaIndex idx = {};
  for (int r = 0; r < size && r < 8; ++r) idx.of_rank[r] = info.lsa_rank + (r - rank);
  void** d_out = nullptr;
  EPMOE_CUDA_RETURN(cudaMallocAsync(reinterpret_cast<void**>(&d_out), 8 * sizeof(void*), stream));
  resolve_peers_kernel<<<1, 32, 0, stream>>>(win, size, idx, d_out);
  const Status launched = cuda_status(cudaGetLastError(), "launch of resolve_peers_kernel", __FILE__, __LINE__);
  const Status copied =
      launched.ok() ? cuda_status(cudaMemcpyAsync(peers, d_out, size * sizeof(void*), cudaMemcpyDeviceToHost, stream),
                                  "cudaMemcpyAsync(peers)", __FILE__, __LINE__)
                    : Status::Ok();
  // Freed whatever happened above; the first error is the one returned.
  const Status freed = cuda_status(cudaFreeAsync(d_out, stream), "cudaFreeAsync(peer table)", __FILE__, __LINE__);
  const Status synced = cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  for (const Status* st : {&launched, &copied, &freed, &synced})
    if (!st->ok()) return *st;
  return Status::Ok();
}

Status write_word_from_device(uint64_t* dst, uint64_t value, cudaStream_t stream) {
  write_word_kernel<<<1, 1, 0, stream>>>(dst, value);
  EPMOE_LAUNCH_CHECK("write_word_kernel");
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status::Ok();
}

}  // namespace epmoe::detail
