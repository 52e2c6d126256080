#!/usr/bin/env bash
# Run here (no GPU needed): build and copy the GPU binaries into .gpu/bin, which the device
# tool carries to the GPU machine (carry [".gpu/bin"]). Then, there: bash tools/gpu_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
build=${build%/}
export PATH=/usr/local/cuda/bin:$PATH
# The GPU machines' NCCL >= 2.28.9 (their system libnccl is older and ABI-incompatible): first in
# the binaries' RUNPATH. The library's own default has no machine-specific path.
gpu_rpath=${EPMOE_EXTRA_RPATH:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
# EPMOE_BUILD_PROBES: the probes of tools/probes are staged too (bash tools/gpu_all.sh probe).
# EPMOE_TEST_HOOKS: the fault-injection hooks of the timeout and failure tests (the hooks' only
# device-side trace is one check per GEMM producer run, outside the K loops).
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_DIAG_TRACE=OFF -DEPMOE_BUILD_PROBES=ON \
  -DEPMOE_TEST_HOOKS=ON \
  -DEPMOE_EXTRA_RPATH="$gpu_rpath" >/dev/null
cmake --build "$build" -j "$(nproc)"
rm -rf .gpu/bin && mkdir -p .gpu/bin
# The peers of ../shared/peers (DeepGEMM's wheels and their scripts) for gpu_all.sh peer-gemm.
if [ -d ../shared/peers ]; then rm -rf .gpu/peers && cp -r ../shared/peers .gpu/peers && chmod -R u+w .gpu/peers; fi
for b in epmoe-gpu-check epmoe_gpu_tests epmoe_mgpu_tests epmoe-bench epmoe_unit_tests epmoe-wgmma-probe epmoe-gather-probe epmoe-tma-probe epmoe-launch-probe epmoe-icache-probe; do
  [ -x "$build/$b" ] && cp "$build/$b" .gpu/bin/ && strip --strip-debug .gpu/bin/$b || true
done
# EPMOE_STAGE_TRACE=1: also the trace build of epmoe-bench (device/debug/diag_trace.cuh) as
# epmoe-bench-trace, for bash tools/gpu_all.sh trace.
if [ "${EPMOE_STAGE_TRACE:-0}" = 1 ]; then
  cmake -S . -B "$build-trace" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_DIAG_TRACE=ON -DEPMOE_BUILD_TESTS=OFF \
    -DEPMOE_BUILD_PYTHON=OFF -DEPMOE_EXTRA_RPATH="$gpu_rpath" >/dev/null
  cmake --build "$build-trace" --target epmoe-bench -j "$(nproc)"
  cp "$build-trace/epmoe-bench" .gpu/bin/epmoe-bench-trace && strip --strip-debug .gpu/bin/epmoe-bench-trace
fi
if [ -f "$build/python/libepmoe_c.so" ]; then
  cp "$build/python/libepmoe_c.so" .gpu/bin/ && strip --strip-debug .gpu/bin/libepmoe_c.so
fi
# The FP8 GEMMs behind ctypes, for python/benchmarks/gemm_vs_deepgemm.py (gpu_all.sh gemm-peer-turns).
if [ -f "$build/libepmoe_gemm_ctypes.so" ]; then
  cp "$build/libepmoe_gemm_ctypes.so" .gpu/bin/ && strip --strip-debug .gpu/bin/libepmoe_gemm_ctypes.so
fi
# The Python package as a wheel (py3-none: no CPython ABI), so the GPU run tests the installed package.
# EPMOE_STAGE_WHEEL=0 skips it: pip builds the library again from scratch (~4 min on 2 cores).
if [ "${EPMOE_STAGE_WHEEL:-1}" != 0 ]; then
  python3 -m pip wheel -q --no-deps -w .gpu/bin -C cmake.define.EPMOE_EXTRA_RPATH="$gpu_rpath" ./python \
    >/dev/null 2>&1 || echo "stage_gpu: python wheel build failed"
fi
# The tree the binaries were built from (the device copy's git metadata can be stale): benchmark
# scripts print it (gemm_vs_deepgemm.py reads the COMMIT next to its library).
{ git rev-parse --short HEAD; git diff --quiet HEAD -- src include bench python tools 2>/dev/null || echo "+ uncommitted changes"; } \
  >.gpu/bin/COMMIT 2>/dev/null || true
du -sh .gpu/bin
