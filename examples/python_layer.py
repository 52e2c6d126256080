"""epmoe from Python: one MoE layer across the GPUs of a node, one process per GPU.

    pip install ./python                       # once, from the repository root
    torchrun --nproc-per-node 2 examples/python_layer.py [--dtype bf16] [--tokens 512]

Each rank builds FP8 (or BF16) weights for its own experts, routes random tokens, runs the layer
eagerly, then captures the same call in a CUDA graph and replays it. Shapes are a small slice of
DeepSeek-V3 (H=7168, I=2048, K=8); pass --hidden/--intermediate/--experts for others.
"""

import argparse
import os

import torch
import torch.distributed as dist

import epmoe

# NVLink multicast stays off on these nodes.
for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(key, value)


def fp8_block_quantize(w):
    """[E, rows, cols] float -> (e4m3 values, fp32 scales [E, rows/128, cols/128])."""
    e, rows, cols = w.shape
    blocks = w.reshape(e, rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(e, rows, cols), scale.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--experts", type=int, default=32, help="E in total (a multiple of the ranks)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--path", choices=["auto", "fused", "pipeline"], default="auto")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    # The layer: collective over the default process group (rank 0 makes the NCCL unique id,
    # torch.distributed shares it). Every rank passes the same shapes.
    layer = epmoe.Layer(None, num_experts=args.experts, hidden=args.hidden,
                        intermediate=args.intermediate, topk=args.topk,
                        max_tokens_per_rank=args.tokens, dtype=args.dtype)

    # This rank's experts: W1 [E_loc, 2I, H] (gate rows, then up rows), W2 [E_loc, H, I].
    e_loc, h, i = args.experts // world, args.hidden, args.intermediate
    torch.manual_seed(rank)
    w1 = torch.randn(e_loc, 2 * i, h, device=dev) / h ** 0.5
    w2 = torch.randn(e_loc, h, i, device=dev) / i ** 0.5
    if args.dtype == "fp8":
        layer.load_weights(*fp8_block_quantize(w1), *fp8_block_quantize(w2))
    else:
        layer.load_weights(w1.bfloat16(), None, w2.bfloat16(), None)
    del w1, w2

    # Inputs of this rank: x [T, H] bf16, top-k expert ids (int32) and routing weights (fp32).
    t = args.tokens
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    scores = torch.randn(t, args.experts, device=dev).softmax(dim=-1)
    topk_weights, topk_idx = scores.topk(args.topk, dim=-1)
    topk_idx = topk_idx.int()

    # Eager call: runs on torch.cuda.current_stream(), returns a new [T, H] bf16 tensor.
    y = layer(x, topk_idx, topk_weights, path=args.path)
    layer.check_device_error()  # synchronizes; raises if the GPU saw a bad expert index
    print(f"rank {rank}: y {tuple(y.shape)} {y.dtype}, |y| = {y.float().norm():.3f}")

    # CUDA graph: capture once into fixed buffers, then refill the inputs and replay.
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, topk_idx, topk_weights, out=out, path=args.path)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, topk_idx, topk_weights, out=out, path=args.path)

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x.copy_(torch.randn_like(x))
    dist.barrier()
    start.record()
    for _ in range(20):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    print(f"rank {rank}: graph replay {start.elapsed_time(stop) / 20 * 1e3:.1f} us per layer call "
          f"({t} tokens, {args.dtype}, path={args.path})")

    # Errors carry the library's message; argument errors are also ValueErrors.
    try:
        layer(x.float(), topk_idx, topk_weights)
    except epmoe.InvalidArgument as e:
        if rank == 0:
            print(f"expected error: {e}")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
