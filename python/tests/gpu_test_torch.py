"""GPU test of epmoe.torch: the operator and the MoE module in eager mode, under
torch.compile(fullgraph=True) and in CUDA graphs, on 2 or 4 GPUs of one node.

    torchrun --nproc-per-node 2 python/tests/gpu_test_torch.py
    python python/tests/gpu_test_torch.py [--nproc 4]       # spawns the ranks itself

Checks, for an FP8 and a BF16 layer: eager output against the CPU float64 reference of SPEC.md
(gpu_test_layer.reference; SPEC's tolerances), and bitwise equality of every other way to make
the same call: int64 against int32 topk_idx, the operator through torch's dispatcher against the
module's direct eager path, torch.compile(fullgraph=True) (also at a second T, and with T = 0 on
one rank), compile mode="reduce-overhead" (inductor's CUDA graphs), and a captured CUDA graph
replayed on new inputs (int32 and int64); with EPMOE_TORCH_FAST_PATH=1, the C++ eager path
against the Python one (with and without expert counts). Then a two-block stack with a torch router (linear,
softmax, topk) eager vs compiled vs graph-replayed; an FP8 and a BF16 MoE on one epmoe.Workspace
(weights by reference) bitwise equal to the same modules on their own buffers, with their expert
counts against the routing's histogram; compile-time and eager argument errors, and an
out-of-range int64 index reported by the device. Prints SKIPPED and exits 0 without torch or
with fewer GPUs than ranks. Never hangs (see gpu_test_layer.py: abort on any exception, watchdog).
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_test_layer as base  # noqa: E402  (sets the NVLS-off environment, finds epmoe)


def bitwise(a, b) -> bool:
    import torch
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16),
                                                                    b.view(torch.int16))


def build(cfg, rank, world, device):
    """A MoE with this rank's slice of weights that every rank draws alike, plus the float64
    weights of all experts for the reference."""
    import torch
    import epmoe.torch as et
    (w1, w1s, w2, w2s), (w1d, w2d) = base.make_weights(cfg, torch.Generator().manual_seed(1234),
                                                       device)
    e_loc = cfg["num_experts"] // world
    lo, hi = rank * e_loc, (rank + 1) * e_loc
    moe = et.MoE(cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["topk"],
                 cfg["max_tokens_per_rank"], cfg["dtype"],
                 activation_clamp=cfg.get("activation_clamp"))
    sl = lambda w: None if w is None else w[lo:hi].contiguous()  # noqa: E731
    moe.load_weights(sl(w1), sl(w1s), sl(w2), sl(w2s))
    return moe, w1d, w2d


def check_moe(res, cfg, rank, world, device):
    import torch
    import epmoe.torch as et
    tol = 1e-2 if cfg["dtype"] == "fp8" else 5e-3
    tag = f"{cfg['dtype']} E={cfg['num_experts']} H={cfg['hidden']} K={cfg['topk']}"
    moe, w1d, w2d = build(cfg, rank, world, device)
    gen = torch.Generator().manual_seed(100 + rank)
    t = cfg["max_tokens_per_rank"] - 7 * rank
    x, idx, wts = base.make_inputs(cfg, t, gen, device)
    idx64 = idx.long()

    # Eager, against SPEC's reference.
    y = moe(x, idx, wts)
    torch.cuda.synchronize()
    err = base.rel_err(y, base.reference(cfg, x, idx, wts, w1d, w2d))
    finite = bool(torch.isfinite(y.float()).all())
    res.record(f"{tag} eager vs reference T={t}", finite and err <= tol, f"rel_err={err:.2e}")

    res.record(f"{tag} int64 topk_idx == int32 (bitwise)", bitwise(moe(x, idx64, wts), y))
    if et.fast_path_loaded():
        # The C++ eager path (EPMOE_TORCH_FAST_PATH=1) against the Python one, same call.
        fast, moe._bound.fast = moe._bound.fast, None
        try:
            slow = [moe(x, i, wts, return_expert_counts=True) for i in (idx, idx64)]
        finally:
            moe._bound.fast = fast
        res.record(f"{tag} fast path bound", fast is not None)
        for (ys, cs), i in zip(slow, (idx, idx64)):
            yf, cf = moe(x, i, wts, return_expert_counts=True)
            res.record(f"{tag} fast path == Python path ({i.dtype}, with counts; bitwise)",
                       bitwise(yf, ys) and torch.equal(cf, cs) and bitwise(ys, y))
    res.record(f"{tag} torch.ops.epmoe.moe_forward == module (bitwise)",
               bitwise(torch.ops.epmoe.moe_forward(x, idx, wts, moe.layer_key), y))
    res.record(f"{tag} et.moe_forward(key, int64) == module (bitwise)",
               bitwise(et.moe_forward(x, idx64, wts, moe.layer_key), y))

    # torch.compile(fullgraph=True): the same call, then another T, then T = 0 on the last rank.
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: moe(a, b, c), fullgraph=True)
    res.record(f"{tag} compiled(fullgraph) int64 == eager (bitwise)",
               bitwise(compiled(x, idx64, wts), y))
    res.record(f"{tag} compiled(fullgraph) int32 == eager (bitwise)",
               bitwise(compiled(x, idx, wts), y))
    for t2 in (t // 2 + 1, 0 if rank == world - 1 else 5):
        x2, idx2, w2 = base.make_inputs(cfg, t2, gen, device)
        want = moe(x2, idx2, w2)
        got = compiled(x2, idx2.long(), w2)
        res.record(f"{tag} compiled at T={t2} == eager (bitwise)", bitwise(got, want))

    # Inductor's CUDA graphs (mode="reduce-overhead"): a few calls, then compare.
    torch._dynamo.reset()
    ro = torch.compile(lambda a, b, c: moe(a, b, c), fullgraph=True, mode="reduce-overhead")
    got = None
    for _ in range(3):
        got = ro(x, idx64, wts).clone()
    res.record(f"{tag} compiled reduce-overhead == eager (bitwise)", bitwise(got, y))

    # A captured CUDA graph replayed on new inputs in the same buffers (int32 and int64 paths).
    for name, index in (("int32", idx), ("int64", idx64)):
        sx, si, sw = x.clone(), index.clone(), wts.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(sx, si, sw)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = moe(sx, si, sw)
        ok = True
        for _ in range(2):
            nx, nidx, nw = base.make_inputs(cfg, t, gen, device)
            sx.copy_(nx), si.copy_(nidx.to(si.dtype)), sw.copy_(nw)
            sy.fill_(float("nan"))
            graph.replay()
            ok &= bitwise(sy, moe(nx, nidx, nw))
        torch.cuda.synchronize()
        res.record(f"{tag} CUDA graph replay x2 ({name}) == eager (bitwise)", ok)
        del graph

    # Argument errors: eager (before anything launches) and at compile time.
    for name, call, message in [
        ("eager float32 x", lambda: moe(x.float(), idx, wts), "x must be bfloat16; got float32"),
        ("eager wrong K", lambda: moe(x, idx[:, :1].contiguous(), wts),
         f"topk_idx must have shape ({t}, {cfg['topk']})"),
        ("eager host x", lambda: moe(x.cpu(), idx, wts), "x is on cpu but this epmoe layer"),
        ("compiled float32 x", lambda: torch.compile(lambda a, b, c: moe(a.float(), b, c),
                                                     fullgraph=True)(x, idx, wts),
         "x must be bfloat16; got float32"),
    ]:
        try:
            call()
            res.record(f"{tag} error: {name}", False, "no exception")
        except Exception as e:  # under compile it arrives wrapped by dynamo
            res.record(f"{tag} error: {name}", message in str(e), f"-> {str(e).splitlines()[0]}")
    base.agree(True)
    return moe


def check_device_error(res, moe, cfg, rank, device):
    """An int64 index beyond int32 on rank 0 saturates and is reported by the device."""
    import torch
    import epmoe
    x, idx, wts = base.make_inputs(cfg, 4, torch.Generator().manual_seed(9), device)
    idx = idx.long()
    if rank == 0:
        idx[1, 0] = 2**33 + 1  # int32 wrap-around would make this expert 1
    moe(x, idx, wts)
    try:
        moe.check_device_error()
        raised = None
    except epmoe.Error as e:
        raised = e
    if rank == 0:
        res.record("int64 index 2**33+1 reported by the device", raised is not None,
                   f"-> {type(raised).__name__}: {raised}" if raised else "no exception")
    base.agree(True)


def check_stack(res, rank, world, device):
    """Two blocks: x + MoE(x) with a torch router; eager, compiled and graph-replayed."""
    import torch
    cfg = dict(dtype="fp8", num_experts=4 * world, hidden=512, intermediate=256, topk=4,
               max_tokens_per_rank=64)
    blocks = [build(cfg, rank, world, device)[0] for _ in range(2)]
    g = torch.Generator(device=device).manual_seed(5)
    routers = [torch.randn(cfg["hidden"], cfg["num_experts"], device=device, generator=g) * 0.05
               for _ in blocks]

    def stack(h):
        for moe, r in zip(blocks, routers):
            w, i = (h.float() @ r).softmax(dim=-1).topk(cfg["topk"], dim=-1)
            h = h + moe(h, i, w)
        return h

    x = torch.randn(48 + rank, cfg["hidden"], device=device, generator=g).bfloat16()
    eager = stack(x)
    torch._dynamo.reset()
    compiled = torch.compile(stack, fullgraph=True)(x)
    err = base.rel_err(compiled, eager)
    res.record("stack x2 compiled vs eager", err <= 1e-2,
               f"rel_err={err:.2e} bitwise={bitwise(compiled, eager)}")
    sx = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stack(sx)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = stack(sx)
    graph.replay()
    torch.cuda.synchronize()
    res.record("stack x2 graph replay == eager (bitwise)", bitwise(sy, eager))
    base.agree(True)


def check_workspace(res, configs, rank, world, device):
    """An FP8 and a BF16 MoE on one epmoe.Workspace (weights by reference, counting experts),
    against the same modules on their own buffers (build()): bitwise equal eager (int32 and int64),
    compiled and replayed from a CUDA graph; the expert counts (returned, and the running sum
    through the eager and the compiled path) equal the routing's histogram; the workspace's size
    does not change and it refuses to close while a module is open."""
    import torch
    import epmoe
    import epmoe.torch as et
    keys = ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank", "dtype")
    wcfg = epmoe.WorkspaceConfig.for_layers(
        [epmoe.LayerConfig(world, *(c[k] for k in keys)) for c in configs])
    ws = epmoe.Workspace(None, wcfg)
    nbytes = ws.nbytes
    gen = torch.Generator().manual_seed(700 + rank)
    mods = []
    for cfg in configs:
        (w1, w1s, w2, w2s), _ = base.make_weights(cfg, torch.Generator().manual_seed(1234), device)
        e_loc = cfg["num_experts"] // world
        lo, hi = rank * e_loc, (rank + 1) * e_loc
        sl = lambda w: None if w is None else w[lo:hi].contiguous()  # noqa: E731
        moe = et.MoE(*(cfg[k] for k in keys), activation_clamp=cfg.get("activation_clamp"),
                     workspace=ws, count_experts=True)
        moe.load_weights(sl(w1), sl(w1s), sl(w2), sl(w2s))
        own = build(cfg, rank, world, device)[0]
        mods.append((cfg, moe, own, (lo, hi)))
    res.record("workspace: MoE modules on it hold nothing more",
               ws.nbytes == nbytes == wcfg.sizes()["total"] and ws.num_layers == len(configs),
               f"nbytes {nbytes}, {ws.num_layers} layers")
    try:
        ws.close()
        refused = False
    except epmoe.InvalidArgument:
        refused = True
    res.record("workspace close refused while its modules are open", refused and not ws.closed)

    for cfg, moe, own, (lo, hi) in mods:
        tag = f"workspace MoE {cfg['dtype']}"
        t = cfg["max_tokens_per_rank"] - 5 * rank
        x, idx, wts = base.make_inputs(cfg, t, gen, device)
        want = own(x, idx, wts)
        hist = base.histogram(idx, cfg["num_experts"], lo, hi)
        y, counts = moe(x, idx.long(), wts, return_expert_counts=True)
        res.record(f"{tag} eager int64 == own buffers (bitwise)", bitwise(y, want))
        res.record(f"{tag} eager int32 == own buffers (bitwise)", bitwise(moe(x, idx, wts), want))
        res.record(f"{tag} returned expert counts == histogram", torch.equal(counts.long(), hist),
                   f"{counts.tolist()} vs {hist.tolist()}")
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b, c: moe(a, b, c), fullgraph=True)
        res.record(f"{tag} compiled (int64) == own buffers (bitwise)",
                   bitwise(compiled(x, idx.long(), wts), want))
        # The running sum: the two eager calls above and the compiled one each added the counts.
        torch.cuda.synchronize()
        res.record(f"{tag} running expert counts (eager x2, compiled x1) == 3 x histogram",
                   torch.equal(moe.expert_counts_total, 3 * hist),
                   f"{moe.expert_counts_total.tolist()} vs 3 x {hist.tolist()}")
        moe.reset_expert_counts()
        sx, si, sw = x.clone(), idx.long(), wts.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(sx, si, sw)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = moe(sx, si, sw)
        nx, nidx, nw = base.make_inputs(cfg, t, gen, device)
        sx.copy_(nx), si.copy_(nidx.long()), sw.copy_(nw)
        graph.replay()
        ok = bitwise(sy, own(nx, nidx, nw))
        torch.cuda.synchronize()
        del graph
        res.record(f"{tag} CUDA graph replay == own buffers (bitwise)", ok)
        moe.check_device_error()
    for _, moe, own, _ in mods:
        moe.close()
        own.close()
    ws.close()
    res.record("workspace closed after its modules", ws.closed)
    base.agree(True)


def check_overhead(res, moe, cfg, rank, device):
    """Host time per eager call (informational: python/benchmarks/op_overhead.py measures it)."""
    import torch
    import torch.distributed as dist
    x, idx, wts = base.make_inputs(cfg, 8, torch.Generator().manual_seed(3), device)
    for _ in range(10):
        moe(x, idx, wts)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[device.index])
    n = 100
    t0 = time.perf_counter()
    for _ in range(n):
        moe(x, idx, wts)
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    import epmoe.torch as et
    res.record(f"host time per eager MoE call (info; C++ fast path "
               f"{'on' if et.fast_path_loaded() else 'off'})", True, f"{us:.1f} us")


def run(rank, world, local_rank, timeout):
    faulthandler.dump_traceback_later(timeout, exit=True)
    import torch
    import torch.distributed as dist
    import epmoe
    import epmoe.torch  # noqa: F401

    base.DEVICE = device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    res = base.Results(rank)
    if rank == 0:
        print(f"epmoe {epmoe.version()} from {epmoe.library_path()}, torch {torch.__version__}, "
              f"{world} ranks", flush=True)
    import os
    if os.environ.get("EPMOE_TORCH_FAST_PATH", "0") not in ("", "0"):
        res.record("EPMOE_TORCH_FAST_PATH: the C++ fast path loaded", epmoe.torch.fast_path_loaded())
    configs = [
        dict(dtype="fp8", num_experts=4 * world, hidden=512, intermediate=256, topk=4,
             max_tokens_per_rank=96),
        dict(dtype="bf16", num_experts=2 * world, hidden=384, intermediate=128, topk=2,
             max_tokens_per_rank=64, activation_clamp=0.5),
    ]

    def step(name, fn):
        base.restore_device()
        try:
            return fn()
        except Exception as e:
            res.record(name, False, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            base.abort(res, f"an exception in step '{name}'")

    moes = [step(f"moe {c['dtype']}", lambda c=c: check_moe(res, c, rank, world, device))
            for c in configs]
    step("stack", lambda: check_stack(res, rank, world, device))
    step("workspace", lambda: check_workspace(res, configs, rank, world, device))
    step("overhead", lambda: check_overhead(res, moes[0], configs[0], rank, device))
    step("device error", lambda: check_device_error(res, moes[-1], configs[-1], rank, device))

    return base.finish(res, "gpu_test_torch", device, local_rank)


def main():
    return base.main(run, __doc__, default_timeout=300, timeout_note=": compiling takes a while")


if __name__ == "__main__":
    sys.exit(main())
