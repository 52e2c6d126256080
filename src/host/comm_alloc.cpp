// Symmetric memory: alloc_symmetric (every step agreed across ranks, and what a failed attempt
// allocated or registered released on every rank) and free_symmetric, with the init-time check
// that catches NCCL's silent fallbacks (plain cudaMalloc memory, a window without a symmetric
// mapping).
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "host/check.h"
#include "host/comm_impl.h"
#include "host/comm_internal.h"
#include "host/comm_symmetric.h"
#include "host/heuristics.h"

namespace epmoe {

namespace {

#ifdef EPMOE_TEST_HOOKS
// The fail-symmetric test hook: whether alloc_symmetric fails on this rank at `step`.
bool simulated_failure(int rank, int step) {
  int hook_rank = -1, hook_step = 0;
  detail::debug_fail_symmetric(&hook_rank, &hook_step);
  return hook_rank == rank && hook_step == step;
}
#endif

Status simulated(const char* what) {
  return Status(StatusCode::kNcclError, std::string(what) + " failed (simulated by the fail-symmetric test hook)");
}

}  // namespace

Status Communicator::alloc_symmetric(size_t bytes, SymmetricBuffer** out, double timeout_seconds) {
  Impl& m = *impl_;
  EPMOE_RETURN_IF_ERROR(m.check_usable("alloc_symmetric"));
  const bool timeout_ok = detail::valid_host_timeout(timeout_seconds);
  const double bound = timeout_ok ? timeout_seconds : kDefaultHostTimeoutSeconds;
  [[maybe_unused]] const auto hook = [&](int step) {
#ifdef EPMOE_TEST_HOOKS
    return simulated_failure(m.rank, step);
#else
    (void)step;
    return false;
#endif
  };

  // Every rank's arguments first. Why gathered rather than checked here: a rank that returned
  // alone would leave its peers in the blocking registration below.
  {
    const int64_t mine[detail::kSymmetricArgWords] = {int64_t(bytes), out ? 0 : 1, timeout_ok ? 0 : 1};
    std::vector<int64_t> all;
    const Status st = detail::all_gather_words(*this, mine, detail::kSymmetricArgWords, &all, bound,
                                               "alloc_symmetric (the arguments)");
    if (!st.ok()) return st;
    const std::string bad = detail::symmetric_argument_errors(all, m.size);
    if (!bad.empty()) {
      std::string here;
      if (!timeout_ok) here = " (here: timeout_seconds=" + std::to_string(timeout_seconds) + ")";
      return detail::invalid("alloc_symmetric on rank ", m.rank, ": the arguments are wrong or differ across ranks (",
                             "every rank fails; nothing was allocated): ", bad, here);
    }
  }

  const size_t rounded = (bytes + 4095) / 4096 * 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT
  auto* b = new Impl::Buffer();
  m.buffers.push_back(b);  // listed until released, so that the destructor frees what a failure keeps
  // One agreement per step. On a failure anywhere every rank releases what it got; after a
  // timeout nothing is (the communicator is unusable, and a peer may still be in the step).
  const auto agreed = [&](const Status& local, const char* what) -> Status {
    const Status st = detail::agree_on_status(*this, local, what, bound);
    if (st.ok() || m.broken) return st;
    const Status released = m.release(b);
    if (released.ok()) return st;
    return Status(st.code(), st.message() + "; releasing this rank's allocation failed too: " + released.message() +
                                 " (the Communicator's destruction tries again)");
  };

  // Why agree before registering: the registration is a blocking collective, and a rank whose
  // allocation failed (out of memory) would leave the others inside it.
  Status st = hook(1) ? simulated("ncclMemAlloc")
                      : detail::nccl_status(ncclMemAlloc(&b->ptr, rounded), "ncclMemAlloc", __FILE__, __LINE__);
  EPMOE_RETURN_IF_ERROR(agreed(st, "alloc_symmetric (ncclMemAlloc)"));
  st = detail::nccl_status(ncclCommWindowRegister(m.comm, b->ptr, rounded, &b->win, NCCL_WIN_COLL_SYMMETRIC),
                           "ncclCommWindowRegister", __FILE__, __LINE__);
  if (st.ok() && !b->win)
    st = Status(StatusCode::kNcclError, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) returned no window");
  if (st.ok() && hook(2)) st = simulated("ncclCommWindowRegister");
  EPMOE_RETURN_IF_ERROR(agreed(st, "alloc_symmetric (ncclCommWindowRegister)"));

  b->view.local = b->ptr;
  b->view.bytes = rounded;
  st = detail::resolve_peer_pointers(b->win, m.dev, m.rank, m.size, b->view.peers, m.stream);
  if (st.ok()) st = detail::cuda_status(cudaMemsetAsync(b->ptr, 0, rounded, m.stream), "cudaMemsetAsync", __FILE__, __LINE__);
  if (st.ok()) st = detail::cuda_status(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  if (st.ok() && hook(3)) st = simulated("resolving the peer pointers");
  // This agreement is also the barrier that orders every rank's zero-fill before any peer's test
  // write below.
  EPMOE_RETURN_IF_ERROR(agreed(st, "alloc_symmetric (the peer pointers and the zero-fill)"));

  // Why write and read back: NCCL may hand back plain cudaMalloc memory or register a window without
  // symmetric mapping and still return success. Each rank writes a tag into the next rank's copy
  // through the resolved pointer and into its own copy through its own resolved pointer; after an
  // agreement (a barrier) each rank must find both tags in its local memory.
  const uint64_t magic = 0xE93E0C0FFEE00000ull;
  const int next = (m.rank + 1) % m.size, prev = (m.rank + m.size - 1) % m.size;
  st = detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[next]), magic + m.rank, m.stream);
  if (st.ok())
    st = detail::write_word_from_device(static_cast<uint64_t*>(b->view.peers[m.rank]) + 1, magic + 100 + m.rank,
                                        m.stream);
  EPMOE_RETURN_IF_ERROR(agreed(st, "alloc_symmetric (the NVLink test writes)"));

  uint64_t seen[2] = {0, 0};
  st = detail::cuda_status(cudaMemcpy(seen, b->ptr, sizeof(seen), cudaMemcpyDeviceToHost), "cudaMemcpy(check)",
                           __FILE__, __LINE__);
  if (st.ok() && hook(4)) seen[0] = ~seen[0];
  if (st.ok() && (seen[0] != magic + prev || seen[1] != magic + 100 + m.rank)) {
    std::ostringstream os;
    os << "symmetric memory check failed on rank " << m.rank << ": a write through NCCL's peer pointer did not land ("
       << "expected 0x" << std::hex << magic + prev << " / 0x" << magic + 100 + m.rank << ", read 0x" << seen[0]
       << " / 0x" << seen[1] << std::dec
       << "). NCCL likely fell back to non-symmetric memory (ncclMemAlloc without cuMem/VMM support, or no "
          "NVLink P2P between the GPUs); run with NCCL_DEBUG=INFO to see why";
    st = Status(StatusCode::kNcclError, os.str());
  }
  // Why the clearing lands before the agreement: a peer that leaves it may write into this buffer
  // at once.
  Status cleared = detail::cuda_status(cudaMemsetAsync(b->ptr, 0, sizeof(seen), m.stream), "cudaMemsetAsync", __FILE__,
                                       __LINE__);
  if (cleared.ok())
    cleared = detail::cuda_status(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  if (st.ok()) st = cleared;
  EPMOE_RETURN_IF_ERROR(agreed(st, "alloc_symmetric (the NVLink write check)"));
  *out = &b->view;
  return Status::Ok();
}

Status Communicator::free_symmetric(SymmetricBuffer* buf, double timeout_seconds) {
  Impl& m = *impl_;
  if (!buf) return Status::Ok();
  // A broken communicator frees nothing (see Impl::broken); the buffer stays listed.
  EPMOE_RETURN_IF_ERROR(m.check_usable("free_symmetric"));
  Impl::Buffer* b = nullptr;
  for (Impl::Buffer* c : m.buffers)
    if (&c->view == buf) b = c;
  Status local;
  if (!b)
    local = detail::invalid("free_symmetric: the buffer was not allocated by this Communicator (or was freed already)");
  const bool timeout_ok = detail::valid_host_timeout(timeout_seconds);
  if (local.ok() && !timeout_ok)
    local = detail::invalid("free_symmetric: timeout_seconds=", timeout_seconds, " must be in (0, 3600]");
  // Why sync, then agree: our kernels may still be running, and a peer's kernel may still read or
  // write our copy through NVLink (combine's last flag stores land after we finished) until that
  // peer has synchronized too. The agreement is the barrier, and it keeps a rank whose arguments
  // are wrong from leaving its peers waiting.
  if (local.ok())
    local = detail::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  const Status agreed = detail::agree_on_status(*this, local, "free_symmetric (every rank synchronized)",
                                                timeout_ok ? timeout_seconds : kDefaultHostTimeoutSeconds);
  if (!agreed.ok()) return Status(agreed.code(), agreed.message() + ". Nothing was released");
  const Status released = m.release(b);
  if (!released.ok())
    return Status(released.code(), "free_symmetric on rank " + std::to_string(m.rank) + ": " + released.message() +
                                       " (the buffer stays listed; the Communicator's destruction tries again)");
  return Status::Ok();
}

}  // namespace epmoe
