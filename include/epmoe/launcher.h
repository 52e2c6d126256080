// epmoe: a small multi-process launcher (one process per GPU) for tests, benchmarks and users
// without torchrun/mpirun.
#pragma once

#include <nccl.h>

#include <functional>
#include <string>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

/// What each rank's function receives.
struct RankContext {
  int rank = 0;
  int size = 0;
  ncclUniqueId id{};  ///< created once in the parent, the same in every rank
};

/// A rank that is meant to end without returning from fn, by _exit(code): a test of what its peers
/// see when a rank dies in the middle of a call.
struct ExpectedExit {
  int rank = -1;
  int code = 0;
};

struct LaunchOptions {
  int num_ranks = 2;
  double timeout_seconds = 300.0;  ///< the whole run; ranks still running then are killed
  bool set_device = true;          ///< cudaSetDevice(rank) in each child before calling fn
  /// Ranks that must exit early with the given code, without returning from fn. Such a rank passes
  /// only that way (returning, another code or a signal fails the run), and its exit does not stop
  /// the others. Any other rank that ends without returning from fn fails the run.
  std::vector<ExpectedExit> expected_exits;
};

struct RankOutcome {
  int rank = 0;
  bool finished = false;  ///< exited on its own (not killed by the launcher)
  bool returned = false;  ///< fn returned (or threw) and the rank reported its Status
  int exit_code = -1;     ///< 0 = success
  int signal = 0;         ///< the signal that ended it, if any
  bool failed = false;    ///< this rank fails the run (see LaunchOptions::expected_exits)
  std::string message;    ///< its Status message (or what went wrong)
};

struct LaunchResult {
  bool ok = false;
  std::string message;  ///< empty when ok; else the first failing rank's message, then the others'
  std::vector<RankOutcome> ranks;
};

/// Forks `num_ranks` processes before any CUDA call in this process, runs `fn` in each and collects
/// the results. The parent never touches CUDA (it must not have, either: CUDA is not fork-safe).
/// A rank that fails, crashes, exits before fn returns (unless listed in expected_exits) or
/// outlives the time limit fails the run with its message, and every other rank is then killed and
/// reaped: no process is left behind.
LaunchResult launch_ranks(const LaunchOptions& opts, const std::function<Status(const RankContext&)>& fn);

/// Visible CUDA devices, counted in a forked child so this process stays CUDA-free. 0 without a driver.
int probe_gpu_count();

/// Reads "--ranks N" / "--ranks=N" from args (default when absent); -1 on a malformed value.
int parse_ranks_flag(const std::vector<std::string>& args, int default_ranks);

}  // namespace epmoe
