#!/usr/bin/env bash
# Builds libepmoe_cutlass_probe.so: CUTLASS's sm90 FP8 grouped GEMMs with block-scaled accumulation
# behind a C interface (tools/probes/cutlass_grouped_fp8.cu, one kernel per translation unit in
# tools/probes/cutlass_probe/), for python/benchmarks/gemm_vs_deepgemm.py --cutlass-lib. No GPU
# needed. CUTLASS is a header-only dependency of this probe alone: the headers come from the
# nvidia-cutlass wheel, downloaded and unpacked into build-cutlass/ (ignored) on first use.
#
#   bash tools/probes/build_cutlass_probe.sh [OUT]     # default OUT: .gpu/bin/libepmoe_cutlass_probe.so
#
# Environment: EPMOE_CUTLASS_DIR, a CUTLASS tree whose include/ to use instead of the wheel's;
# NVCC (default /usr/local/cuda/bin/nvcc); JOBS (parallel compiles, default nproc); PYTHON (for pip).
# Objects are rebuilt only when their sources changed. ptxas's report of each kernel (registers,
# spills) is kept next to its object in build-cutlass/obj/.
# Note: tools/stage_gpu.sh recreates .gpu/bin, so run this after it.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.gpu/bin/libepmoe_cutlass_probe.so}
work=build-cutlass
cutlass_version=4.2.0.0
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
jobs=${JOBS:-$(nproc)}
python=${PYTHON:-python3}

# CUTLASS headers.
if [ -n "${EPMOE_CUTLASS_DIR:-}" ]; then
  cutlass=$EPMOE_CUTLASS_DIR
else
  cutlass=$work/nvidia-cutlass-$cutlass_version/cutlass_library/source
  if [ ! -f "$cutlass/include/cutlass/cutlass.h" ]; then
    mkdir -p "$work/wheel"
    wheel=$(ls "$work"/wheel/nvidia_cutlass-"$cutlass_version"-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
      "$python" -m pip download -q --no-deps "nvidia-cutlass==$cutlass_version" -d "$work/wheel"
      wheel=$(ls "$work"/wheel/nvidia_cutlass-"$cutlass_version"-*.whl | head -n 1)
    fi
    # Only the two header trees (the wheel also holds the Python generator and examples).
    "$python" - "$wheel" "$work/nvidia-cutlass-$cutlass_version" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
keep = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [m for m in z.namelist() if m.startswith(keep)])
EOF
  fi
fi
if [ ! -f "$cutlass/include/cutlass/cutlass.h" ]; then
  echo "build_cutlass_probe: no CUTLASS headers under $cutlass" >&2
  exit 1
fi

# -DNDEBUG: a device assert is a call, and a call in a kernel that issues wgmma makes ptxas
# serialize every wgmma (warning C7510).
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG
       -Xcompiler -fPIC,-fvisibility=hidden -I"$cutlass/include" -I"$cutlass/tools/util/include")
obj=$work/obj
mkdir -p "$obj"
srcs=(tools/probes/cutlass_grouped_fp8.cu tools/probes/cutlass_probe/sm90_grouped_fp8_*.cu)
headers=(tools/probes/cutlass_probe/*.h tools/probes/cutlass_probe/*.cuh)
todo=()
for s in "${srcs[@]}"; do
  o=$obj/$(basename "${s%.cu}").o
  stale=0
  [ -f "$o" ] || stale=1
  for dep in "$s" "${headers[@]}"; do [ "$dep" -nt "$o" ] && stale=1; done
  [ $stale = 1 ] && todo+=("$s")
done

compile_one() {  # compile_one SRC: object, ptxas report, and the wall time
  local s=$1 o log t0
  o=$obj/$(basename "${s%.cu}").o
  log=${o%.o}.ptxas.log
  t0=$(date +%s)
  if ! "$nvcc" "${flags[@]}" -Xptxas -v -c "$s" -o "$o.tmp" >"$log" 2>&1; then
    cat "$log" >&2
    echo "build_cutlass_probe: $s failed" >&2
    return 1
  fi
  mv "$o.tmp" "$o"
  local regs
  regs=$(grep -E "Used [0-9]+ registers|spill" "$log" | sed -E 's/ptxas info *: //' | tr -s ' ' | paste -sd ';' -)
  echo "  $(basename "$s"): $(( $(date +%s) - t0 )) s; ${regs:-no kernel}"
  if grep -q C7510 "$log"; then echo "  WARNING: $(basename "$s"): ptxas serialized wgmma (C7510), see $log"; fi
}
export -f compile_one
export nvcc obj
export flags_str="${flags[*]}"

if [ ${#todo[@]} -gt 0 ]; then
  echo "build_cutlass_probe: compiling ${#todo[@]} translation unit(s), $jobs at a time (CUTLASS $cutlass_version)"
  t0=$(date +%s)
  # Arrays do not cross into xargs' shells: rebuild `flags` there from its string (no spaces in paths).
  printf '%s\n' "${todo[@]}" |
    xargs -P "$jobs" -I{} bash -c 'flags=($flags_str); compile_one "$1"' _ {}
  echo "build_cutlass_probe: compiled in $(( $(date +%s) - t0 )) s"
fi

# Link: the static CUDA runtime (no libcudart.so needed next to it), and only the C API exported.
mkdir -p "$(dirname "$out")"
cat >"$obj/exports.map" <<'EOF'
{ global: epmoe_cutlass_probe_*; local: *; };
EOF
objs=()
for s in "${srcs[@]}"; do objs+=("$obj/$(basename "${s%.cu}").o"); done
"$nvcc" -gencode=arch=compute_90a,code=sm_90a -shared -cudart static -Xcompiler -fPIC \
  -Xlinker --version-script="$obj/exports.map" -Xlinker --exclude-libs,ALL -Xlinker --no-undefined \
  "${objs[@]}" -o "$out.tmp"
strip --strip-unneeded "$out.tmp"
mv "$out.tmp" "$out"
echo "build_cutlass_probe: $out ($(du -h "$out" | cut -f1))"
