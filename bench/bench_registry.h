// epmoe-bench subcommands register themselves here, so each lives in its own file.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <map>
#include <string>

namespace epmoe::bench {

// What every subcommand gets besides its own flags (main.cpp adds these to each).
struct Output {
  // --json: "" when absent; "-" for a bare --json (or --json -): JSON lines on stdout instead of
  // the table; else a file that gets the JSON lines while the table still prints.
  std::string json;
  bool quiet = false;  // --quiet: no progress lines on stderr
  bool json_stdout() const { return json == "-"; }
  bool json_file() const { return !json.empty() && json != "-"; }
};

// A subcommand's run function: called after the whole command line parsed, with every flag's
// value in place; returns the process exit code (2 for a bad argument, as a parse error is).
using Run = std::function<int(const Output&)>;
// Adds the subcommand's flags to its CLI11 app and returns its run function. Called before
// parsing, so it must not touch CUDA (nothing may, before the flags are checked).
using Setup = std::function<Run(CLI::App&)>;

struct CommandInfo {
  Setup setup;
  std::string help;
};

inline std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> commands;
  return commands;
}

struct Registrar {
  Registrar(const char* name, const char* help, Setup setup) {
    registry()[name] = CommandInfo{std::move(setup), help};
  }
};

}  // namespace epmoe::bench

#define EPMOE_BENCH_CAT2(a, b) a##b
#define EPMOE_BENCH_CAT(a, b) EPMOE_BENCH_CAT2(a, b)
// EPMOE_BENCH_COMMAND("gemm", "grouped GEMM TFLOP/s vs cuBLASLt", setup_gemm);
#define EPMOE_BENCH_COMMAND(name, help, setup) \
  static ::epmoe::bench::Registrar EPMOE_BENCH_CAT(epmoe_bench_registrar_, __LINE__)(name, help, setup)
