"""epmoe's BF16 grouped GEMMs beside torch._grouped_mm (and DeepGEMM's bf16 grouped GEMM when it
imports), in one process, on the same tensors, timed in turns.

    python3 python/benchmarks/bf16_gemm_turns.py [G,M,N,K ...] [--zipf] [--rounds 5] [--iters 20]
        [--lib PATH] [--json PATH]
    python3 python/benchmarks/bf16_gemm_turns.py --dry-run [...]     # no GPU: the plan checks only

Why (issue: BF16 L1 and L2 at >= 0.97x torch._grouped_mm, measured in the same call): the clock
drifts under the power cap by more than the differences measured, so the kernels of a shape take
turns round by round on one stream and one set of inputs (as gemm_vs_deepgemm.py does for FP8).

Per shape (G groups of M rows, N x K weights):
  - inputs: A bf16 randn [rows][K]; B bf16 randn / sqrt(K) [G][N][K]. torch._grouped_mm and DeepGEMM
    read A as it is (groups back to back); epmoe reads the same rows from its pool, each group's
    segment starting at a multiple of 128 rows (a copy when M is not one; the same rows).
  - torch._grouped_mm(A, B^T, offs): the reference every other output is compared with (relative L2
    error over all valid rows, --tol); epmoe's L2 kernel writes bf16 [rows][N]; epmoe's L1 kernel
    takes B as W1 (N = 2I rows, gate then up, prepare_w1 into a second buffer) and writes
    silu(gate) * up (row weight 1) in bf16, compared with the same function of torch's output.
  - --rounds rounds; in each, every kernel runs --iters back-to-back calls between CUDA events, the
    order rotated by one per round. Prints the median TFLOP/s per kernel and the median over the
    rounds of each kernel's ratio to torch._grouped_mm in the same round. FLOPs: 2 x rows x N x K.

The library is libepmoe_gemm_ctypes.so (as gemm_vs_deepgemm.py finds it). Exit status 0, or 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_vs_deepgemm as fp8  # noqa: E402  (the shapes, the pool layout and the ctypes library)

DEFAULT_SHAPES = fp8.DEFAULT_SHAPES


def shapes_from(args) -> list:
    shapes = [fp8.parse_shape(s) for s in (args.shapes or ([] if args.no_defaults else DEFAULT_SHAPES))]
    if args.zipf:
        for n, k in fp8.NK_PAIRS:
            shapes.append(fp8.Shape(f"zipf(32,32768,{n},{k})", fp8.zipf_rows(32, 32768, 1.1), n, k))
    if not shapes:
        raise SystemExit("bf16_gemm_turns: no shapes (--no-defaults without --zipf or G,M,N,K)")
    return shapes


def dry_run(args, shapes) -> int:
    """Plans that must fail on any machine (null pointers, bad n / k) fail with InvalidArgument before
    any CUDA call; the shapes parse."""
    lib = fp8.GemmLib(fp8.find_lib(args.lib))
    if not lib.has_bf16:
        print(f"{lib.path}: no BF16 entry points (an older build)")
        return 1
    bad = 0
    for what, call in (
        ("plan_l2_bf16 null a", lambda: lib.plan_l2_bf16(-1, 1, 8, 8, 128, a=0, b=8, n=128, k=128, out=8)),
        ("plan_l2_bf16 n=100", lambda: lib.plan_l2_bf16(-1, 1, 8, 8, 128, a=8, b=8, n=100, k=128, out=8)),
        ("plan_l1_bf16 n=128", lambda: lib.plan_l1_bf16(-1, 1, 8, 8, 128, x=8, w1=8, w1_internal=8, row_weight=8,
                                                        n=128, k=128, clamp=0.0, a_out=8, stream=0)),
    ):
        try:
            call()
            print(f"  {what}: accepted (expected InvalidArgument)")
            bad += 1
        except fp8.EpmoeError as e:
            ok = e.code == 1
            bad += not ok
            print(f"  {what}: {'ok' if ok else 'WRONG'}: {e}")
    print(f"dry run: {len(shapes)} shapes parsed: {', '.join(s.name for s in shapes)}")
    return 1 if bad else 0


def run_shape(torch, lib, sh, args, stream_ptr, deep_gemm, align) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    g, n, k = len(sh.rows), sh.n, sh.k
    total = sum(sh.rows)
    gen = torch.Generator(device=dev).manual_seed(1234)
    a = torch.randn(total, k, device=dev, generator=gen).bfloat16()
    b = (torch.randn(g, n, k, device=dev, generator=gen) / k ** 0.5).bfloat16()
    ends = torch.tensor([sum(sh.rows[:i + 1]) for i in range(g)], device=dev, dtype=torch.int32)
    # epmoe's pool: the same rows, segments at multiples of `align` (row_align, and DeepGEMM's
    # alignment when it runs on the same pool).
    off, max_rows = fp8.pool_offsets(sh.rows, align)
    pool = torch.zeros(max_rows, k, device=dev, dtype=torch.bfloat16)
    starts = [sum(sh.rows[:i]) for i in range(g)]
    for e in range(g):
        pool[off[e]:off[e] + sh.rows[e]] = a[starts[e]:starts[e] + sh.rows[e]]
    count = torch.tensor(sh.rows, device=dev, dtype=torch.int32)
    offset = torch.tensor(off, device=dev, dtype=torch.int32)
    out_l2 = torch.full((max_rows, n), float("nan"), device=dev, dtype=torch.bfloat16)
    out_l1 = torch.full((max_rows, n // 2), float("nan"), device=dev, dtype=torch.bfloat16)
    w1_internal = torch.empty_like(b)
    ones = torch.ones(max_rows, device=dev, dtype=torch.float32)
    p_l2 = lib.plan_l2_bf16(dev.index, g, count.data_ptr(), offset.data_ptr(), max_rows, a=pool.data_ptr(),
                            b=b.data_ptr(), n=n, k=k, out=out_l2.data_ptr())
    # L1 needs N = 2I with I a multiple of 128 (a 256-column tile holds gate and up of one group).
    p_l1 = None
    if n % 256 == 0:
        p_l1 = lib.plan_l1_bf16(dev.index, g, count.data_ptr(), offset.data_ptr(), max_rows, x=pool.data_ptr(),
                                w1=b.data_ptr(), w1_internal=w1_internal.data_ptr(), row_weight=ones.data_ptr(),
                                n=n, k=k, clamp=0.0, a_out=out_l1.data_ptr(), stream=stream_ptr)
    bt = b.transpose(1, 2)

    def torch_calls(it):
        for _ in range(it):  # (each output dropped at once)
            torch._grouped_mm(a, bt, offs=ends)

    calls = {"torch": torch_calls, "epmoe_l2": lambda it: lib.launch(p_l2, stream_ptr, it)}
    if p_l1 is not None:
        calls["epmoe_l1"] = lambda it: lib.launch(p_l1, stream_ptr, it)
    d_dg = None
    if deep_gemm is not None and hasattr(deep_gemm, "m_grouped_bf16_gemm_nt_contiguous"):
        # DeepGEMM's contiguous layout: each group's rows padded to its alignment, m_indices per row
        # (-1 for padding); its pool is epmoe's when the alignments agree.
        m_idx = torch.full((max_rows,), -1, device=dev, dtype=torch.int32)
        for e in range(g):
            m_idx[off[e]:off[e] + sh.rows[e]] = e
        d_dg = torch.empty(max_rows, n, device=dev, dtype=torch.bfloat16)

        def dg_calls(it):
            for _ in range(it):
                deep_gemm.m_grouped_bf16_gemm_nt_contiguous(pool, b, d_dg, m_idx)
        calls["deepgemm"] = dg_calls
    rec = {"shape": sh.name, "rows": total, "flops": sh.flops, "checks": {}, "tflops": {}, "ratio": {}}
    # Checks, once, against torch's output on every valid row.
    ref = torch._grouped_mm(a, bt, offs=ends)
    for name in calls:
        if name != "torch":
            calls[name](1)
    torch.cuda.synchronize()
    gather = torch.cat([torch.arange(off[e], off[e] + sh.rows[e], device=dev) for e in range(g)])
    refl = ref.float()

    def rel(x, r):
        return float((x.float() - r).norm() / r.norm().clamp_min(1e-30))
    rec["checks"]["epmoe_l2"] = rel(out_l2[gather], refl)
    if p_l1 is not None:
        inter = n // 2
        # L1's reference: silu(gate) * up of torch's product of the user-layout W1 (gate rows first).
        act = torch.nn.functional.silu(refl[:, :inter]) * refl[:, inter:]
        rec["checks"]["epmoe_l1"] = rel(out_l1[gather], act)
    if d_dg is not None:
        rec["checks"]["deepgemm"] = rel(d_dg[gather], refl)
    # Turns.
    names = list(calls)
    times = {nm: [] for nm in names}
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # warm-up
        for nm in names:
            calls[nm](args.iters)
    if args.rounds % len(names):
        # Why: only a multiple of len(names) rounds puts every kernel in every position of the turns
        # (see gemm_vs_deepgemm.py).
        rec["warning"] = (f"{args.rounds} rounds of {len(names)} kernels: positions in the turns not balanced; "
                          f"use a multiple of {len(names)} rounds")
        print("WARNING: " + rec["warning"], flush=True)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for nm in order:
            ev0.record()
            calls[nm](args.iters)
            ev1.record()
            ev1.synchronize()
            times[nm].append(ev0.elapsed_time(ev1) / args.iters)
    for nm in names:
        rec["tflops"][nm] = statistics.median(sh.flops / (ms * 1e9) for ms in times[nm])
        rec["ratio"][nm] = statistics.median(t / m for t, m in zip(times["torch"], times[nm]))
    lib.destroy(p_l2)
    if p_l1 is not None:
        lib.destroy(p_l1)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", metavar="G,M,N,K")
    ap.add_argument("--no-defaults", action="store_true", help="without G,M,N,K: no default shapes (with --zipf)")
    ap.add_argument("--zipf", action="store_true", help="add 32 groups of Zipf(1.1) rows, 32768 in all, at both N,K")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tol", type=float, default=2e-2, help="relative L2 error allowed against torch's output")
    ap.add_argument("--lib", help=f"{fp8.LIB_NAME} (default: as gemm_vs_deepgemm.py finds it)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: plan checks and shapes only")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        raise SystemExit("--rounds and --iters must be >= 1")
    shapes = shapes_from(args)
    if args.dry_run:
        return dry_run(args, shapes)
    import torch
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU (--dry-run checks the plans without one)")
        return 0
    lib = fp8.GemmLib(fp8.find_lib(args.lib))
    if not lib.has_bf16:
        raise SystemExit(f"{lib.path}: no BF16 entry points (an older build); rebuild epmoe_gemm_ctypes")
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 (optional peer)
        deep_gemm = None
    stream_ptr = torch.cuda.current_stream().cuda_stream
    align = lib.row_align
    if deep_gemm is not None:
        import math
        dg_align = int(getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout", lambda: 128)())
        align = align * dg_align // math.gcd(align, dg_align)
    print(f"bf16_gemm_turns on {torch.cuda.get_device_name()}: torch {torch.__version__}, deep_gemm "
          f"{getattr(deep_gemm, '__version__', 'absent')}, commit {fp8.git_commit(lib.path)}; TFLOP/s median of "
          f"{args.rounds} rounds x {args.iters} calls in turns; ratio: median of the per-round ratios to "
          f"torch._grouped_mm")
    failed = False
    records = []
    for sh in shapes:
        rec = run_shape(torch, lib, sh, args, stream_ptr, deep_gemm, align)
        records.append(rec)
        bad = {k: v for k, v in rec["checks"].items() if not v <= args.tol}
        failed |= bool(bad)
        cells = "  ".join(f"{nm} {rec['tflops'][nm]:7.1f} ({rec['ratio'][nm]:.3f})" for nm in rec["tflops"])
        checks = ", ".join(f"{k} {v:.1e}" for k, v in rec["checks"].items())
        print(f"{sh.name:28s} {cells}   rel err vs torch: {checks}{'  FAILED' if bad else ''}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print("all checks passed" if not failed else "a check FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
