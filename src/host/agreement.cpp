// Cross-rank agreements (comm_internal.h): every rank's Status or words, gathered over the
// communicator, and the verdicts every rank computes alike from them.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "host/check.h"
#include "host/comm_internal.h"

namespace epmoe::detail {

Status all_gather_words(Communicator& comm, const int64_t* mine, int n, std::vector<int64_t>* all,
                        double timeout_seconds, const char* what) {
  std::vector<char> bytes;
  EPMOE_RETURN_IF_ERROR(all_gather_bytes(comm, mine, sizeof(int64_t) * size_t(n), &bytes, timeout_seconds, what));
  all->assign(size_t(comm.size()) * n, 0);
  std::memcpy(all->data(), bytes.data(), bytes.size());
  return Status::Ok();
}

Status agree_on_status(Communicator& comm, const Status& mine, const char* what, double timeout_seconds) {
  // Per rank: the code, then the message (truncated), NUL-terminated.
  struct Word {
    int64_t code;
    char message[kAgreedMessageBytes];
  };
  Word w{};
  w.code = int64_t(mine.code());
  std::snprintf(w.message, kAgreedMessageBytes, "%s", mine.message().c_str());
  std::vector<char> bytes;
  const Status st = all_gather_bytes(comm, &w, sizeof(w), &bytes, timeout_seconds, what);
  if (!st.ok()) {
    if (!mine.ok()) return Status(mine.code(), mine.message() + " (then: " + st.message() + ")");
    // The exchange's own messages (a timeout, an unusable communicator) name the step already.
    if (st.message().find(what) != std::string::npos) return st;
    return Status(st.code(), std::string(what) + ": " + st.message());
  }
  std::vector<Status> all;
  for (int r = 0; r < comm.size(); ++r) {
    Word o;
    std::memcpy(&o, bytes.data() + size_t(r) * sizeof(Word), sizeof(Word));
    o.message[kAgreedMessageBytes - 1] = '\0';
    all.emplace_back(StatusCode(o.code), o.code == int64_t(StatusCode::kOk) ? std::string() : std::string(o.message));
  }
  // This rank's own message is kept whole.
  if (comm.rank() >= 0 && comm.rank() < int(all.size())) all[size_t(comm.rank())] = mine;
  return agreement_verdict(all, comm.rank(), what);
}

Status agreement_verdict(const std::vector<Status>& all, int self, const char* what) {
  std::vector<int> failed;
  std::string causes;
  StatusCode first = StatusCode::kOk;
  for (int r = 0; r < int(all.size()); ++r) {
    if (all[size_t(r)].ok()) continue;
    if (failed.empty()) first = all[size_t(r)].code();
    failed.push_back(r);
    causes += std::string(causes.empty() ? "" : "; ") + "rank " + std::to_string(r) + ": " +
              status_code_name(all[size_t(r)].code()) + ": " + all[size_t(r)].message();
  }
  if (failed.empty()) return Status::Ok();
  const bool self_failed = self >= 0 && self < int(all.size()) && !all[size_t(self)].ok();
  return Status(self_failed ? all[size_t(self)].code() : first,
                std::string(what) + " failed on " + rank_list(failed) + " (reported on rank " + std::to_string(self) +
                    "; every rank fails and releases what it allocated): " + causes);
}

std::string symmetric_argument_errors(const std::vector<int64_t>& all, int ranks) {
  constexpr int n = kSymmetricArgWords;
  std::vector<int> null_out, zero, bad_timeout;
  std::vector<int64_t> sizes;
  std::vector<std::vector<int>> size_ranks;
  for (int r = 0; r < ranks; ++r) {
    const int64_t bytes = all[size_t(r) * n], out_null = all[size_t(r) * n + 1], timeout_bad = all[size_t(r) * n + 2];
    if (out_null) null_out.push_back(r);
    if (bytes == 0) zero.push_back(r);
    if (timeout_bad) bad_timeout.push_back(r);
    size_t i = 0;
    while (i < sizes.size() && sizes[i] != bytes) ++i;
    if (i == sizes.size()) {
      sizes.push_back(bytes);
      size_ranks.emplace_back();
    }
    size_ranks[i].push_back(r);
  }
  std::ostringstream os;
  const auto add = [&](const std::string& s) { os << (os.tellp() > 0 ? "; " : "") << s; };
  if (!null_out.empty()) add("out is null on " + rank_list(null_out));
  if (!zero.empty()) add("bytes is 0 on " + rank_list(zero) + " (it must be > 0)");
  if (sizes.size() > 1) {
    std::string s = "bytes differ across ranks (every rank must allocate the same size): ";
    for (size_t i = 0; i < sizes.size(); ++i)
      s += (i ? ", " : "") + std::to_string(sizes[i]) + " on " + rank_list(size_ranks[i]);
    add(s);
  }
  if (!bad_timeout.empty()) add("timeout_seconds is outside (0, 3600] on " + rank_list(bad_timeout));
  return os.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace epmoe::detail
