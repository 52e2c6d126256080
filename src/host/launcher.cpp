// Fork-based launcher: one child per rank, results through pipes, a hard deadline for the run.
#include "epmoe/launcher.h"

#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

namespace epmoe {
namespace {

// What a child writes first once fn has returned; its Status message follows.
constexpr char kReturnedMarker = '\x1e';

// Child side: run fn, write the message, exit. Never returns.
[[noreturn]] void run_child(const RankContext& ctx, const LaunchOptions& opts,
                            const std::function<Status(const RankContext&)>& fn, int write_fd) {
  // Why: if the parent dies, the children must not linger on the GPUs.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  Status st;
  try {
    if (opts.set_device) {
      const cudaError_t e = cudaSetDevice(ctx.rank);
      if (e != cudaSuccess)
        st = Status(StatusCode::kCudaError, std::string("cudaSetDevice(") + std::to_string(ctx.rank) +
                                                ") failed: " + cudaGetErrorString(e));
    }
    if (st.ok()) st = fn(ctx);
  } catch (const std::exception& ex) {
    st = Status(StatusCode::kInternal, std::string("uncaught exception: ") + ex.what());
  } catch (...) {
    st = Status(StatusCode::kInternal, "uncaught non-standard exception");
  }
  // The marker tells the parent that fn returned: a rank that exits without it died mid-call.
  const std::string msg = std::string(1, kReturnedMarker) + (st.ok() ? std::string() : st.to_string());
  size_t off = 0;
  while (off < msg.size()) {
    const ssize_t n = write(write_fd, msg.data() + off, msg.size() - off);
    if (n <= 0) break;
    off += size_t(n);
  }
  close(write_fd);
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(st.ok() ? 0 : 1);
}

// Reads what is left in a dead child's pipe (bounded: a grandchild may hold the write end open).
void drain(int& fd, std::string* into) {
  if (fd < 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
  while (std::chrono::steady_clock::now() < until) {
    pollfd pf{fd, POLLIN, 0};
    if (poll(&pf, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t k = read(fd, buf, sizeof(buf));
    if (k <= 0) break;
    into->append(buf, size_t(k));
  }
  close(fd);
  fd = -1;
}

// Whether a finished rank fails the run, and why (for the summary).
bool judge(RankOutcome& o, const LaunchOptions& opts, std::string* why) {
  const ExpectedExit* expected = nullptr;
  for (const ExpectedExit& e : opts.expected_exits)
    if (e.rank == o.rank) expected = &e;
  if (o.signal) {
    *why = "died from signal " + std::to_string(o.signal) + " (" + strsignal(o.signal) + ")";
    return true;
  }
  if (expected) {
    if (o.returned) {
      *why = "was expected to exit with code " + std::to_string(expected->code) +
             " before its function returned, but the function returned (exit code " + std::to_string(o.exit_code) + ")";
      return true;
    }
    if (o.exit_code != expected->code) {
      *why = "exited with code " + std::to_string(o.exit_code) + " before its function returned; expected code " +
             std::to_string(expected->code);
      return true;
    }
    return false;
  }
  if (!o.returned) {
    *why = "exited with code " + std::to_string(o.exit_code) + " before its function returned (it reported nothing)";
    return true;
  }
  if (o.exit_code != 0) {
    *why = "exited with code " + std::to_string(o.exit_code);
    return true;
  }
  return false;
}

void kill_all(std::vector<pid_t>& pids, std::vector<bool>& alive) {
  for (size_t i = 0; i < pids.size(); ++i)
    if (alive[i]) kill(pids[i], SIGTERM);
  // Grace period for SIGTERM, then SIGKILL; every child is reaped either way.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  for (;;) {
    bool any = false;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (!alive[i]) continue;
      int wst = 0;
      if (waitpid(pids[i], &wst, WNOHANG) == pids[i]) alive[i] = false;
      else any = true;
    }
    if (!any) return;
    if (std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < pids.size(); ++i)
    if (alive[i]) {
      kill(pids[i], SIGKILL);
      int wst = 0;
      waitpid(pids[i], &wst, 0);
      alive[i] = false;
    }
}

}  // namespace

LaunchResult launch_ranks(const LaunchOptions& opts, const std::function<Status(const RankContext&)>& fn) {
  LaunchResult res;
  const int n = opts.num_ranks;
  if (n < 1) {
    res.message = "launch_ranks: num_ranks=" + std::to_string(n) + " must be >= 1";
    return res;
  }
  RankContext ctx;
  ctx.size = n;
  const ncclResult_t idres = ncclGetUniqueId(&ctx.id);
  if (idres != ncclSuccess) {
    res.message = std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(idres);
    return res;
  }
  std::fflush(stdout);
  std::fflush(stderr);

  std::vector<pid_t> pids(n, -1);
  std::vector<int> fds(n, -1);
  std::vector<bool> alive(n, false);
  res.ranks.resize(n);
  for (int r = 0; r < n; ++r) {
    res.ranks[r].rank = r;
    int p[2];
    if (pipe(p) != 0) {
      res.message = std::string("pipe() failed: ") + std::strerror(errno);
      kill_all(pids, alive);
      return res;
    }
    const pid_t pid = fork();
    if (pid < 0) {
      res.message = std::string("fork() failed: ") + std::strerror(errno);
      close(p[0]);
      close(p[1]);
      kill_all(pids, alive);
      return res;
    }
    if (pid == 0) {
      close(p[0]);
      for (int q = 0; q < r; ++q) close(fds[q]);
      RankContext mine = ctx;
      mine.rank = r;
      run_child(mine, opts, fn, p[1]);
    }
    close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
    alive[r] = true;
  }

  // Collect: read messages as they come, reap children, stop at the first failure or the deadline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(opts.timeout_seconds);
  int first_failure = -1;
  bool timed_out = false;
  std::vector<std::string> why(n);
  int running = n;
  while (running > 0) {
    for (int r = 0; r < n; ++r) {
      if (fds[r] < 0) continue;
      pollfd pf{fds[r], POLLIN, 0};
      while (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLIN | POLLHUP))) {
        char buf[4096];
        const ssize_t k = read(fds[r], buf, sizeof(buf));
        if (k <= 0) {
          close(fds[r]);
          fds[r] = -1;
          break;
        }
        res.ranks[r].message.append(buf, size_t(k));
      }
    }
    for (int r = 0; r < n; ++r) {
      if (!alive[r]) continue;
      int wst = 0;
      if (waitpid(pids[r], &wst, WNOHANG) != pids[r]) continue;
      alive[r] = false;
      --running;
      RankOutcome& o = res.ranks[r];
      o.finished = true;
      if (WIFEXITED(wst)) o.exit_code = WEXITSTATUS(wst);
      if (WIFSIGNALED(wst)) o.signal = WTERMSIG(wst);
      // Why drain now: whether it returned is in its pipe, which may still hold the marker.
      drain(fds[r], &o.message);
      o.returned = !o.message.empty() && o.message[0] == kReturnedMarker;
      if (o.returned) o.message.erase(0, 1);
      o.failed = judge(o, opts, &why[r]);
      if (o.failed && first_failure < 0) first_failure = r;
    }
    if (first_failure >= 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      break;
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill_all(pids, alive);
  for (int r = 0; r < n; ++r) {
    if (fds[r] < 0) continue;
    char buf[4096];
    ssize_t k;
    while ((k = read(fds[r], buf, sizeof(buf))) > 0) res.ranks[r].message.append(buf, size_t(k));
    close(fds[r]);
    // A killed rank that had returned (it was killed while exiting) keeps no marker in its message.
    RankOutcome& o = res.ranks[r];
    if (!o.message.empty() && o.message[0] == kReturnedMarker) {
      o.returned = true;
      o.message.erase(0, 1);
    }
  }
  for (RankOutcome& o : res.ranks)
    if (!o.finished) o.failed = true;

  std::ostringstream os;
  auto describe = [&](const RankOutcome& o) {
    os << "rank " << o.rank << ": ";
    if (!o.finished) os << (timed_out ? "did not finish within the time limit of " + std::to_string(opts.timeout_seconds) + " s (killed)"
                                      : "killed after another rank failed");
    else os << why[size_t(o.rank)];
    if (!o.message.empty()) os << ": " << o.message;
    os << "\n";
  };
  if (first_failure >= 0) describe(res.ranks[first_failure]);
  for (const RankOutcome& o : res.ranks)
    if (o.rank != first_failure && o.failed) describe(o);
  res.message = os.str();
  res.ok = res.message.empty();
  return res;
}

int probe_gpu_count() {
  int p[2];
  if (pipe(p) != 0) return 0;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(p[0]);
    close(p[1]);
    return 0;
  }
  if (pid == 0) {
    close(p[0]);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    const ssize_t w = write(p[1], &count, sizeof(count));
    (void)w;
    _exit(0);
  }
  close(p[1]);
  int count = 0;
  // Why poll with a bound: a broken driver must not hang the test binary.
  pollfd pf{p[0], POLLIN, 0};
  if (poll(&pf, 1, 60000) > 0 && read(p[0], &count, sizeof(count)) != ssize_t(sizeof(count))) count = 0;
  close(p[0]);
  kill(pid, SIGKILL);
  int wst = 0;
  waitpid(pid, &wst, 0);
  return count;
}

int parse_ranks_flag(const std::vector<std::string>& args, int default_ranks) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (args[i] == "--ranks" && i + 1 < args.size()) v = args[i + 1];
    else if (args[i].rfind("--ranks=", 0) == 0) v = args[i].substr(8);
    else continue;
    try {
      size_t used = 0;
      const int n = std::stoi(v, &used);
      return used == v.size() && n >= 1 ? n : -1;
    } catch (...) {
      return -1;
    }
  }
  return default_ranks;
}

}  // namespace epmoe
