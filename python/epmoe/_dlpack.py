"""Reading tensors through the DLPack protocol with ctypes (no framework needed at build time).

``view(obj, name, stream)`` calls ``obj.__dlpack__``, reads the DLTensor inside the capsule and
returns a TensorView. The capsule (and with it the producer's tensor) stays alive as long as the
view does; the capsule is never renamed, so the producer's own capsule destructor releases it.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32
from ctypes import c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidArgument

# DLDeviceType values (dlpack.h).
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}

# (DLDataTypeCode, bits) -> name; lanes must be 1.
_DTYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (6, 8): "bool",
    (7, 8): "float8_e3m4", (8, 8): "float8_e4m3", (9, 8): "float8_e4m3b11fnuz",
    (10, 8): "float8_e4m3fn", (11, 8): "float8_e4m3fnuz", (12, 8): "float8_e5m2",
    (13, 8): "float8_e5m2fnuz", (14, 8): "float8_e8m0fnu",
}
_CODES = {name: key for key, name in _DTYPES.items()}
DTYPE_BYTES = {name: bits // 8 for (code, bits), name in _DTYPES.items()}

_FLAG_READ_ONLY = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    # Why a private prototype: ctypes.pythonapi.X is one shared object whose argtypes anybody
    # (another library, a test) may overwrite.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_is_valid = _capi("PyCapsule_IsValid", c_int, ctypes.py_object, c_char_p)
_capsule_get_pointer = _capi("PyCapsule_GetPointer", c_void_p, ctypes.py_object, c_char_p)


@dataclass
class TensorView:
    """What epmoe needs to know about one tensor, read from its DLTensor."""

    name: str
    ptr: int                    # data + byte_offset (0 for an empty tensor that has no data)
    device_type: int
    device_id: int
    dtype: str
    shape: tuple
    strides: tuple | None       # in elements; None means compact row-major
    read_only: bool
    owner: Any                  # the object the view came from
    capsule: Any = None         # keeps the producer's memory alive

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 1)

    @property
    def device_name(self) -> str:
        name = _DEVICE_NAMES.get(self.device_type, f"device_type {self.device_type}")
        return f"{name}:{self.device_id}"

    def is_contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size == 0:
                return True
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def dlpack_device(obj: Any, name: str) -> tuple[int, int]:
    """(device_type, device_id) of a DLPack producer, with a clear error for non-tensors."""
    if not hasattr(obj, "__dlpack__"):
        raise InvalidArgument(
            f"{name} must be a tensor that supports DLPack (__dlpack__: torch, CuPy, JAX, ...); "
            f"got {type(obj).__module__}.{type(obj).__qualname__}")
    if hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = obj.__dlpack_device__()
        return int(dev_type), int(dev_id)
    return -1, -1


def _export(obj: Any, name: str, stream: int | None) -> Any:
    kwargs = {} if stream is None else {"stream": stream}
    try:
        try:
            return obj.__dlpack__(max_version=(1, 0), **kwargs)
        except TypeError:
            # A producer that predates DLPack 1.0 (no max_version keyword).
            return obj.__dlpack__(**kwargs)
    except Exception as e:
        raw = _raw_bytes_view(obj)
        if raw is not None:
            return _export(raw, name, stream)
        raise InvalidArgument(f"{name} could not be exported through DLPack: "
                              f"{type(e).__name__}: {e}") from e


def _raw_bytes_view(obj: Any) -> Any:
    # Why: some torch versions refuse to export float8 tensors through DLPack. The same bytes as
    # uint8 are accepted wherever epmoe takes e4m3 data.
    dtype = getattr(obj, "dtype", None)
    if type(obj).__module__.split(".")[0] == "torch" and "float8" in str(dtype):
        import torch
        return obj.view(torch.uint8)
    return None


def _detach(obj: Any) -> Any:
    # torch refuses to export a tensor that requires grad; epmoe only reads weights and inputs.
    if getattr(obj, "requires_grad", False) and hasattr(obj, "detach"):
        return obj.detach()
    return obj


def view(obj: Any, name: str, stream: int | None = None) -> TensorView:
    """Reads `obj` through DLPack. `stream` (a cudaStream_t value, 1 = legacy default) is passed
    to CUDA producers, which order their pending work before it; CPU producers get none."""
    dev_type, _ = dlpack_device(obj, name)
    obj = _detach(obj)
    capsule = _export(obj, name, stream if dev_type in (KDL_CUDA, KDL_CUDA_MANAGED) else None)
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        managed = DLManagedTensorVersioned.from_address(
            _capsule_get_pointer(capsule, b"dltensor_versioned"))
        if managed.version.major != 1:
            raise InvalidArgument(f"{name}: the producer speaks DLPack {managed.version.major}."
                                  f"{managed.version.minor}; epmoe reads DLPack 1.x")
        read_only = bool(managed.flags & _FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, b"dltensor"):
        managed = DLManagedTensor.from_address(_capsule_get_pointer(capsule, b"dltensor"))
        read_only = False
    else:
        raise InvalidArgument(f"{name}.__dlpack__() did not return a DLPack capsule "
                              f"(got {type(capsule).__name__}; was it already consumed?)")
    t = managed.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _DTYPES.get((code, bits), f"dlpack(code={code}, bits={bits})")
    if lanes != 1:
        dtype = f"{dtype}x{lanes}"
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    ptr = (t.data or 0) + t.byte_offset
    return TensorView(name=name, ptr=ptr, device_type=t.device.device_type,
                      device_id=t.device.device_id, dtype=dtype, shape=shape, strides=strides,
                      read_only=read_only, owner=obj, capsule=capsule)


# ---- producing: device memory owned by epmoe, exported to frameworks ----------------------------

class DeviceArray:
    """A view of device memory that epmoe owns (e.g. the dispatch pool), exported through DLPack
    (``torch.from_dlpack(a)``, ``cupy.from_dlpack(a)``) and ``__cuda_array_interface__``. It keeps
    its owner alive, and so does every tensor made from it."""

    device_type = KDL_CUDA  # a test subclass describes host memory with KDL_CPU

    def __init__(self, ptr: int, shape: tuple, dtype: str, device_id: int, owner: Any):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device_id = int(device_id)
        self._owner = owner

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device=cuda:{self.device_id},"
                f" ptr=0x{self.ptr:x})")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        # Why no synchronization: epmoe's kernels run on the stream the caller gave them, so the
        # consumer orders its reads itself (as for any tensor produced on its own stream).
        if copy:
            raise BufferError("epmoe.DeviceArray cannot be copied through DLPack")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"epmoe.DeviceArray lives on cuda:{self.device_id}")
        return _make_capsule(self, versioned=max_version is not None and max_version[0] >= 1)

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = {"float32": "<f4", "int32": "<i4", "uint32": "<u4", "bfloat16": "<u2",
                   "uint16": "<u2", "uint8": "|u1", "float8_e4m3fn": "|u1"}[self.dtype]
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}


_DELETER = ctypes.CFUNCTYPE(None, c_void_p)
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, c_void_p)
_capsule_new = _capi("PyCapsule_New", ctypes.py_object, c_void_p, c_void_p, c_void_p)
_capsule_get_name = _capi("PyCapsule_GetName", c_void_p, c_void_p)
_capsule_raw_pointer = _capi("PyCapsule_GetPointer", c_void_p, c_void_p, c_void_p)

# Managed tensors handed out and not yet released, by address: (struct, shape, strides, array).
_live: dict[int, tuple] = {}
_NAMES = {False: ctypes.create_string_buffer(b"dltensor"),
          True: ctypes.create_string_buffer(b"dltensor_versioned")}


@_DELETER
def _release_managed(address: int) -> None:
    _live.pop(address, None)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule_address: int) -> None:
    # Why raw addresses: the capsule is being freed, so it must not be turned into a Python object.
    # A consumer that took the tensor renamed the capsule ("used_..."); only an untaken capsule
    # still owns its managed tensor.
    name = _capsule_get_name(capsule_address)
    for buf in _NAMES.values():
        if name == ctypes.addressof(buf):
            _release_managed(_capsule_raw_pointer(capsule_address, name))


def _make_capsule(arr: DeviceArray, versioned: bool) -> Any:
    ndim = len(arr.shape)
    shape = (c_int64 * max(ndim, 1))(*arr.shape)
    code, bits = _CODES[arr.dtype]
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data = arr.ptr or None
    t.device = DLDevice(arr.device_type, arr.device_id)
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    row_major, step = [], 1
    for size in reversed(arr.shape):
        row_major.insert(0, step)
        step *= size
    strides = (c_int64 * max(ndim, 1))(*row_major)  # DLPack 1.1 wants strides, not NULL
    t.strides = ctypes.cast(strides, POINTER(c_int64))
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = ctypes.cast(_release_managed, c_void_p)
    if versioned:
        managed.version = DLPackVersion(1, 0)
        managed.flags = 0
    address = ctypes.addressof(managed)
    _live[address] = (managed, shape, strides, arr)
    name = _NAMES[versioned]
    return _capsule_new(address, ctypes.cast(name, c_void_p),
                        ctypes.cast(_capsule_destructor, c_void_p))
