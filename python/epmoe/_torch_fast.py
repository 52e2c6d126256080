"""The hot path of Layer.__call__ for torch tensors: the same checks as the DLPack path, read from
the tensors' own attributes.

Why: reading a tensor through a DLPack capsule with ctypes costs ~10-30 us of host time, four
tensors per call, plus a torch.cuda.Stream object for the current stream. In an eager decode loop
that host time is longer than the GPU's work (one token per rank runs in ~75 us on the GPUs of the
Qwen3-like shape), so it became the call's time. Here a call costs attribute reads and one C call.

Taken only where it means exactly what the DLPack path means: every tensor a strided torch CUDA
tensor of the SPEC dtype (topk_idx int32 or int64), no explicit stream or an explicit one that is
torch's current stream (is_current_stream; the DLPack path then has nothing to order: the inputs
were made on that stream), and expert counts, if asked for, in torch tensors of their dtype and
shape. Anything else, and any argument that fails a check, goes to the DLPack path, whose messages
name the argument."""

from __future__ import annotations

from typing import Any

import torch

from ._checks import ranges_overlap
from ._lib import forward_args as _forward_args

_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_STRIDED = torch.strided
# Why the private call: torch's own generated code (inductor) uses it; torch.cuda.current_stream()
# builds a Stream object per call.
_raw_stream = torch._C._cuda_getCurrentRawStream


def is_current_stream(stream: Any, dev: int, raw_stream: Any = None) -> bool:
    """Whether `stream` (a torch.cuda.Stream, or a cudaStream_t int) is torch's current stream on
    `dev`. Anything else (another stream, another kind of object) is False: the DLPack path."""
    handle = stream if type(stream) is int else getattr(stream, "cuda_stream", None)
    return type(handle) is int and handle == (raw_stream or _raw_stream)(dev)


def _ok(v: Any, dtype: Any, dev: int, rows: int, cols: int) -> bool:
    return (type(v) is torch.Tensor and v.dtype is dtype and v.layout is _STRIDED and v.dim() == 2
            and v.shape[0] == rows and v.shape[1] == cols and v.get_device() == dev
            and v.is_contiguous())


def _ok1(v: Any, dtype: Any, dev: int, n: int) -> bool:
    return (type(v) is torch.Tensor and v.dtype is dtype and v.layout is _STRIDED and v.dim() == 1
            and v.shape[0] == n and v.get_device() == dev and v.is_contiguous())


def forward(c_forward_args: Any, handle: int, dev: int, hidden: int, topk: int, t_max: int,
            x: Any, topk_idx: Any, topk_weights: Any, out: Any, path_code: int,
            idx_int32: int, idx_int64: int, raw_stream: Any = _raw_stream, *,
            counts: Any = None, totals: Any = None, e_loc: int = 0) -> tuple[bool, Any, int]:
    """(True, out, status of the C call `c_forward_args` (epmoe_layer_forward_args)), the caller
    raising for a nonzero status; or (False, None, 0): not taken, nothing done (no allocation, no
    call). topk_idx may be int32 or int64 (idx_int32 / idx_int64: the C codes). counts / totals:
    the optional expert counts (int32 [e_loc]) and running totals (int64 [e_loc])."""
    if type(x) is not torch.Tensor or x.dim() != 2 or type(topk_idx) is not torch.Tensor:
        return False, None, 0
    t = x.shape[0]
    wide = topk_idx.dtype is _I64
    if not (0 <= t <= t_max and _ok(x, _BF16, dev, t, hidden)
            and _ok(topk_idx, _I64 if wide else _I32, dev, t, topk)
            and _ok(topk_weights, _F32, dev, t, topk)):
        return False, None, 0
    xp, ip, wp = x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
    isize = 8 if wide else 4
    if t and (xp % 16 or ip % isize or wp % 4):
        return False, None, 0
    # The byte ranges the kernels read (t = 0: none) and the expert counts' (written).
    inputs = [(xp, t * hidden * 2), (ip, t * topk * isize), (wp, t * topk * 4)]
    written = []
    for v, dtype, size in ((counts, _I32, 4), (totals, _I64, 8)):
        if v is None:
            written.append((0, 0))
            continue
        if not _ok1(v, dtype, dev, e_loc) or v.data_ptr() % size:
            return False, None, 0
        r = (v.data_ptr(), e_loc * size)
        # Written buffers may share memory with nothing else: the DLPack path's no_overlap check.
        if any(ranges_overlap(*r, *u) for u in inputs + written):
            return False, None, 0
        written.append(r)
    if out is None:
        out = torch.empty((t, hidden), dtype=_BF16, device=x.device)
    elif not _ok(out, _BF16, dev, t, hidden) or (t and out.data_ptr() % 16):
        return False, None, 0
    op = out.data_ptr()
    # The output may not share memory with an input (peers read the inputs while it is written)
    # nor with the expert counts: the DLPack path's no_overlap check, on the same byte ranges.
    ro = (op, t * hidden * 2)
    if any(ranges_overlap(*ro, *u) for u in inputs + written):
        return False, None, 0
    pack, buf, address = _forward_args()
    pack(buf, 0, xp, ip, wp, op, written[0][0], written[1][0], raw_stream(dev), t,
         idx_int64 if wide else idx_int32, path_code)
    return True, out, c_forward_args(handle, address)
