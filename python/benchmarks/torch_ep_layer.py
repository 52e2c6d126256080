"""A plain PyTorch expert-parallel MoE layer beside epmoe, in one process per GPU, on the same
weights, tokens and routing, timed the same way (eager calls, CUDA events, best of 3 x 20, the
slowest rank). It is what an engine without epmoe would write: the routing's per-rank counts
exchanged with all_to_all_single (a host sync for the split sizes), the token rows sent with
all_to_all_single, both expert GEMMs as torch._grouped_mm in BF16 with SwiGLU between them, the
rows sent back, and the top-k sum.

    torchrun --standalone --nproc-per-node R python/benchmarks/torch_ep_layer.py [--shape dsv3|qwen3] [--tokens 1,128,4096]

Prints per token count the microseconds per call of the PyTorch layer (BF16) and of epmoe's
pipeline and fused paths in FP8 and BF16, with the relative L2 difference of each output from
epmoe's BF16 pipeline output (the PyTorch layer computes in BF16 too: expect ~1e-2 or less for it,
~2e-2 for FP8). --json FILE writes the rows.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

E4M3 = 448.0


def blockq(w):  # [N, K] fp32 -> e4m3 [N, K], fp32 scales [N/128, K/128] (as the peer script)
    N, K = w.shape
    b = w.reshape(N // 128, 128, K // 128, 128)
    s = b.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-4) / E4M3
    return (b / s).clamp(-E4M3, E4M3).to(torch.float8_e4m3fn).reshape(N, K), s.reshape(N // 128, K // 128)


def bench(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        torch.cuda.synchronize()
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / iters * 1e3)
    t = torch.tensor([best], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class TorchEP:
    """One rank of a BF16 expert-parallel layer: experts [rank * E_loc, (rank + 1) * E_loc) here,
    w13 [E_loc, 2I, H] (gate rows, then up rows), w2 [E_loc, H, I]."""

    def __init__(self, w13, w2, rank, world, topk):
        self.E_loc, two_i, self.H = w13.shape
        self.I = two_i // 2
        self.rank, self.world, self.K = rank, world, topk
        self.w13t = w13.transpose(1, 2)  # [E_loc, H, 2I], as torch._grouped_mm takes B
        self.w2t = w2.transpose(1, 2)    # [E_loc, I, H]

    def __call__(self, x, idx, w):
        T, H, K, R = x.shape[0], self.H, self.K, self.world
        flat_e = idx.reshape(-1).long()
        dest = flat_e // self.E_loc
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=R)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()  # the split sizes live on the host
        rows_out = x.repeat_interleave(K, dim=0)[order]
        e_out = flat_e[order]
        rows_in = x.new_empty(sum(rc), H)
        e_in = e_out.new_empty(sum(rc))
        dist.all_to_all_single(rows_in, rows_out, rc, sc)
        dist.all_to_all_single(e_in, e_out, rc, sc)
        local = e_in - self.rank * self.E_loc
        by_expert = torch.argsort(local, stable=True)
        offs = torch.cumsum(torch.bincount(local, minlength=self.E_loc), 0).to(torch.int32)
        h = torch._grouped_mm(rows_in[by_expert], self.w13t, offs=offs)
        a = (F.silu(h[:, :self.I].float()) * h[:, self.I:].float()).to(torch.bfloat16)
        o = torch._grouped_mm(a, self.w2t, offs=offs)
        o_back = torch.empty_like(o)
        o_back[by_expert] = o
        back = x.new_empty(T * K, H)
        dist.all_to_all_single(back, o_back, sc, rc)
        y_slots = torch.empty_like(back)
        y_slots[order] = back
        return (y_slots.view(T, K, H).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="dsv3")
    ap.add_argument("--tokens", default="1,128,4096")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    E, H, I, K = {"dsv3": (32 * R, 7168, 2048, 8), "qwen3": (32 * R, 2048, 768, 8)}[a.shape]
    El = E // R
    toks = [int(t) for t in a.tokens.split(",")]
    log = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 + rank)
    w13 = torch.randn(El, 2 * I, H, device="cuda", generator=gen) / H ** 0.5
    w2 = torch.randn(El, H, I, device="cuda", generator=gen) / I ** 0.5
    q13 = [blockq(w13[e]) for e in range(El)]
    q2 = [blockq(w2[e]) for e in range(El)]
    w1q, s1 = torch.stack([q[0] for q in q13]), torch.stack([q[1] for q in q13])
    w2q, s2 = torch.stack([q[0] for q in q2]), torch.stack([q[1] for q in q2])
    w13b, w2b = w13.bfloat16(), w2.bfloat16()
    del w13, w2
    log(f"shape {a.shape}: E={E} H={H} I={I} K={K} R={R} on {torch.cuda.get_device_name()}")
    impls = {"torch_ep_bf16": TorchEP(w13b, w2b, rank, R, K)}
    import epmoe
    for dt, (w1, ws1, w2_, ws2) in (("bf16", (w13b, None, w2b, None)), ("fp8", (w1q, s1, w2q, s2))):
        layer = epmoe.Layer(None, num_experts=E, hidden=H, intermediate=I, topk=K,
                            max_tokens_per_rank=max(toks), dtype=dt, combine_partials="bf16")
        layer.load_weights(w1, ws1, w2_, ws2)
        for path in ("pipeline", "fused"):
            impls[f"epmoe_{path}_{dt}"] = (lambda x, i, w, L=layer, p=path: L(x, i, w, path=p))
    rows = []
    for T in toks:
        g = torch.Generator(device="cuda")
        g.manual_seed(77 + rank)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        idx = torch.topk(torch.rand(T, E, device="cuda", generator=g), K, dim=-1).indices.to(torch.int32).contiguous()
        w = torch.rand(T, K, device="cuda", generator=g) + 0.1
        w = (w / w.sum(-1, keepdim=True)).contiguous()
        outs = {name: f(x, idx, w) for name, f in impls.items()}
        torch.cuda.synchronize()
        base = outs["epmoe_pipeline_bf16"].float()
        line = f"T={T:6d}"
        for name, f in impls.items():
            d = ((outs[name].float() - base).norm() / base.norm().clamp_min(1e-30)).item() if T else 0.0
            us = bench(lambda f=f: f(x, idx, w))
            line += f" | {name} {us:8.1f} us diff {d:.1e}"
            rows.append(dict(T=T, impl=name, us=us, rel_diff=d))
        log(line)
    if rank == 0 and a.json:
        json.dump(dict(R=R, shape=a.shape, gpu=torch.cuda.get_device_name(), rows=rows), open(a.json, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
