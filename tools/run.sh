#!/usr/bin/env bash
# Builds epmoe and runs its main job: the layer benchmark on every local GPU (one process per
# GPU), DeepSeek-V3 slice by default. Extra flags go to `epmoe-bench layer`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${EPMOE_BUILD:-build}
bash tools/deps.sh
export PATH=/usr/local/cuda/bin:$PATH
good_nccl=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
# The GPU machines' NCCL >= 2.28.9 first in the RUNPATH (the library's default has no such path).
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_EXTRA_RPATH="${EPMOE_EXTRA_RPATH:-$good_nccl}" >/dev/null
cmake --build "$build" -j "$(nproc)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d "$good_nccl" ] && export LD_LIBRARY_PATH=$good_nccl:${LD_LIBRARY_PATH:-}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -eq 0 ]; then
  echo "epmoe: no NVIDIA GPU found on this machine (nvidia-smi lists none)."
  echo "epmoe runs on Hopper GPUs (H100/H200). The build succeeded; run 'bash tools/test.sh' for the CPU tests."
  exit 0
fi
exec "$build/epmoe-bench" layer --ranks "$gpus" "$@"
