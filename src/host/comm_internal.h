// Internal access to a Communicator (not public API): shared ownership of its state, and the
// bounded host-side collectives that create-time agreement and the symmetric allocations use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/status.h"

namespace epmoe::detail {

struct CommAccess {
  // A second Communicator object over the same state: layers and dispatch handles hold one, so
  // the state (NCCL communicator, symmetric buffers) lives until the last holder goes, whatever
  // the order in which the user destroys them.
  static std::unique_ptr<Communicator> share(const Communicator& comm);
  // Whether a collective timed out or failed asynchronously (see Communicator's class comment).
  static bool broken(const Communicator& comm);
  // Ok, or the error that made the communicator unusable (naming `what` and the rank).
  static Status usable(const Communicator& comm, const char* what);
  // Holders of the state besides `comm` itself.
  static long other_holders(const Communicator& comm);
  // all_gather_bytes below.
  static Status all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                                 double timeout_seconds);
};

// Collective over `comm` (every rank, same bytes, same order as the other collective calls):
// gathers each rank's `bytes` into out[rank * bytes, ...). Never blocks without bound: it polls
// the stream and NCCL's asynchronous error, and gives up after timeout_seconds with kTimeout. A
// timed-out communicator is unusable (a peer never joined the collective): it is aborted when
// epmoe owns the NCCL communicator, and every later collective call on it fails at once.
Status all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                        double timeout_seconds);
// The same for n int64 words per rank: all[rank * n + i].
Status all_gather_words(Communicator& comm, const int64_t* mine, int n, std::vector<int64_t>* all,
                        double timeout_seconds);

// Collective: every rank contributes its Status; Ok on every rank only if every rank's is Ok.
// Otherwise every rank returns an error that names each failing rank with its code and message,
// prefixed by `what` (the failing rank keeps its own code). Why: a rank that returned alone from a
// collective call would leave its peers waiting in the next collective step.
Status agree_on_status(Communicator& comm, const Status& mine, const char* what, double timeout_seconds);

// "rank 3" or "ranks 0, 2" for messages.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace epmoe::detail
