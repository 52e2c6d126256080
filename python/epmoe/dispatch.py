"""epmoe.Dispatcher: the standalone dispatch and combine (the communication half of the layer)."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

from . import _checks, _frameworks, _lib
from ._checks import BF16, FP32, INT32, choice_arg, float_arg, int_arg
from ._dlpack import DeviceArray
from ._errors import InvalidArgument
from .comm import Communicator
from .layer import DTYPES, _as_communicator

PARTIALS = {"fp32": _lib.PARTIALS_FP32, "bf16": _lib.PARTIALS_BF16}


class _Owned:
    """Owns the C handle. The pool's DeviceArrays (and tensors made from them) hold this object,
    not the Dispatcher, so no reference cycle delays freeing the pool."""

    def __init__(self, handle: int, comm: Communicator):
        self.handle = handle
        self._finalizer = weakref.finalize(self, _destroy, handle, comm)
        # Why: destroying it is collective (NCCL window deregistration); at interpreter exit a
        # peer may already be gone, so leave it to process teardown, as Communicator does.
        self._finalizer.atexit = False

    def close(self) -> None:
        self._finalizer()


def _destroy(handle: int, comm: Communicator) -> None:
    # `comm` is an argument so that the communicator outlives the handle.
    _lib.lib().epmoe_dispatch_destroy(handle)


class Dispatcher:
    """Moves each token to the ranks of its experts (dispatch) and the expert outputs back to the
    token's rank (combine), through an expert-major pool on each rank.

    After ``dispatch(x, topk_idx, topk_weights)``, :attr:`pool` shows the rows this rank received:
    ``x_pool`` [rows, H] (e4m3 with ``x_scale`` in fp8 mode, else bf16), ``row_weight``,
    ``row_source``, ``expert_count`` [E_loc] and ``expert_offset`` [E_loc + 1] (segment starts,
    multiples of `row_align`). Write each row's expert output, routing weight applied, into
    ``o_pool`` [rows, H] bf16; then ``combine(out)`` sums every token's outputs on its own rank.
    Calls on all ranks alternate dispatch, combine in the same order; neither synchronizes with
    the host (CUDA-graph safe). Collective like :class:`epmoe.Layer`.
    """

    def __init__(self, group_or_comm: Any, num_experts: int, hidden: int, topk: int,
                 max_tokens_per_rank: int, dtype: str = "fp8", *, intermediate: int = 0,
                 row_align: int = 128, combine_partials: str = "fp32", pow2_scales: bool = False,
                 num_blocks: int = 0, timeout_seconds: float = 10.0):
        comm = _as_communicator(group_or_comm)
        c = _lib.DispatchConfigC()
        c.num_experts = int_arg("num_experts", num_experts)
        c.hidden = int_arg("hidden", hidden)
        c.topk = int_arg("topk", topk)
        c.max_tokens_per_rank = int_arg("max_tokens_per_rank", max_tokens_per_rank)
        c.row_align = int_arg("row_align", row_align)
        c.intermediate = int_arg("intermediate", intermediate)
        c.dtype = choice_arg("dtype", dtype, DTYPES)
        c.pow2_scales = int(bool(pow2_scales))
        c.combine_partials = choice_arg("combine_partials", combine_partials, PARTIALS)
        c.num_blocks = int_arg("num_blocks", num_blocks)
        c.timeout_seconds = float_arg("timeout_seconds", timeout_seconds)
        handle = ctypes.c_void_p()
        _lib.call("epmoe_dispatch_create", comm.handle, ctypes.byref(c), ctypes.byref(handle))
        self._owned = _Owned(handle.value, comm)
        self._handle = handle.value
        self.comm = comm
        self.device = comm.device
        self.num_experts, self.hidden, self.topk = c.num_experts, c.hidden, c.topk
        self.max_tokens_per_rank = c.max_tokens_per_rank
        self.dtype = dtype
        self.experts_per_rank = c.num_experts // comm.size
        self._num_tokens = None
        self.pool = self._pool_arrays()

    def _pool_arrays(self) -> dict:
        v = _lib.PoolViewC()
        _lib.call("epmoe_dispatch_get_pool", self._handle, ctypes.byref(v))
        rows, h, e = v.max_rows, self.hidden, self.experts_per_rank
        arr = lambda ptr, shape, dtype: DeviceArray(ptr, shape, dtype, self.device, self._owned)  # noqa
        pool = {
            "x_pool": arr(v.x_pool, (rows, h), "uint8" if self.dtype == "fp8" else "bfloat16"),
            "row_weight": arr(v.row_weight, (rows,), "float32"),
            "row_source": arr(v.row_source, (rows,), "int32"),  # the uint32 bits
            "o_pool": arr(v.o_pool, (rows, h), "bfloat16"),
            "expert_count": arr(v.expert_count, (e,), "int32"),
            "expert_offset": arr(v.expert_offset, (e + 1,), "int32"),
        }
        if v.x_scale:
            pool["x_scale"] = arr(v.x_scale, (h // 128, v.scale_stride), "float32")
        return pool

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stream: Any = None) -> None:
        """x [T, H] bf16, topk_idx [T, K] int32, topk_weights [T, K] fp32 on this rank's GPU."""
        handle = self._live_handle()
        s, ds = _frameworks.resolve_stream(stream, x, self.device)
        xv = _checks.tensor(x, "x", dtypes=BF16, shape=(None, self.hidden), dims=("T", "hidden"),
                            device=self.device, stream=ds, align=16)
        t = xv.shape[0]
        if t > self.max_tokens_per_rank:
            raise InvalidArgument(f"x has T={t} tokens but the dispatcher was created with "
                                  f"max_tokens_per_rank={self.max_tokens_per_rank}")
        iv = _checks.tensor(topk_idx, "topk_idx", dtypes=INT32, shape=(t, self.topk),
                            dims=("T", "topk"), device=self.device, stream=ds)
        wv = _checks.tensor(topk_weights, "topk_weights", dtypes=FP32, shape=(t, self.topk),
                            dims=("T", "topk"), device=self.device, stream=ds)
        _lib.call("epmoe_dispatch_run", handle, xv.ptr or None, iv.ptr or None, wv.ptr or None,
                  t, s)
        self._num_tokens = t

    def combine(self, out: Any = None, like: Any = None, stream: Any = None) -> Any:
        """Writes out [T, H] bf16 for the T of the last dispatch and returns it. With out=None a
        tensor of `like`'s framework is allocated (torch and CuPy)."""
        handle = self._live_handle()
        if self._num_tokens is None:
            raise InvalidArgument("combine() needs a dispatch() before it")
        t = self._num_tokens
        ref = out if out is not None else like
        if ref is None:
            raise InvalidArgument("combine() needs out= (or like= to allocate one)")
        s, ds = _frameworks.resolve_stream(stream, ref, self.device)
        if out is None:
            out = _frameworks.empty(like, (t, self.hidden), self.device)
        ov = _checks.tensor(out, "out", dtypes=BF16, shape=(t, self.hidden), dims=("T", "hidden"),
                            device=self.device, stream=ds, align=16, writable=True)
        _lib.call("epmoe_combine_run", handle, ov.ptr or None, t, s)
        return out

    def check_errors(self, stream: Any = None) -> None:
        """Synchronizes the stream and raises (then clears) an error the kernels recorded."""
        handle = self._live_handle()
        s = _frameworks.stream_handle(stream) if stream is not None else 0
        if stream is None:
            import sys
            if "torch" in sys.modules:
                import torch
                s = int(torch.cuda.current_stream(self.device).cuda_stream)
        _lib.call("epmoe_dispatch_check_errors", handle, s)

    def close(self) -> None:
        """Frees the handle and its pool now, even while tensors made from the pool live (they
        then dangle); otherwise that happens when the last of them and this object are gone."""
        if self._handle is not None:
            self._owned.close()
            self._handle = None

    def _live_handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument("this Dispatcher was closed")
        return self._handle

