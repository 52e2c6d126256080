// epmoe-bench: one binary, one subcommand per part of the library (comm, gemm, layer).
#include <cstdio>
#include <string>
#include <vector>

#include "bench_registry.h"

int main(int argc, char** argv) {
  auto& commands = epmoe::bench::registry();
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::printf("usage: epmoe-bench <command> [flags]\ncommands:\n");
    for (auto& [name, info] : commands) std::printf("  %-8s %s\n", name.c_str(), info.help.c_str());
    return argc < 2 ? 2 : 0;
  }
  auto it = commands.find(argv[1]);
  if (it == commands.end()) {
    std::fprintf(stderr, "epmoe-bench: unknown command '%s' (try --help)\n", argv[1]);
    return 2;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  return it->second.run(args);
}
