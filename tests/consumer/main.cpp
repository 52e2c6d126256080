// Uses the installed headers and library; needs no GPU.
#include <cstdio>

#include "epmoe/epmoe.h"

int main() {
  epmoe::LayerConfig cfg;
  cfg.num_ranks = 2;
  cfg.num_experts = 64;
  cfg.hidden = 7168;
  cfg.intermediate = 2048;
  cfg.topk = 8;
  cfg.max_tokens_per_rank = 4096;
  epmoe::Status good = epmoe::validate(cfg);
  cfg.hidden = 100;
  epmoe::Status bad = epmoe::validate(cfg);
  std::printf("epmoe %s: good=%s bad=%s\n", epmoe::version_string(), good.to_string().c_str(),
              bad.to_string().c_str());
  return good.ok() && !bad.ok() ? 0 : 1;
}
