"""One workspace, many layers: the device buffers every layer on it shares (include/epmoe/workspace.h)."""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from . import _lib
from ._checks import choice_arg, float_arg, int_arg
from ._errors import InvalidArgument
from .comm import Communicator, as_communicator

_DTYPES = {"fp8": _lib.DTYPE_FP8, "bf16": _lib.DTYPE_BF16}


@dataclass(frozen=True)
class WorkspaceConfig:
    """The largest layer a workspace serves (every rank passes the same one).

    ``dtype="fp8"`` admits FP8 layers only; ``"bf16"`` admits BF16 and FP8 layers.
    :meth:`for_layers` gives the smallest one that fits a list of layers.
    """

    max_experts_per_rank: int
    max_hidden: int
    max_intermediate: int
    max_topk: int
    max_tokens_per_rank: int
    dtype: str = "fp8"
    num_ranks: int = 0  # 0: the communicator's size
    timeout_seconds: float = 10.0

    @classmethod
    def for_layers(cls, layers: Iterable[Any], timeout_seconds: float = 10.0) -> "WorkspaceConfig":
        """The smallest workspace on which every layer of `layers` fits: each field the largest of
        theirs. Takes LayerConfig objects (or anything with a ``config`` LayerConfig: an
        epmoe.Layer, an epmoe.torch.MoE); they must agree on num_ranks."""
        configs = [getattr(c, "config", c) for c in layers]
        if not configs:
            raise InvalidArgument("WorkspaceConfig.for_layers needs at least one layer config")
        ranks = {c.num_ranks for c in configs}
        if len(ranks) != 1:
            raise InvalidArgument(f"WorkspaceConfig.for_layers: the layers' num_ranks differ "
                                  f"({sorted(ranks)}); one workspace serves one communicator")
        return cls(max_experts_per_rank=max(c.experts_per_rank for c in configs),
                   max_hidden=max(c.hidden for c in configs),
                   max_intermediate=max(c.intermediate for c in configs),
                   max_topk=max(c.topk for c in configs),
                   max_tokens_per_rank=max(c.max_tokens_per_rank for c in configs),
                   dtype="bf16" if any(c.dtype == "bf16" for c in configs) else "fp8",
                   num_ranks=ranks.pop(), timeout_seconds=timeout_seconds)

    def _c(self) -> _lib.WorkspaceConfigC:
        c = _lib.WorkspaceConfigC()
        for field in ("num_ranks", "max_experts_per_rank", "max_hidden", "max_intermediate",
                      "max_topk", "max_tokens_per_rank"):
            setattr(c, field, int_arg(f"WorkspaceConfig.{field}", getattr(self, field)))
        c.dtype = choice_arg("WorkspaceConfig.dtype", self.dtype, _DTYPES)
        c.reserved = 0
        # Why checked here: the C struct reads 0 as "the default", which a Python caller never means.
        c.timeout_seconds = float_arg("WorkspaceConfig.timeout_seconds", self.timeout_seconds)
        if c.timeout_seconds <= 0:
            raise InvalidArgument(f"WorkspaceConfig.timeout_seconds={self.timeout_seconds} must be in "
                                  f"(0, 3600]")
        return c

    def validate(self) -> "WorkspaceConfig":
        """Raises InvalidArgument naming the bad field (host only; num_ranks must be set)."""
        _lib.call("epmoe_validate_workspace_config", ctypes.byref(self._c()))
        return self

    def sizes(self) -> dict:
        """Device bytes per rank: {'symmetric', 'local', 'pool', 'total'} (host only; num_ranks must be set)."""
        sym, loc, pool = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        _lib.call("epmoe_workspace_sizes", ctypes.byref(self._c()), ctypes.byref(sym), ctypes.byref(loc),
                  ctypes.byref(pool))
        return {"symmetric": sym.value, "local": loc.value, "pool": pool.value,
                "total": sym.value + loc.value + pool.value}


def _destroy(handle: int, comm: Communicator) -> None:
    # `comm` is an argument so that the communicator outlives the workspace.
    _lib.lib().epmoe_workspace_destroy(handle)


class Workspace:
    """Every device buffer a forward call needs, created once (collectively) for the largest layer.

    Any number of layers run on it (``epmoe.Layer(..., workspace=ws)``, ``epmoe.torch.MoE(...,
    workspace=ws)``), one after another; creating one allocates nothing on the device beyond small
    metadata when it references its weights. :attr:`nbytes` is the GPU memory epmoe holds for all
    of them. Calls on one workspace run one at a time, in the same order on every rank.

    Args:
        group_or_comm: as for :class:`epmoe.Layer`: an epmoe.Communicator, a torch.distributed
            process group (None: the default group) or an ``ncclComm_t`` as an int.
        config: a :class:`WorkspaceConfig` (num_ranks 0: the communicator's size).

    ``close()`` releases the buffers (collectively: close on every rank) and raises
    InvalidArgument, releasing nothing, while a layer created on it is open; close the layers
    first. Each layer holds a reference to its workspace, so collection never releases it under
    them.
    """

    def __init__(self, group_or_comm: Any, config: WorkspaceConfig):
        if not isinstance(config, WorkspaceConfig):
            raise InvalidArgument(f"config must be an epmoe.WorkspaceConfig, got "
                                  f"{type(config).__module__}.{type(config).__qualname__}")
        comm = as_communicator(group_or_comm)
        c = config._c()
        handle = ctypes.c_void_p()
        _lib.call("epmoe_workspace_create", comm.handle, ctypes.byref(c), ctypes.byref(handle))
        self._handle = handle.value
        self.comm = comm
        self.device = comm.device
        self.config = dataclasses.replace(config, num_ranks=comm.size)
        self._finalizer = weakref.finalize(self, _destroy, self._handle, comm)
        # Why not at exit: releasing it is collective (NCCL window deregistration); a rank whose
        # peers already left would wait for them. Process exit releases everything anyway.
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        c = self.config
        state = "closed" if self._handle is None else f"cuda:{self.device}"
        return (f"epmoe.Workspace(rank={self.comm.rank}/{c.num_ranks}, E_loc<={c.max_experts_per_rank}, "
                f"H<={c.max_hidden}, I<={c.max_intermediate}, K<={c.max_topk}, "
                f"T_max={c.max_tokens_per_rank}, dtype={c.dtype!r}, {state})")

    @property
    def nbytes(self) -> int:
        """GPU memory the workspace holds on this rank, in bytes: what epmoe holds for every layer
        on it (layers that reference their weights add none)."""
        out = ctypes.c_int64()
        _lib.call("epmoe_workspace_nbytes", self._live_handle(), ctypes.byref(out))
        return out.value

    @property
    def num_layers(self) -> int:
        """Layers created on this workspace that are still open (0 once closed)."""
        if self._handle is None:
            return 0
        out = ctypes.c_int32()
        _lib.call("epmoe_workspace_num_layers", self._handle, ctypes.byref(out))
        return out.value

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Releases the buffers now (collective). Raises InvalidArgument, releasing nothing, while
        a layer created on this workspace is open."""
        if self._handle is not None:
            _lib.call("epmoe_workspace_destroy", self._handle)
            self._finalizer.detach()
            self._handle = None

    def _live_handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument("this Workspace was closed")
        return self._handle
