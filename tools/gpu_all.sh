#!/usr/bin/env bash
# On the GPU machine: every GPU test and the key benchmarks in one call, each step under a time
# limit, logs under $OUT (or ./gpu-logs). Binaries come from tools/stage_gpu.sh.
# Usage: bash tools/gpu_all.sh [quick|full|single|profile|profile-fused|probe|ab|ab-ranks|diag|sanitize|ranks|trace|peer-gemm|peer-ab|gemm-peer-turns|decode-gemm|layer-peer|e2e-stats|validate]   (quick skips the long benchmarks; profile
# runs only the GPU check and an ncu profile of the FP8 L2 and L1 GEMM kernels at the first large
# shape, (8, 4096, 4096, 7168); ab times this build against an older one staged by
# tools/stage_ab.sh, alternating in one call (ab-ranks: the same at R = every local GPU, both
# shapes, decode to throughput token counts, with a table); profile-fused profiles the fused kernel and the L1
# GEMM on one GPU; diag: decode timing with and without graphs, an nsys trace, clock samples;
# sanitize: racecheck and synccheck on the GEMM tests that reuse stages, then racecheck, synccheck
# and memcheck on both layer paths at R = 1 (small cases); single: everything that
# runs on one GPU, for the one-GPU kinds; trace: per-block timelines of the comm phases and the
# megakernel at 0 / 1 / 128 tokens on every local GPU, from the trace build that
# EPMOE_STAGE_TRACE=1 bash tools/stage_gpu.sh adds as epmoe-bench-trace; probe: the wgmma
# structure probe twice, then ncu's shared-memory traffic of its fed and unfed variants and of the
# FP8 L2 and L1 GEMM kernels at (8, 4096, 4096, 7168))
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
bin=${EPMOE_BIN:-.gpu/bin}
final=${OUT:-gpu-logs}
mkdir -p "$final"
# Why a scratch folder and one archive: the device tool brings back at most 8 files.
out=$(mktemp -d /tmp/epmoe-logs.XXXXXX)
# Never NVLink multicast: it can take the host's shared GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The system libnccl on these machines is 2.28.3 (ABI-incompatible); the 2.28.9 one is in torch's venv.
good_nccl=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$good_nccl" ] && export LD_LIBRARY_PATH=$good_nccl:${LD_LIBRARY_PATH:-}
summary=()
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  { [ -x "${1}" ] || command -v "${1}" >/dev/null; } || { summary+=("$name: SKIPPED (no ${1})"); return; }
  [ "$name" != python_binding ] || [ -f "$bin/libepmoe_c.so" ] || { summary+=("$name: SKIPPED (no libepmoe_c.so)"); return; }
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local verdict; verdict=$([ $rc = 0 ] && echo ok || echo "FAILED rc=$rc")
  # Why: a test that finds too few GPUs exits 0 after printing SKIPPED; it must not read as passed.
  [ $rc = 0 ] && grep -q '^SKIPPED' "$out/$name.log" && verdict="SKIPPED (see its log)"
  summary+=("$name: $verdict ($((SECONDS - t0)) s)")
  tail -n 25 "$out/$name.log"
  save
}
# Why after every step: if the whole call is killed at the device tool's limit, what ran so far
# still comes back.
save() {
  printf '%s\n' "${summary[@]}" >"$out/summary.log"
  cp "$out/summary.log" "$final/summary.log"
  tar czf "$final/gpu-logs.tgz" -C "$out" .
}
# An ncu report (from a step's -o "$out/NAME") as text sections and a per-instruction SASS CSV.
ncu_export() {
  local name=$1
  [ -f "$out/$name.ncu-rep" ] || return 0
  "$ncu_bin" --import "$out/$name.ncu-rep" --print-details all >"$out/$name.txt" 2>&1
  "$ncu_bin" --import "$out/$name.ncu-rep" --page source --print-source sass --csv >"$out/${name}_sass.csv" 2>&1
  rm -f "$out/$name.ncu-rep"
  save
}
finish() {
  echo "==== summary ($mode) ===="
  printf '%s\n' "${summary[@]}"
  save
  exit 0
}
ncu_bin=$(command -v ncu || true)
# The e2e subset that the multi-rank modes run (both paths of each case).
e2e_subset=$(echo Dsv3Fp8ManyTokens:Qwen3Fp8:Qwen3Bf16:ZipfFp8:AllTokensToOneRank:ZeroTokensOnOneRank:UnequalTokens:CudaGraphReplay:FusedDeferredEpilogueFp8:ThousandCallsFreshRouting |
  tr ':' '\n' | sed 's/^/LayerE2E*./' | paste -sd:)
# ncu's options for a GEMM kernel profile (one launch after three warm-ups; text sections and the
# per-instruction stall samples).
ncu_gemm=(--clock-control none --kernel-name-base mangled -c 1 --launch-skip 3 --section SpeedOfLight
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats
          --section SchedulerStats --section SourceCounters --import-source no)
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm --format=csv >"$out/nvidia-smi.log" 2>&1
step gpu_check 120 "$bin/epmoe-gpu-check"
if [ "$mode" = ab ]; then
  # The key benchmarks of this build and of an older one (tools/stage_ab.sh <commit> put it in
  # $bin/epmoe-bench-old), alternating, two rounds: GEMMs, then the layer (both paths, bf16 and
  # fp32 combine partials).
  # EPMOE_AB_TESTS=1: first the GEMM tests and, at R = 1, the layer tests of both paths on the new
  # build (a change is timed only once it computes the right thing). EPMOE_AB_GEMM_ARGS: extra
  # arguments of the GEMM benchmark (e.g. --dtype fp8). EPMOE_AB_PROFILE_COMM=1: then an ncu
  # profile of the new build's dispatch and combine kernels.
  [ -x "$bin/epmoe-bench-old" ] || { echo "gpu_all.sh ab: no $bin/epmoe-bench-old (run tools/stage_ab.sh <commit> here first)"; exit 2; }
  if [ "${EPMOE_AB_TESTS:-0}" = 1 ]; then
    step gpu_tests 300 "$bin/epmoe_gpu_tests" --gtest_brief=1
    export EPMOE_TEST_RANKS=1
    step r1_layer_tests 300 "$bin/epmoe_mgpu_tests" --gtest_brief=1 --gtest_filter='LayerE2E.*:LayerE2EFused.*:DispatchCombine.*'
    unset EPMOE_TEST_RANKS
  fi
  for round in 1 2; do
    for v in new old; do
      b="$bin/epmoe-bench"; [ "$v" = old ] && b="$bin/epmoe-bench-old"
      # shellcheck disable=SC2086
      step "ab_gemm_${v}_$round" 150 "$b" gemm ${EPMOE_AB_GEMM_ARGS:-}
    done
    for v in new old; do
      b="$bin/epmoe-bench"; [ "$v" = old ] && b="$bin/epmoe-bench-old"
      step "ab_layer_${v}_$round" 90 "$b" layer --path pipeline,fused --tokens 1,128,1024,4096,8192 --partials bf16
      step "ab_layer_fp32p_${v}_$round" 90 "$b" layer --path pipeline,fused --tokens 128,4096
    done
  done
  if [ "${EPMOE_AB_PROFILE_COMM:-0}" = 1 ]; then
    # The new build's dispatch and combine kernels at R = 1 and 4096 tokens (FP8, bf16 partials):
    # throughput, memory and stall sections as text, per-instruction stall samples as CSV.
    for kernel in dispatch combine; do
      step "ncu_r1_$kernel" 200 "${ncu_bin:-/nonexistent/ncu}" --clock-control none --kernel-name-base mangled \
        -k "regex:sm90_${kernel}_kernel" -c 1 --launch-skip 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section SourceCounters --import-source no \
        -o "$out/ncu_r1_$kernel" "$bin/epmoe-bench" layer --ranks 1 --path pipeline --tokens 4096 --partials bf16 \
        --graph 0 --iters 2 --warmup 1 --sets 1
      ncu_export "ncu_r1_$kernel"
    done
  fi
  finish
fi
# The peers (../shared/peers, copied to .gpu/peers by tools/stage_gpu.sh): DeepGEMM's grouped FP8
# GEMM and torch/DeepGEMM bf16 beside epmoe-bench gemm in the same call, EPMOE_PEER_ROUNDS rounds
# (default 2), then (EPMOE_PEER_NCU=1, default) an ncu profile of DeepGEMM's kernel and of our FP8 L2
# and L1 kernels at (8,4096,4096,7168), each with SourceCounters exported per SASS instruction.
peer_setup() {
  [ -d .gpu/peers/wheels ] || { echo "gpu_all.sh: no .gpu/peers (tools/stage_gpu.sh copies ../shared/peers)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .gpu/peers/wheels/*.whl >/dev/null 2>&1 || return 1
  export PYTHONPATH=/tmp/peers${PYTHONPATH:+:$PYTHONPATH} CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
}
# The FP8 accuracy statistics at EPMOE_TEST_RANKS (default 1): the disabled evidence tests (per-call
# rel_l2 quantiles against the float64 reference and against the kernel-consistent one, fused ==
# pipeline on every call), then EPMOE_E2E_REPEATS (default 100) repeats of the small cases, in the
# same rank processes (tests/e2e/test_layer.cpp: no fork and NCCL bootstrap per repeat).
if [ "$mode" = e2e-stats ]; then
  export EPMOE_TEST_RANKS=${EPMOE_TEST_RANKS:-1}
  # Why unset: the binary reads EPMOE_E2E_REPEATS itself, and it is meant for the second step only.
  repeats=${EPMOE_E2E_REPEATS:-100}
  unset EPMOE_E2E_REPEATS
  step e2e_evidence "${EPMOE_EVIDENCE_LIMIT:-240}" "$bin/epmoe_mgpu_tests" --gtest_also_run_disabled_tests \
    --gtest_filter="${EPMOE_EVIDENCE_FILTER:-LayerE2EEvidence.*}"
  EPMOE_E2E_REPEATS=$repeats step e2e_small_repeats "${EPMOE_REPEAT_LIMIT:-300}" "$bin/epmoe_mgpu_tests" \
    --gtest_brief=1 --gtest_filter='LayerE2E*.Small*:LayerE2E*.UnequalTokens'
  finish
fi
if [ "$mode" = peer-gemm ]; then
  peer_setup || { summary+=("peer_setup: FAILED"); finish; }
  shapes=${EPMOE_PEER_SHAPES:-8,4096,4096,7168 8,4096,7168,2048 32,1024,4096,7168 32,1024,7168,2048}
  shape_args=(); for sh in $shapes; do shape_args+=(--shape "$sh"); done
  for round in $(seq 1 "${EPMOE_PEER_ROUNDS:-2}"); do
    # shellcheck disable=SC2086
    step "deepgemm_fp8_$round" 300 python3 .gpu/peers/deepgemm_gemm.py $shapes
    step "epmoe_gemm_fp8_$round" 200 "$bin/epmoe-bench" gemm --dtype fp8 "${shape_args[@]}"
    if [ "${EPMOE_PEER_BF16:-1}" = 1 ]; then
      # shellcheck disable=SC2086
      step "peer_bf16_$round" 300 python3 .gpu/peers/bf16_grouped.py $shapes
      step "epmoe_gemm_bf16_$round" 200 "$bin/epmoe-bench" gemm --dtype bf16 "${shape_args[@]}"
    fi
  done
  if [ "${EPMOE_PEER_NCU:-1}" = 1 ]; then
    prof=("${ncu_gemm[@]}" --section LaunchStats --section Occupancy)
    step ncu_deepgemm 300 "${ncu_bin:-/nonexistent/ncu}" "${prof[@]}" -k "regex:sm90_fp8_gemm_1d2d" \
      -o "$out/ncu_deepgemm" python3 .gpu/peers/deepgemm_gemm.py 8,4096,4096,7168
    ncu_export ncu_deepgemm
    # E1: the L2 kernel (bf16 out), E3: the L1 kernel (SwiGLU + FP8 requant), Sm90Epilogue's order.
    for e in E1 E3; do
      step "ncu_ours_$e" 300 "${ncu_bin:-/nonexistent/ncu}" "${prof[@]}" -k "regex:ILb1ELNS0_12Sm90Epilogue${e}ELi4EE" \
        -o "$out/ncu_ours_$e" "$bin/epmoe-bench" gemm --dtype fp8 --iters 1 --shape 8,4096,4096,7168
      ncu_export "ncu_ours_$e"
    done
  fi
  finish
fi
# peer-ab: the GEMM tests, then EPMOE_PEER_ROUNDS rounds (default 3) of DeepGEMM's grouped FP8
# GEMM, this build's and an older build's (tools/stage_ab.sh) FP8 GEMMs at the same shapes,
# alternating, then (EPMOE_PEER_NCU=1, default) ncu of this build's FP8 L2 and L1 kernels.
if [ "$mode" = peer-ab ]; then
  peer_setup || { summary+=("peer_setup: FAILED"); finish; }
  step gpu_tests 300 "$bin/epmoe_gpu_tests" --gtest_brief=1
  shapes=${EPMOE_PEER_SHAPES:-8,4096,4096,7168 8,4096,7168,2048 32,1024,4096,7168 32,1024,7168,2048}
  shape_args=(); for sh in $shapes; do shape_args+=(--shape "$sh"); done
  for round in $(seq 1 "${EPMOE_PEER_ROUNDS:-3}"); do
    # shellcheck disable=SC2086
    step "deepgemm_fp8_$round" 300 python3 .gpu/peers/deepgemm_gemm.py $shapes
    step "new_gemm_fp8_$round" 200 "$bin/epmoe-bench" gemm --dtype fp8 "${shape_args[@]}"
    [ -x "$bin/epmoe-bench-old" ] && step "old_gemm_fp8_$round" 200 "$bin/epmoe-bench-old" gemm --dtype fp8 "${shape_args[@]}"
  done
  if [ "${EPMOE_PEER_NCU:-1}" = 1 ]; then
    prof=("${ncu_gemm[@]}")
    for e in E1 E3; do
      step "ncu_ours_$e" 300 "${ncu_bin:-/nonexistent/ncu}" "${prof[@]}" -k "regex:ILb1ELNS0_12Sm90Epilogue${e}ELi4EE" \
        -o "$out/ncu_ours_$e" "$bin/epmoe-bench" gemm --dtype fp8 --iters 1 --shape 8,4096,4096,7168
      ncu_export "ncu_ours_$e"
    done
  fi
  finish
fi
# gemm-peer-turns: python/benchmarks/gemm_vs_deepgemm.py, which runs DeepGEMM's grouped FP8 GEMM and
# this build's FP8 L2 and L1 kernels (libepmoe_gemm_ctypes.so) in one process on the same tensors,
# checks the outputs against an fp32 reference and times the kernels in turns; once with randn data
# and once with random e4m3 codes. EPMOE_TURNS_ARGS: more arguments (shapes G,M,N,K, --zipf,
# --decode, --rounds, --iters). EPMOE_TURNS_TESTS=1: the GEMM tests first.
if [ "$mode" = decode-gemm ]; then
  # One GPU: the GEMMs of a decode call (one m-block per active expert, so fewer tiles than SMs)
  # beside DeepGEMM's, in turns on the same tensors with CUDA graphs, then ncu of both kernels at
  # (8,8,1536,2048) (docs/DESIGN.md, "Decode latency": DeepGEMM picks 16-column tiles with 12 stages
  # there). EPMOE_DECODE_SHAPES overrides the shapes.
  peer_setup || { summary+=("peer_setup: FAILED"); finish; }
  shapes=${EPMOE_DECODE_SHAPES:-8,8,1536,2048 8,8,2048,768 2,8,1536,2048 8,8,4096,7168 8,8,7168,2048}
  # shellcheck disable=SC2086
  step decode_turns 330 python3 python/benchmarks/gemm_vs_deepgemm.py --no-kernel-list --graph on \
    --lib "$bin/libepmoe_gemm_ctypes.so" --json "$out/decode_turns.json" $shapes
  prof=("${ncu_gemm[@]}" --section LaunchStats --section Occupancy)
  step ncu_decode_deepgemm 200 "${ncu_bin:-/nonexistent/ncu}" "${prof[@]}" -k "regex:sm90_fp8_gemm_1d2d" \
    -o "$out/ncu_decode_deepgemm" python3 .gpu/peers/deepgemm_gemm.py 8,8,1536,2048
  ncu_export ncu_decode_deepgemm
  step ncu_decode_ours 200 "${ncu_bin:-/nonexistent/ncu}" "${prof[@]}" -k "regex:ILb1ELNS0_12Sm90EpilogueE1ELi4EE" \
    -o "$out/ncu_decode_ours" "$bin/epmoe-bench" gemm --dtype fp8 --iters 1 --shape 8,8,1536,2048
  ncu_export ncu_decode_ours
  finish
fi
if [ "$mode" = gemm-peer-turns ]; then
  peer_setup || { summary+=("peer_setup: FAILED"); finish; }
  [ "${EPMOE_TURNS_TESTS:-0}" = 1 ] && step gpu_tests 300 "$bin/epmoe_gpu_tests" --gtest_brief=1
  # Why a longer limit for the first: DeepGEMM compiles its kernel for each shape on first use.
  for data in randn codes; do
    limit=180; [ "$data" = randn ] && limit=330
    # shellcheck disable=SC2086
    step "gemm_turns_$data" "$limit" python3 python/benchmarks/gemm_vs_deepgemm.py --data "$data" \
      --lib "$bin/libepmoe_gemm_ctypes.so" --json "$out/gemm_turns_$data.json" ${EPMOE_TURNS_ARGS:-}
  done
  # The BF16 kernels beside torch._grouped_mm (and DeepGEMM's bf16 GEMM), in turns (EPMOE_BF16_TURNS=0
  # skips them).
  [ "${EPMOE_BF16_TURNS:-1}" = 1 ] && step bf16_turns 240 python3 python/benchmarks/bf16_gemm_turns.py \
    --lib "$bin/libepmoe_gemm_ctypes.so" --json "$out/bf16_turns.json"
  finish
fi
if [ "$mode" = single ]; then
  # One GPU (nvidia-h200 / nvidia-h100-x1): the unit and GEMM tests; at R = 1 the whole e2e matrix
  # of both paths, the bad-input case, the dispatch/combine routings and the 10,000-call soak (every
  # kernel runs, the megakernel's ordering between its own blocks included; no NVLink traffic); the
  # Python package on one rank; then the GEMM benchmark and the layer at R = 1 with the megakernel's
  # epilogue variant chosen per call, forced inline, forced deferred.
  step unit_tests 120 "$bin/epmoe_unit_tests" --gtest_brief=1
  step gpu_tests 300 "$bin/epmoe_gpu_tests" --gtest_brief=1
  export EPMOE_TEST_RANKS=1
  step r1_fused 240 "$bin/epmoe_mgpu_tests" --gtest_brief=1 --gtest_filter='LayerE2EFused.*'
  step r1_pipeline_comm 240 "$bin/epmoe_mgpu_tests" --gtest_brief=1 --gtest_filter='LayerE2E.*:DispatchCombine.*Routings:LayerWorkspace.*'
  step r1_soak 300 "$bin/epmoe_mgpu_tests" --gtest_brief=1 --gtest_filter='LayerSoak.*'
  unset EPMOE_TEST_RANKS
  # The Python package (the wheel that stage_gpu.sh built) on one rank.
  whl=$(ls "$bin"/epmoe-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    step python_binding 150 /bin/bash python/tests/gpu_run.sh --wheel "$whl" 1
  else
    step python_binding 150 /bin/bash python/tests/gpu_run.sh "$bin/libepmoe_c.so" 1
  fi
  step bench_gemm 150 "$bin/epmoe-bench" gemm
  # The cp.async row-gather feed (why gathered FP8 L1 was dropped, docs/DESIGN.md), a few seconds.
  step gather_probe 60 "$bin/epmoe-gather-probe"
  for v in auto inline deferred; do
    [ "$v" = auto ] && unset EPMOE_FUSED_EPILOGUE || export EPMOE_FUSED_EPILOGUE=$v
    step "r1_layer_fp8_$v" 90 "$bin/epmoe-bench" layer --ranks 1 --path pipeline,fused \
      --tokens 1,8,128,1024,4096,8192 --partials bf16
  done
  unset EPMOE_FUSED_EPILOGUE
  step r1_layer_bf16 90 "$bin/epmoe-bench" layer --ranks 1 --path pipeline,fused --dtype bf16 --tokens 128,4096 --partials bf16
  finish
fi
# layer-peer: every local GPU as one rank: the e2e subset of `ranks` (both paths) and the
# dispatch/combine routings, then the layer beside the MegaMoE peer (megamoe_layer.py, which runs
# the peer, epmoe's pipeline and fused paths in one process group) at R = all GPUs and R = 2, DSV3
# slice (EPMOE_PEER_TOKENS) and the Qwen3-like shape.
# validate: where decode time goes (the layer at 0 / 1 / 8 / 128 tokens per rank, both paths, with
# the per-stage split, DSV3 slice and Qwen3-like shape), then a tree's multi-rank checks on every
# local GPU: the torch operator, the fault tests at R and at R = 2, the e2e subset, the
# dispatch/combine routings and the Python package (the order puts the short steps first).
if [ "$mode" = validate ]; then
  R=$(nvidia-smi -L 2>/dev/null | wc -l)
  whl=$(ls "$bin"/epmoe-*.whl 2>/dev/null | head -1)
  for shape in dsv3 qwen3; do
    step "decode_${shape}_r$R" 120 "$bin/epmoe-bench" layer --ranks "$R" --shape "$shape" --path pipeline,fused \
      --tokens 0,1,8,128 --partials bf16
  done
  [ -n "$whl" ] && EPMOE_GPU_TEST=python/tests/gpu_test_torch.py step "torch_op_r$R" 240 \
    bash python/tests/gpu_run.sh --wheel "$whl" "$R"
  # The same on the C++ eager path (epmoe.torch.load_fast_path, built first: ~30 s).
  [ -n "$whl" ] && EPMOE_TORCH_FAST_PATH=1 CXX=/usr/bin/g++ CUDA_HOME=/usr/local/cuda \
    EPMOE_GPU_TEST=python/tests/gpu_test_torch.py step "torch_op_fast_r$R" 300 \
    bash python/tests/gpu_run.sh --wheel "$whl" "$R"
  EPMOE_TEST_RANKS=$R step "ranks${R}_faults" 300 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerFaults.*:CollectiveChecks.*'
  EPMOE_TEST_RANKS=$R step "ranks${R}_e2e" 240 "$bin/epmoe_mgpu_tests" --gtest_filter="$e2e_subset"
  EPMOE_TEST_RANKS=$R step "ranks${R}_dispatch_combine" 120 "$bin/epmoe_mgpu_tests" \
    --gtest_filter='DispatchCombine.Fp8AllRoutings:DispatchCombine.Bf16PartialsAllRoutings'
  EPMOE_TEST_RANKS=$R step "ranks${R}_workspace" 200 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerWorkspace.*'
  [ "$R" -gt 2 ] && EPMOE_TEST_RANKS=2 step ranks2_faults 300 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerFaults.*:CollectiveChecks.*'
  [ -n "$whl" ] && step "python_r$R" 240 bash python/tests/gpu_run.sh --wheel "$whl" "$R"
  finish
fi
if [ "$mode" = layer-peer ]; then
  R=$(nvidia-smi -L 2>/dev/null | wc -l)
  whl=$(ls "$bin"/epmoe-*.whl 2>/dev/null | head -1)
  peer_setup && python3 -m pip install -q --no-index --no-deps --target /tmp/peers "$whl" >/dev/null 2>&1 ||
    { summary+=("peer_setup: FAILED"); finish; }
  if [ "${EPMOE_PEER_TESTS:-1}" = 1 ]; then
    EPMOE_TEST_RANKS=$R step "ranks${R}_e2e" 240 "$bin/epmoe_mgpu_tests" --gtest_filter="$e2e_subset"
    EPMOE_TEST_RANKS=$R step "ranks${R}_dispatch_combine" 120 "$bin/epmoe_mgpu_tests" \
      --gtest_filter='DispatchCombine.Fp8AllRoutings:DispatchCombine.Bf16PartialsAllRoutings'
    EPMOE_TEST_RANKS=$R step "ranks${R}_faults" 300 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerFaults.*:CollectiveChecks.*'
    [ "$R" -gt 2 ] && EPMOE_TEST_RANKS=2 step ranks2_faults 300 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerFaults.*:CollectiveChecks.*'
  fi
  tokens=${EPMOE_PEER_TOKENS:-1,128,1024,4096,8192}
  step "layer_peer_r${R}" 200 torchrun --standalone --nproc-per-node "$R" .gpu/peers/megamoe_layer.py --shape dsv3 --tokens "$tokens"
  step "layer_peer_r${R}_qwen3" 120 torchrun --standalone --nproc-per-node "$R" .gpu/peers/megamoe_layer.py --shape qwen3
  # A plain PyTorch expert-parallel layer (BF16, all_to_all_single + torch._grouped_mm) beside
  # epmoe's paths in FP8 and BF16, same shape and token counts.
  step "torch_ep_r${R}" 300 torchrun --standalone --nproc-per-node "$R" python/benchmarks/torch_ep_layer.py \
    --shape dsv3 --tokens "$tokens"
  [ "$R" -gt 2 ] && step layer_peer_r2 150 torchrun --standalone --nproc-per-node 2 .gpu/peers/megamoe_layer.py --shape dsv3 --tokens 1,128,4096
  finish
fi
if [ "$mode" = ranks ]; then
  # Every local GPU as one rank (the 4- and 8-GPU kinds): a subset of the e2e matrix and the
  # dispatch/combine routings with EPMOE_TEST_RANKS = R, then the layer (DSV3 slice with 32
  # experts per rank, and the full DSV3 with 256 experts over the ranks) and comm benchmarks.
  R=$(nvidia-smi -L 2>/dev/null | wc -l)
  export EPMOE_TEST_RANKS=$R
  step "ranks${R}_e2e" 240 "$bin/epmoe_mgpu_tests" --gtest_filter="$e2e_subset"
  step "ranks${R}_dispatch_combine" 120 "$bin/epmoe_mgpu_tests" \
    --gtest_filter='DispatchCombine.Fp8AllRoutings:DispatchCombine.Bf16PartialsAllRoutings'
  step "ranks${R}_workspace" 200 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerWorkspace.*'
  unset EPMOE_TEST_RANKS
  step "ranks${R}_bench_layer" 90 "$bin/epmoe-bench" layer --ranks "$R" --path pipeline,fused \
    --tokens 1,128,1024,4096,8192 --partials bf16
  step "ranks${R}_bench_layer_dsv3full" 90 "$bin/epmoe-bench" layer --ranks "$R" --shape dsv3full \
    --path pipeline,fused --tokens 1,128,4096 --partials bf16
  step "ranks${R}_bench_comm" 120 "$bin/epmoe-bench" comm --ranks "$R" --tokens 128,4096
  finish
fi
if [ "$mode" = ab-ranks ]; then
  # Every local GPU as one rank: this build against an older one (tools/stage_ab.sh <commit> put it
  # in $bin/epmoe-bench-old), both paths, from decode to throughput token counts, the builds in
  # turns, two rounds; then tools/ab_table.py's table of the per-rank medians (ab_table.txt, and in
  # the summary). First the e2e small cases at this R on the new build (a change is timed only once
  # it computes the right thing; EPMOE_AB_TESTS=0 skips them). EPMOE_AB_QWEN3_TOKENS,
  # EPMOE_AB_DSV3_TOKENS: the token counts.
  [ -x "$bin/epmoe-bench-old" ] || { echo "gpu_all.sh ab-ranks: no $bin/epmoe-bench-old (run tools/stage_ab.sh <commit> here first)"; exit 2; }
  R=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${R:-0}" -ge 1 ] 2>/dev/null || R=1
  if [ "${EPMOE_AB_TESTS:-1}" = 1 ]; then
    EPMOE_TEST_RANKS=$R step "ab_tests_r$R" 150 "$bin/epmoe_mgpu_tests" \
      --gtest_filter='LayerE2E.Small*:LayerE2E.UnequalTokens:LayerE2E.ZeroTokensOnOneRank:LayerE2EFused.UnequalTokens:LayerE2EFused.AlternatingPaths'
  fi
  for round in 1 2; do
    for v in new old; do
      b="$bin/epmoe-bench"; [ "$v" = old ] && b="$bin/epmoe-bench-old"
      step "ab_qwen3_${v}_$round" 60 "$b" layer --ranks "$R" --shape qwen3 --path pipeline,fused \
        --tokens "${EPMOE_AB_QWEN3_TOKENS:-0,1,8,128,1024}" --partials bf16 --iters 30
      step "ab_dsv3_${v}_$round" 90 "$b" layer --ranks "$R" --path pipeline,fused \
        --tokens "${EPMOE_AB_DSV3_TOKENS:-0,1,2,128,4096}" --partials bf16 --iters 20
    done
  done
  python3 tools/ab_table.py "$out"/ab_qwen3_*.log "$out"/ab_dsv3_*.log >"$out/ab_table.txt" 2>&1
  cat "$out/ab_table.txt"
  while IFS= read -r line; do summary+=("$line"); done <"$out/ab_table.txt"
  finish
fi
if [ "$mode" = trace ]; then
  # device/debug/diag_trace.cuh: each run prints, per trace point, how many blocks reached it and
  # when (min / median / max over blocks) in the last call of each kernel. One path per run, so the
  # printed call is that path's.
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${ngpu:-0}" -ge 1 ] 2>/dev/null || ngpu=1
  for T in ${EPMOE_TRACE_TOKENS:-0 1 128}; do
    for path in pipeline fused; do
      step "trace_${path}_$T" 90 "$bin/epmoe-bench-trace" layer --ranks "$ngpu" --path "$path" --tokens "$T" --partials bf16
    done
  done
  finish
fi
if [ "$mode" = diag ]; then
  # Where decode time goes and what the clocks do: the layer at 0-128 tokens with and without
  # CUDA graphs, an nsys kernel trace of the decode calls (if nsys is installed), and nvidia-smi
  # clock/power samples every 100 ms during the GEMM benchmark and the 4096-token layer.
  step diag_layer_decode 90 "$bin/epmoe-bench" layer --path pipeline,fused --tokens 0,1,8,128 --partials bf16
  step diag_layer_decode_nograph 90 "$bin/epmoe-bench" layer --path pipeline,fused --tokens 0,1,8,128 --partials bf16 --graph 0
  reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
    --format=csv -lms 100 >"$out/smi_trace.log" 2>&1 &
  smi=$!
  step diag_gemm 150 "$bin/epmoe-bench" gemm --dtype fp8
  step diag_layer_4096 90 "$bin/epmoe-bench" layer --path pipeline,fused --tokens 4096 --partials bf16
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  nsys_bin=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)
  if [ -n "$nsys_bin" ]; then
    step diag_nsys 150 "$nsys_bin" profile -t cuda --cuda-graph-trace=node --trace-fork-before-exec=true -f true -o "$out/nsys_decode" \
      "$bin/epmoe-bench" layer --path pipeline,fused --tokens 1,128 --partials bf16 --iters 20
    for f in "$out"/nsys_decode*.nsys-rep; do
      [ -f "$f" ] || continue
      "$nsys_bin" stats -q --report cuda_gpu_trace --format csv -o "${f%.nsys-rep}" "$f" >/dev/null 2>&1
      rm -f "$f" "${f%.nsys-rep}.sqlite"
    done
    save
  else
    summary+=("diag_nsys: SKIPPED (no nsys)")
  fi
  finish
fi
if [ "$mode" = sanitize ]; then
  # compute-sanitizer racecheck and synccheck on GEMM tests that reuse ring stages and run the
  # deferred epilogues (docs/DEVELOPING.md: one known racecheck report on the FP8 scale loads
  # against the warp-delegated stage release). In a block without full L2 tiles the storer waits
  # the whole kernel in one bounded (10 s) wait: keep the cases small under the sanitizer.
  san=$(command -v compute-sanitizer || echo /nonexistent/compute-sanitizer)
  filter='*fp8_L2_H384_I640*:*fp8_L1_H384_I640*:*bf16_L2_H384_I640*:GemmPlanLaunch.*:GemmManyTilesPerBlock.*'
  step san_racecheck 150 "$san" --tool racecheck "$bin/epmoe_gpu_tests" --gtest_filter="$filter"
  step san_synccheck 150 "$san" --tool synccheck "$bin/epmoe_gpu_tests" --gtest_filter="$filter"
  # Both layer paths at R = 1 on the small sanitizer-sized cases (tests/e2e/test_layer.cpp): the
  # megakernel's smem tile slots, mbarriers and named barriers (racecheck, synccheck) and every
  # kernel's global accesses (memcheck). One GPU: under the sanitizer a second rank's kernel would
  # wait on this one's far longer than at full speed.
  lfilter='LayerE2E*.Small*TwoCalls'
  EPMOE_TEST_RANKS=1 step san_layer_racecheck 200 "$san" --tool racecheck "$bin/epmoe_mgpu_tests" --gtest_filter="$lfilter"
  EPMOE_TEST_RANKS=1 step san_layer_synccheck 200 "$san" --tool synccheck "$bin/epmoe_mgpu_tests" --gtest_filter="$lfilter"
  EPMOE_TEST_RANKS=1 step san_layer_memcheck 200 "$san" --tool memcheck --leak-check no "$bin/epmoe_mgpu_tests" --gtest_filter="$lfilter"
  # Why counted apart: memcheck's error summary also counts the CUDA API errors that NCCL's own
  # probes hit at communicator creation (no kernel image for some of its kernels, cuMemCreate not
  # permitted); only device-side reports are ours.
  if [ -f "$out/san_layer_memcheck.log" ]; then
    n=$(grep -cE 'Invalid (__global__|__shared__|__local__)|Misaligned|out of bounds|Hardware Exception|Unspecified' \
        "$out/san_layer_memcheck.log")
    summary+=("san_layer_memcheck device-side reports: $n")
  fi
  finish
fi
if [ "$mode" = profile-fused ]; then
  # One GPU (--ranks 1: no peer to wait for, so ncu can replay the kernel): the fused kernel and
  # the pipeline's L1 GEMM kernel at 4096 tokens (the same per-rank GEMM work as R = 2), sections
  # as text and per-instruction stall samples as CSV. Why: the fused path's L1 phase was measured
  # slower than the pipeline's L1 kernel, and ncu cannot replay the 2-rank kernel.
  # EPMOE_PROFILE_TOKENS (default 4096): the token counts to profile; at <= 128 tokens the
  # pipeline's combine kernel is profiled instead of its L1 kernel (the decode gap is in combine).
  for T in ${EPMOE_PROFILE_TOKENS:-4096}; do
    second=l1:ILb1ELNS0_12Sm90EpilogueE3E
    [ "$T" -le 128 ] && second=combine:combine
    for what in fused:sm90_fused_moe_kernel $second; do
      name=${what%%:*} regex=${what#*:}
      path=pipeline; [ "$name" = fused ] && path=fused
      step "ncu_r1_${name}_$T" 300 "${ncu_bin:-/nonexistent/ncu}" --clock-control none --kernel-name-base mangled \
        -k "regex:$regex" -c 1 --launch-skip 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section SourceCounters --import-source no -o "$out/ncu_r1_${name}_$T" \
        "$bin/epmoe-bench" layer --ranks 1 --path "$path" --tokens "$T" --graph 0 --iters 2 --warmup 1 --sets 1
      ncu_export "ncu_r1_${name}_$T"
    done
  done
  finish
fi
if [ "$mode" = probe ]; then
  step wgmma_probe_1 120 "$bin/epmoe-wgmma-probe" 4000
  step wgmma_probe_2 120 "$bin/epmoe-wgmma-probe" 4000
  # Shared-memory traffic against tensor use: wgmma operand reads (LSU
  # wavefronts of op gmma, 128 B each), TMA fills (xbar2l1tex bytes), both as % of their peaks.
  m=sm__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second
  m+=,sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  m+=,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__sass_data_bytes_mem_shared_op_gmma.sum
  m+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum
  m+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
  m+=,l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum.pct_of_peak_sustained_elapsed
  m+=,lts__t_bytes.sum.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed
  for v in 0 9 10 12 13 14; do
    step "ncu_probe_v$v" 120 "${ncu_bin:-/nonexistent/ncu}" --clock-control none --kernel-name-base mangled \
      -k "regex:ILi${v}EE" -c 1 --metrics "$m" "$bin/epmoe-wgmma-probe" 1000
  done
  for kernel in E1 E3; do
    step "ncu_smem_fp8_$kernel" 200 "${ncu_bin:-/nonexistent/ncu}" --clock-control none --kernel-name-base mangled \
      -k "regex:ILb1ELNS0_12Sm90Epilogue${kernel}E" -c 1 --launch-skip 3 --metrics "$m" \
      "$bin/epmoe-bench" gemm --quick --dtype fp8 --iters 1
  done
  finish
fi
if [ "$mode" = profile ]; then
  # The L2 (plain-epilogue) FP8 kernel, then the L1 one, each at the first shape of --quick (the
  # bench runs 3 warm-up + 5 timed calls per kernel and shape with --iters 1): the sections as
  # text, and the per-instruction stall samples (SourceCounters) as a CSV of the SASS.
  # E1 = the L2 kernel (kStoreBf16Deferred), E3 = the L1 kernel (kSwiGLUDeferred): Sm90Epilogue's order.
  # EPMOE_PROFILE_KERNELS / EPMOE_PROFILE_SHAPE: other kernels (mangled-name regexes) and shape.
  for kernel in ${EPMOE_PROFILE_KERNELS:-ILb1ELNS0_12Sm90EpilogueE1E ILb1ELNS0_12Sm90EpilogueE3E}; do
    step "ncu_fp8_${kernel: -10}" 300 "${ncu_bin:-/nonexistent/ncu}" --clock-control none --kernel-name-base mangled \
      -k "regex:${kernel}" -c 1 --launch-skip 3 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section SourceCounters --import-source no -o "$out/ncu_fp8_${kernel: -10}" \
      "$bin/epmoe-bench" gemm --dtype fp8 --iters 1 --shape "${EPMOE_PROFILE_SHAPE:-8,4096,4096,7168}"
    ncu_export "ncu_fp8_${kernel: -10}"
  done
  finish
fi
step unit_tests 120 "$bin/epmoe_unit_tests" --gtest_brief=1
step gpu_tests 300 "$bin/epmoe_gpu_tests" --gtest_brief=1
# The fused path's suite first and fail-fast: a broken megakernel costs one bounded wait, not one
# per case. Then the benchmark that compares the paths, then everything else.
step mgpu_fused 220 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerE2EFused.*' --gtest_fail_fast
[ "$mode" = full ] && step bench_layer_fp8 60 "$bin/epmoe-bench" layer --path pipeline,fused --tokens 1,8,128,1024,4096,8192
[ "$mode" = full ] && step bench_layer_fp8_bf16p 60 "$bin/epmoe-bench" layer --path pipeline,fused --partials bf16 --tokens 1,8,128,1024,4096,8192
step mgpu_tests 260 "$bin/epmoe_mgpu_tests" --gtest_brief=1 --gtest_filter='-LayerE2EFused.*:LayerSoak.*'
[ "$mode" = full ] && step mgpu_soak 300 "$bin/epmoe_mgpu_tests" --gtest_filter='LayerSoak.*'
whl=$(ls "$bin"/epmoe-*.whl 2>/dev/null | head -1)
if [ -n "$whl" ]; then
  step python_binding 150 /bin/bash python/tests/gpu_run.sh --wheel "$whl"
  # epmoe.torch (the operators, the module, modules on one workspace): compiling takes a while.
  EPMOE_GPU_TEST=python/tests/gpu_test_torch.py EPMOE_TEST_TIMEOUT=600 \
    step python_torch 700 /bin/bash python/tests/gpu_run.sh --wheel "$whl"
  # The same on the C++ eager path (epmoe.torch.load_fast_path; the extension is built first).
  EPMOE_TORCH_FAST_PATH=1 CXX=/usr/bin/g++ CUDA_HOME=/usr/local/cuda EPMOE_GPU_TEST=python/tests/gpu_test_torch.py \
    EPMOE_TEST_TIMEOUT=600 step python_torch_fast 700 /bin/bash python/tests/gpu_run.sh --wheel "$whl"
else
  step python_binding 150 /bin/bash python/tests/gpu_run.sh "$bin/libepmoe_c.so"
fi
if [ "$mode" = full ]; then
  step bench_layer_bf16 150 "$bin/epmoe-bench" layer --path pipeline,fused --dtype bf16 --tokens 128,4096
  step bench_comm 180 "$bin/epmoe-bench" comm
  step bench_gemm 150 "$bin/epmoe-bench" gemm
fi
finish
