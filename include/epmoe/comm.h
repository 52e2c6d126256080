// epmoe: the NCCL communicator and symmetric memory that epmoe's kernels use.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>

#include "epmoe/status.h"

namespace epmoe {

namespace detail {
struct CommAccess;  // internal: layers and dispatch handles share the communicator's state
}  // namespace detail

/// Largest number of ranks a Communicator supports (one NVLink node).
inline constexpr int kMaxCommRanks = 8;

/// One allocation that exists on every rank with the same size, reachable from every rank's kernels
/// over NVLink. Created by Communicator::alloc_symmetric; owned by the Communicator until
/// Communicator::free_symmetric (or the Communicator's destruction) releases it.
struct SymmetricBuffer {
  void* local = nullptr;                 ///< this rank's copy (device memory)
  void* peers[kMaxCommRanks] = {};       ///< peers[r]: rank r's copy, mapped into this process
  size_t bytes = 0;
};

/// Default bound of the host-side collectives (barrier, alloc_symmetric, free_symmetric) when the
/// caller gives none. Layers and dispatch handles pass their own timeout_seconds.
inline constexpr double kDefaultHostTimeoutSeconds = 60.0;

/// Wraps an NCCL communicator (one process per GPU) and the symmetric memory that epmoe's kernels
/// reach peers through. Init fails with a clear message when NCCL cannot give true symmetric,
/// NVLink-mapped memory (older libnccl, ranks not all NVLink-reachable, silent fallbacks).
///
/// Collective calls (every rank, in the same order): create, wrap, alloc_symmetric,
/// free_symmetric, barrier, and the creation and destruction of every MoELayer and DispatchHandle
/// made from it. Each host-side collective is bounded: when a rank does not reach it within the
/// timeout, the others fail with kTimeout naming the step, and the communicator becomes unusable
/// (aborted when epmoe owns the NCCL communicator; a wrapped one may be left blocked in the
/// collective: abort it or end the process). A check that fails on one rank only (an argument, an
/// allocation, a CUDA or NCCL call) does not make that rank return alone: it goes through an
/// agreement, and every rank fails with a message naming the failing ranks and their causes.
///
/// Layers, workspaces and dispatch handles share the communicator's state: it lives until the last
/// of them is destroyed, whatever the order. close() releases it now, and fails while any of them
/// lives.
class Communicator {
 public:
  /// Creates a new NCCL communicator on the current CUDA device (collective: all `size` ranks call it
  /// with the same `id`). The NCCL init is bounded by timeout_seconds (in (0, 3600]): a rank that
  /// never joins it makes the others fail with kTimeout. A rank whose `rank` or `size` is out of
  /// range cannot join and fails at once, alone (its peers then time out); every other failure (a
  /// null `out`, a bad timeout, an old libnccl, the checks after the init) is agreed: every rank
  /// fails, naming the failing ranks and causes, and destroys the NCCL communicator.
  static Status create(const ncclUniqueId& id, int rank, int size, std::unique_ptr<Communicator>* out,
                       double timeout_seconds = kDefaultHostTimeoutSeconds);
  /// Uses the caller's communicator (e.g. from torch.distributed or MPI); it is not destroyed by
  /// the Communicator, and must outlive it and every layer made from it. The current CUDA device
  /// must be the communicator's device. Collective: its checks are agreed as in create (a null
  /// `comm` fails alone, since that rank cannot take part); each exchange is bounded by
  /// timeout_seconds.
  static Status wrap(ncclComm_t comm, std::unique_ptr<Communicator>* out,
                     double timeout_seconds = kDefaultHostTimeoutSeconds);

  /// Drops this object's share of the state. The NCCL communicator and the symmetric memory go with
  /// the last share: this object, or the last layer or dispatch handle made from it.
  ~Communicator();

  /// Releases the state now. Fails (kInvalidArgument, nothing released) while a layer, workspace or
  /// dispatch handle made from this communicator lives. Not collective by itself, but the NCCL communicator's
  /// destruction is: close on every rank. After Ok, only destruction is valid.
  Status close();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  ncclComm_t nccl() const;

  /// Allocates `bytes` of symmetric memory on every rank (collective: same sizes, same order on every
  /// rank), zero-filled, with the peer pointers resolved and checked by a write/read-back through
  /// NVLink. The buffer lives until free_symmetric() or the Communicator's destruction.
  /// The arguments are compared across ranks first (a null `out`, bytes of 0, sizes that differ, a
  /// timeout outside (0, 3600] on any rank fail every rank, naming the ranks). When any rank's
  /// allocation, window registration, peer pointers or NVLink check fails, every rank fails naming
  /// the failing ranks and causes, and deregisters and frees what it allocated. kTimeout when a
  /// rank does not arrive within timeout_seconds (then nothing is released: the communicator is
  /// unusable).
  Status alloc_symmetric(size_t bytes, SymmetricBuffer** out, double timeout_seconds = kDefaultHostTimeoutSeconds);

  /// Releases a buffer from alloc_symmetric. Collective: every rank calls it for its copy of the same
  /// buffer, in the same order relative to other collective calls. Synchronizes this device, then
  /// agrees with every rank (bounded by timeout_seconds), so that no kernel of any rank still
  /// touches the memory, then deregisters the NCCL window and frees the memory. `buf` is invalid
  /// afterwards. A buffer this Communicator did not allocate, a bad timeout or a failed
  /// synchronization on any rank fails every rank, naming it, and releases nothing. A rank that
  /// never calls it makes the others fail with kTimeout (nothing released, the communicator
  /// unusable). Null is a no-op on this rank (no exchange).
  Status free_symmetric(SymmetricBuffer* buf, double timeout_seconds = kDefaultHostTimeoutSeconds);

  /// Host-side barrier over all ranks (an NCCL all-reduce of one word on `stream`, then a bounded
  /// wait for it: kTimeout after timeout_seconds).
  Status barrier(cudaStream_t stream, double timeout_seconds = kDefaultHostTimeoutSeconds);

  /// Streaming multiprocessors of this rank's GPU (the persistent comm kernels use one block each).
  int num_sms() const;

 private:
  friend struct detail::CommAccess;
  struct Impl;
  explicit Communicator(std::shared_ptr<Impl> impl);
  static Status init(std::shared_ptr<Impl> impl, const Status& caller, double timeout_s,
                     std::unique_ptr<Communicator>* out);
  std::shared_ptr<Impl> impl_;
};

}  // namespace epmoe
