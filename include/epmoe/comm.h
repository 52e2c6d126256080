// epmoe: the NCCL communicator and symmetric memory that epmoe's kernels use.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>

#include "epmoe/status.h"

namespace epmoe {

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

/// Wraps an NCCL communicator (one process per GPU) and the symmetric memory that epmoe's kernels
/// reach peers through. Init fails with a clear message when NCCL cannot give true symmetric,
/// NVLink-mapped memory (older libnccl, ranks not all NVLink-reachable, silent fallbacks).
class Communicator {
 public:
  /// Creates a new NCCL communicator on the current CUDA device (collective: all `size` ranks call it
  /// with the same `id`).
  static Status create(const ncclUniqueId& id, int rank, int size, std::unique_ptr<Communicator>* out);
  /// Uses the caller's communicator (e.g. from torch.distributed or MPI); it is not destroyed by
  /// the Communicator. The current CUDA device must be the communicator's device. Collective.
  static Status wrap(ncclComm_t comm, std::unique_ptr<Communicator>* out);

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  ncclComm_t nccl() const;

  /// Allocates `bytes` of symmetric memory on every rank (collective: same sizes, same order on every
  /// rank), zero-filled, with the peer pointers resolved and checked by a write/read-back through
  /// NVLink. The buffer lives until free_symmetric() or the Communicator's destruction.
  Status alloc_symmetric(size_t bytes, SymmetricBuffer** out);

  /// Releases a buffer from alloc_symmetric. Collective: every rank calls it for its copy of the same
  /// buffer, in the same order relative to other collective calls (a rank that never calls it blocks
  /// the others). Synchronizes this device and barriers across ranks first, so no kernel of any rank
  /// still touches the memory, then deregisters the NCCL window and frees the memory. `buf` is
  /// invalid afterwards; null is a no-op. A buffer this Communicator did not allocate is an error.
  Status free_symmetric(SymmetricBuffer* buf);

  /// Host-side barrier over all ranks (an NCCL all-reduce of one word, then a stream sync).
  Status barrier(cudaStream_t stream);

  /// Streaming multiprocessors of this rank's GPU (the persistent comm kernels use one block each).
  int num_sms() const;

 private:
  struct Impl;
  explicit Communicator(std::unique_ptr<Impl> impl);
  static Status init(std::unique_ptr<Impl> impl, std::unique_ptr<Communicator>* out);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe
