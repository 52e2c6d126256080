// Communicator: NCCL setup, symmetric allocations, the init-time checks that catch NCCL's silent
// fallbacks (plain cudaMalloc memory, registration without symmetric support), and the bounded
// host-side collectives (comm_internal.h).
#include "epmoe/comm.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/version.h"
#include "host/check.h"
#include "host/comm_internal.h"
#include "host/comm_symmetric.h"

namespace epmoe {

struct Communicator::Impl {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int rank = 0, size = 0, device = 0, sms = 0;
  cudaStream_t stream = nullptr;
  int* scratch = nullptr;  // one word for barrier()
  detail::DevCommInfo dev;
  // Set when a bounded collective timed out or NCCL reported an asynchronous error: the NCCL
  // communicator is aborted (owned) or blocked in a collective a peer never joined (borrowed).
  // Every later collective fails at once with `broken_why`; nothing is freed on the device (a
  // synchronization could wait forever, and peers may still touch the symmetric memory).
  bool broken = false;
  std::string broken_why;
  struct Buffer {
    void* ptr = nullptr;
    ncclWindow_t win = nullptr;
    SymmetricBuffer view;
  };
  std::vector<Buffer*> buffers;

  ~Impl() {
    if (broken) {
      for (Buffer* b : buffers) delete b;
      if (owned && comm) ncclCommDestroy(comm);
      return;
    }
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

  Status check_usable(const char* what) const {
    if (!broken) return Status::Ok();
    return Status(StatusCode::kNcclError, std::string(what) + " on rank " + std::to_string(rank) +
                                              ": the communicator is unusable: " + broken_why);
  }

  // Marks the communicator unusable after `why`; aborts the NCCL communicator if epmoe owns it
  // (its kernels stuck in the collective then exit).
  Status fail(StatusCode code, const std::string& why) {
    broken = true;
    broken_why = why;
    std::string message = why;
    if (owned && comm) {
      const ncclResult_t r = ncclCommAbort(comm);
      comm = nullptr;
      message += r == ncclSuccess ? ". The NCCL communicator was aborted; create a new Communicator (and layers) "
                                    "or end the process"
                                  : std::string(". ncclCommAbort failed too: ") + ncclGetErrorString(r);
    } else {
      message += ". The caller's NCCL communicator may be blocked in that collective: abort it (ncclCommAbort) "
                 "or end the process";
    }
    broken_why = message;
    return Status(code, message);
  }

  // Waits (polling) until `stream`, which holds an NCCL collective, is done: at most timeout_s.
  Status wait_collective(cudaStream_t s, const char* what, double timeout_s) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
    for (int i = 0;; ++i) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady)
        return detail::cuda_status(q, (std::string(what) + ": cudaStreamQuery").c_str(), __FILE__, __LINE__);
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
      if (r != ncclSuccess) return detail::nccl_status(r, "ncclCommGetAsyncError", __FILE__, __LINE__);
      if (async != ncclSuccess && async != ncclInProgress)
        return fail(StatusCode::kNcclError, std::string("rank ") + std::to_string(rank) + ": " + what +
                                                ": NCCL reported an asynchronous error: " + ncclGetErrorString(async));
      if (clock::now() > deadline) {
        std::ostringstream os;
        os << "rank " << rank << ": " << what << " did not complete within timeout_seconds=" << timeout_s
           << ": at least one of the " << size << " ranks did not reach it (it failed earlier, crashed, or is not "
           << "making the same collective call)";
        return fail(StatusCode::kTimeout, os.str());
      }
      if (i < 100)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  // Host-side barrier: an NCCL all-reduce of one word on `s`, bounded.
  Status barrier(cudaStream_t s, double timeout_s) {
    EPMOE_RETURN_IF_ERROR(check_usable("Communicator::barrier"));
    EPMOE_NCCL_RETURN(ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, comm, s));
    return wait_collective(s, "the barrier", timeout_s);
  }
};

Communicator::Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
int Communicator::device() const { return impl_->device; }
int Communicator::num_sms() const { return impl_->sms; }
ncclComm_t Communicator::nccl() const { return impl_->comm; }

Status Communicator::close() {
  if (!impl_) return Status::Ok();
  const long others = impl_.use_count() - 1;
  if (others > 0)
    return detail::invalid("Communicator::close on rank ", impl_->rank,
                           ": layers, workspaces or dispatch handles made from this communicator still live (",
                           others, " references to its state); destroy them first (on every rank), then close it");
  impl_.reset();
  return Status::Ok();
}

Status Communicator::create(const ncclUniqueId& id, int rank, int size, std::unique_ptr<Communicator>* out) {
  if (!out) return detail::invalid("Communicator::create: out is null");
  if (size < 1 || size > kMaxCommRanks)
    return detail::invalid("Communicator: size=", size, " must be in [1, ", kMaxCommRanks, "]");
  if (rank < 0 || rank >= size) return detail::invalid("Communicator: rank=", rank, " must be in [0, ", size, ")");
  EPMOE_RETURN_IF_ERROR(check_nccl_runtime_version());
  auto impl = std::make_shared<Impl>();
  EPMOE_NCCL_RETURN(ncclCommInitRank(&impl->comm, size, id, rank));
  impl->owned = true;
  return init(std::move(impl), out);
}

Status Communicator::wrap(ncclComm_t comm, std::unique_ptr<Communicator>* out) {
  if (!out) return detail::invalid("Communicator::wrap: out is null");
  if (!comm) return detail::invalid("Communicator::wrap: comm is null");
  EPMOE_RETURN_IF_ERROR(check_nccl_runtime_version());
  auto impl = std::make_shared<Impl>();
  impl->comm = comm;
  return init(std::move(impl), out);
}

Status Communicator::init(std::shared_ptr<Impl> impl, std::unique_ptr<Communicator>* out) {
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

Status Communicator::free_symmetric(SymmetricBuffer* buf, double timeout_seconds) {
  Impl& m = *impl_;
  if (!buf) return Status::Ok();
  auto it = m.buffers.begin();
  while (it != m.buffers.end() && &(*it)->view != buf) ++it;
  if (it == m.buffers.end())
    return detail::invalid("free_symmetric: the buffer was not allocated by this Communicator (or was freed already)");
  // A broken communicator frees nothing (see Impl::broken); the buffer stays listed.
  EPMOE_RETURN_IF_ERROR(m.check_usable("free_symmetric"));
  Impl::Buffer* b = *it;
  m.buffers.erase(it);
  // Why sync and barrier first: our kernels may still be running, and a peer's kernel may still read
  // or write our copy through NVLink (combine's last flag stores land after we finished).
  Status st = detail::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  if (st.ok()) st = m.barrier(m.stream, timeout_seconds);
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

Status Communicator::barrier(cudaStream_t stream, double timeout_seconds) {
  return impl_->barrier(stream, timeout_seconds);
}

Status Communicator::alloc_symmetric(size_t bytes, SymmetricBuffer** out, double timeout_seconds) {
  Impl& m = *impl_;
  if (!out) return detail::invalid("alloc_symmetric: out is null");
  if (bytes == 0) return detail::invalid("alloc_symmetric: bytes must be > 0");
  EPMOE_RETURN_IF_ERROR(m.check_usable("alloc_symmetric"));
  bytes = (bytes + 4095) / 4096 * 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT
  auto* b = new Impl::Buffer();
  m.buffers.push_back(b);  // freed with the communicator, also on a failure below
  // Why agree before registering: the registration is a blocking collective, and a rank whose
  // allocation failed (out of memory) would leave the others inside it.
  const Status allocated = detail::nccl_status(ncclMemAlloc(&b->ptr, bytes), "ncclMemAlloc", __FILE__, __LINE__);
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*this, allocated, "alloc_symmetric (ncclMemAlloc)", timeout_seconds));
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
  EPMOE_RETURN_IF_ERROR(m.barrier(m.stream, timeout_seconds));
  EPMOE_RETURN_IF_ERROR(detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[next]), magic + m.rank, m.stream));
  EPMOE_RETURN_IF_ERROR(
      detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[m.rank]) + 1, magic + 100 + m.rank, m.stream));
  EPMOE_RETURN_IF_ERROR(m.barrier(m.stream, timeout_seconds));
  uint64_t seen[2] = {0, 0};
  EPMOE_CUDA_RETURN(cudaMemcpy(seen, b->ptr, sizeof(seen), cudaMemcpyDeviceToHost));
  Status checked;
  if (seen[0] != magic + prev || seen[1] != magic + 100 + m.rank) {
    std::ostringstream os;
    os << "symmetric memory check failed on rank " << m.rank << ": a write through NCCL's peer pointer did not land ("
       << "expected 0x" << std::hex << magic + prev << " / 0x" << magic + 100 + m.rank << ", read 0x" << seen[0]
       << " / 0x" << seen[1] << std::dec
       << "). NCCL likely fell back to non-symmetric memory (ncclMemAlloc without cuMem/VMM support, or no "
          "NVLink P2P between the GPUs); run with NCCL_DEBUG=INFO to see why";
    checked = Status(StatusCode::kNcclError, os.str());
  }
  EPMOE_CUDA_RETURN(cudaMemsetAsync(b->ptr, 0, 16, m.stream));
  // Why wait for the clearing before agreeing: the agreement runs on another stream, and a peer
  // that leaves it may write into this buffer at once; the clearing must have landed by then.
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(m.stream));
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*this, checked, "alloc_symmetric (the NVLink write check)",
                                                timeout_seconds));
  *out = &b->view;
  return Status::Ok();
}

namespace detail {

std::unique_ptr<Communicator> CommAccess::share(const Communicator& comm) {
  return std::unique_ptr<Communicator>(new Communicator(comm.impl_));
}

bool CommAccess::broken(const Communicator& comm) { return comm.impl_ && comm.impl_->broken; }
Status CommAccess::usable(const Communicator& comm, const char* what) {
  return comm.impl_ ? comm.impl_->check_usable(what) : Status::Ok();
}

long CommAccess::other_holders(const Communicator& comm) { return comm.impl_ ? comm.impl_.use_count() - 1 : 0; }

Status all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                        double timeout_seconds) {
  return CommAccess::all_gather_bytes(comm, mine, bytes, out, timeout_seconds);
}

Status CommAccess::all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                                    double timeout_seconds) {
  Communicator::Impl& m = *comm.impl_;
  EPMOE_RETURN_IF_ERROR(m.check_usable("a create-time exchange"));
  const int R = m.size;
  out->assign(size_t(R) * bytes, 0);
  cudaStream_t stream = nullptr;
  char* d = nullptr;
  Status st = cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate", __FILE__,
                          __LINE__);
  if (st.ok())
    st = cuda_status(cudaMalloc(reinterpret_cast<void**>(&d), bytes * (R + 1)), "cudaMalloc", __FILE__, __LINE__);
  if (st.ok())
    st = cuda_status(cudaMemcpyAsync(d, mine, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(mine)",
                     __FILE__, __LINE__);
  if (st.ok())
    st = nccl_status(ncclAllGather(d, d + bytes, bytes, ncclChar, m.comm, stream), "ncclAllGather", __FILE__, __LINE__);
  if (st.ok()) st = m.wait_collective(stream, "the create-time exchange (an NCCL all-gather)", timeout_seconds);
  // Why the copy back only after the bounded wait: a device-to-pageable copy returns only once it
  // has completed, so enqueued behind the all-gather it would block this thread until a peer that
  // never joins does, and the wait above would never run.
  if (st.ok())
    st = cuda_status(cudaMemcpyAsync(out->data(), d + bytes, out->size(), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync(all)", __FILE__, __LINE__);
  if (st.ok()) st = cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  // Why not free after a timeout: cudaFree waits for the device, and a collective that a peer
  // never joined may never end (a borrowed communicator is not aborted).
  if (!m.broken) {
    if (d) cudaFree(d);
  }
  if (stream) cudaStreamDestroy(stream);
  return st;
}

Status all_gather_words(Communicator& comm, const int64_t* mine, int n, std::vector<int64_t>* all,
                        double timeout_seconds) {
  std::vector<char> bytes;
  EPMOE_RETURN_IF_ERROR(all_gather_bytes(comm, mine, sizeof(int64_t) * size_t(n), &bytes, timeout_seconds));
  all->assign(size_t(comm.size()) * n, 0);
  std::memcpy(all->data(), bytes.data(), bytes.size());
  return Status::Ok();
}

Status agree_on_status(Communicator& comm, const Status& mine, const char* what, double timeout_seconds) {
  // Per rank: the code, then the message (truncated), NUL-terminated.
  constexpr size_t kMessageBytes = 480;
  struct Word {
    int64_t code;
    char message[kMessageBytes];
  };
  Word w{};
  w.code = int64_t(mine.code());
  std::snprintf(w.message, kMessageBytes, "%s", mine.message().c_str());
  std::vector<char> bytes;
  const Status st = all_gather_bytes(comm, &w, sizeof(w), &bytes, timeout_seconds);
  if (!st.ok()) {
    if (!mine.ok()) return Status(mine.code(), mine.message() + " (then: " + st.message() + ")");
    return Status(st.code(), std::string(what) + ": " + st.message());
  }
  std::vector<int> failed;
  std::string causes;
  StatusCode first = StatusCode::kOk;
  for (int r = 0; r < comm.size(); ++r) {
    Word o;
    std::memcpy(&o, bytes.data() + size_t(r) * sizeof(Word), sizeof(Word));
    o.message[kMessageBytes - 1] = '\0';
    if (o.code == int64_t(StatusCode::kOk)) continue;
    if (failed.empty()) first = StatusCode(o.code);
    failed.push_back(r);
    causes += std::string(causes.empty() ? "" : "; ") + "rank " + std::to_string(r) + ": " +
              status_code_name(StatusCode(o.code)) + ": " + o.message;
  }
  if (failed.empty()) return Status::Ok();
  return Status(mine.ok() ? first : mine.code(),
                std::string(what) + " failed on " + rank_list(failed) + " (reported on rank " +
                    std::to_string(comm.rank()) + "; every rank fails and releases what it allocated): " + causes);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace detail

}  // namespace epmoe
