"""One workspace, many layers: the device buffers every layer on it shares (include/epmoe/workspace.h)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import _lib

_DTYPES = {"fp8": 0, "bf16": 1}


@dataclass(frozen=True)
class WorkspaceConfig:
    """The largest layer a workspace serves (every rank passes the same one).

    ``dtype="fp8"`` admits FP8 layers only; ``"bf16"`` admits BF16 and FP8 layers.
    """

    max_experts_per_rank: int
    max_hidden: int
    max_intermediate: int
    max_topk: int
    max_tokens_per_rank: int
    dtype: str = "fp8"
    num_ranks: int = 0  # 0: the communicator's size
    timeout_seconds: float = 10.0

    def _c(self) -> _lib.WorkspaceConfigC:
        if self.dtype not in _DTYPES:
            raise ValueError(f"WorkspaceConfig.dtype={self.dtype!r} must be 'fp8' or 'bf16'")
        c = _lib.WorkspaceConfigC()
        c.num_ranks = self.num_ranks
        c.max_experts_per_rank = self.max_experts_per_rank
        c.max_hidden = self.max_hidden
        c.max_intermediate = self.max_intermediate
        c.max_topk = self.max_topk
        c.max_tokens_per_rank = self.max_tokens_per_rank
        c.dtype = _DTYPES[self.dtype]
        c.reserved = 0
        c.timeout_seconds = self.timeout_seconds
        return c

    def validate(self) -> None:
        """Raises InvalidArgument naming the bad field (host only)."""
        _lib.call("epmoe_validate_workspace_config", ctypes.byref(self._c()))

    def sizes(self) -> dict:
        """Device bytes per rank: {'symmetric', 'local', 'pool', 'total'} (host only; num_ranks must be set)."""
        sym, loc, pool = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        _lib.call("epmoe_workspace_sizes", ctypes.byref(self._c()), ctypes.byref(sym), ctypes.byref(loc),
                  ctypes.byref(pool))
        return {"symmetric": sym.value, "local": loc.value, "pool": pool.value,
                "total": sym.value + loc.value + pool.value}


class Workspace:
    """Every device buffer a forward call needs, created once (collectively) for the largest layer.

    Layers created on it (``Layer(..., workspace=ws)``, not yet in this package: see docs/PYTHON.md)
    allocate nothing on the device. Calls on one workspace run one at a time, in the same order on
    every rank. ``close()`` drops this handle's share; the memory goes with the last share.
    """

    def __init__(self, comm, config: WorkspaceConfig):
        handle = ctypes.c_void_p()
        _lib.call("epmoe_workspace_create", comm._handle, ctypes.byref(config._c()), ctypes.byref(handle))
        self._handle = handle
        self._comm = comm  # keeps the communicator alive
        self.config = config

    @property
    def nbytes(self) -> int:
        """GPU memory the workspace holds on this rank, in bytes."""
        if self._handle is None:
            raise ValueError("the workspace is closed")
        out = ctypes.c_int64()
        _lib.call("epmoe_workspace_nbytes", self._handle, ctypes.byref(out))
        return out.value

    def close(self) -> None:
        if self._handle is not None:
            _lib.call("epmoe_workspace_destroy", self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
