"""Exceptions raised by epmoe. Each carries the library's message and status code."""

from __future__ import annotations

# Values of epmoe::StatusCode (include/epmoe/status.h, include/epmoe/c_api.h).
OK = 0
INVALID_ARGUMENT = 1
UNSUPPORTED = 2
CUDA_ERROR = 3
NCCL_ERROR = 4
TIMEOUT = 5
INTERNAL = 6

_CODE_NAMES = {
    INVALID_ARGUMENT: "InvalidArgument",
    UNSUPPORTED: "Unsupported",
    CUDA_ERROR: "CudaError",
    NCCL_ERROR: "NcclError",
    TIMEOUT: "Timeout",
    INTERNAL: "Internal",
}


class Error(RuntimeError):
    """Base class of every epmoe failure.

    ``str(err)`` is the library's message; ``err.code`` the status code and ``err.code_name``
    its name ("InvalidArgument", "CudaError", ...).
    """

    code = INTERNAL

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        return _CODE_NAMES.get(self.code, "Unknown")


class InvalidArgument(Error, ValueError):
    """An argument or a configuration field is out of its allowed range (also a ValueError)."""

    code = INVALID_ARGUMENT


class UnsupportedError(Error):
    """Valid in principle, but not supported by this build, this GPU or this library version."""

    code = UNSUPPORTED


class CudaError(Error):
    """A CUDA runtime or driver call failed."""

    code = CUDA_ERROR


class NcclError(Error):
    """An NCCL call failed, or the loaded NCCL lacks a feature epmoe needs."""

    code = NCCL_ERROR


class DeviceTimeout(Error):
    """A bounded device-side wait expired (a peer never arrived)."""

    code = TIMEOUT


class InternalError(Error):
    """A bug in epmoe."""

    code = INTERNAL


class LibraryError(Error, ImportError):
    """libepmoe_c.so could not be found or loaded, or it does not match this package."""

    code = UNSUPPORTED


_BY_CODE = {
    INVALID_ARGUMENT: InvalidArgument,
    UNSUPPORTED: UnsupportedError,
    CUDA_ERROR: CudaError,
    NCCL_ERROR: NcclError,
    TIMEOUT: DeviceTimeout,
    INTERNAL: InternalError,
}


def error_for(code: int, message: str) -> Error:
    """The exception for a nonzero status code from the C API."""
    cls = _BY_CODE.get(code, Error)
    return cls(message, code if cls is Error else None)
