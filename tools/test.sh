#!/usr/bin/env bash
# Builds epmoe and runs every test. GPU tests skip cleanly on a machine without GPUs.
# Usage: bash tools/test.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bash tools/deps.sh
# EPMOE_TEST_HOOKS: the fault-injection hooks that the timeout and failure tests need.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_TEST_HOOKS=ON
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure
