"""A stack of MoE blocks on epmoe: the router on torch, the experts on epmoe, one process per GPU.

    pip install ./python                                  # once, from the repository root
    torchrun --nproc-per-node 4 examples/moe_stack.py [--dtype fp8|bf16|both] [--blocks 8]

Each block is h + MoE(h): a router (linear, softmax, top-k, renormalized weights; torch.topk's
int64 indices go to epmoe as they are) and the experts as an epmoe.torch.MoE module. Every block
runs on ONE epmoe.Workspace (sized for the largest block) and reads its weights by reference, so
the GPU memory epmoe holds is that workspace, whatever the number of blocks (Workspace.nbytes).
The stack runs eagerly, compiled with torch.compile(fullgraph=True) and replayed from a CUDA
graph, and every block's expert output is checked against a plain PyTorch implementation of
SPEC.md (on the same block input, so that the routing is the same); one block's expert counts are
checked against a histogram of every rank's routing. It prints the time per block of each mode and
the memory epmoe holds.
"""

import argparse
import os
import time

# NVLink multicast stays off on these nodes.
for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import epmoe  # noqa: E402
import epmoe.torch as et  # noqa: E402

MIB = 1 << 20


# ---- weights -------------------------------------------------------------------------------------

def fp8_block_quantize(w):
    """[E, rows, cols] fp32 -> (e4m3 [E, rows, cols], fp32 scales [E, rows/128, cols/128],
    the exact dequantized fp32 weights)."""
    e, rows, cols = w.shape
    blocks = w.reshape(e, rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, :, None, :, None]).reshape(e, rows, cols)
    return q.reshape(e, rows, cols), scale, deq


def make_experts(args, world, gen, device):
    """All E experts (every rank draws the same ones): the kernels' inputs and fp32 copies for
    the reference."""
    e, h, i = args.experts_total, args.hidden, args.intermediate
    w1 = torch.randn(e, 2 * i, h, device=device, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, device=device, generator=gen) / i ** 0.5
    if args.dtype == "fp8":
        (q1, s1, d1), (q2, s2, d2) = fp8_block_quantize(w1), fp8_block_quantize(w2)
        return (q1, s1, q2, s2), (d1, d2)
    w1, w2 = w1.bfloat16(), w2.bfloat16()
    return (w1, None, w2, None), (w1.float(), w2.float())


# ---- the model -----------------------------------------------------------------------------------

class Block(torch.nn.Module):
    """h + experts(h), routed by a linear router on torch."""

    def __init__(self, args, moe):
        super().__init__()
        self.router = torch.nn.Linear(args.hidden, args.experts_total, bias=False,
                                      dtype=torch.bfloat16)
        self.moe, self.topk = moe, args.topk

    def route(self, h):
        probs = F.softmax(self.router(h).float(), dim=-1)
        weights, idx = probs.topk(self.topk, dim=-1)             # idx is int64
        return weights / weights.sum(dim=-1, keepdim=True), idx

    def forward(self, h, record=None):
        weights, idx = self.route(h)
        y = self.moe(h, idx, weights)
        if record is not None:
            record.append((h, y))
        return h + y


class Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, h, record=None):
        for block in self.blocks:
            h = block(h, record)
        return h


# ---- the plain PyTorch implementation of SPEC.md -------------------------------------------------

def quant_dequant_1x128(v):
    """SPEC steps 1 and 5 on fp32 `v` [n, C]: per 128 channels s = max(amax, 1e-4) / 448 (a true
    division: tensor by tensor), q = e4m3(v / s) saturating, returns q * s."""
    g = v.reshape(v.shape[0], -1, 128)
    amax = g.abs().amax(dim=-1, keepdim=True)
    s = torch.maximum(amax, torch.full_like(amax, 1e-4)) / torch.full_like(amax, 448.0)
    q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(v.shape)


def reference_experts(args, x, idx, weights, w1, w2):
    """y [T, H] bf16 of SPEC.md for this rank's tokens, with all experts' fp32 weights."""
    fp8, inter = args.dtype == "fp8", args.intermediate
    xh = quant_dequant_1x128(x.float()) if fp8 else x.float()
    o = torch.zeros(x.shape[0], idx.shape[1], x.shape[1], device=x.device)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        hid = xh[tok] @ w1[e].T
        gate, up = hid[:, :inter], hid[:, inter:]
        a = F.silu(gate) * up * weights[tok, slot][:, None]
        ah = quant_dequant_1x128(a) if fp8 else a.bfloat16().float()
        o[tok, slot] = (ah @ w2[e].T).bfloat16().float()
    acc = torch.zeros_like(o[:, 0])
    for k in range(idx.shape[1]):  # fp32, slot order, valid slots only
        acc = torch.where((idx[:, k] >= 0)[:, None], acc + o[:, k], acc)
    return acc.bfloat16()


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---- timing --------------------------------------------------------------------------------------

def time_per_block(fn, args, device):
    """Microseconds per block of fn() (the whole stack), GPU time between CUDA events, the
    slowest rank's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(device_ids=[device.index])
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    us = torch.tensor([start.elapsed_time(stop) * 1e3 / args.iters / args.blocks], device=device)
    dist.all_reduce(us, op=dist.ReduceOp.MAX)
    return float(us)


def epmoe_bytes(free_before, reserved_before, device):
    """GPU memory taken since the snapshot outside torch's caching allocator: what epmoe (and
    NCCL) allocated."""
    torch.cuda.synchronize()
    free_now = torch.cuda.mem_get_info(device)[0]
    torch_growth = torch.cuda.memory_reserved(device) - reserved_before
    return free_before - free_now - torch_growth


# ---- one run -------------------------------------------------------------------------------------

def run(args, rank, world, device):
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's GEMMs in fp32
    tol = 1e-2 if args.dtype == "fp8" else 5e-3
    gen = torch.Generator(device=device).manual_seed(2024)
    e_loc = args.experts_total // world
    lo, hi = rank * e_loc, (rank + 1) * e_loc

    # One workspace for every block, then the blocks on it: creating each is collective. Memory is
    # measured around them.
    comm = epmoe.Communicator.from_torch()  # cached: the workspace and the layers share it
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    shape = epmoe.LayerConfig(world, args.experts_total, args.hidden, args.intermediate, args.topk,
                              args.tokens, args.dtype)
    ws = epmoe.Workspace(comm, epmoe.WorkspaceConfig.for_layers([shape]))

    def block_moe():
        return et.MoE(args.experts_total, args.hidden, args.intermediate, args.topk, args.tokens,
                      args.dtype, workspace=ws, path=args.path)

    moes = [block_moe()]
    held_one = epmoe_bytes(free0, reserved0, device)
    moes += [block_moe() for _ in range(args.blocks - 1)]
    ref_weights = []
    for moe in moes:
        (w1, w1s, w2, w2s), (d1, d2) = make_experts(args, world, gen, device)
        sl = lambda w: None if w is None else w[lo:hi].contiguous()  # noqa: E731
        moe.load_weights(sl(w1), sl(w1s), sl(w2), sl(w2s))
        ref_weights.append((d1, d2))
    held = epmoe_bytes(free0, reserved0, device)
    buffers = sum(b.numel() * b.element_size() for m in moes for b in m.buffers())
    torch.manual_seed(7)  # the routers: same on every rank
    stack = Stack([Block(args, m) for m in moes]).to(device)
    say(f"\n== {args.dtype}: {args.blocks} blocks, R={world}, E={args.experts_total}, "
        f"H={args.hidden}, I={args.intermediate}, K={args.topk}, T={args.tokens} per rank, "
        f"path={args.path}")
    say(f"GPU memory epmoe holds (rank 0): Workspace.nbytes = {ws.nbytes / MIB:.1f} MiB for all "
        f"{args.blocks} blocks (one workspace; the blocks reference their weights); measured drop "
        f"in free memory outside torch's allocator: {held_one / MIB:.1f} MiB with 1 block, "
        f"{held / MIB:.1f} MiB with {args.blocks}")
    say(f"the modules' weight buffers (torch, rank 0): {buffers / MIB:.1f} MiB (W1 and W2 in the "
        f"SPEC layout, and W1 in the kernels' layout)")

    x = torch.randn(args.tokens, args.hidden, device=device, generator=gen).bfloat16()
    with torch.inference_mode():
        # Eager, recording each block's input and expert output.
        record = []
        eager = stack(x, record)
        # Each block against the plain PyTorch one on the same input (same routing).
        worst = 0.0
        for (h, y), block, (d1, d2) in zip(record, stack.blocks, ref_weights):
            weights, idx = block.route(h)
            worst = max(worst, rel_err(y, reference_experts(args, h, idx, weights, d1, d2)))
        ok_ref = worst <= tol

        # One block's expert counts against a histogram of every rank's routing of its input.
        h0 = record[0][0]
        weights0, idx0 = stack.blocks[0].route(h0)
        y0, counts = moes[0](h0, idx0, weights0, return_expert_counts=True)
        hist = torch.bincount(idx0.flatten(), minlength=args.experts_total)
        dist.all_reduce(hist)
        ok_counts = torch.equal(counts.long(), hist[lo:hi]) and torch.equal(y0, record[0][1])

        # The epmoe operator under torch.compile on block 0's eager routing: the same kernels on the
        # same inputs, so bitwise the eager output. (The whole compiled stack is compared only for
        # information: inductor computes the router's softmax in another order, which flips near-tie
        # top-k choices, and 8 blocks compound them.)
        compiled_moe = torch.compile(lambda h, i, w: moes[0](h, i, w), fullgraph=True)
        compiled_equal = torch.equal(compiled_moe(h0, idx0, weights0), record[0][1])
        compiled_stack = torch.compile(stack, fullgraph=True)
        compiled = compiled_stack(x)
        err_compiled = rel_err(compiled, eager)

        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stack(static_x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = stack(static_x)
        graph.replay()
        torch.cuda.synchronize()
        graph_equal = torch.equal(static_y, eager)

        verdicts = torch.tensor([0 if ok_ref else 1, 0 if graph_equal else 1,
                                 0 if compiled_equal else 1, 0 if ok_counts else 1],
                                device=device)
        dist.all_reduce(verdicts, op=dist.ReduceOp.MAX)
        say(f"check: every block's experts vs plain PyTorch (SPEC.md): worst rel_err "
            f"{worst:.2e} (rank 0; bound {tol:g}) "
            f"{'PASS' if verdicts[0] == 0 else 'FAIL'}")
        say(f"check: CUDA graph replay == eager, bitwise: {'PASS' if verdicts[1] == 0 else 'FAIL'}")
        say(f"check: the epmoe operator compiled (fullgraph) == eager on block 0's routing, bitwise: "
            f"{'PASS' if verdicts[2] == 0 else 'FAIL'}")
        say(f"info: the whole stack compiled vs eager: rel_err {err_compiled:.2e} (rank 0; inductor's "
            f"router flips near-tie top-k choices, compounded over the blocks)")
        say(f"check: block 0's expert counts == the routing's histogram over every rank (and the "
            f"same y): {'PASS' if verdicts[3] == 0 else 'FAIL'}")

        modes = [("eager", lambda: stack(x)), ("torch.compile", lambda: compiled_stack(x)),
                 ("CUDA graph replay", graph.replay)]
        for name, fn in modes:
            say(f"time per block, {name:18s}: {time_per_block(fn, args, device):8.1f} us "
                f"(router + epmoe experts + residual; slowest rank)")
        host = time.perf_counter()
        for _ in range(args.iters):
            stack(x)
        host = (time.perf_counter() - host) / args.iters / args.blocks * 1e6
        torch.cuda.synchronize()
        say(f"host time per eager block (rank 0, enqueue only): {host:.1f} us")
    for moe in moes:
        moe.check_device_error()
    del graph
    dist.barrier(device_ids=[device.index])
    for moe in moes:
        moe.close()  # drops each block's share of the workspace
    ws.close()  # collective, at the same point on every rank
    return int(verdicts.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["fp8", "bf16", "both"], default="both")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8, help="experts per rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--path", choices=["auto", "pipeline", "fused"], default="auto")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.experts_total = args.experts * world
    failures = 0
    for dtype in (["fp8", "bf16"] if args.dtype == "both" else [args.dtype]):
        args.dtype = dtype
        failures += run(args, rank, world, device)
    if rank == 0:
        print("\nall checks passed" if failures == 0 else f"\n{failures} checks FAILED")
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
