// Internal access to a Communicator (not public API): shared ownership of its state, the bounded
// host-side collectives that the agreements of every collective call use, and the entry points
// through which a wrapper (the C ABI) folds its own argument checks into those agreements.
#pragma once

#include <nccl.h>

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
                                 double timeout_seconds, const char* what);
  // Communicator::create and ::wrap with the checks a wrapper ran before them (`caller`): a rank
  // whose caller check failed still joins the NCCL init and the first agreement, and fails there
  // with its peers (see Communicator::create).
  static Status create(const ncclUniqueId& id, int rank, int size, const Status& caller, double timeout_seconds,
                       std::unique_ptr<Communicator>* out);
  static Status wrap(ncclComm_t comm, const Status& caller, double timeout_seconds,
                     std::unique_ptr<Communicator>* out);
};

// A host-side bound in (0, 3600] seconds, as LayerConfig::timeout_seconds.
inline bool valid_host_timeout(double seconds) { return seconds > 0 && seconds <= 3600; }

// Collective over `comm` (every rank, same bytes, same order as the other collective calls):
// gathers each rank's `bytes` into out[rank * bytes, ...). Never blocks without bound: it polls
// the stream and NCCL's asynchronous error, and gives up after timeout_seconds with kTimeout. A
// timed-out communicator is unusable (a peer never joined the collective): it is aborted when
// epmoe owns the NCCL communicator, and every later collective call on it fails at once. `what`
// names the step in the timeout's message.
Status all_gather_bytes(Communicator& comm, const void* mine, size_t bytes, std::vector<char>* out,
                        double timeout_seconds, const char* what = "a create-time exchange");
// The same for n int64 words per rank: all[rank * n + i].
Status all_gather_words(Communicator& comm, const int64_t* mine, int n, std::vector<int64_t>* all,
                        double timeout_seconds, const char* what = "a create-time exchange");

// Collective: every rank contributes its Status; Ok on every rank only if every rank's is Ok.
// Otherwise every rank returns an error that names each failing rank with its code and message,
// prefixed by `what` (the failing rank keeps its own code). Why: a rank that returned alone from a
// collective call would leave its peers waiting in the next collective step. A failed rank's
// message is truncated to kAgreedMessageBytes - 1 characters.
Status agree_on_status(Communicator& comm, const Status& mine, const char* what, double timeout_seconds);
inline constexpr size_t kAgreedMessageBytes = 480;

// The verdict of an agreement, from every rank's Status (all[r] is rank r's): what
// agree_on_status returns on rank `self` (host only, for the CPU tests).
Status agreement_verdict(const std::vector<Status>& all, int self, const char* what);

// alloc_symmetric's argument check over every rank's gathered words (kSymmetricArgWords per rank:
// requested bytes, out is null, timeout_seconds invalid): "" when every rank's arguments are good
// and alike, else what is wrong and where (host only, for the CPU tests).
inline constexpr int kSymmetricArgWords = 3;
std::string symmetric_argument_errors(const std::vector<int64_t>& all, int ranks);

// "rank 3" or "ranks 0, 2" for messages.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace epmoe::detail
