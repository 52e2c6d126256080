"""Weights by reference: the one-time W1 transform (:func:`transform_w13`) and the checks of the
tensors a layer on a workspace reads in place (``Layer(..., workspace=ws, weights=...)``)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from . import _checks, _dlpack, _frameworks, _lib
from ._checks import BF16, FP8, FP32, WEIGHT
from ._errors import InvalidArgument

REF_NAMES = ("w13", "w13_scale", "w2", "w2_scale")
_DIMS = {"w13": ("E_loc", "2*I", "H"), "w13_scale": ("E_loc", "2*I/128", "H/128"),
         "w2": ("E_loc", "H", "I"), "w2_scale": ("E_loc", "H/128", "I/128")}


def transform_w13(w13: Any, w13_scale: Any = None, *, out: Any = None, out_scale: Any = None,
                  stream: Any = None) -> tuple[Any, Any]:
    """W1 in the checkpoint layout into the kernels' layout, for a layer that references its
    weights (docs/GEMM.md, "The W1 interleave"; docs/LAYOUTS.md names the checkpoint tensors).

    w13 [E_loc, 2I, H]: rows 0..I-1 of each expert the gate projection, I..2I-1 the up projection;
    e4m3 (``float8_e4m3fn`` or its bits as uint8 / int8) with w13_scale fp32 [E_loc, 2I/128, H/128],
    or bf16 (or its bits as uint16 / int16) with no scale. The result goes to `out` (and
    `out_scale`): same shapes and dtypes, on w13's GPU, not overlapping the inputs; new tensors of
    w13's framework (torch, CuPy) when None. Runs on `stream` (default: the framework's current
    stream) without a host sync. Returns (out, out_scale); out_scale is None for bf16.
    """
    dev_type, device = _dlpack.dlpack_device(w13, "w13")
    if dev_type == -1:  # a producer without __dlpack_device__: its capsule says
        seen = _dlpack.view(w13, "w13", None)
        dev_type, device = seen.device_type, seen.device_id
    if dev_type != _dlpack.KDL_CUDA:
        where = _dlpack._DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
        raise InvalidArgument(f"w13 must be on a CUDA device (the transform runs there); got a "
                              f"tensor on {where}:{device}")
    s, ds = _frameworks.resolve_stream(stream, w13, device)
    v = _checks.tensor(w13, "w13", dtypes=WEIGHT, shape=(None, None, None),
                       dims=_DIMS["w13"], device=device, stream=ds, align=16)
    fp8 = v.dtype in FP8
    e, two_i, h = v.shape
    if two_i % 256 or h % 128 or e < 1 or two_i == 0 or h == 0:
        raise InvalidArgument(f"w13 must have shape (E_loc, 2*I, H) with E_loc >= 1 and I, H positive "
                              f"multiples of 128; got {tuple(v.shape)}")
    scale_shape = (e, two_i // 128, h // 128)
    if fp8 and w13_scale is None:
        raise InvalidArgument("w13_scale is required for an e4m3 w13")
    if not fp8 and (w13_scale is not None or out_scale is not None):
        raise InvalidArgument("w13_scale and out_scale must be None for a bf16 w13 (no weight scales)")
    sv = _checks.tensor(w13_scale, "w13_scale", dtypes=FP32, shape=scale_shape,
                        dims=_DIMS["w13_scale"], device=device, stream=ds) if fp8 else None
    if out is None:
        out = _frameworks.empty(w13, tuple(v.shape), device)
    ov = _checks.tensor(out, "out", dtypes=(v.dtype,), shape=tuple(v.shape), dims=_DIMS["w13"],
                        device=device, stream=ds, align=16, writable=True)
    _checks.no_overlap(ov, v, *([sv] if sv else []))
    osv = None
    if fp8:
        if out_scale is None:
            out_scale = _frameworks.empty(w13_scale, scale_shape, device)
        osv = _checks.tensor(out_scale, "out_scale", dtypes=FP32, shape=scale_shape,
                             dims=_DIMS["w13_scale"], device=device, stream=ds, writable=True)
        _checks.no_overlap(osv, v, sv, ov)
    _lib.call("epmoe_transform_w13", _lib.DTYPE_FP8 if fp8 else _lib.DTYPE_BF16, v.ptr,
              sv.ptr if sv else None, ov.ptr, osv.ptr if osv else None, e, two_i // 2, h, s)
    return out, out_scale


def weight_refs(weights: Any, config: Any, device: int) -> tuple[_lib.WeightRefsC, tuple]:
    """The C struct of `weights` (a mapping with keys 'w13', 'w13_scale', 'w2', 'w2_scale'; the
    scales absent or None in bf16 mode) for a layer of `config` on cuda:`device`, and the objects
    the layer must keep alive. Raises InvalidArgument naming the tensor."""
    if not isinstance(weights, Mapping):
        raise InvalidArgument(f"weights must be a dict with keys {', '.join(map(repr, REF_NAMES))} "
                              f"(scales None in bf16 mode); got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(REF_NAMES))
    if unknown:
        raise InvalidArgument(f"weights has unknown keys {unknown}; the keys are "
                              f"{', '.join(map(repr, REF_NAMES))}")
    shapes = config.weight_shapes()
    shapes = {"w13": shapes["w1"], "w13_scale": shapes["w1_scale"], "w2": shapes["w2"],
              "w2_scale": shapes["w2_scale"]}
    fp8 = config.dtype == "fp8"
    refs = _lib.WeightRefsC()
    for name in REF_NAMES:
        obj = weights.get(name)
        scale = name.endswith("_scale")
        if scale and not fp8:
            if obj is not None:
                raise InvalidArgument(f"weights[{name!r}] must be None in bf16 mode")
            continue
        if obj is None:
            raise InvalidArgument(f"weights[{name!r}] is required" + (" in fp8 mode" if scale else ""))
        _, ds = _frameworks.resolve_stream(None, obj, device)
        v = _checks.tensor(obj, f"weights[{name!r}]", dtypes=FP32 if scale else (FP8 if fp8 else BF16),
                           shape=shapes[name], dims=_DIMS[name], device=device, stream=ds,
                           align=4 if scale else 16)
        setattr(refs, name, v.ptr)
    return refs, tuple(weights.get(n) for n in REF_NAMES)


def null_refs() -> ctypes.Structure:
    """Weight references the library refuses (w13 null): passed by a rank whose own checks failed,
    so that every rank fails creation together instead of waiting for it."""
    return _lib.WeightRefsC()
