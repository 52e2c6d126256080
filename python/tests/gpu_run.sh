#!/usr/bin/env bash
# Runs the GPU test of the Python binding (gpu_test_layer.py) with a prebuilt libepmoe_c.so and no
# install: the package comes from python/, the library from $EPMOE_LIBRARY or the first argument.
# Usage (repository root): bash python/tests/gpu_run.sh [path/to/libepmoe_c.so | --wheel W.whl] [nproc]
# EPMOE_GPU_TEST=python/tests/gpu_test_torch.py runs that script instead (the torch.library operator).
# Each rank ends itself with status 1 after $EPMOE_TEST_TIMEOUT seconds (default 180); the whole
# run is killed 60 s after that in any case.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--wheel" ]; then
  # The installed package: pip installs the wheel into a scratch site directory, and the test
  # imports epmoe from there (its bundled libepmoe_c.so), not from python/.
  whl=$2; shift 2
  site=$(mktemp -d /tmp/epmoe-site.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --target "$site" "$whl" || { echo "gpu_run.sh: pip install $whl failed" >&2; exit 1; }
  unset EPMOE_LIBRARY
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  echo "gpu_run.sh: testing the installed package from $whl"
else
  lib=${1:-${EPMOE_LIBRARY:-}}
  if [ -z "$lib" ]; then
    for c in .gpu/bin/libepmoe_c.so build/python/libepmoe_c.so build-py/python/libepmoe_c.so; do
      [ -f "$c" ] && { lib=$c; break; }
    done
  fi
  [ -n "$lib" ] && [ -f "$lib" ] || { echo "gpu_run.sh: no libepmoe_c.so (pass its path)" >&2; exit 1; }
  [ $# -gt 0 ] && shift
  export EPMOE_LIBRARY=$(realpath "$lib") PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
good_nccl=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$good_nccl" ] && export LD_LIBRARY_PATH=$good_nccl:${LD_LIBRARY_PATH:-}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
nproc=${1:-2}
test=${EPMOE_GPU_TEST:-python/tests/gpu_test_layer.py}
export EPMOE_TEST_TIMEOUT=${EPMOE_TEST_TIMEOUT:-180}
outer=$(( ${EPMOE_TEST_TIMEOUT%.*} + 60 ))
if [ "$gpus" -lt "$nproc" ]; then
  exec timeout -k 15 "$outer" python3 "$test" --nproc "$nproc"  # SKIPPED
fi
exec timeout -k 15 "$outer" python3 -m torch.distributed.run --standalone \
  --nproc-per-node "$nproc" "$test"
