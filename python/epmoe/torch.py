"""epmoe.torch: the layer as a PyTorch operator (``torch.ops.epmoe.moe_forward``) and a module
(:class:`MoE`), for eager mode, ``torch.compile(fullgraph=True)`` and CUDA graphs.

    import epmoe.torch as et
    moe = et.MoE(num_experts=256, hidden=7168, intermediate=2048, topk=8,
                 max_tokens_per_rank=4096, dtype="fp8")          # collective, like epmoe.Layer
    moe.load_weights(w1, w1_scale, w2, w2_scale)
    y = moe(x, topk_idx, topk_weights)          # topk_idx int32 or int64 (torch.topk's)

The operator takes tensors and scalars only, so it names its layer by an int key into a
registry of this process (:func:`register_layer`). Importing this module imports torch; the
rest of epmoe never does. See docs/PYTHON.md.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from . import _lib
from ._errors import InvalidArgument
from .layer import Layer

__all__ = ["MoE", "moe_forward", "register_layer", "unregister_layer", "registered_layer"]

_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_PATHS = {"pipeline": _lib.PATH_PIPELINE, "fused": _lib.PATH_FUSED}

# ---- the registry: int key -> layer --------------------------------------------------------------


class _Bound:
    """What one call of the operator needs of a layer, read once at registration, so that a call
    costs a few attribute reads, one allocation and one C call (no DLPack, no ctypes lookups)."""

    __slots__ = ("layer", "key", "device_index", "hidden", "topk", "num_experts", "t_max",
                 "c_forward", "raw_stream")

    def __init__(self, layer: Layer, key: int):
        c = layer.config
        self.layer, self.key = layer, key
        self.device_index = layer.device
        self.hidden, self.topk, self.num_experts = c.hidden, c.topk, c.num_experts
        self.t_max = c.max_tokens_per_rank
        # Why cached here: Layer.__call__ reads each tensor through a DLPack capsule and looks the
        # C function up by name on every call; a torch tensor gives its pointer directly.
        self.c_forward = _lib.lib().epmoe_layer_forward
        self.raw_stream = _raw_stream

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                path: str) -> torch.Tensor:
        handle = self.layer._handle
        if topk_idx.dtype is _I64:
            topk_idx = idx_to_int32(topk_idx, self.num_experts)
        dev = self.device_index
        t = x.shape[0] if x.dim() == 2 else -1
        k = (t, self.topk)
        # One boolean chain on the hot path; _explain() names the failing argument.
        if not (handle is not None and x.dtype is _BF16 and 0 <= t <= self.t_max
                and x.shape[1] == self.hidden and topk_idx.dtype is _I32 and topk_idx.shape == k
                and topk_weights.dtype is _F32 and topk_weights.shape == k
                and x.get_device() == dev and topk_idx.get_device() == dev
                and topk_weights.get_device() == dev and x.is_contiguous()
                and topk_idx.is_contiguous() and topk_weights.is_contiguous()
                and x.data_ptr() % 16 == 0 and path in _PATHS):
            self._explain(x, topk_idx, topk_weights, path)
        out = x.new_empty((t, self.hidden))
        status = self.c_forward(handle, x.data_ptr(), topk_idx.data_ptr(),
                                topk_weights.data_ptr(), out.data_ptr(), t,
                                self.raw_stream(dev), _PATHS[path])
        if status:
            _lib.check(status)
        return out

    def _explain(self, x, topk_idx, topk_weights, path) -> None:
        if self.layer._handle is None:
            raise InvalidArgument(f"epmoe::moe_forward: the layer registered as {self.key} was "
                                  f"closed")
        if path not in _PATHS:
            raise InvalidArgument(f"path={path!r} must be one of 'pipeline', 'fused'")
        dev = self.device_index
        t = x.shape[0] if x.dim() == 2 else None
        specs = (("x", x, (_BF16,), (None, self.hidden), ("T", "hidden")),
                 ("topk_idx", topk_idx, (_I32, _I64), (t, self.topk), ("T", "topk")),
                 ("topk_weights", topk_weights, (_F32,), (t, self.topk), ("T", "topk")))
        for name, v, dtypes, shape, dims in specs:
            where = v.get_device()
            if where != dev:
                here = f"cuda:{where}" if where >= 0 else str(v.device)
                target = f"cuda:{dev}" if dev >= 0 else "cpu"
                raise InvalidArgument(f"{name} is on {here} but this epmoe layer lives on {target}")
            if v.dtype not in dtypes:
                want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
                raise InvalidArgument(f"{name} must be {want}; got "
                                      f"{str(v.dtype).replace('torch.', '')}")
            if v.dim() != 2 or any(e is not None and e != s for e, s in zip(shape, v.shape)):
                sizes = ", ".join("?" if s is None else str(s) for s in shape)
                raise InvalidArgument(f"{name} must have shape ({sizes}) = ({', '.join(dims)}); "
                                      f"got {tuple(v.shape)}")
            if not v.is_contiguous():
                raise InvalidArgument(f"{name} must be contiguous (row-major, no gaps); got "
                                      f"strides {tuple(v.stride())} for shape {tuple(v.shape)} "
                                      f"(call .contiguous())")
        if x.shape[0] > self.t_max:
            raise InvalidArgument(f"x has T={x.shape[0]} tokens but the layer was created with "
                                  f"max_tokens_per_rank={self.t_max}")
        if x.data_ptr() % 16:
            raise InvalidArgument(f"x must start at a 16-byte aligned address; its data starts "
                                  f"at 0x{x.data_ptr():x}")
        raise InvalidArgument("epmoe::moe_forward: bad arguments")  # not reached


def _buffer_device(index: int) -> torch.device:
    return torch.device("cuda", index)  # the CPU tests put the buffers on "meta"


def _raw_stream(device: int) -> int:
    # Why the private call: it is what torch's own generated code (inductor) uses, and it costs a
    # fraction of torch.cuda.current_stream(), which builds a Stream object per call.
    return torch._C._cuda_getCurrentRawStream(device)


_registry: dict[int, _Bound] = {}
_keys = itertools.count(1)
_registry_lock = threading.Lock()


def register_layer(layer: Layer) -> int:
    """Makes `layer` callable through ``torch.ops.epmoe.moe_forward`` under the returned key.
    The registry holds the layer until :func:`unregister_layer` (a :class:`MoE` does both)."""
    if not isinstance(layer, Layer):
        raise InvalidArgument(f"register_layer takes an epmoe.Layer, got "
                              f"{type(layer).__module__}.{type(layer).__qualname__}")
    if layer._handle is None:
        raise InvalidArgument("register_layer: this Layer was closed")
    with _registry_lock:
        key = next(_keys)
        _registry[key] = _Bound(layer, key)
    return key


def unregister_layer(key: int) -> None:
    """Forgets a key (a later call with it raises). Does not close the layer."""
    with _registry_lock:
        _registry.pop(key, None)


def registered_layer(key: int) -> Layer:
    """The layer registered under `key`."""
    return _bound(key).layer


def _bound(key: Any) -> _Bound:
    b = _registry.get(key) if isinstance(key, int) else None
    if b is None:
        raise InvalidArgument(f"epmoe::moe_forward: no layer is registered under key {key!r} in "
                              f"this process (register_layer() gives keys; a closed MoE "
                              f"unregisters its own)")
    return b


# ---- the operator --------------------------------------------------------------------------------

# Why define/impl rather than torch.library.custom_op: custom_op routes every eager call through
# its Python autograd and dispatch wrappers, several microseconds more per call (the "noop
# custom_op" row of python/benchmarks/op_overhead.py).
_library = torch.library.Library("epmoe", "DEF")
_library.define("moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, int layer, "
                "str path='pipeline') -> Tensor")


def _moe_forward_cuda(x, topk_idx, topk_weights, layer, path="pipeline"):
    b = _registry.get(layer)
    if b is None:
        b = _bound(layer)
    return b.forward(x, topk_idx, topk_weights, path)


_library.impl("moe_forward", _moe_forward_cuda, "CUDA")


@torch.library.register_fake("epmoe::moe_forward")
def _moe_forward_fake(x, topk_idx, topk_weights, layer, path="pipeline"):
    # Shapes and dtypes that are static under tracing are checked here, so a wrong one fails at
    # compile time with the same message as in eager mode.
    if x.dtype is not _BF16:
        raise InvalidArgument(f"x must be bfloat16; got {str(x.dtype).replace('torch.', '')}")
    if topk_idx.dtype not in (_I32, _I64):
        raise InvalidArgument(f"topk_idx must be int32 or int64; got "
                              f"{str(topk_idx.dtype).replace('torch.', '')}")
    if topk_weights.dtype is not _F32:
        raise InvalidArgument(f"topk_weights must be float32; got "
                              f"{str(topk_weights.dtype).replace('torch.', '')}")
    hidden = x.shape[1] if x.dim() == 2 else None
    b = _registry.get(layer) if isinstance(layer, int) else None
    if b is not None:
        hidden = b.hidden
        if x.dim() != 2 or x.shape[1] != hidden:
            raise InvalidArgument(f"x must have shape (?, {hidden}) = (T, hidden); got "
                                  f"{tuple(x.shape)}")
        for name, v in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if v.dim() != 2 or v.shape[1] != b.topk:
                raise InvalidArgument(f"{name} must have shape (T, {b.topk}) = (T, topk); got "
                                      f"{tuple(v.shape)}")
    if hidden is None:
        raise InvalidArgument(f"x must have 2 dimensions (T, hidden); got {tuple(x.shape)}")
    return x.new_empty((x.shape[0], hidden))


_OP = torch.ops.epmoe.moe_forward.default
try:
    # Why: every rank must make the same number of these collective calls; an unused result must
    # not let a graph pass drop one.
    torch.fx.node.has_side_effect(_OP)
except AttributeError:  # an older torch without the registry: nothing to do
    pass


def _plain_eager(x: Any) -> bool:
    """True when nothing observes or traces the call: no torch.compile / export tracing, no
    tensor subclass (FakeTensor, FunctionalTensor, ...), no dispatch or function mode (make_fx,
    FlopCounterMode, torch.device(...) blocks). Then the operator's kernel is called directly,
    without the dispatcher's round trip into Python (2-5 us per call); otherwise the operator."""
    # Why this order: dynamo folds is_compiling() to True and never traces the private calls.
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor
            and not _dispatch_modes() and not _function_modes())


# Private counters of torch's mode stacks (C calls of ~0.1 us); without them every call takes the
# operator.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_function_modes = getattr(torch._C, "_len_torch_function_stack", lambda: 1)


def idx_to_int32(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 routing indices as the int32 the kernels read: one elementwise pass on the device
    (two small kernels in eager mode, one fused kernel under torch.compile). Out-of-range values
    saturate to other out-of-range values (-2 or num_experts), so the device still reports them."""
    return topk_idx.clamp(-2, num_experts).to(_I32)


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                layer: Any, path: str | None = None) -> torch.Tensor:
    """y [T, H] bf16 of the layer `layer` (a :class:`MoE`, or a key from :func:`register_layer`).
    `path`: "pipeline" or "fused"; by default the module's own (a :class:`MoE`) or "pipeline" (a
    key). A path other than a module's own is refused: set ``MoE.path`` instead.

    Calls ``torch.ops.epmoe.moe_forward`` on torch's current stream. Collective: every rank
    calls it (with its own T, possibly 0). No host synchronization, so it can be captured in a
    CUDA graph and traced by ``torch.compile``. int64 `topk_idx` is narrowed to int32 on the device
    first (:func:`idx_to_int32`)."""
    if isinstance(layer, MoE):
        if path is not None and path != layer.path:
            raise InvalidArgument(
                f"moe_forward: path={path!r} but the MoE module runs path={layer.path!r}; set "
                "MoE.path, or pass its registry key instead of the module to choose per call")
        return layer(x, topk_idx, topk_weights)
    if path is None:
        path = "pipeline"
    if _plain_eager(x):
        return _bound(layer).forward(x, topk_idx, topk_weights, path)
    if topk_idx.dtype == _I64:
        topk_idx = idx_to_int32(topk_idx, _bound(layer).num_experts)
    return _OP(x, topk_idx, topk_weights, layer, path)


# ---- the module ----------------------------------------------------------------------------------


class MoE(torch.nn.Module):
    """The experts of one MoE layer on this rank: an :class:`epmoe.Layer` plus its weights as
    buffers (``w1``, ``w1_scale``, ``w2``, ``w2_scale``; the scales are None in bf16 mode).

    Creation is collective (every rank, same arguments), as for :class:`epmoe.Layer`, whose
    arguments these are; `group` is what Layer calls `group_or_comm` (None: torch's default
    group). ``forward(x, topk_idx, topk_weights)`` calls ``torch.ops.epmoe.moe_forward``.
    Inference only: the operator has no backward.

    The buffers are this rank's experts in the SPEC layout. :meth:`load_weights` copies into them
    and hands them to the layer, which keeps its own copy in the kernels' layout (so the weights are
    held twice until epmoe takes weights by reference); ``load_state_dict`` does the same.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, dtype: str = "fp8", *, group: Any = None,
                 activation_clamp: float | None = None, pow2_scales: bool = False,
                 combine_partials: str = "fp32", timeout_seconds: float = 10.0,
                 path: str = "pipeline"):
        super().__init__()
        if path not in _PATHS:
            raise InvalidArgument(f"path={path!r} must be one of 'pipeline', 'fused'")
        self.layer = Layer(group, num_experts, hidden, intermediate, topk, max_tokens_per_rank,
                           dtype, activation_clamp, pow2_scales=pow2_scales,
                           combine_partials=combine_partials, timeout_seconds=timeout_seconds)
        self.config = self.layer.config
        self.num_experts, self.path = num_experts, path
        self.weights_loaded = False
        self.layer_key = register_layer(self.layer)
        self._bound = _registry[self.layer_key]
        self._unregister = weakref.finalize(self, unregister_layer, self.layer_key)
        device = _buffer_device(self.layer.device)
        wdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
        for name, shape in self.config.weight_shapes().items():
            if shape is None:
                self.register_buffer(name, None)
            else:
                self.register_buffer(name, torch.empty(shape, device=device, dtype=(
                    torch.float32 if name.endswith("_scale") else wdtype)))
        self.register_load_state_dict_post_hook(lambda module, keys: module._push_weights())

    def extra_repr(self) -> str:
        c = self.config
        return (f"E={c.num_experts}, H={c.hidden}, I={c.intermediate}, K={c.topk}, "
                f"T_max={c.max_tokens_per_rank}, dtype={c.dtype!r}, path={self.path!r}, "
                f"rank={self.layer.comm.rank}/{c.num_ranks}, key={self.layer_key}")

    def load_weights(self, w1: torch.Tensor, w1_scale: torch.Tensor | None, w2: torch.Tensor,
                     w2_scale: torch.Tensor | None) -> None:
        """Copies this rank's experts (SPEC layout, any device; e4m3 also as uint8) into the
        buffers and loads them into the layer. Shapes: ``self.config.weight_shapes()``."""
        given = {"w1": w1, "w1_scale": w1_scale, "w2": w2, "w2_scale": w2_scale}
        for name, value in given.items():
            buf = getattr(self, name)
            if buf is None:
                if value is not None:
                    raise InvalidArgument(f"{name} must be None in bf16 mode")
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(buf.shape):
                raise InvalidArgument(f"{name} must have shape {tuple(buf.shape)}; got "
                                      f"{tuple(value.shape)}")
            if value.dtype != buf.dtype and not (buf.dtype == torch.float8_e4m3fn
                                                 and value.dtype in (torch.uint8, torch.int8)):
                raise InvalidArgument(f"{name} must be {str(buf.dtype).replace('torch.', '')}; "
                                      f"got {str(value.dtype).replace('torch.', '')}")
        with torch.no_grad():
            for name, value in given.items():
                buf = getattr(self, name)
                if buf is not None:
                    (buf.view(value.dtype) if value.dtype != buf.dtype else buf).copy_(value)
        self._push_weights()

    def _push_weights(self) -> None:
        self.layer.load_weights(self.w1, self.w1_scale, self.w2, self.w2_scale,
                                stream=torch.cuda.current_stream(self.layer.device))
        self.weights_loaded = True

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """y [T, H] bf16; x [T, H] bf16, topk_idx [T, K] int32 or int64, topk_weights [T, K]
        fp32, all on this rank's GPU. Collective (every rank calls it, T may differ)."""
        if _plain_eager(x):
            return self._bound.forward(x, topk_idx, topk_weights, self.path)
        if topk_idx.dtype == _I64:
            topk_idx = idx_to_int32(topk_idx, self.num_experts)
        return _OP(x, topk_idx, topk_weights, self.layer_key, self.path)

    def check_device_error(self) -> None:
        """Synchronizes torch's current stream and raises an error the GPU recorded (e.g. an
        expert index out of range). Not for the hot path."""
        self.layer.check_device_error(torch.cuda.current_stream(self.layer.device))

    def close(self) -> None:
        """Unregisters the layer and frees its GPU buffers now (a CUDA graph that captured this
        module must not be replayed after)."""
        self._unregister()
        self.layer.close()
