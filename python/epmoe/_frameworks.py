"""The few things epmoe asks of the caller's framework: its current CUDA stream and, when the
caller gives no `out`, a new output tensor. Frameworks are imported only if the tensor is theirs."""

from __future__ import annotations

from typing import Any

from ._errors import InvalidArgument


def _framework(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def stream_handle(stream: Any) -> int:
    """A cudaStream_t value from an int, a torch.cuda.Stream (.cuda_stream) or a CuPy stream (.ptr)."""
    if isinstance(stream, bool):
        raise InvalidArgument(f"stream must be a CUDA stream or an int handle, got {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidArgument(f"stream={stream} must be a cudaStream_t value (>= 0)")
        return stream
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise InvalidArgument(f"stream must be a torch.cuda.Stream, a CuPy stream or an int handle; got "
                          f"{type(stream).__module__}.{type(stream).__qualname__}")


def current_stream(obj: Any, device: int) -> int:
    """The caller's current stream on `device`, as a cudaStream_t value (0: legacy default)."""
    fw = _framework(obj)
    if fw == "torch":
        import torch
        return int(torch.cuda.current_stream(device).cuda_stream)
    if fw == "cupy":
        import cupy
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)
    return 0


def dlpack_stream(handle: int) -> int:
    """The value to pass as __dlpack__(stream=...): DLPack reserves 0, and 1 means the legacy default."""
    return 1 if handle == 0 else handle


def resolve_stream(stream: Any, like: Any, device: int) -> tuple[int, int]:
    """(the cudaStream_t epmoe runs on, the value for __dlpack__(stream=...)).

    With no explicit stream epmoe runs on the framework's current stream, where the inputs were
    produced: torch is told so with -1 (no synchronization, documented by torch); other producers
    get the stream itself, which equals their current one. An explicit stream is handed to the
    producer, which makes it wait for the work pending on its own current stream."""
    if stream is not None:
        handle = stream_handle(stream)
        return handle, dlpack_stream(handle)
    fw = _framework(like)
    if fw in ("torch", "cupy"):
        handle = current_stream(like, device)
        return handle, -1 if fw == "torch" else dlpack_stream(handle)
    return 0, 1


def empty(like: Any, shape: tuple, device: int) -> Any:
    """A new uninitialized tensor of `like`'s framework and dtype, with `shape`, on `device`."""
    fw = _framework(like)
    if fw == "torch":
        import torch
        return torch.empty(shape, dtype=like.dtype, device=torch.device("cuda", device))
    if fw == "cupy":
        import cupy
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=like.dtype)
    raise InvalidArgument(f"out= is required for inputs of type {type(like).__module__}."
                          f"{type(like).__qualname__} (epmoe allocates outputs for torch and CuPy "
                          f"only)")
