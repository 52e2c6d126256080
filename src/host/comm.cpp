// Communicator: NCCL setup (an init bounded by a timeout, then an agreement on every rank's checks
// before the device communicator), the bounded host-side collectives (comm_internal.h), and the
// shared state's lifetime. Symmetric memory is in comm_alloc.cpp.
#include "epmoe/comm.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/version.h"
#include "host/check.h"
#include "host/comm_impl.h"
#include "host/comm_internal.h"
#include "host/comm_symmetric.h"

namespace epmoe {

Communicator::Impl::~Impl() {
  if (broken) {
    for (Buffer* b : buffers) delete b;
    if (owned && comm) ncclCommDestroy(comm);
    return;
  }
  if (stream) cudaStreamSynchronize(stream);
  // What free_symmetric (or a failed alloc_symmetric) did not release. Why log: a destructor
  // returns nothing, and what fails here only leaks until the process ends.
  while (!buffers.empty()) {
    Buffer* b = buffers.back();
    const Status st = release(b);
    if (!st.ok()) {
      std::fprintf(stderr, "[epmoe] ~Communicator on rank %d: releasing a symmetric buffer failed: %s\n", rank,
                   st.to_string().c_str());
      buffers.pop_back();
      delete b;
    }
  }
  detail::destroy_dev_comm(comm, &dev);
  if (scratch) cudaFree(scratch);
  if (stream) cudaStreamDestroy(stream);
  if (owned && comm) ncclCommDestroy(comm);
}

Status Communicator::Impl::check_usable(const char* what) const {
  if (!broken) return Status::Ok();
  return Status(StatusCode::kNcclError, std::string(what) + " on rank " + std::to_string(rank) +
                                            ": the communicator is unusable: " + broken_why);
}

Status Communicator::Impl::fail(StatusCode code, const std::string& why) {
  broken = true;
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

Status Communicator::Impl::wait_collective(cudaStream_t s, const char* what, double timeout_s) {
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
         << ": at least one of the " << size << " ranks did not reach it (it failed earlier, crashed, exited, "
         << "or is not making the same collective call)";
      return fail(StatusCode::kTimeout, os.str());
    }
    if (i < 100)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

Status Communicator::Impl::barrier(cudaStream_t s, double timeout_s) {
  EPMOE_RETURN_IF_ERROR(check_usable("Communicator::barrier"));
  EPMOE_NCCL_RETURN(ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, comm, s));
  return wait_collective(s, "the barrier", timeout_s);
}

Status Communicator::Impl::release(Buffer* b) {
  Status st;
  if (b->win) {
    st = detail::nccl_status(ncclCommWindowDeregister(comm, b->win), "ncclCommWindowDeregister", __FILE__, __LINE__);
    if (st.ok()) b->win = nullptr;
  }
  // Why not free memory whose window is still registered: NCCL (and the peers' mappings) still
  // refer to it; the destructor tries both again.
  if (st.ok() && b->ptr) {
    st = detail::nccl_status(ncclMemFree(b->ptr), "ncclMemFree", __FILE__, __LINE__);
    if (st.ok()) b->ptr = nullptr;
  }
  if (!st.ok()) return st;
  for (auto it = buffers.begin(); it != buffers.end(); ++it)
    if (*it == b) {
      buffers.erase(it);
      break;
    }
  delete b;
  return Status::Ok();
}

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

Status Communicator::create(const ncclUniqueId& id, int rank, int size, std::unique_ptr<Communicator>* out,
                            double timeout_seconds) {
  return detail::CommAccess::create(id, rank, size, Status::Ok(), timeout_seconds, out);
}

Status Communicator::wrap(ncclComm_t comm, std::unique_ptr<Communicator>* out, double timeout_seconds) {
  return detail::CommAccess::wrap(comm, Status::Ok(), timeout_seconds, out);
}

namespace {

// ncclCommInitRank on `device`, bounded by timeout_s. Why a helper thread: the init blocks until
// every rank has joined, NCCL does not bound that wait, and a rank that failed its own argument
// checks (or died) never joins. On a timeout the thread is left behind (it may stay blocked until
// the process ends); should its init complete after all, it aborts the communicator it got, which
// nobody else holds.
Status init_rank_bounded(const ncclUniqueId& id, int rank, int size, int device, double timeout_s, ncclComm_t* out) {
  struct Call {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    ncclComm_t comm = nullptr;
    ncclResult_t result = ncclInternalError;
    cudaError_t device_error = cudaSuccess;
  };
  auto call = std::make_shared<Call>();
  try {
    std::thread([call, id, rank, size, device] {
      ncclComm_t comm = nullptr;
      ncclResult_t result = ncclInternalError;
      const cudaError_t e = cudaSetDevice(device);
      if (e == cudaSuccess) result = ncclCommInitRank(&comm, size, id, rank);
      std::lock_guard<std::mutex> lock(call->mu);
      if (call->abandoned) {
        if (result == ncclSuccess && comm) (void)ncclCommAbort(comm);
        return;
      }
      call->comm = comm;
      call->result = result;
      call->device_error = e;
      call->done = true;
      call->cv.notify_all();
    }).detach();
  } catch (const std::exception& ex) {
    return Status(StatusCode::kInternal, std::string("Communicator::create: starting the init thread failed: ") + ex.what());
  }
  std::unique_lock<std::mutex> lock(call->mu);
  if (!call->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return call->done; })) {
    call->abandoned = true;
    std::ostringstream os;
    os << "Communicator::create on rank " << rank << ": ncclCommInitRank did not complete within timeout_seconds="
       << timeout_s << ": at least one of the " << size << " ranks did not join it (its own arguments failed their "
       << "checks, it crashed or exited, or it was given another unique id). Nothing of this communicator is usable; "
       << "the init is left to end with the process";
    return Status(StatusCode::kTimeout, os.str());
  }
  if (call->device_error != cudaSuccess)
    return detail::cuda_status(call->device_error, "cudaSetDevice (the init thread)", __FILE__, __LINE__);
  if (call->result != ncclSuccess) {
    // Why the hint: when one rank gives up (its own timeout, a failed check, an exit), NCCL reports
    // it to the ranks still in the init as a remote or system error, possibly before their own
    // bound; the NCCL code alone does not say that a peer left.
    const Status st = detail::nccl_status(call->result, "ncclCommInitRank", __FILE__, __LINE__);
    std::ostringstream os;
    os << "Communicator::create on rank " << rank << ": " << st.message() << ": a peer rank left the init of the "
       << size << " ranks (its create failed its checks or timed out, or it exited), or the network failed";
    return Status(StatusCode::kNcclError, os.str());
  }
  *out = call->comm;
  return Status::Ok();
}

}  // namespace

// Collective. Every check that one rank alone can fail goes through an agreement over the new
// communicator before the first NCCL call that blocks on every rank (ncclDevCommCreate): a rank
// that returned alone would leave its peers inside it. `caller` carries the checks made before
// (arguments, the NCCL version); `timeout_s` bounds each exchange.
Status Communicator::init(std::shared_ptr<Impl> impl, const Status& caller, double timeout_s,
                          std::unique_ptr<Communicator>* out) {
  EPMOE_NCCL_RETURN(ncclCommUserRank(impl->comm, &impl->rank));
  EPMOE_NCCL_RETURN(ncclCommCount(impl->comm, &impl->size));
  EPMOE_NCCL_RETURN(ncclCommCuDevice(impl->comm, &impl->device));
  Status local = caller;
  if (local.ok() && impl->size > kMaxCommRanks)
    local = Status(StatusCode::kUnsupported, "Communicator: " + std::to_string(impl->size) +
                                                 " ranks; epmoe supports at most " + std::to_string(kMaxCommRanks) +
                                                 " (one NVLink node)");
  int current = -1;
  if (local.ok()) local = detail::cuda_status(cudaGetDevice(&current), "cudaGetDevice", __FILE__, __LINE__);
  if (local.ok() && current != impl->device) {
    std::ostringstream os;
    os << "Communicator: the current CUDA device is " << current << " but the NCCL communicator lives on device "
       << impl->device << "; call cudaSetDevice(" << impl->device << ") first";
    local = detail::invalid(os.str());
  }
  // Why the communicator's device whatever the current one: a rank whose check failed still takes
  // part in the agreement, whose exchange runs there.
  detail::DeviceScope scope;
  EPMOE_RETURN_IF_ERROR(scope.enter(impl->device));
  if (local.ok())
    local = detail::cuda_status(cudaDeviceGetAttribute(&impl->sms, cudaDevAttrMultiProcessorCount, impl->device),
                                "cudaDeviceGetAttribute", __FILE__, __LINE__);
  if (local.ok())
    local = detail::cuda_status(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "cudaStreamCreate",
                                __FILE__, __LINE__);
  if (local.ok())
    local = detail::cuda_status(cudaMalloc(reinterpret_cast<void**>(&impl->scratch), sizeof(int)), "cudaMalloc",
                                __FILE__, __LINE__);
  // A failed init destroys this object with every rank's (the owned NCCL communicator with it).
  std::unique_ptr<Communicator> made(new Communicator(std::move(impl)));
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*made, local, "Communicator init (the checks of every rank)", timeout_s));
  Impl& m = *made->impl_;
  const Status dev = detail::create_dev_comm(m.comm, &m.dev);
  EPMOE_RETURN_IF_ERROR(detail::agree_on_status(*made, dev, "Communicator init (ncclDevCommCreate)", timeout_s));
  *out = std::move(made);
  return Status::Ok();
}

Status Communicator::barrier(cudaStream_t stream, double timeout_seconds) {
  return impl_->barrier(stream, timeout_seconds);
}

namespace detail {

Status CommAccess::create(const ncclUniqueId& id, int rank, int size, const Status& caller, double timeout_seconds,
                          std::unique_ptr<Communicator>* out) {
  // Without a valid rank and size this rank cannot join the NCCL init: it fails alone, and its
  // peers' init ends with kTimeout after their timeout_seconds.
  if (size < 1 || size > kMaxCommRanks)
    return invalid("Communicator::create: size=", size, " must be in [1, ", kMaxCommRanks, "]");
  if (rank < 0 || rank >= size)
    return invalid("Communicator::create: rank=", rank, " must be in [0, size=", size, ")");
  // Everything else joins the init and fails in the first agreement, with every rank.
  Status local = caller;
  if (local.ok() && !out) local = invalid("Communicator::create: out is null");
  if (local.ok() && !valid_host_timeout(timeout_seconds))
    local = invalid("Communicator::create: timeout_seconds=", timeout_seconds, " must be in (0, 3600]");
  // Why not a reason to stay out: an older libnccl still has ncclCommInitRank and the all-gather
  // of the agreement; the device API that needs the newer one is used only after it.
  if (local.ok()) local = check_nccl_runtime_version();
  const double bound = valid_host_timeout(timeout_seconds) ? timeout_seconds : kDefaultHostTimeoutSeconds;
  int device = -1;
  EPMOE_CUDA_RETURN(cudaGetDevice(&device));
  auto impl = std::make_shared<Communicator::Impl>();
  EPMOE_RETURN_IF_ERROR(init_rank_bounded(id, rank, size, device, bound, &impl->comm));
  impl->owned = true;
  std::unique_ptr<Communicator> made;
  EPMOE_RETURN_IF_ERROR(Communicator::init(std::move(impl), local, bound, &made));
  *out = std::move(made);
  return Status::Ok();
}

Status CommAccess::wrap(ncclComm_t comm, const Status& caller, double timeout_seconds,
                        std::unique_ptr<Communicator>* out) {
  // Without a communicator this rank cannot take part: it fails alone, and its peers' first
  // agreement ends with kTimeout after their timeout_seconds.
  if (!comm) return invalid("Communicator::wrap: comm is null");
  Status local = caller;
  if (local.ok() && !out) local = invalid("Communicator::wrap: out is null");
  if (local.ok() && !valid_host_timeout(timeout_seconds))
    local = invalid("Communicator::wrap: timeout_seconds=", timeout_seconds, " must be in (0, 3600]");
  if (local.ok()) local = check_nccl_runtime_version();
  auto impl = std::make_shared<Communicator::Impl>();
  impl->comm = comm;
  std::unique_ptr<Communicator> made;
  EPMOE_RETURN_IF_ERROR(Communicator::init(std::move(impl), local,
                                           valid_host_timeout(timeout_seconds) ? timeout_seconds
                                                                               : kDefaultHostTimeoutSeconds,
                                           &made));
  *out = std::move(made);
  return Status::Ok();
}

std::unique_ptr<Communicator> CommAccess::share(const Communicator& comm) {
  return std::unique_ptr<Communicator>(new Communicator(comm.impl_));
}

bool CommAccess::broken(const Communicator& comm) { return comm.impl_ && comm.impl_->broken; }
Status CommAccess::usable(const Communicator& comm, const char* what) {
  return comm.impl_ ? comm.impl_->check_usable(what) : Status::Ok();
}

long CommAccess::other_holders(const Communicator& comm) { return comm.impl_ ? comm.impl_.use_count() - 1 : 0; }

Status all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                        double timeout_seconds, const char* what) {
  return CommAccess::all_gather_bytes(comm, mine, bytes, out, timeout_seconds, what);
}

Status CommAccess::all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                                    double timeout_seconds, const char* what) {
  Communicator::Impl& m = *comm.impl_;
  EPMOE_RETURN_IF_ERROR(m.check_usable(what));
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
  if (st.ok()) st = m.wait_collective(stream, (std::string(what) + " (an NCCL all-gather)").c_str(), timeout_seconds);
  // Why the copy back only after the bounded wait: a device-to-pageable copy returns only once it
  // has completed, so enqueued behind the all-gather it would block this thread until a peer that
  // never joins does, and the wait above would never run.
  if (st.ok())
    st = cuda_status(cudaMemcpyAsync(out->data(), d + bytes, out->size(), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync(all)", __FILE__, __LINE__);
  if (st.ok()) st = cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  // Why not free after a timeout: cudaFree waits for the device, and a collective that a peer
  // never joined may never end (a borrowed communicator is not aborted).
  Status cleanup;
  if (!m.broken && d) cleanup = cuda_status(cudaFree(d), "cudaFree(exchange buffer)", __FILE__, __LINE__);
  if (stream) {
    const Status destroyed = cuda_status(cudaStreamDestroy(stream), "cudaStreamDestroy", __FILE__, __LINE__);
    if (cleanup.ok()) cleanup = destroyed;
  }
  // Why only logged once the exchange worked: every rank has the result, and an error returned by
  // this rank alone would set it apart from its peers in the steps that follow.
  if (st.ok() && !cleanup.ok())
    std::fprintf(stderr, "[epmoe] rank %d: %s: cleaning up after the exchange failed (%s); the exchange completed\n",
                 m.rank, what, cleanup.message().c_str());
  return st;
}

}  // namespace detail

}  // namespace epmoe
