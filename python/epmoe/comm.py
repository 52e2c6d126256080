"""epmoe.Communicator: the NCCL communicator (and symmetric memory) that layers run on."""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from . import _lib
from ._checks import int_arg
from ._errors import InvalidArgument, UnsupportedError


def get_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes). One rank makes it and shares it with the others."""
    buf = (ctypes.c_uint8 * _lib.UNIQUE_ID_BYTES)()
    _lib.call("epmoe_get_unique_id", buf)
    return bytes(buf)


def _destroy(handle: int) -> None:
    _lib.lib().epmoe_comm_destroy(handle)


class Communicator:
    """One rank's NCCL communicator plus the symmetric memory epmoe's kernels reach peers through.

    Make one with :meth:`from_torch` (torch.distributed bootstrap), :meth:`create` (a unique id you
    share yourself) or :meth:`from_nccl_comm` (an ``ncclComm_t`` you already have). Every rank
    makes its communicator collectively. Layers keep their communicator alive.
    """

    _torch_cache: dict = {}
    _torch_lock = threading.Lock()

    def __init__(self, handle: int, owner: Any = None):
        # Use the class methods; this wraps an epmoe_comm* returned by the C API.
        self._handle = handle
        self._owner = owner  # keeps a borrowed communicator's owner alive, if given
        rank, size, device = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        _lib.call("epmoe_comm_info", handle, ctypes.byref(rank), ctypes.byref(size),
                  ctypes.byref(device))
        self.rank, self.size, self.device = rank.value, size.value, device.value
        self._finalizer = weakref.finalize(self, _destroy, handle)
        # Why not at exit: destroying deregisters NCCL windows, a collective; a rank whose peers
        # already left would wait for them. Process exit releases everything anyway.
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else f"cuda:{self.device}"
        return f"epmoe.Communicator(rank={self.rank}, size={self.size}, {state})"

    @classmethod
    def create(cls, unique_id: bytes, rank: int, size: int, device: int) -> "Communicator":
        """Collective over `size` ranks: a new NCCL communicator on CUDA device `device` from
        the shared `unique_id` (see :func:`get_unique_id`)."""
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _lib.UNIQUE_ID_BYTES:
            raise InvalidArgument(f"unique_id must be {_lib.UNIQUE_ID_BYTES} bytes (from "
                                  f"epmoe.get_unique_id()); got {type(unique_id).__name__}"
                                  f"{' of length %d' % len(unique_id) if hasattr(unique_id, '__len__') else ''}")
        rank = int_arg("rank", rank)
        size = int_arg("size", size)
        device = int_arg("device", device)
        buf = (ctypes.c_uint8 * _lib.UNIQUE_ID_BYTES).from_buffer_copy(bytes(unique_id))
        handle = ctypes.c_void_p()
        _lib.call("epmoe_comm_create", buf, rank, size, device, ctypes.byref(handle))
        return cls(handle.value)

    @classmethod
    def from_nccl_comm(cls, comm: int, owner: Any = None) -> "Communicator":
        """Collective: wraps an existing ``ncclComm_t`` given as an integer. The caller keeps it
        alive (pass its owner as `owner` to have this object hold a reference) and destroys it."""
        if isinstance(comm, bool) or not isinstance(comm, int):
            raise InvalidArgument(f"comm must be an ncclComm_t as an int, got "
                                  f"{type(comm).__name__}")
        if comm <= 0:
            raise InvalidArgument(f"comm=0x{comm:x} is not a valid ncclComm_t")
        handle = ctypes.c_void_p()
        _lib.call("epmoe_comm_from_nccl", comm, ctypes.byref(handle))
        return cls(handle.value, owner)

    @classmethod
    def from_torch(cls, group: Any = None, device: int | None = None,
                   cached: bool = True) -> "Communicator":
        """Collective over a torch.distributed process group (None: the default group).

        The group's rank 0 makes an NCCL unique id, ``broadcast_object_list`` shares it, and each
        rank creates its communicator on `device` (default: ``torch.cuda.current_device()``).
        With `cached`, every later call for the same group returns the same communicator, so the
        layers of one model share it.
        """
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            raise UnsupportedError(f"Communicator.from_torch (and Layer(None or a process group, "
                                   f"...)) needs PyTorch: {e}. Without torch, make the "
                                   f"communicator with Communicator.create(unique_id, rank, size, "
                                   f"device) or Communicator.from_nccl_comm(ptr).") from e
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgument("torch.distributed is not initialized: call "
                                  "torch.distributed.init_process_group() first (e.g. under torchrun)")
        if device is None:
            device = torch.cuda.current_device()
        key = (id(group), device)
        if cached:
            with cls._torch_lock:
                hit = cls._torch_cache.get(key)
            if hit is not None and hit[0] is group:
                return hit[1]
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        uid = [get_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group)
        comm = cls.create(uid[0], rank, size, device)
        if cached:
            with cls._torch_lock:
                cls._torch_cache[key] = (group, comm)
        return comm

    def close(self) -> None:
        """Destroys the communicator now. Raises InvalidArgument (and destroys nothing) while a
        Layer or DispatchHandle made from it is still open. Also done at collection, after the
        layers that hold it."""
        if self._handle is not None:
            _lib.call("epmoe_comm_destroy", self._handle)
            self._finalizer.detach()
            self._handle = None

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument("this Communicator was closed")
        return self._handle


def as_communicator(group_or_comm: Any) -> Communicator:
    """An epmoe.Communicator from what Layer, Workspace and Dispatcher take as their first argument:
    a Communicator, a torch.distributed process group (None: the default group) or an ncclComm_t
    as an int."""
    if isinstance(group_or_comm, Communicator):
        return group_or_comm
    if isinstance(group_or_comm, bool):
        raise InvalidArgument("group_or_comm must be an epmoe.Communicator, a torch.distributed "
                              "process group (or None for the default group) or an ncclComm_t int")
    if isinstance(group_or_comm, int):
        return Communicator.from_nccl_comm(group_or_comm)
    if group_or_comm is None or type(group_or_comm).__module__.split(".")[0] == "torch":
        return Communicator.from_torch(group_or_comm)
    raise InvalidArgument(f"group_or_comm must be an epmoe.Communicator, a torch.distributed "
                          f"process group (or None for the default group) or an ncclComm_t int; "
                          f"got {type(group_or_comm).__module__}.{type(group_or_comm).__qualname__}")
