"""Argument checks done in Python before calling into the library, so that a wrong tensor gets a
message naming the argument, what was expected and what was seen. The library checks again."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

from . import _dlpack
from ._dlpack import KDL_CPU, KDL_CUDA, TensorView
from ._errors import InvalidArgument

INT32_MAX = 2**31 - 1

# Accepted element types: the SPEC type, plus same-width integers holding its raw bits (CuPy and
# NumPy have no bfloat16 or float8 dtype).
BF16 = ("bfloat16", "uint16", "int16")
FP8 = ("float8_e4m3fn", "uint8", "int8")
FP32 = ("float32",)
INT32 = ("int32",)
INT64 = ("int64",)
INDEX = ("int32", "int64")  # topk_idx: either, no conversion
WEIGHT = FP8 + BF16  # a weight tensor of either mode (the dtype tells which)


def int_arg(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer argument (numpy integers too, never bool or float) that fits in int32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise InvalidArgument(f"{name}={value} does not fit in a 32-bit int")
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name}={value} must be >= {minimum}")
    return value


def float_arg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgument(f"{name}={value} must be finite")
    return value


def choice_arg(name: str, value: Any, choices: dict) -> Any:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise InvalidArgument(f"{name}={value!r} must be one of {allowed}")
    return choices[value]


def _dtype_text(dtypes: Iterable[str]) -> str:
    dtypes = tuple(dtypes)
    if len(dtypes) == 1:
        return dtypes[0]
    if dtypes == INDEX:
        return "int32 or int64"
    if dtypes == WEIGHT:
        return "float8_e4m3fn or bfloat16 (or a same-width integer type holding the bits)"
    return f"{dtypes[0]} (or {' / '.join(dtypes[1:])} holding its bits)"


def _shape_text(shape: tuple, names: tuple) -> str:
    dims = ", ".join("?" if s is None else str(s) for s in shape)
    return f"({dims}) = ({', '.join(names)})"


def tensor(obj: Any, name: str, *, dtypes: tuple, shape: tuple, dims: tuple,
           device: int | None, stream: int | None, on_cuda: bool = True, align: int = 4,
           writable: bool = False) -> TensorView:
    """Reads `obj` through DLPack and checks it. `shape` holds ints and None (any size), `dims`
    the names of the dimensions for the message. With on_cuda=False host memory is also accepted."""
    dev_type, dev_id = _dlpack.dlpack_device(obj, name)
    if dev_type != -1:
        _check_device(name, dev_type, dev_id, device, on_cuda)
    v = _dlpack.view(obj, name, stream)
    _check_device(name, v.device_type, v.device_id, device, on_cuda)
    if v.dtype not in dtypes:
        raise InvalidArgument(f"{name} must be {_dtype_text(dtypes)}; got {v.dtype}")
    if len(v.shape) != len(shape) or any(e is not None and e != s for e, s in zip(shape, v.shape)):
        raise InvalidArgument(f"{name} must have shape {_shape_text(shape, dims)}; got "
                              f"{tuple(v.shape)}")
    if not v.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous (row-major, no gaps); got strides "
                              f"{v.strides} for shape {tuple(v.shape)} (call .contiguous())")
    if v.numel > 0 and v.ptr % align != 0:
        raise InvalidArgument(f"{name} must start at a {align}-byte aligned address; its data "
                              f"starts at 0x{v.ptr:x}")
    if writable and v.read_only:
        raise InvalidArgument(f"{name} is read-only (its producer exported it with the DLPack "
                              f"read-only flag); pass a writable tensor")
    return v


def _check_device(name: str, dev_type: int, dev_id: int, device: int | None, on_cuda: bool) -> None:
    if dev_type == KDL_CUDA:
        if device is not None and dev_id != device:
            raise InvalidArgument(f"{name} is on cuda:{dev_id} but this epmoe object lives on "
                                  f"cuda:{device}")
        return
    where = _dlpack._DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
    if on_cuda:
        target = "a CUDA device" if device is None else f"the CUDA device cuda:{device}"
        raise InvalidArgument(f"{name} must be on {target}; got a tensor on {where}:{dev_id}")
    if dev_type != KDL_CPU:
        raise InvalidArgument(f"{name} must be in CUDA or host memory; got {where}:{dev_id}")


def ranges_overlap(a_ptr: int, a_bytes: int, b_ptr: int, b_bytes: int) -> bool:
    """Whether two byte ranges share a byte (an empty range shares none)."""
    return a_bytes > 0 and b_bytes > 0 and a_ptr < b_ptr + b_bytes and b_ptr < a_ptr + a_bytes


def no_overlap(out: TensorView, *inputs: TensorView) -> None:
    """The output may not share memory with an input (peers read the inputs while it is written)."""
    for v in inputs:
        if out.numel and v.numel and ranges_overlap(out.ptr, out.nbytes, v.ptr, v.nbytes):
            raise InvalidArgument(f"{out.name} overlaps {v.name} in memory; epmoe needs a separate "
                                  f"output buffer")
