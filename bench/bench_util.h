// Small helpers shared by epmoe-bench subcommands: list flags, JSON lines, progress, statistics.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_registry.h"

namespace epmoe::bench {

// The three spans of one comm kernel's phase stamps (comm::CommPhase) in microseconds: ts[base]
// holds ~t of the first block, ts[base + 1 .. base + 3] the ends of its three phases.
inline void comm_phase_spans_us(const unsigned long long* ts, int base, double out[3]) {
  out[0] = (double(ts[base + 1]) - double(~ts[base])) / 1e3;
  out[1] = (double(ts[base + 2]) - double(ts[base + 1])) / 1e3;
  out[2] = (double(ts[base + 3]) - double(ts[base + 2])) / 1e3;
}

// "a,b,,c" -> {"a", "b", "c"} (empty items are dropped).
inline std::vector<std::string> split_list(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// A comma-separated list of integers, each >= min_value ("--tokens 1,128,4096"). A malformed item
// is a parse error (exit code 2) that names the flag and the item.
inline std::vector<int> parse_int_list(const std::string& flag, const std::string& v, int min_value) {
  std::vector<int> out;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) {
    int n = 0;
    const char* end = item.data() + item.size();
    const auto [ptr, ec] = std::from_chars(item.data(), end, n);
    if (item.empty() || ec != std::errc() || ptr != end)
      throw CLI::ValidationError(flag, "'" + item + "' in '" + v + "' is not an integer (want a list like 1,128,4096)");
    if (n < min_value)
      throw CLI::ValidationError(flag, "'" + item + "' in '" + v + "' is below " + std::to_string(min_value));
    out.push_back(n);
  }
  if (out.empty()) throw CLI::ValidationError(flag, "an empty list");
  return out;
}

inline std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// Adds `flag` as a list of integers that replaces *out (its current value is the default shown).
inline CLI::Option* add_int_list(CLI::App& app, const std::string& flag, std::vector<int>* out,
                                 const std::string& help, int min_value) {
  return app
      .add_option_function<std::string>(
          flag, [flag, out, min_value](const std::string& v) { *out = parse_int_list(flag, v, min_value); }, help)
      ->type_name("N,N,...")
      ->default_str(join_ints(*out));
}

// ---- JSON output (--json) -----------------------------------------------------------------------
// One object per measured case and line (JSON lines); keys keep their insertion order.
using Json = nlohmann::ordered_json;

// v rounded to `digits` decimals, as the tables print it; NaN and infinities become null.
inline Json json_number(double v, int digits) {
  if (!std::isfinite(v)) return nullptr;
  if (digits == 0) return static_cast<long long>(std::llround(v));
  const double p = std::pow(10.0, digits);
  return std::round(v * p) / p;
}

inline std::string json_line(const Json& j) { return j.dump() + "\n"; }

// Appends `text` to the --json file (main.cpp created it empty before the run).
inline bool append_json_file(const Output& out, const std::string& text, const char* mode) {
  std::ofstream f(out.json, std::ios::app);
  f << text;
  f.flush();
  if (!f) {
    std::fprintf(stderr, "epmoe-bench %s: cannot append to --json file '%s'\n", mode, out.json.c_str());
    return false;
  }
  return true;
}

// ---- progress (stderr) ----------------------------------------------------------------------------
// "epmoe-bench gemm: [3/16] fp8 (32,256,4096,7168) (12.3 s)": one line as each case starts, on
// stderr, so that the tables on stdout stay as they are. --quiet turns it off.
class Progress {
 public:
  Progress(const char* mode, int total, bool quiet)
      : mode_(mode), total_(total), quiet_(quiet), t0_(std::chrono::steady_clock::now()) {}
  void step(const std::string& what) {
    ++done_;
    if (quiet_) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    std::fprintf(stderr, "epmoe-bench %s: [%d/%d] %s (%.1f s)\n", mode_, done_, total_, what.c_str(), s);
    std::fflush(stderr);
  }

 private:
  const char* mode_;
  int total_, done_ = 0;
  bool quiet_;
  std::chrono::steady_clock::time_point t0_;
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
