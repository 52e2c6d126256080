"""Host time per eager call of torch.ops.epmoe.moe_forward, next to torch's own baselines.

    python python/benchmarks/op_overhead.py                       # 1 GPU (a one-rank layer)
    torchrun --nproc-per-node 2 python/benchmarks/op_overhead.py  # R GPUs (rank 0 prints)
    python python/benchmarks/op_overhead.py --cpu [--profile]     # no GPU: the Python side only

Each row times `--calls` enqueues with time.perf_counter and no synchronization inside the loop
(the GPU runs behind), `--repeats` times after a synchronize and a barrier; the median per call
is printed, with the batches' 10th percentile beside it. The rows split a call of the operator into
its parts:

  torch.empty            torch's allocation of a [T, H] bf16 tensor: the floor of any op that
                         returns a new tensor
  noop op                an operator registered the same way (torch.library define/impl, Python
                         kernel) whose body is one new_empty: torch's dispatcher + Python kernel
  noop custom_op         the same body as a torch.library.custom_op (what epmoe does not use:
                         its Python wrappers cost more per eager call)
  C forward only         epmoe_layer_forward_args through the cached ctypes function, its argument
                         struct filled once: the library's own host time (its kernel launches)
  epmoe op (int32)       torch.ops.epmoe.moe_forward: all of the above plus the argument checks
  MoE module (int32)     the nn.Module around it (nn.Module.__call__ adds its hooks check)
  MoE module (int64)     the same with torch.topk's int64 indices (read as they are, no copy)
  epmoe.Layer(out=)      the DLPack path of epmoe.Layer.__call__, for comparison
  ... [C++]              with --fast-path: the same call with epmoe.torch.load_fast_path()'s C++
                         eager path (built first; the rows alternate with the Python path's)

--cpu replaces the C call by a no-op and runs the CPU tensors through the same code, so the Python
side can be measured and profiled (--profile: cProfile of the op rows) on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402  (before epmoe's library: it must load its own libnccl first)

try:
    import epmoe
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import epmoe
import epmoe.torch as et  # noqa: E402

TARGET_US = 15.0
_bench_lib = torch.library.Library("epmoe_bench", "DEF")
_bench_lib.define("noop(Tensor x, Tensor topk_idx, Tensor topk_weights, int layer, "
                  "str path='pipeline') -> Tensor")


def _noop(x, topk_idx, topk_weights, layer, path="pipeline"):
    return x.new_empty((x.shape[0], x.shape[1]))


@torch.library.custom_op("epmoe_bench::noop_custom_op", mutates_args=())
def _noop_custom_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    layer: int, path: str = "pipeline") -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1]))


def time_calls(fn, calls: int, repeats: int, sync) -> float:
    """Median host microseconds per call of fn() over `repeats` batches of `calls` (the batches'
    10th percentile goes to _P10[fn], printed beside it: the host's own noise moves the median)."""
    for _ in range(min(calls, 20)):
        fn()
    per_call = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    per_call.sort()
    _P10[fn] = per_call[len(per_call) // 10]
    return statistics.median(per_call)


_P10: dict = {}


def report(rows, title, rank=0):
    if rank != 0:
        return
    base = rows[0][1]
    print(title)
    print(f"  {'':28s} {'us/call':>9s} {'p10':>7s} {'x ' + rows[0][0]:>20s}")
    for name, us, p10 in rows:
        print(f"  {name:28s} {us:9.2f} {p10:7.2f} {us / base:20.2f}")


def run_cpu(args) -> int:
    """No GPU: a stand-in layer on device -1 (the CPU), the C call a no-op returning 0."""
    from epmoe.layer import Layer
    layer = object.__new__(Layer)
    layer.config = epmoe.LayerConfig(1, args.experts, args.hidden, args.intermediate, args.topk,
                                     max(args.tokens, 1), args.dtype)
    layer.device, layer._handle = -1, 0x1234
    key = et.register_layer(layer)
    bound = et._registry[key]
    bound.c_forward = lambda *a: 0
    bound.raw_stream = lambda device: 0
    impl = torch.library.Library("epmoe", "IMPL")
    impl.impl("moe_forward", et._moe_forward_cuda, "CPU")
    _bench_lib.impl("noop", _noop, "CPU")
    t, h, k = args.tokens, args.hidden, args.topk
    x = torch.randn(t, h).bfloat16()
    idx = torch.randint(0, args.experts, (t, k), dtype=torch.int32)
    idx64, w = idx.long(), torch.rand(t, k)
    op, noop = torch.ops.epmoe.moe_forward.default, torch.ops.epmoe_bench.noop.default
    custom = torch.ops.epmoe_bench.noop_custom_op.default
    rows_fns = [
        ("torch.empty", lambda: torch.empty((t, h), dtype=torch.bfloat16)),
        ("noop op", lambda: noop(x, idx, w, key)),
        ("noop custom_op", lambda: custom(x, idx, w, key)),
        ("epmoe op, C call stubbed", lambda: op(x, idx, w, key)),
        ("  its Python kernel alone", lambda: et._moe_forward_cuda(x, idx, w, key)),
        ("moe_forward(), C stubbed", lambda: et.moe_forward(x, idx, w, key)),
        ("epmoe op int64, C stubbed", lambda: op(x, idx64, w, key)),
    ]
    with torch.inference_mode():
        rows = [(n, time_calls(f, args.calls, args.repeats, lambda: None), _P10[f])
                for n, f in rows_fns]
    report(rows, f"host time per call on the CPU (no GPU; T={t}, H={h}, K={k}; the C call is a "
                 f"no-op)")
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            op(x, idx, w, key)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 0


def run_gpu(args) -> int:
    import torch.distributed as dist
    if "RANK" not in os.environ:  # a one-rank group on this GPU
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    e = args.experts * world if args.experts_per_rank else args.experts
    moe = et.MoE(e, args.hidden, args.intermediate, args.topk, max(args.tokens, 1), args.dtype,
                 path=args.path)
    shapes = moe.config.weight_shapes()
    gen = torch.Generator(device=dev).manual_seed(rank)
    if args.dtype == "fp8":
        w1 = (torch.randn(shapes["w1"], device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
        w2 = (torch.randn(shapes["w2"], device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
        moe.load_weights(w1, torch.full(shapes["w1_scale"], 0.01, device=dev), w2,
                         torch.full(shapes["w2_scale"], 0.01, device=dev))
    else:
        moe.load_weights(torch.randn(shapes["w1"], device=dev).bfloat16() * 0.02, None,
                         torch.randn(shapes["w2"], device=dev).bfloat16() * 0.02, None)
    t, h, k = args.tokens, args.hidden, args.topk
    x = torch.randn(t, h, device=dev).bfloat16()
    idx64 = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64, device=dev)
    idx, w = idx64.int(), torch.rand(t, k, device=dev)
    out = torch.empty_like(x)
    key = moe.layer_key
    op, noop = torch.ops.epmoe.moe_forward.default, torch.ops.epmoe_bench.noop.default
    custom = torch.ops.epmoe_bench.noop_custom_op.default
    _bench_lib.impl("noop", _noop, "CUDA")
    bound = et._registry[key]
    handle, c_forward = moe.layer._handle, bound.c_forward
    xp, ip, wp, op_ = x.data_ptr(), idx.data_ptr(), w.data_ptr(), out.data_ptr()
    raw = torch._C._cuda_getCurrentRawStream
    path_code = et._PATHS[args.path]
    # The C call with its own argument struct, filled once (epmoe_layer_forward_args; the hot paths
    # refill this thread's struct on every call).
    c_args = epmoe._lib.ForwardArgsC(xp, ip, wp, op_, None, None, raw(local), t, 0, path_code)
    args_address = ctypes.addressof(c_args)
    if args.pin is not None:
        # This thread only, after every thread of NCCL, torch and epmoe exists (they keep their
        # affinity): one core per local rank, so that the timed loop does not migrate.
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[(args.pin + 2 * local) % len(allowed)]})

    def sync():
        torch.cuda.synchronize()
        dist.barrier(device_ids=[local])

    rows_fns = [
        ("torch.empty", lambda: torch.empty((t, h), dtype=torch.bfloat16, device=dev)),
        ("noop op", lambda: noop(x, idx, w, key)),
        ("noop custom_op", lambda: custom(x, idx, w, key)),
        ("C forward only", lambda: c_forward(handle, args_address)),
        ("epmoe op (int32)", lambda: op(x, idx, w, key, args.path)),
        ("MoE module (int32)", lambda: moe(x, idx, w)),
        ("MoE module (int64)", lambda: moe(x, idx64, w)),
        ("epmoe.Layer(out=)", lambda: moe.layer(x, idx, w, out=out, path=args.path)),
        # An explicit stream takes the DLPack path (each tensor read through a capsule).
        ("Layer(out=, stream=)", lambda: moe.layer(x, idx, w, out=out, path=args.path,
                                                   stream=torch.cuda.current_stream(dev))),
    ]
    fast = None
    if args.fast_path:
        et.load_fast_path()
        fast = bound.fast
        if fast is None:
            raise SystemExit("--fast-path: the C++ fast path loaded but is not bound to the layer")
        fns = dict(rows_fns)
        for _ in range(2):  # each row again, the Python path's and the C++ path's in turns
            for name in ("MoE module (int32)", "MoE module (int64)", "epmoe op (int32)"):
                rows_fns += [(name, fns[name]), (name + " [C++]", fns[name])]
    rows = []
    with torch.inference_mode():
        for name, fn in rows_fns:
            bound.fast = fast if name.endswith("[C++]") else None
            rows.append((name, time_calls(fn, args.calls, args.repeats, sync), _P10[fn]))
        bound.fast = fast
    moe.check_device_error()
    report(rows, f"host time per eager call, {torch.cuda.get_device_name(dev)}, R={world}, "
                 f"{args.dtype}, path={args.path}, T={t}, E={e}, H={h}, I={args.intermediate}, "
                 f"K={k}, torch {torch.__version__}", rank)
    if rank == 0:
        print(f"path taken on rank 0: {moe.layer.last_path}")
        names = ["MoE module (int32)", "MoE module (int64)", "epmoe op (int32)"]
        if fast is not None:
            names += [n + " [C++]" for n in names]
        for name in names:
            us = {r[0]: r[1] for r in rows}[name]
            verdict = "meets" if us <= TARGET_US else "misses"
            print(f"{name}: {us:.2f} us per call, {verdict} the target of {TARGET_US:.0f} us")
    dist.barrier(device_ids=[local])
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: the Python side, C call stubbed")
    ap.add_argument("--pin", type=int, default=None, metavar="CORE",
                    help="pin the timing thread of local rank r to core CORE + 2 r (of those allowed)")
    ap.add_argument("--profile", action="store_true", help="with --cpu: cProfile the op calls")
    ap.add_argument("--fast-path", action="store_true",
                    help="also time the C++ eager path (epmoe.torch.load_fast_path: builds it first)")
    ap.add_argument("--calls", type=int, default=100, help="enqueues per timed batch")
    ap.add_argument("--repeats", type=int, default=20, help="timed batches (median reported)")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--experts", type=int, default=8,
                    help="experts per rank (or in total with --experts-total)")
    ap.add_argument("--experts-total", dest="experts_per_rank", action="store_false")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    ap.add_argument("--path", choices=["auto", "pipeline", "fused"], default="auto",
                    help="pipeline: four kernel launches per call; fused: one; auto (the "
                         "default of MoE and the operator): fused for small calls")
    args = ap.parse_args()
    if args.cpu:
        return run_cpu(args)
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU (use --cpu for the Python side alone)")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
