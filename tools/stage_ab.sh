#!/usr/bin/env bash
# Run here (no GPU needed), after tools/stage_gpu.sh: builds epmoe-bench of an older commit in a
# git worktree (build-ab/, ignored) and copies it into .gpu/bin as epmoe-bench-old, so that one
# device call can time the old and the new build alternately (bash tools/gpu_all.sh ab).
# Why alternate in one call: the GPUs' clocks move with power and temperature from call to call
# by more than most single changes are worth; an older build timed in the same call is the only
# comparison that holds.
# Usage: bash tools/stage_ab.sh <commit>
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: bash tools/stage_ab.sh <commit>}
# Why resolved here: a relative name (HEAD~1) would otherwise be read in the worktree, whose HEAD
# is the previous run's commit.
commit=$(git rev-parse --verify --quiet "$commit^{commit}") || { echo "stage_ab: unknown commit $1" >&2; exit 2; }
export PATH=/usr/local/cuda/bin:$PATH
tree=build-ab/tree
if [ ! -d "$tree" ]; then
  git worktree add --detach -f "$tree" "$commit" >/dev/null
else
  git -C "$tree" checkout -q --detach "$commit"
fi
# The GPU machines' NCCL first in the RUNPATH, as tools/stage_gpu.sh does (older commits had it as
# their default; newer ones default to none). The test hooks on, as tools/stage_gpu.sh builds the
# new side: each GEMM producer run then carries the same hook check in both builds (a commit
# without the option ignores it).
cmake -S "$tree" -B build-ab/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_TEST_HOOKS=ON \
  -DEPMOE_EXTRA_RPATH="${EPMOE_EXTRA_RPATH:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}" >/dev/null
cmake --build build-ab/build --target epmoe-bench -j "$(nproc)"
mkdir -p .gpu/bin
cp build-ab/build/epmoe-bench .gpu/bin/epmoe-bench-old
strip --strip-debug .gpu/bin/epmoe-bench-old
echo "stage_ab: .gpu/bin/epmoe-bench-old is epmoe-bench of $(git rev-parse --short "$commit")"
