#!/usr/bin/env bash
# Installs the build dependencies that are missing (Debian/Ubuntu): CMake >= 3.25, Ninja,
# GoogleTest, and for epmoe-bench CLI11 and nlohmann/json (header-only). The CUDA 13 toolkit (with
# NCCL >= 2.28.9) must already be installed.
set -euo pipefail
need=()
command -v ninja >/dev/null || need+=(ninja-build)
command -v cmake >/dev/null || need+=(cmake)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "deps: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}"
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null || { echo "deps: nvcc not found; install the CUDA 13 toolkit" >&2; exit 1; }
