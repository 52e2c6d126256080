// Communicator: NCCL setup, symmetric allocations and the init-time checks that catch NCCL's
// silent fallbacks (plain cudaMalloc memory, registration without symmetric support).
#include "epmoe/comm.h"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/version.h"
#include "host/check.h"
#include "host/comm_symmetric.h"

namespace epmoe {

struct Communicator::Impl {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int rank = 0, size = 0, device = 0, sms = 0;
  cudaStream_t stream = nullptr;
  int* scratch = nullptr;  // one word for barrier()
  detail::DevCommInfo dev;
  struct Buffer {
    void* ptr = nullptr;
    ncclWindow_t win = nullptr;
    SymmetricBuffer view;
  };
  std::vector<Buffer*> buffers;

  ~Impl() {
    if (stream) cudaStreamSynchronize(stream);
    for (Buffer* b : buffers) {
      if (b->win) ncclCommWindowDeregister(comm, b->win);
      if (b->ptr) ncclMemFree(b->ptr);
      delete b;
    }
    detail::destroy_dev_comm(comm, &dev);
    if (scratch) cudaFree(scratch);
    if (stream) cudaStreamDestroy(stream);
    if (owned && comm) ncclCommDestroy(comm);
  }
};

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
int Communicator::device() const { return impl_->device; }
int Communicator::num_sms() const { return impl_->sms; }
ncclComm_t Communicator::nccl() const { return impl_->comm; }

Status Communicator::create(const ncclUniqueId& id, int rank, int size, std::unique_ptr<Communicator>* out) {
  if (size < 1 || size > kMaxCommRanks)
    return detail::invalid("Communicator: size=", size, " must be in [1, ", kMaxCommRanks, "]");
  if (rank < 0 || rank >= size) return detail::invalid("Communicator: rank=", rank, " must be in [0, ", size, ")");
  EPMOE_RETURN_IF_ERROR(check_nccl_runtime_version());
  auto impl = std::make_unique<Impl>();
  EPMOE_NCCL_RETURN(ncclCommInitRank(&impl->comm, size, id, rank));
  impl->owned = true;
  return init(std::move(impl), out);
}

Status Communicator::wrap(ncclComm_t comm, std::unique_ptr<Communicator>* out) {
  if (!comm) return detail::invalid("Communicator::wrap: comm is null");
  EPMOE_RETURN_IF_ERROR(check_nccl_runtime_version());
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;
  return init(std::move(impl), out);
}

Status Communicator::init(std::unique_ptr<Impl> impl, std::unique_ptr<Communicator>* out) {
  EPMOE_NCCL_RETURN(ncclCommUserRank(impl->comm, &impl->rank));
  EPMOE_NCCL_RETURN(ncclCommCount(impl->comm, &impl->size));
  EPMOE_NCCL_RETURN(ncclCommCuDevice(impl->comm, &impl->device));
  if (impl->size > kMaxCommRanks)
    return Status(StatusCode::kUnsupported, "Communicator: " + std::to_string(impl->size) + " ranks; epmoe supports at most " +
                                                std::to_string(kMaxCommRanks) + " (one NVLink node)");
  int current = -1;
  EPMOE_CUDA_RETURN(cudaGetDevice(&current));
  if (current != impl->device) {
    std::ostringstream os;
    os << "Communicator: the current CUDA device is " << current << " but the NCCL communicator lives on device "
       << impl->device << "; call cudaSetDevice(" << impl->device << ") first";
    return detail::invalid(os.str());
  }
  EPMOE_CUDA_RETURN(cudaDeviceGetAttribute(&impl->sms, cudaDevAttrMultiProcessorCount, impl->device));
  EPMOE_CUDA_RETURN(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  EPMOE_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&impl->scratch), sizeof(int)));
  EPMOE_RETURN_IF_ERROR(detail::create_dev_comm(impl->comm, &impl->dev));
  out->reset(new Communicator(std::move(impl)));
  return Status::Ok();
}

Status Communicator::free_symmetric(SymmetricBuffer* buf) {
  Impl& m = *impl_;
  if (!buf) return Status::Ok();
  auto it = m.buffers.begin();
  while (it != m.buffers.end() && &(*it)->view != buf) ++it;
  if (it == m.buffers.end())
    return detail::invalid("free_symmetric: the buffer was not allocated by this Communicator (or was freed already)");
  Impl::Buffer* b = *it;
  m.buffers.erase(it);
  // Why sync and barrier first: our kernels may still be running, and a peer's kernel may still read
  // or write our copy through NVLink (combine's last flag stores land after we finished).
  Status st = detail::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  if (st.ok()) st = barrier(m.stream);
  if (st.ok() && b->win) {
    st = detail::nccl_status(ncclCommWindowDeregister(m.comm, b->win), "ncclCommWindowDeregister", __FILE__, __LINE__);
    if (st.ok()) b->win = nullptr;
  }
  if (st.ok() && b->ptr) {
    st = detail::nccl_status(ncclMemFree(b->ptr), "ncclMemFree", __FILE__, __LINE__);
    if (st.ok()) b->ptr = nullptr;
  }
  if (!st.ok()) {
    // Not (fully) freed: keep it listed so that the Communicator's destructor tries the rest.
    m.buffers.push_back(b);
    return Status(st.code(), "free_symmetric on rank " + std::to_string(m.rank) + ": " + st.message());
  }
  delete b;
  return Status::Ok();
}

Status Communicator::barrier(cudaStream_t stream) {
  EPMOE_NCCL_RETURN(ncclAllReduce(impl_->scratch, impl_->scratch, 1, ncclInt32, ncclSum, impl_->comm, stream));
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status::Ok();
}

Status Communicator::alloc_symmetric(size_t bytes, SymmetricBuffer** out) {
  Impl& m = *impl_;
  if (bytes == 0) return detail::invalid("alloc_symmetric: bytes must be > 0");
  bytes = (bytes + 4095) / 4096 * 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT
  auto* b = new Impl::Buffer();
  m.buffers.push_back(b);  // freed with the communicator, also on a failure below
  EPMOE_NCCL_RETURN(ncclMemAlloc(&b->ptr, bytes));
  EPMOE_NCCL_RETURN(ncclCommWindowRegister(m.comm, b->ptr, bytes, &b->win, NCCL_WIN_COLL_SYMMETRIC));
  if (!b->win)
    return Status(StatusCode::kNcclError, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) returned no window");
  b->view.local = b->ptr;
  b->view.bytes = bytes;
  EPMOE_RETURN_IF_ERROR(detail::resolve_peer_pointers(b->win, m.dev, m.rank, m.size, b->view.peers, m.stream));

  // Why write and read back: NCCL may hand back plain cudaMalloc memory or register a window without
  // symmetric mapping and still return success. Each rank writes a tag into the next rank's copy
  // through the resolved pointer and into its own copy through its own resolved pointer; after a
  // barrier each rank must find both tags in its local memory.
  const uint64_t magic = 0xE93E0C0FFEE00000ull;
  const int next = (m.rank + 1) % m.size, prev = (m.rank + m.size - 1) % m.size;
  EPMOE_CUDA_RETURN(cudaMemsetAsync(b->ptr, 0, bytes, m.stream));
  EPMOE_RETURN_IF_ERROR(barrier(m.stream));
  EPMOE_RETURN_IF_ERROR(detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[next]), magic + m.rank, m.stream));
  EPMOE_RETURN_IF_ERROR(
      detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[m.rank]) + 1, magic + 100 + m.rank, m.stream));
  EPMOE_RETURN_IF_ERROR(barrier(m.stream));
  uint64_t seen[2] = {0, 0};
  EPMOE_CUDA_RETURN(cudaMemcpy(seen, b->ptr, sizeof(seen), cudaMemcpyDeviceToHost));
  if (seen[0] != magic + prev || seen[1] != magic + 100 + m.rank) {
    std::ostringstream os;
    os << "symmetric memory check failed on rank " << m.rank << ": a write through NCCL's peer pointer did not land ("
       << "expected 0x" << std::hex << magic + prev << " / 0x" << magic + 100 + m.rank << ", read 0x" << seen[0]
       << " / 0x" << seen[1] << std::dec
       << "). NCCL likely fell back to non-symmetric memory (ncclMemAlloc without cuMem/VMM support, or no "
          "NVLink P2P between the GPUs); run with NCCL_DEBUG=INFO to see why";
    return Status(StatusCode::kNcclError, os.str());
  }
  EPMOE_CUDA_RETURN(cudaMemsetAsync(b->ptr, 0, 16, m.stream));
  EPMOE_RETURN_IF_ERROR(barrier(m.stream));
  *out = &b->view;
  return Status::Ok();
}

}  // namespace epmoe
