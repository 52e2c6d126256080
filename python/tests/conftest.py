"""Helpers for the CPU tests: stand-in tensors that claim to live on a GPU, built with ctypes."""

import ctypes

import pytest

# Why torch first, when it is installed: it must load its own libnccl before libepmoe_c.so does.
# Where the system's libnccl differs from torch's (this CPU machine), the other order makes
# `import torch` fail, and the torch tests would skip as if torch were missing.
try:
    import torch  # noqa: F401
except ImportError:
    pass

from epmoe import _dlpack

_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))

_CODES = {name: code for code, name in _dlpack._DTYPES.items()}


class FakeTensor:
    """A DLPack producer whose tensor is described but never touched: any device, dtype, shape,
    strides and address. Only epmoe's checks look at it, so no memory stands behind `ptr`."""

    def __init__(self, shape, dtype="bfloat16", device=(2, 0), ptr=0x7F0000000000, strides=None,
                 read_only=False, versioned=True):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.ptr, self.strides, self.read_only, self.versioned = ptr, strides, read_only, versioned
        self.streams = []  # the stream argument of every __dlpack__ call

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        versioned = self.versioned and max_version is not None
        m = _dlpack.DLManagedTensorVersioned() if versioned else _dlpack.DLManagedTensor()
        ndim = len(self.shape)
        self._shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        t = m.dl_tensor
        t.data = self.ptr
        t.device = _dlpack.DLDevice(*self.device)
        t.ndim = ndim
        code, bits = _CODES[self.dtype]
        t.dtype = _dlpack.DLDataType(code, bits, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            self._strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        if versioned:
            m.version = _dlpack.DLPackVersion(1, 0)
            m.flags = 1 if self.read_only else 0
        self._managed = m  # no deleter: the test object owns the struct
        name = b"dltensor_versioned" if versioned else b"dltensor"
        return _new_capsule(ctypes.addressof(m), name, None)


@pytest.fixture
def fake():
    return FakeTensor
