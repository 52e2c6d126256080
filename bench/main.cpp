// epmoe-bench: one binary, one subcommand per part of the library (comm, gemm, layer).
// The whole command line is parsed (CLI11) before any subcommand runs, so a bad flag fails the
// same way on a machine with or without GPUs: a message on stderr and exit code 2.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "tuning_env.h"

namespace {

struct Mode {
  std::string name;
  CLI::App* app = nullptr;
  epmoe::bench::Run run;
  epmoe::bench::Output out;
  CLI::Option* json = nullptr;
};

// "epmoe-bench layer: Could not convert: --iters = x" and where to look for the flags.
std::string failure_message(const CLI::App* app, const CLI::Error& e) {
  std::string where = "epmoe-bench";
  const auto selected = app->get_subcommands();
  if (!selected.empty()) where += " " + selected.front()->get_name();
  return where + ": " + e.what() + "\nRun '" + where + " --help' for the flags.\n";
}

}  // namespace

int main(int argc, char** argv) {
  // The EPMOE_* tuning switches for A/B runs (tools/gpu_all.sh sets some), before any layer or
  // dispatch handle exists; forked ranks inherit them.
  epmoe::testing_env::apply_tuning_env();
  CLI::App app{"epmoe-bench: benchmarks of the epmoe MoE layer and its parts on Hopper GPUs.",
               "epmoe-bench"};
  app.require_subcommand(1);
  // As before CLI11: a flag given twice takes its last value (a list flag is one comma list).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.failure_message(failure_message);
  app.footer("'epmoe-bench <command> --help' lists a command's flags. Every command takes --json [FILE] and "
             "--quiet. A bad flag or value exits with status 2.");

  std::vector<std::unique_ptr<Mode>> modes;
  for (auto& [name, info] : epmoe::bench::registry()) {
    auto m = std::make_unique<Mode>();
    m->name = name;
    m->app = app.add_subcommand(name, info.help);
    m->run = info.setup(*m->app);
    m->json = m->app
                  ->add_option("--json", m->out.json,
                               "also write the results as JSON lines (one object per table row) to FILE; a bare "
                               "--json (or --json -) prints them on stdout instead of the table")
                  ->expected(0, 1)
                  ->type_name("[FILE]");
    m->app->add_flag("--quiet,-q", m->out.quiet, "no progress lines on stderr");
    modes.push_back(std::move(m));
  }

  if (argc < 2) {
    std::fputs(app.help().c_str(), stdout);
    return 2;
  }
  // An unknown command by its name (CLI11 alone would only say that one is required).
  const std::string first = argv[1];
  if (first[0] != '-' && !epmoe::bench::registry().count(first)) {
    std::string names;
    for (auto& m : modes) names += (names.empty() ? "" : ", ") + m->name;
    std::fprintf(stderr, "epmoe-bench: unknown command '%s' (commands: %s; try --help)\n", first.c_str(), names.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0 after printing the help; every real error prints its message and exits 2.
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  for (auto& m : modes) {
    if (!m->app->parsed()) continue;
    if (m->json->count() > 0 && m->out.json.empty()) m->out.json = "-";
    if (m->out.json_file()) {
      // Created empty here, before the run: an unwritable path fails now, not after the measurement.
      std::ofstream f(m->out.json, std::ios::trunc);
      if (!f) {
        std::fprintf(stderr, "epmoe-bench %s: cannot write --json file '%s'\n", m->name.c_str(), m->out.json.c_str());
        return 2;
      }
    }
    return m->run(m->out);
  }
  return 2;  // not reached: require_subcommand(1)
}
