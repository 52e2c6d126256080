#!/usr/bin/env bash
# Run here (no GPU needed): build and copy the GPU binaries into .gpu/bin, which the device
# tool carries to the GPU machine (carry [".gpu/bin"]). Then, there: bash tools/gpu_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)"
rm -rf .gpu/bin && mkdir -p .gpu/bin
for b in epmoe-gpu-check epmoe_gpu_tests epmoe_mgpu_tests epmoe-bench epmoe_unit_tests; do
  [ -x "$build/$b" ] && cp "$build/$b" .gpu/bin/ && strip --strip-debug .gpu/bin/$b || true
done
if [ -f "$build/python/libepmoe_c.so" ]; then
  cp "$build/python/libepmoe_c.so" .gpu/bin/ && strip --strip-debug .gpu/bin/libepmoe_c.so
fi
du -sh .gpu/bin
