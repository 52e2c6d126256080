"""GPU test of the Python binding: epmoe.Layer and epmoe.Dispatcher against a plain PyTorch
implementation of SPEC.md, on 2 (or more) GPUs of one node, with a CUDA-graph capture.

    torchrun --nproc-per-node 2 python/tests/gpu_test_layer.py
    python python/tests/gpu_test_layer.py [--nproc 2]      # spawns the ranks itself

Needs torch with CUDA. Without torch or with fewer than 2 GPUs it prints SKIPPED and exits 0.
The reference follows SPEC.md step by step on the CPU (steps 1 and 5 bit-exact, GEMMs in
float64), so the tolerances are SPEC's own: 1e-2 (FP8) and 5e-3 (BF16). A last step runs two
layers on one epmoe.Workspace (one by reference) against the same layers on their own buffers.
Never hangs: an exception in any step makes that rank exit with status 1 at once (the others are
stopped by the launcher), and a watchdog ends every rank with status 1 after --timeout seconds
(default $EPMOE_TEST_TIMEOUT or 180), printing every thread's stack. JAX is confined to the
rank's own GPU and runs last; where it cannot be confined its check is a SKIP.
The library comes from the installed package, or from $EPMOE_LIBRARY (a prebuilt
libepmoe_c.so) with python/ put on sys.path by this script. Rank 0 prints one line per check and
a closing 'N passed, N failed' line; the exit status is nonzero on any failure.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import traceback
from pathlib import Path

# Never NVLink multicast on these machines (it can take the host's shared GPUs down). JAX must
# not grab most of the GPU memory at import.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")):
    os.environ.setdefault(_k, _v)

try:
    import epmoe  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCALE_GROUP = 128
E4M3_MAX = 448.0
MIN_AMAX = 1e-4

# Set by run(): this rank's GPU. Every tensor a collective touches lives there, whatever device
# another library (JAX) left current.
DEVICE = None


# ---- the reference: SPEC.md in plain PyTorch, on the CPU --------------------------------------------
#
# Bit-exact to SPEC steps 1 and 5 as tests/reference/reference.cpp performs them, with the GEMMs in
# float64. Everything runs on the CPU: no TF32, no fast-math, and no "divide by a scalar =
# multiply by its reciprocal" shortcut (torch's CUDA division takes it for a CPU scalar divisor,
# and 1/448 is not exact). Every fp32 division below is tensor / tensor of the same shape.

def _f32(v):
    import torch
    return v.detach().to("cpu", torch.float32)


def e4m3_rne_satfinite(v):
    """fp32 -> the nearest e4m3 value, ties to even, |v| >= 448 saturating to +-448 (satfinite).
    torch's float8_e4m3fn cast rounds to nearest even but turns overflow into NaN, hence the
    clamp first (a value in (448, 464) rounds to 448 either way). Returns fp32."""
    import torch
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def quant_scale(amax, pow2: bool):
    """s = max(amax, 1e-4) / 448 in fp32 with a true division; with pow2, rounded up to a power
    of two (a power of two stays; as numeric.cpp: frexp mantissa 0.5 means exact)."""
    import torch
    s = torch.maximum(amax, torch.full_like(amax, MIN_AMAX)) / torch.full_like(amax, E4M3_MAX)
    if pow2:
        mant, ex = torch.frexp(s)
        up = torch.ldexp(torch.ones_like(s), ex)
        s = torch.where(torch.isfinite(s) & (mant != 0.5), up, s)
    return s


def quant_1x128(v, pow2: bool):
    """SPEC step 1 / 5 on the last dimension of fp32 `v` (CPU): per 128-group scale,
    q = e4m3_rne_satfinite(v / s), returns the dequantized q * s in float64 (exact)."""
    shape = v.shape
    g = v.reshape(*shape[:-1], shape[-1] // SCALE_GROUP, SCALE_GROUP)
    s = quant_scale(g.abs().amax(dim=-1, keepdim=True), pow2).expand_as(g).contiguous()
    q = e4m3_rne_satfinite(g / s)
    return (q.double() * s.double()).reshape(shape)


def silu_f32(g):
    """g / (1 + exp(-g)) in fp32; exp evaluated in float64 and rounded (= a correctly rounded
    expf, as the C++ reference's libm expf). g < -88: exp is inf, the result -0."""
    import torch
    e = torch.exp((-g).double()).float()
    return g / (e + 1.0)


def reference(cfg, x, idx, wts, w1, w2):
    """y[T,H] bf16 (on the CPU) of SPEC.md. w1 [E, 2I, H] and w2 [E, H, I] are the dequantized
    float64 weights of all experts on the CPU; x bf16, idx int32, wts fp32 are this rank's
    inputs (any device)."""
    import torch
    x, idx, wts = _f32(x), idx.detach().to("cpu", torch.int64), _f32(wts)
    t_count, h = x.shape
    k_count = idx.shape[1] if idx.dim() == 2 else cfg["topk"]
    inter = cfg["intermediate"]
    fp8 = cfg["dtype"] == "fp8"
    pow2 = bool(cfg.get("pow2_scales", False))
    clamp = float(cfg.get("activation_clamp") or 0.0)
    # Step 1: x^ (float64, exact).
    xh = quant_1x128(x, pow2) if fp8 else x.double()
    o_all = torch.zeros(t_count, k_count, h, dtype=torch.float32)  # o[t,k]: bf16 values in fp32
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        # Step 2: float64 GEMM, the result rounded to fp32.
        hid = (xh[tok] @ w1[e].T).float()                      # [n, 2I]
        gate, up = hid[:, :inter], hid[:, inter:]
        # Step 3: the clamp, in fp32.
        if clamp > 0:
            c = torch.tensor(clamp, dtype=torch.float32)
            gate = torch.minimum(gate, c)
            up = torch.maximum(torch.minimum(up, c), -c)
        # Step 4: a = (silu(gate) * up) * w, each product rounded to fp32.
        a = (silu_f32(gate) * up) * wts[tok, slot][:, None]
        # Step 5: a^ (float64, exact).
        ah = quant_1x128(a, pow2) if fp8 else a.bfloat16().double()
        # Step 6: float64 GEMM, rounded to fp32, then to bf16.
        o = (ah @ w2[e].T).float().bfloat16().float()          # [n, H]
        o_all[tok, slot] = o
    # Step 7: fp32 sum over the valid slots in slot order, then bf16 (0 without a valid slot).
    acc = torch.zeros(t_count, h, dtype=torch.float32)
    for k in range(k_count):
        acc = torch.where((idx[:, k] >= 0)[:, None], acc + o_all[:, k], acc)
    return acc.bfloat16()


def make_weights(cfg, gen, device):
    """All experts' weights, identical on every rank (same seed). Returns (w1_q, w1_s, w2_q, w2_s)
    in the library's input layout on `device` and the exactly dequantized float64 copies for the
    reference, on the CPU."""
    import torch
    e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
    w1 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    if cfg["dtype"] == "bf16":
        w1, w2 = w1.bfloat16(), w2.bfloat16()
        return (w1.to(device), None, w2.to(device), None), (w1.double(), w2.double())

    def block_quant(w):  # 128x128 blocks over the last two dims
        en, rows, cols = w.shape
        b = w.reshape(en, rows // 128, 128, cols // 128, 128)
        s = b.abs().amax(dim=(2, 4)).clamp(min=1e-8) / E4M3_MAX  # [E, rows/128, cols/128]
        q = (b / s[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        s = s.float()
        deq = (q.double() * s.double()[:, :, None, :, None]).reshape(en, rows, cols)  # exact
        return q.reshape(en, rows, cols), s, deq

    w1q, w1s, w1d = block_quant(w1)
    w2q, w2s, w2d = block_quant(w2)
    return ((w1q.to(device), w1s.to(device), w2q.to(device), w2s.to(device)), (w1d, w2d))


def make_inputs(cfg, t_count, gen, device, masked_frac=0.15):
    import torch
    e, h, k = cfg["num_experts"], cfg["hidden"], cfg["topk"]
    x = torch.randn(t_count, h, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t_count)]) \
        if t_count else torch.zeros(0, k, dtype=torch.int64)
    idx = idx.int()
    if t_count:
        idx[torch.rand(t_count, k, generator=gen) < masked_frac] = -1
    wts = torch.rand(t_count, k, generator=gen).float() + 0.05
    return x.to(device), idx.to(device), wts.to(device)


def rel_err(y, ref):
    """||y - ref|| / ||ref|| in float64 on the CPU."""
    import torch
    y, ref = y.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    num = torch.linalg.vector_norm(y - ref)
    den = torch.linalg.vector_norm(ref)
    return float(num / den) if den > 0 else float(num)


# ---- the checks -------------------------------------------------------------------------------------

class Results:
    def __init__(self, rank):
        self.rank, self.passed, self.failed, self.skipped = rank, 0, 0, 0
        self.lines = []

    def record(self, name, ok, detail=""):
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        if ok is True:
            self.passed += 1
        elif ok is False:
            self.failed += 1
        else:
            self.skipped += 1
        self.lines.append(f"[rank {self.rank}] {status} {name} {detail}".rstrip())
        print(self.lines[-1], flush=True)


def agree_max(code: int) -> int:
    """The largest `code` over all ranks (a collective: every rank must call it, in the same
    order). The tensor is made on this rank's GPU explicitly, never on the current device."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([int(code)], dtype=torch.int32, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def agree(flag):
    """True on every rank only if `flag` is true on every rank (a collective)."""
    return agree_max(0 if flag else 1) == 0


def restore_device():
    """Make this rank's GPU current again (JAX, for one, may leave another one current)."""
    import torch
    torch.cuda.set_device(DEVICE)


def check_layer(res, cfg, rank, world, device, paths):
    import torch
    import epmoe

    tol = 1e-2 if cfg["dtype"] == "fp8" else 5e-3
    tag = f"{cfg['dtype']} E={cfg['num_experts']} H={cfg['hidden']} I={cfg['intermediate']} " \
          f"K={cfg['topk']} clamp={cfg.get('activation_clamp')}"
    gen_w = torch.Generator().manual_seed(1234)  # same weights on every rank
    (w1, w1s, w2, w2s), (w1d, w2d) = make_weights(cfg, gen_w, device)
    e_loc = cfg["num_experts"] // world
    lo, hi = rank * e_loc, (rank + 1) * e_loc

    layer = epmoe.Layer(None, cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["topk"],
                        cfg["max_tokens_per_rank"], dtype=cfg["dtype"],
                        activation_clamp=cfg.get("activation_clamp"),
                        pow2_scales=bool(cfg.get("pow2_scales", False)))
    layer.load_weights(w1[lo:hi], None if w1s is None else w1s[lo:hi], w2[lo:hi],
                       None if w2s is None else w2s[lo:hi])
    res.record(f"layer create + load_weights ({tag})", True)

    gen = torch.Generator().manual_seed(100 + rank)
    ok_paths = []
    for path in paths:
        unsupported = False
        # Token counts differ per rank; one round has T=0 on rank 0.
        for t_count in (cfg["max_tokens_per_rank"] - 3 * rank, 0 if rank == 0 else 17,
                        1 + 5 * rank):
            x, idx, wts = make_inputs(cfg, t_count, gen, device)
            y = torch.full((t_count, cfg["hidden"]), float("nan"), dtype=torch.bfloat16,
                           device=device)
            err_msg = None
            try:
                layer(x, idx, wts, out=y, path=path)
            except epmoe.UnsupportedError as e:
                err_msg = str(e)
            if not agree(err_msg is None):  # the same decision on every rank
                unsupported = True
                res.record(f"forward path={path} ({tag})", None,
                           f"unsupported in this build: {err_msg or 'on a peer'}")
                break
            torch.cuda.synchronize()
            layer.check_device_error()
            ref = reference(cfg, x, idx, wts, w1d, w2d)
            finite = bool(torch.isfinite(y.float()).all())
            err = rel_err(y, ref) if t_count else 0.0
            res.record(f"forward path={path} T={t_count} ({tag})", finite and err <= tol,
                       f"rel_err={err:.2e} tol={tol:g} finite={finite}")
            # What the call chose: its own path, or for "auto" the megakernel at these sizes
            # (<= 512 tokens) unless the fused path, run before, was unsupported here.
            fused_ok = "fused" in ok_paths or "fused" not in paths
            want = path if path != "auto" else ("fused" if fused_ok else "pipeline")
            res.record(f"last_path after path={path} T={t_count} ({tag})", layer.last_path == want,
                       f"last_path={layer.last_path} expected {want}")

        if unsupported:
            continue
        # The default: out allocated by the binding, stream from torch.
        x, idx, wts = make_inputs(cfg, 24 + rank, gen, device)
        y = layer(x, idx, wts, path=path)
        torch.cuda.synchronize()
        err = rel_err(y, reference(cfg, x, idx, wts, w1d, w2d))
        res.record(f"forward out=None path={path}", y.shape == x.shape and err <= tol,
                   f"rel_err={err:.2e}")
        check_hot_path(res, layer, cfg, rank, device, path, gen)
        check_graph(res, layer, cfg, rank, device, path, tol, w1d, w2d, gen)
        check_cupy(res, layer, cfg, device, path, tol, w1d, w2d, gen)
        ok_paths.append(path)
    # The JAX checks run last (see run()): starting JAX's GPU backend may change the current
    # device and takes GPU memory, so it must not come before anything else.
    return dict(layer=layer, cfg=cfg, tol=tol, w1d=w1d, w2d=w2d, paths=ok_paths)


def jax_device(local_rank):
    """This rank's GPU as a JAX device, or (None, why) when JAX cannot be confined to it.

    JAX is told to use only that GPU (JAX_CUDA_VISIBLE_DEVICES, set before jax is imported,
    and jax_cuda_visible_devices, which counts while the backend has not started): otherwise
    every rank's JAX opens every GPU and may leave another one current. The device is then
    picked by its hardware ordinal, never by position."""
    import jax
    try:
        jax.config.update("jax_cuda_visible_devices", str(local_rank))
    except Exception:  # an older JAX, or the backend already up: the checks below decide
        pass
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        return None, f"JAX has no GPU backend ({e})"
    mine = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == local_rank]
    if len(mine) != 1:
        seen = [(d.id, getattr(d, "local_hardware_id", None)) for d in gpus]
        return None, (f"cannot confine JAX to cuda:{local_rank}: its GPUs (id, hardware id) "
                      f"are {seen}")
    return mine[0], None


def check_jax(res, entry, device, path, gen):
    """JAX arrays as inputs (out is a torch tensor: JAX arrays are immutable). Every rank takes
    part in every agreement whatever happens locally; the torch device is restored after each
    use of JAX."""
    import torch
    layer, cfg, tol = entry["layer"], entry["cfg"], entry["tol"]
    name = f"jax inputs path={path} ({cfg['dtype']})"
    OK, SKIP, FAIL = 0, 1, 2
    code, why = OK, ""
    x, idx, wts = make_inputs(cfg, 29, gen, device)
    torch.cuda.synchronize()
    jargs = None
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        code, why = SKIP, "jax not installed"
    if code == OK:
        try:
            jdev, why = jax_device(device.index)
            if jdev is None:
                code = SKIP
            else:
                jargs = tuple(jax.device_put(jnp.from_dlpack(t), jdev) for t in (x, idx, wts))
                where = [a.devices() for a in jargs]
                if any(d != {jdev} for d in where):
                    code, why = SKIP, f"JAX put the inputs on {where}, not on {jdev}"
        except Exception as e:
            code, why = FAIL, f"JAX device / jnp.from_dlpack: {type(e).__name__}: {e}"
        finally:
            restore_device()
    worst = agree_max(code)  # forward is collective: all ranks call it, or none
    if worst != OK:
        if code != OK:
            res.record(name, None if code == SKIP else False, why)
        else:
            res.record(name, None if worst == SKIP else False, "skipped on a peer")
        return
    y = torch.full_like(x, float("nan"))
    try:
        layer(*jargs, out=y, path=path)
        torch.cuda.synchronize()
    finally:
        restore_device()
    err = rel_err(y, reference(cfg, x, idx, wts, entry["w1d"], entry["w2d"]))
    res.record(name, bool(torch.isfinite(y.float()).all()) and err <= tol, f"rel_err={err:.2e}")


def check_cupy(res, layer, cfg, device, path, tol, w1d, w2d, gen):
    """The same layer fed CuPy arrays (bf16 as int16 bits: CuPy has no bfloat16), out=None."""
    import torch
    try:
        import cupy
    except ImportError:
        agree(False)
        res.record(f"cupy inputs path={path}", None, "cupy not installed")
        return
    if not agree(True):
        return
    x, idx, wts = make_inputs(cfg, 27, gen, device)
    torch.cuda.synchronize()
    with cupy.cuda.Device(device.index):
        cx = cupy.from_dlpack(x.view(torch.int16))
        y = layer(cx, cupy.from_dlpack(idx), cupy.from_dlpack(wts), path=path)
        cupy.cuda.get_current_stream().synchronize()
    restore_device()
    ty = torch.from_dlpack(y).view(torch.bfloat16)
    err = rel_err(ty, reference(cfg, x, idx, wts, w1d, w2d))
    res.record(f"cupy inputs, out=None path={path}",
               isinstance(y, cupy.ndarray) and y.dtype == cupy.int16 and err <= tol,
               f"rel_err={err:.2e}")


def check_hot_path(res, layer, cfg, rank, device, path, gen):
    """Layer.__call__'s torch hot path (epmoe/_torch_fast.py) against the DLPack path, which an
    explicit stream other than torch's current one selects: bitwise the same output; an explicit
    current stream takes the hot path (same output); and the host time of each (info)."""
    import time
    import torch
    x, idx, wts = make_inputs(cfg, 5 + 2 * rank, gen, device)
    other = torch.cuda.Stream(device)
    y_fast = layer(x, idx, wts, path=path)
    y_dlpack = layer(x, idx, wts, path=path, stream=other)
    torch.cuda.current_stream().wait_stream(other)
    y_current = layer(x, idx, wts, path=path, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    res.record(f"torch hot path == DLPack path ({path})", torch.equal(y_fast, y_dlpack),
               f"T={x.shape[0]}")
    res.record(f"stream=current_stream() == hot path ({path})", torch.equal(y_fast, y_current),
               f"T={x.shape[0]}")
    stream = torch.cuda.current_stream()
    for name, kw in (("hot path", {}), ("stream=current_stream()", {"stream": stream}),
                     ("DLPack path", {"stream": other})):
        torch.cuda.synchronize()
        agree(True)  # every rank starts together: the calls are collective
        t0 = time.perf_counter()
        for _ in range(20):
            layer(x, idx, wts, out=y_fast, path=path, **kw)
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        res.record(f"host time per eager call, {name} ({path}, info)", True, f"{host_us:.1f} us")
    layer.check_device_error()


def check_graph(res, layer, cfg, rank, device, path, tol, w1d, w2d, gen):
    """Capture one forward in a CUDA graph, then replay it on new inputs in the same buffers."""
    import torch
    t_count = cfg["max_tokens_per_rank"] // 2 + rank
    x, idx, wts = make_inputs(cfg, t_count, gen, device)
    y = torch.empty(t_count, cfg["hidden"], dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on a side stream
        layer(x, idx, wts, out=y, path=path)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            layer(x, idx, wts, out=y, path=path)
    except Exception as e:  # report, then keep the ranks in step
        res.record(f"cuda graph capture path={path}", False, f"{type(e).__name__}: {e}")
        agree(False)
        return
    if not agree(True):
        return
    worst, finite = 0.0, True
    for _ in range(3):
        nx, nidx, nwts = make_inputs(cfg, t_count, gen, device)
        x.copy_(nx), idx.copy_(nidx), wts.copy_(nwts)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        finite &= bool(torch.isfinite(y.float()).all())
        worst = max(worst, rel_err(y, reference(cfg, nx, nidx, nwts, w1d, w2d)))
    layer.check_device_error()
    res.record(f"cuda graph replay x3 path={path} T={t_count}", finite and worst <= tol,
               f"rel_err={worst:.2e} finite={finite}")


def check_errors(res, layer, cfg, rank, device, path):
    """Python-side and device-side errors raise epmoe exceptions with the library's message."""
    import torch
    import epmoe
    h, k = cfg["hidden"], cfg["topk"]
    x = torch.randn(4, h, device=device).bfloat16()
    idx = torch.arange(k, dtype=torch.int32, device=device).repeat(4, 1)  # distinct experts
    wts = torch.ones(4, k, device=device)
    cases = [
        ("float32 x", dict(x=x.float()), "x must be bfloat16"),
        ("host x", dict(x=x.cpu()), "x must be on the CUDA device"),
        ("int16 topk_idx", dict(idx=idx.short()), "topk_idx must be int32 or int64; got int16"),
        ("non-contiguous x", dict(x=torch.randn(h, 4, device=device).bfloat16().T),
         "x must be contiguous"),
        ("too many tokens", dict(x=torch.zeros(cfg["max_tokens_per_rank"] + 1, h, device=device,
                                               dtype=torch.bfloat16)),
         "max_tokens_per_rank"),
    ]
    for name, over, message in cases:
        a = dict(x=x, idx=idx, wts=wts)
        a.update(over)
        try:
            layer(a["x"], a["idx"], a["wts"], path=path)
            res.record(f"error: {name}", False, "no exception")
        except epmoe.InvalidArgument as e:
            res.record(f"error: {name}", message in str(e), f"-> {e}")
    # An expert index out of range is seen on the GPU: the call itself returns, the next
    # check_device_error() raises. Rank 0 sends the bad index; every rank takes part.
    bad = idx.clone()
    if rank == 0:
        bad[1, 0] = cfg["num_experts"] + 3
    layer(x, bad, wts, path=path)
    try:
        layer.check_device_error()
        raised = None
    except epmoe.Error as e:
        raised = e
    if rank == 0:
        res.record("error: expert index out of range (device-side)", raised is not None,
                   f"-> {type(raised).__name__}: {raised}" if raised else "no exception")
    agree(True)


def check_dispatcher(res, rank, world, device):
    """Standalone dispatch / combine with a trivial expert (o = routing weight * x)."""
    import torch
    import epmoe
    e, h, k, t_max = 4 * world, 256, 3, 64
    disp = epmoe.Dispatcher(None, e, h, k, t_max, dtype="bf16")
    gen = torch.Generator().manual_seed(7 + rank)
    cfg = dict(num_experts=e, hidden=h, topk=k)
    x, idx, wts = make_inputs(cfg, t_max - 5 * rank, gen, device)
    disp.dispatch(x, idx, wts)
    pool = {name: torch.from_dlpack(a) for name, a in disp.pool.items()}
    valid = (pool["row_source"] != -1)[:, None]
    o = (pool["x_pool"].float() * pool["row_weight"][:, None]).bfloat16()
    pool["o_pool"].copy_(torch.where(valid, o, torch.zeros_like(o)))
    y = torch.full_like(x, float("nan"))
    disp.combine(y)
    torch.cuda.synchronize()
    disp.check_errors()
    contrib = (x.float()[:, None, :] * wts[:, :, None]).bfloat16().float()
    contrib = torch.where((idx >= 0)[:, :, None], contrib, torch.zeros_like(contrib))
    ref = contrib.sum(dim=1).bfloat16()
    err = rel_err(y, ref)
    rows = int(pool["expert_offset"][-1].item())
    res.record(f"dispatcher bf16 dispatch -> o_pool (torch via DLPack) -> combine T={x.shape[0]}",
               bool(torch.isfinite(y.float()).all()) and err <= 5e-3,
               f"rel_err={err:.2e} pool_rows={rows}")


def histogram(idx, num_experts, lo, hi):
    """Rows each expert in [lo, hi) receives from every rank's routing `idx` (a collective)."""
    import torch
    import torch.distributed as dist
    valid = idx[idx >= 0].long()
    hist = torch.bincount(valid, minlength=num_experts).to(DEVICE)
    dist.all_reduce(hist)
    return hist[lo:hi]


def check_workspace(res, rank, world, device):
    """Two layers of different shapes and dtypes on one epmoe.Workspace (A copies its weights, B
    references them through epmoe.transform_w13), called in turn: each equals the same layer on its
    own buffers bitwise and the reference within SPEC's bound; int64 routing equals int32; the
    expert counts equal the routing's histogram; the workspace's size does not change, and it
    refuses to close while a layer is open."""
    import torch
    import epmoe
    cfg_a = dict(dtype="fp8", num_experts=4 * world, hidden=512, intermediate=256, topk=4,
                 max_tokens_per_rank=96)
    cfg_b = dict(dtype="bf16", num_experts=2 * world, hidden=384, intermediate=128, topk=2,
                 max_tokens_per_rank=64, activation_clamp=0.5)
    keys = ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank", "dtype")
    wcfg = epmoe.WorkspaceConfig.for_layers(
        [epmoe.LayerConfig(world, *(c[k] for k in keys)) for c in (cfg_a, cfg_b)])
    ws = epmoe.Workspace(None, wcfg)
    nbytes = ws.nbytes
    res.record("workspace nbytes == WorkspaceConfig.sizes()", nbytes == wcfg.sizes()["total"],
               f"{nbytes} bytes ({wcfg.dtype}, serves both layers)")

    def weights(cfg, seed):
        (w1, w1s, w2, w2s), (w1d, w2d) = make_weights(cfg, torch.Generator().manual_seed(seed),
                                                      device)
        e_loc = cfg["num_experts"] // world
        sl = slice(rank * e_loc, (rank + 1) * e_loc)
        part = tuple(None if w is None else w[sl].contiguous() for w in (w1, w1s, w2, w2s))
        return part, (w1d, w2d), (sl.start, sl.stop)

    def layer(cfg, **kw):
        return epmoe.Layer(None, *(cfg[k] for k in keys[:5]), dtype=cfg["dtype"],
                           activation_clamp=cfg.get("activation_clamp"), **kw)

    (a1, a1s, a2, a2s), ref_a, range_a = weights(cfg_a, 1234)
    (b1, b1s, b2, b2s), ref_b, range_b = weights(cfg_b, 4321)
    la = layer(cfg_a, workspace=ws)
    la.load_weights(a1, a1s, a2, a2s)
    b13, b13s = epmoe.transform_w13(b1, b1s)  # bf16: no scale
    lb = layer(cfg_b, workspace=ws, weights={"w13": b13, "w2": b2})
    la_own, lb_own = layer(cfg_a), layer(cfg_b)
    la_own.load_weights(a1, a1s, a2, a2s)
    lb_own.load_weights(b1, b1s, b2, b2s)
    res.record("two layers on the workspace: nbytes unchanged, num_layers == 2",
               ws.nbytes == nbytes and ws.num_layers == 2,
               f"nbytes {ws.nbytes} num_layers {ws.num_layers} by_reference {lb.by_reference}")
    try:
        ws.close()
        refused = False
    except epmoe.InvalidArgument as e:
        refused = "still li" in str(e)
    res.record("workspace close refused while its layers are open", refused and not ws.closed)

    gen = torch.Generator().manual_seed(500 + rank)
    total = torch.zeros(range_a[1] - range_a[0], dtype=torch.int64, device=device)
    want_total = torch.zeros_like(total)
    for call in range(3):
        t_a = cfg_a["max_tokens_per_rank"] - 9 * rank - 4 * call
        t_b = 0 if (rank == 0 and call == 1) else 40 - 5 * rank
        xa, ia, wa = make_inputs(cfg_a, t_a, gen, device)
        xb, ib, wb = make_inputs(cfg_b, t_b, gen, device)
        counts = torch.full((range_a[1] - range_a[0],), -1, dtype=torch.int32, device=device)
        ya = la(xa, ia, wa, expert_counts=counts, expert_counts_total=total)
        yb = lb(xb, ib.long(), wb)
        ya_own, yb_own = la_own(xa, ia, wa), lb_own(xb, ib, wb)
        ya64 = la(xa, ia.long(), wa)
        torch.cuda.synchronize()
        la.check_device_error()
        hist = histogram(ia, cfg_a["num_experts"], *range_a)
        want_total += hist
        err_a = rel_err(ya, reference(cfg_a, xa, ia, wa, *ref_a)) if t_a else 0.0
        err_b = rel_err(yb, reference(cfg_b, xb, ib, wb, *ref_b)) if t_b else 0.0
        res.record(f"workspace call {call}: A == A on its own buffers (bitwise), int64 == int32",
                   torch.equal(ya.view(torch.int16), ya_own.view(torch.int16))
                   and torch.equal(ya64.view(torch.int16), ya.view(torch.int16)))
        res.record(f"workspace call {call}: B by reference, int64 == B copied, int32 (bitwise)",
                   torch.equal(yb.view(torch.int16), yb_own.view(torch.int16)))
        res.record(f"workspace call {call}: A, B vs reference (T={t_a}, {t_b})",
                   err_a <= 1e-2 and err_b <= 5e-3, f"rel_err {err_a:.2e} (fp8), {err_b:.2e} (bf16)")
        res.record(f"workspace call {call}: expert counts == the routing's histogram",
                   torch.equal(counts.long(), hist), f"{counts.tolist()} vs {hist.tolist()}")
    res.record("workspace: running expert counts == the sum of the histograms",
               torch.equal(total, want_total), f"{total.tolist()} vs {want_total.tolist()}")
    for l in (la, lb, la_own, lb_own):
        l.close()
    ws.close()
    try:
        layer(cfg_a, workspace=ws)
        reused = "no exception"
    except epmoe.InvalidArgument as e:
        reused = str(e)
    res.record("after its layers: workspace closed; a layer on it is refused",
               ws.closed and "this Workspace was closed" in reused, f"-> {reused}")
    agree(True)


def abort(res, what):
    """After an exception the ranks may be out of step in their collectives, and a peer may
    already wait in one for ever: never go on. Exit non-zero at once; the launcher (torchrun,
    mp.spawn) then stops the other ranks, and their own watchdog stops them in any case."""
    print(f"[rank {res.rank}] ABORT after {what}: {res.passed} passed, {res.failed} failed "
          f"so far on this rank; exiting with status 1", flush=True)
    sys.stderr.flush()
    os._exit(1)


def run(rank, world, local_rank, timeout):
    global DEVICE
    # The watchdog: whatever hangs (a collective whose peer died, a stuck kernel), this rank
    # prints every thread's stack and exits with status 1 after `timeout` seconds.
    faulthandler.dump_traceback_later(timeout, exit=True)
    os.environ["JAX_CUDA_VISIBLE_DEVICES"] = str(local_rank)  # before jax is imported
    import torch
    import torch.distributed as dist
    import epmoe

    DEVICE = device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    res = Results(rank)
    if rank == 0:
        print(f"epmoe {epmoe.version()} from {epmoe.library_path()}, NCCL code "
              f"{epmoe.nccl_version()}, torch {torch.__version__}, {world} ranks", flush=True)
    paths = [p for p in os.environ.get("EPMOE_TEST_PATHS", "pipeline,fused,auto").split(",") if p]
    configs = [
        dict(dtype="fp8", num_experts=4 * world, hidden=512, intermediate=256, topk=4,
             max_tokens_per_rank=96),
        dict(dtype="bf16", num_experts=2 * world, hidden=384, intermediate=128, topk=2,
             max_tokens_per_rank=64, activation_clamp=0.5),
    ]

    def step(name, fn):
        """Runs one step on every rank; an exception anywhere ends the run (see abort)."""
        restore_device()
        try:
            return fn()
        except Exception as e:
            res.record(name, False, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            abort(res, f"an exception in step '{name}'")

    entries = [step(f"layer {c['dtype']}", lambda c=c: check_layer(res, c, rank, world, device,
                                                                     paths))
               for c in configs]
    step("errors", lambda: check_errors(res, entries[-1]["layer"], configs[-1], rank, device,
                                        "pipeline"))
    step("dispatcher", lambda: check_dispatcher(res, rank, world, device))
    step("workspace", lambda: check_workspace(res, rank, world, device))
    # JAX last: starting its GPU backend is the one thing here that touches the current device.
    gen = torch.Generator().manual_seed(300 + rank)
    for entry in entries:
        for path in entry["paths"]:
            step(f"jax path={path}", lambda e=entry, p=path: check_jax(res, e, device, p, gen))

    restore_device()
    return finish(res, "gpu_test_layer", device, local_rank)


def finish(res, name, device, local_rank):
    """The totals over ranks (printed by rank 0), then the process group's end; returns this
    run's failure count over all ranks."""
    import torch
    import torch.distributed as dist
    totals = torch.tensor([res.passed, res.failed, res.skipped], device=device)
    dist.all_reduce(totals)
    dist.barrier(device_ids=[local_rank])
    if res.rank == 0:
        p, f, s = (int(v) for v in totals.tolist())
        print(f"{name}: {p} passed, {f} failed, {s} skipped", flush=True)
    failed = int(totals[1].item())
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return failed


def _spawned(local_rank, run_fn, world, port, timeout):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if run_fn(local_rank, world, local_rank, timeout):
        sys.stdout.flush()
        os._exit(1)


def main(run_fn=None, doc=None, default_timeout=180, timeout_note=""):
    """Runs `run_fn(rank, world, local_rank, timeout)` (default: this file's run) on every rank:
    under torchrun, or spawning --nproc ranks itself. Also the entry of gpu_test_torch.py."""
    run_fn = run_fn or run
    ap = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    ap.add_argument("--timeout", type=float,
                    default=float(os.environ.get("EPMOE_TEST_TIMEOUT", str(default_timeout))),
                    help="each rank exits with status 1 after this many seconds "
                         f"(default $EPMOE_TEST_TIMEOUT or {default_timeout}{timeout_note})")
    args = ap.parse_args()
    # The launching process gets a little longer than the ranks, so that their stacks print.
    faulthandler.dump_traceback_later(args.timeout + 30, exit=True)
    try:
        import torch
    except ImportError:
        print("SKIPPED: torch is not installed")
        return 0
    # As many GPUs as ranks: WORLD_SIZE under torchrun, --nproc otherwise (1 runs every check on one
    # GPU, without cross-GPU traffic).
    want = max(1, int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.nproc)
    if not torch.cuda.is_available() or torch.cuda.device_count() < want:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"SKIPPED: needs {want} GPUs, found {n}")
        return 0
    if "RANK" in os.environ:  # under torchrun
        return 1 if run_fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                           int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), args.timeout) else 0
    import socket
    import torch.multiprocessing as mp
    world = min(args.nproc, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned, args=(run_fn, world, port, args.timeout), nprocs=world, join=True)
    except mp.ProcessRaisedException as e:
        print(f"FAILED: {e}")
        return 1
    except mp.ProcessExitedException as e:
        print(f"FAILED: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
