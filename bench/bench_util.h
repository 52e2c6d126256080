// Small helpers shared by epmoe-bench subcommands: flags, statistics, tables.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace epmoe::bench {

// The three spans of one comm kernel's phase stamps (comm::CommPhase) in microseconds: ts[base]
// holds ~t of the first block, ts[base + 1 .. base + 3] the ends of its three phases.
inline void comm_phase_spans_us(const unsigned long long* ts, int base, double out[3]) {
  out[0] = (double(ts[base + 1]) - double(~ts[base])) / 1e3;
  out[1] = (double(ts[base + 2]) - double(ts[base + 1])) / 1e3;
  out[2] = (double(ts[base + 3]) - double(ts[base + 2])) / 1e3;
}

// --name=value or --name value; a bare --name is "1".
class Flags {
 public:
  explicit Flags(const std::vector<std::string>& args) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.rfind("--", 0) != 0) { positional_.push_back(a); continue; }
      const size_t eq = a.find('=');
      if (eq != std::string::npos) { values_[a.substr(2, eq - 2)] = a.substr(eq + 1); continue; }
      if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) values_[a.substr(2)] = args[++i];
      else values_[a.substr(2)] = "1";
    }
  }
  bool has(const std::string& k) const { return values_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def) const {
    auto it = values_.find(k);
    return it == values_.end() ? def : it->second;
  }
  int integer(const std::string& k, int def) const { return has(k) ? std::atoi(str(k, "").c_str()) : def; }
  double real(const std::string& k, double def) const { return has(k) ? std::atof(str(k, "").c_str()) : def; }
  std::vector<std::string> list(const std::string& k, const std::string& def) const {
    std::vector<std::string> out;
    std::stringstream ss(str(k, def));
    for (std::string item; std::getline(ss, item, ',');) if (!item.empty()) out.push_back(item);
    return out;
  }
  // Flags given but not in `known`: a typo should fail loudly, not run the default.
  std::vector<std::string> unknown(const std::vector<std::string>& known) const {
    std::vector<std::string> bad;
    for (auto& [k, v] : values_)
      if (std::find(known.begin(), known.end(), k) == known.end()) bad.push_back(k);
    return bad;
  }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

struct Stats {
  double median = 0, p10 = 0, p90 = 0, mean = 0;
};

inline Stats stats_of(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, size_t(q * (v.size() - 1) + 0.5))]; };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  for (double x : v) s.mean += x;
  s.mean /= v.size();
  return s;
}

}  // namespace epmoe::bench
