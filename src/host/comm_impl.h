// The state behind a Communicator (not public API), shared by comm.cpp (setup, the bounded
// collectives) and comm_alloc.cpp (symmetric memory).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/status.h"
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
  // Every buffer this rank allocated or registered and has not released: the destructor releases
  // what is left.
  std::vector<Buffer*> buffers;

  ~Impl();

  Status check_usable(const char* what) const;
  // Marks the communicator unusable after `why`; aborts the NCCL communicator if epmoe owns it
  // (its kernels stuck in the collective then exit).
  Status fail(StatusCode code, const std::string& why);
  // Waits (polling) until `s`, which holds an NCCL collective, is done: at most timeout_s. `what`
  // names the step in the messages.
  Status wait_collective(cudaStream_t s, const char* what, double timeout_s);
  // Host-side barrier: an NCCL all-reduce of one word on `s`, bounded.
  Status barrier(cudaStream_t s, double timeout_s);
  // Deregisters the window and frees the memory of `b`, each call checked; on success `b` is
  // removed from `buffers` and deleted. On a failure `b` stays listed with what is left, so that
  // the destructor tries again. The caller makes sure no kernel of any rank still touches it.
  Status release(Buffer* b);
};

}  // namespace epmoe
