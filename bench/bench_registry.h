// epmoe-bench subcommands register themselves here, so each lives in its own file.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace epmoe::bench {

// A subcommand gets the arguments after its name and returns the process exit code.
using Command = std::function<int(const std::vector<std::string>& args)>;

struct CommandInfo {
  Command run;
  std::string help;
};

inline std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> commands;
  return commands;
}

struct Registrar {
  Registrar(const char* name, const char* help, Command run) {
    registry()[name] = CommandInfo{std::move(run), help};
  }
};

}  // namespace epmoe::bench

#define EPMOE_BENCH_CAT2(a, b) a##b
#define EPMOE_BENCH_CAT(a, b) EPMOE_BENCH_CAT2(a, b)
// EPMOE_BENCH_COMMAND("gemm", "grouped GEMM TFLOP/s vs cuBLASLt", run_gemm);
#define EPMOE_BENCH_COMMAND(name, help, fn) \
  static ::epmoe::bench::Registrar EPMOE_BENCH_CAT(epmoe_bench_registrar_, __LINE__)(name, help, fn)
