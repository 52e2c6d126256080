"""epmoe.Layer: the MoE layer of SPEC.md over the GPUs of one node, one process per GPU."""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any

from . import _checks, _frameworks, _lib, weights as _weights
from ._checks import BF16, FP8, FP32, INDEX, INT32, INT64, choice_arg, float_arg, int_arg
from ._errors import Error, InvalidArgument
from .comm import Communicator, as_communicator
from .workspace import Workspace

DTYPES = {"fp8": _lib.DTYPE_FP8, "bf16": _lib.DTYPE_BF16}
PATHS = {"auto": _lib.PATH_AUTO, "fused": _lib.PATH_FUSED, "pipeline": _lib.PATH_PIPELINE}


@dataclass(frozen=True)
class LayerConfig:
    """Shapes and options of one layer, identical on every rank (mirror of epmoe::LayerConfig).

    ``validate()`` runs the library's own checks and needs no GPU.
    """

    num_ranks: int
    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    max_tokens_per_rank: int
    dtype: str = "fp8"
    activation_clamp: float | None = None
    pow2_scales: bool = False
    combine_partials: str = "fp32"  # "fp32" or "bf16": precision of combine's partial sums
    timeout_seconds: float = 10.0  # bound of every device wait and host collective, in (0, 3600]
    strict_routing: bool = False  # check each call's routing on the host first (debugging; syncs)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks if self.num_ranks > 0 else 0

    def to_c(self) -> _lib.LayerConfigC:
        c = _lib.LayerConfigC()
        for field in ("num_ranks", "num_experts", "hidden", "intermediate", "topk",
                      "max_tokens_per_rank"):
            setattr(c, field, int_arg(field, getattr(self, field)))
        c.dtype = choice_arg("dtype", self.dtype, DTYPES)
        clamp = self.activation_clamp
        c.activation_clamp = 0.0 if clamp is None else float_arg("activation_clamp", clamp)
        if not isinstance(self.pow2_scales, bool):
            raise InvalidArgument(f"pow2_scales must be a bool, got {self.pow2_scales!r}")
        c.pow2_scales = int(self.pow2_scales)
        c.combine_partials = choice_arg("combine_partials", self.combine_partials,
                                        {"fp32": _lib.PARTIALS_FP32, "bf16": _lib.PARTIALS_BF16})
        # Why checked here: the C struct reads 0 as "the default", which a Python caller never means.
        c.timeout_seconds = float_arg("timeout_seconds", self.timeout_seconds)
        if c.timeout_seconds <= 0:
            raise InvalidArgument(f"timeout_seconds={self.timeout_seconds} must be in (0, 3600]")
        if not isinstance(self.strict_routing, bool):
            raise InvalidArgument(f"strict_routing must be a bool, got {self.strict_routing!r}")
        c.strict_routing = int(self.strict_routing)
        return c

    def validate(self) -> "LayerConfig":
        """Raises InvalidArgument with the library's message if a field is out of range."""
        c = self.to_c()
        _lib.call("epmoe_validate_config", ctypes.byref(c))
        return self

    def validate_call(self, num_tokens: int) -> None:
        """The library's per-call host checks for `num_tokens` tokens (0 <= T <= T_max)."""
        c = self.to_c()
        t = int_arg("num_tokens", num_tokens)
        # Non-null, 16-byte aligned stand-ins: only the token count is checked here; real pointers
        # (null, alignment) are checked per call.
        p = 256 if t > 0 else None
        _lib.call("epmoe_validate_call", ctypes.byref(c), t, p, p, p, p)

    def check_routing(self, topk_idx: Any) -> None:
        """Checks a routing table in host memory (numpy, or a CPU torch tensor): every index in
        [0, num_experts) or -1. Forward calls never read device data on the host; use this to
        debug a table, or :meth:`Layer.check_device_error` after a call."""
        v = _checks.tensor(topk_idx, "topk_idx", dtypes=INT32, shape=(None, self.topk),
                           dims=("T", "topk"), device=None, stream=None, on_cuda=False)
        if v.device_type != _checks.KDL_CPU:
            raise InvalidArgument(f"check_routing reads host memory; topk_idx is on "
                                  f"{v.device_name} (copy it with .cpu() first)")
        c = self.to_c()
        _lib.call("epmoe_validate_routing_host", ctypes.byref(c), v.shape[0], v.ptr or None)

    def weight_shapes(self) -> dict:
        """Shapes of load_weights' arguments for this rank (scales are None in BF16 mode)."""
        e, h, i = self.experts_per_rank, self.hidden, self.intermediate
        fp8 = self.dtype == "fp8"
        return {
            "w1": (e, 2 * i, h),
            "w1_scale": (e, 2 * i // 128, h // 128) if fp8 else None,
            "w2": (e, h, i),
            "w2_scale": (e, h // 128, i // 128) if fp8 else None,
        }


# The first argument of Layer and Dispatcher (comm.as_communicator).
_as_communicator = as_communicator


def _destroy(handle: int, comm: Communicator, workspace: Any = None, weights: Any = None) -> None:
    # The communicator, the workspace and the referenced weights are arguments so that they
    # outlive the layer (the first two refuse to close while it lives; it reads the weights).
    _lib.lib().epmoe_layer_destroy(handle)


class Layer:
    """The MoE layer on this rank.

    Collective: every rank of the group creates it with the same arguments, every rank calls it
    (with its own token count, possibly 0) the same number of times, and every rank closes it (or
    lets it be collected). If creation fails on any rank, it raises on every rank with the failing
    ranks and causes (only an argument of the wrong Python type, or a timeout_seconds <= 0, raises
    on its rank alone, before the collective). Calls from several streams are serialized (each
    waits for the previous one).

    Args:
        group_or_comm: an :class:`epmoe.Communicator`, a torch.distributed process group (None:
            the default group), or an ``ncclComm_t`` as an int.
        num_experts: E in total; rank r owns experts [r*E/R, (r+1)*E/R).
        hidden, intermediate: H and I, positive multiples of 128.
        topk: K.
        max_tokens_per_rank: T_max; sizes every buffer. Each call has 0 <= T <= T_max.
        dtype: 'fp8' (e4m3 with block scales) or 'bf16'.
        activation_clamp: c of SPEC.md step 3; None (or <= 0) disables it.
        pow2_scales: round FP8 activation scales up to a power of two.
        combine_partials: "fp32" (default) or "bf16": precision of the per-(token, expert rank)
            partial sums that combine sends back; bf16 halves combine's NVLink bytes at the cost
            of one more bf16 rounding per partial (within SPEC's accuracy bound).
        timeout_seconds: bound of every wait, in (0, 3600]: the device-side waits (peers' flags,
            barriers, the GEMM pipelines' stages and counters) and the host-side collectives of
            creation, destruction and strict mode. A device wait that expires records who waited on
            what, and the next call raises DeviceTimeout with that line (the CUDA context is lost).
        strict_routing: a debugging aid: every call copies topk_idx to the host and checks it on
            every rank before launching (raises InvalidArgument on every rank, naming the rank and
            slot). It synchronizes, so it is slow and cannot be captured in a CUDA graph.
        workspace: an :class:`epmoe.Workspace` to run on (shared with other layers; the layer must
            fit it, and group_or_comm must be None or its communicator). None: the layer makes a
            private one of exactly its size.
        weights: with a workspace, the weights by reference: a dict with keys 'w13', 'w13_scale',
            'w2', 'w2_scale' (scales None or absent in bf16 mode), tensors on this rank's GPU that
            the layer reads on every call and never copies: w13 in the kernels' layout
            (:func:`epmoe.transform_w13`'s output), w2 and the scales as load_weights takes them.
            The layer keeps them alive; change them only between calls. None: the layer allocates
            its weights and load_weights copies them in.
    """

    def __init__(self, group_or_comm: Any, num_experts: int, hidden: int, intermediate: int,
                 topk: int, max_tokens_per_rank: int, dtype: str = "fp8",
                 activation_clamp: float | None = None, *, pow2_scales: bool = False,
                 combine_partials: str = "fp32", timeout_seconds: float = 10.0,
                 strict_routing: bool = False, workspace: Workspace | None = None,
                 weights: Any = None):
        if workspace is None:
            if weights is not None:
                raise InvalidArgument("weights= (weights by reference) needs workspace=: a layer "
                                      "without a workspace copies its weights (load_weights)")
            comm = _as_communicator(group_or_comm)
        else:
            if not isinstance(workspace, Workspace):
                raise InvalidArgument(f"workspace must be an epmoe.Workspace, got "
                                      f"{type(workspace).__module__}.{type(workspace).__qualname__}")
            ws_handle = workspace._live_handle()  # "this Workspace was closed"
            comm = workspace.comm
            if group_or_comm is not None and group_or_comm is not comm:
                raise InvalidArgument("group_or_comm must be None or the workspace's communicator: a "
                                      "layer runs on the communicator of its workspace")
        # Why not validate() here: the library's create runs the same checks and agrees on them
        # across ranks, so a value wrong on one rank fails every rank at once, naming it; raising
        # here would leave the other ranks waiting in the create until their timeout.
        self.config = LayerConfig(comm.size, num_experts, hidden, intermediate, topk,
                                  max_tokens_per_rank, dtype, activation_clamp,
                                  pow2_scales, combine_partials, timeout_seconds,
                                  strict_routing)
        c = self.config.to_c()
        handle = ctypes.c_void_p()
        kept = None
        if workspace is None:
            _lib.call("epmoe_layer_create", comm.handle, ctypes.byref(c), ctypes.byref(handle))
        else:
            refs, refused = None, None
            if weights is not None:
                try:
                    refs, kept = _weights.weight_refs(weights, self.config, comm.device)
                except InvalidArgument as e:
                    # Why still call in: creation is collective. References the library refuses
                    # make every rank fail together (with this rank named) instead of leaving the
                    # peers to wait for this one until their timeout.
                    refs, refused = _weights.null_refs(), e
            try:
                _lib.call("epmoe_layer_create_on", ws_handle, ctypes.byref(c),
                          None if refs is None else ctypes.byref(refs), ctypes.byref(handle))
            except Error as e:
                if refused is not None:
                    raise refused from e
                raise
            if refused is not None:  # not reached: the library refuses null references
                _lib.lib().epmoe_layer_destroy(handle.value)
                raise refused
        self._handle = handle.value
        self.comm = comm
        self.device = comm.device
        self.workspace = workspace
        self.by_reference = kept is not None
        self._finalizer = weakref.finalize(self, _destroy, self._handle, comm, workspace, kept)
        # Why: destroying it is collective (NCCL window deregistration); at interpreter exit a
        # peer may already be gone, so leave it to process teardown, as Communicator does.
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        c = self.config
        return (f"epmoe.Layer(rank={self.comm.rank}/{c.num_ranks}, E={c.num_experts}, "
                f"H={c.hidden}, I={c.intermediate}, K={c.topk}, T_max={c.max_tokens_per_rank}, "
                f"dtype={c.dtype!r})")

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, w1: Any, w1_scale: Any, w2: Any, w2_scale: Any,
                     stream: Any = None) -> None:
        """Copies and transforms this rank's local experts into the kernels' layout.

        FP8: w1 e4m3 [E_loc, 2I, H], w1_scale fp32 [E_loc, 2I/128, H/128], w2 e4m3 [E_loc, H, I],
        w2_scale fp32 [E_loc, H/128, I/128]. BF16: w1 bf16 [E_loc, 2I, H], w2 bf16 [E_loc, H, I],
        scales None. Rows 0..I-1 of each W1 are the gate projection, rows I..2I-1 the up
        projection. The four tensors are either all on this rank's GPU or all in host memory.
        """
        handle = self._live_handle()
        if getattr(self, "by_reference", False):
            raise InvalidArgument("load_weights: this layer references its weights (created with "
                                  "weights=); it copies nothing: write into those tensors instead "
                                  "(W1 through epmoe.transform_w13)")
        shapes = self.config.weight_shapes()
        fp8 = self.config.dtype == "fp8"
        s, ds = _frameworks.resolve_stream(stream, w1, self.device)
        dims3 = {"w1": ("E_loc", "2*I", "H"), "w2": ("E_loc", "H", "I"),
                 "w1_scale": ("E_loc", "2*I/128", "H/128"), "w2_scale": ("E_loc", "H/128", "I/128")}
        weight_dtypes = FP8 if fp8 else BF16
        views = {}
        for name, obj in (("w1", w1), ("w1_scale", w1_scale), ("w2", w2), ("w2_scale", w2_scale)):
            if name.endswith("_scale"):
                if not fp8:
                    if obj is not None:
                        raise InvalidArgument(f"{name} must be None in bf16 mode")
                    continue
                if obj is None:
                    raise InvalidArgument(f"{name} is required in fp8 mode")
            views[name] = _checks.tensor(obj, name, dtypes=FP32 if name.endswith("_scale")
                                         else weight_dtypes, shape=shapes[name], dims=dims3[name],
                                         device=self.device, stream=ds, on_cuda=False, align=16)
        where = {v.device_type for v in views.values()}
        if len(where) != 1:
            raise InvalidArgument("w1, w2 (and their scales) must all be on the GPU or all in host "
                                  "memory; got " + ", ".join(f"{v.name} on {v.device_name}"
                                                             for v in views.values()))
        on_device = where.pop() == _checks.KDL_CUDA
        ptr = lambda n: views[n].ptr if n in views else None  # noqa: E731
        _lib.call("epmoe_layer_load_weights", handle, ptr("w1"), ptr("w1_scale"), ptr("w2"),
                  ptr("w2_scale"), int(on_device), s)

    # ---- forward ------------------------------------------------------------------------------

    def __call__(self, x: Any, topk_idx: Any, topk_weights: Any, out: Any = None,
                 path: str = "auto", stream: Any = None, *, expert_counts: Any = None,
                 expert_counts_total: Any = None) -> Any:
        """y = the MoE layer of SPEC.md; returns `out` (allocated if None: torch and CuPy).

        x [T, H] bf16, topk_idx [T, K] int32 or int64 (each in [0, E) or -1; int64 is read as
        it is, an index beyond int32 is reported, never wrapped), topk_weights [T, K] fp32,
        out [T, H] bf16, all on this rank's GPU. Optional, on the same GPU: expert_counts
        [E_loc] int32 receives the rows each local expert got in this call (from every rank),
        expert_counts_total [E_loc] int64 has them added on (a running sum; zero it to restart);
        both written on the stream after the call, without a sync. Runs on `stream` (default:
        the framework's current stream, e.g. torch.cuda.current_stream()) and never synchronizes
        with the host (unless strict_routing), so it can be captured in a CUDA graph. An
        out-of-range expert
        index is found on the GPU (its slot is masked) and the next call on this rank raises
        InvalidArgument naming it, after running normally; a device wait that timed out makes the
        next call raise DeviceTimeout without running. :meth:`check_device_error` is the explicit,
        synchronizing check. `path`: "auto" (the default: per call and rank, the megakernel up to
        512 tokens, the pipeline above), "pipeline" (four kernels) or "fused" (the megakernel);
        all give bitwise the same result, and ranks may take different paths in one call.
        """
        handle = self._live_handle()
        path_code = choice_arg("path", path, PATHS)
        c = self.config
        if (type(x).__module__.startswith("torch")
                and (stream is None or self._is_torch_current_stream(stream))):
            from . import _torch_fast
            taken, result, status = _torch_fast.forward(
                _lib.lib().epmoe_layer_forward_args, handle, self.device, c.hidden, c.topk,
                c.max_tokens_per_rank, x, topk_idx, topk_weights, out, path_code,
                _lib.INDEX_INT32, _lib.INDEX_INT64, counts=expert_counts, totals=expert_counts_total,
                e_loc=c.experts_per_rank)
            if taken:
                _lib.check(status)
                return result
        s, ds = _frameworks.resolve_stream(stream, x, self.device)
        xv = _checks.tensor(x, "x", dtypes=BF16, shape=(None, c.hidden), dims=("T", "hidden"),
                            device=self.device, stream=ds, align=16)
        t = xv.shape[0]
        if t > c.max_tokens_per_rank:
            raise InvalidArgument(f"x has T={t} tokens but the layer was created with "
                                  f"max_tokens_per_rank={c.max_tokens_per_rank}")
        iv = _checks.tensor(topk_idx, "topk_idx", dtypes=INDEX, shape=(t, c.topk),
                            dims=("T", "topk"), device=self.device, stream=ds)
        if iv.dtype == "int64" and iv.numel and iv.ptr % 8:
            raise InvalidArgument(f"topk_idx (int64) must start at an 8-byte aligned address; its "
                                  f"data starts at 0x{iv.ptr:x}")
        wv = _checks.tensor(topk_weights, "topk_weights", dtypes=FP32, shape=(t, c.topk),
                            dims=("T", "topk"), device=self.device, stream=ds)
        if out is None:
            out = _frameworks.empty(x, (t, c.hidden), self.device)
        ov = _checks.tensor(out, "out", dtypes=BF16, shape=(t, c.hidden), dims=("T", "hidden"),
                            device=self.device, stream=ds, align=16, writable=True)
        _checks.no_overlap(ov, xv, iv, wv)
        counts = []
        for name, obj, dtypes, align in (("expert_counts", expert_counts, INT32, 4),
                                         ("expert_counts_total", expert_counts_total, INT64, 8)):
            if obj is None:
                counts.append(None)
                continue
            v = _checks.tensor(obj, name, dtypes=dtypes, shape=(c.experts_per_rank,),
                               dims=("E_loc",), device=self.device, stream=ds, align=align,
                               writable=True)
            _checks.no_overlap(v, xv, iv, wv, ov, *[u for u in counts if u is not None])
            counts.append(v)
        idx_type = _lib.INDEX_INT64 if iv.dtype == "int64" else _lib.INDEX_INT32
        _lib.call("epmoe_layer_forward_ex", handle, xv.ptr or None, iv.ptr or None, idx_type,
                  wv.ptr or None, ov.ptr or None, t, counts[0].ptr if counts[0] else None,
                  counts[1].ptr if counts[1] else None, s, path_code)
        return out

    forward = __call__

    @property
    def last_path(self) -> str:
        """The path this rank's last call chose, "pipeline" or "fused" (what "auto" chose; also
        when its launch then failed); host only, no sync. "pipeline" before the first call."""
        import ctypes
        code = ctypes.c_int(-1)
        _lib.call("epmoe_layer_last_path", self._live_handle(), ctypes.byref(code))
        return "fused" if code.value == _lib.PATH_FUSED else "pipeline"

    def check_device_error(self, stream: Any = None) -> None:
        """Synchronizes the stream and raises the error the GPU recorded since the last check
        (an expert index out of range, a peer that never arrived). Not for the hot path."""
        handle = self._live_handle()
        s = _frameworks.stream_handle(stream) if stream is not None else self._default_stream()
        _lib.call("epmoe_layer_check_device_error", handle, s)

    def close(self) -> None:
        """Frees the layer's GPU buffers now (also done when the object is collected); on a shared
        workspace, drops its share (the workspace can then close). Collective: every rank closes
        its layer."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._finalizer.detach()
            _lib.call("epmoe_layer_destroy", handle)

    # ---- helpers ------------------------------------------------------------------------------

    def _live_handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument("this Layer was closed")
        return self._handle

    def _is_torch_current_stream(self, stream: Any) -> bool:
        """An explicit stream that is torch's current one takes the hot path (engines pass
        stream=torch.cuda.current_stream()): the DLPack path would order nothing there."""
        from . import _torch_fast
        return _torch_fast.is_current_stream(stream, self.device)

    def _default_stream(self) -> int:
        import sys
        if "torch" in sys.modules:
            import torch
            return int(torch.cuda.current_stream(self.device).cuda_stream)
        return 0
