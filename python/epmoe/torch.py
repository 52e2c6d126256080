"""epmoe.torch: the layer as a PyTorch operator (``torch.ops.epmoe.moe_forward``) and a module
(:class:`MoE`), for eager mode, ``torch.compile(fullgraph=True)`` and CUDA graphs.

    import epmoe.torch as et
    moe = et.MoE(num_experts=256, hidden=7168, intermediate=2048, topk=8,
                 max_tokens_per_rank=4096, dtype="fp8")          # collective, like epmoe.Layer
    moe.load_weights(w1, w1_scale, w2, w2_scale)
    y = moe(x, topk_idx, topk_weights)          # topk_idx int32 or int64 (torch.topk's)

Many modules share one epmoe.Workspace (``MoE(..., workspace=ws)``): the GPU memory epmoe holds
is then that workspace, whatever the number of modules. The operator takes tensors and scalars
only, so it names its layer by an int key into a registry of this process
(:func:`register_layer`). Importing this module imports torch; the rest of epmoe never does.
See docs/PYTHON.md.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from typing import Any

import torch

from . import _lib
from ._checks import choice_arg
from ._errors import InvalidArgument
from .layer import Layer, LayerConfig
from .weights import transform_w13
from .workspace import Workspace

__all__ = ["MoE", "moe_forward", "register_layer", "unregister_layer", "registered_layer",
           "load_fast_path", "fast_path_loaded"]

_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_forward_args = _lib.forward_args
_PATHS = {"auto": _lib.PATH_AUTO, "pipeline": _lib.PATH_PIPELINE, "fused": _lib.PATH_FUSED}

# ---- the registry: int key -> layer --------------------------------------------------------------


class _Bound:
    """What one call of the operator needs of a layer, read once at registration, so that a call
    costs a few attribute reads, one allocation and one C call (no DLPack, no ctypes lookups)."""

    __slots__ = ("layer", "key", "device_index", "hidden", "topk", "e_loc", "t_max", "c_forward",
                 "raw_stream", "fast")

    def __init__(self, layer: Layer, key: int):
        c = layer.config
        self.layer, self.key = layer, key
        self.device_index = layer.device
        self.hidden, self.topk, self.e_loc = c.hidden, c.topk, c.experts_per_rank
        self.t_max = c.max_tokens_per_rank
        # Why cached here: Layer.__call__ reads each tensor through a DLPack capsule and looks the
        # C function up by name on every call; a torch tensor gives its pointer directly. The call
        # is epmoe_layer_forward_args(layer, &args): filling this thread's struct and passing two
        # arguments costs ~1 us less than converting epmoe_layer_forward_ex's eleven.
        self.c_forward = _lib.lib().epmoe_layer_forward_args
        self.raw_stream = _raw_stream
        self.fast = None
        self.bind_fast()

    def bind_fast(self, ext: Any = None) -> None:
        """The C++ fast path's callable for this layer (`ext`: the extension being loaded, else the
        loaded one, if any)."""
        ext = ext if ext is not None else _fast_ext
        # (A C function only: the CPU tests replace c_forward with a Python recorder.)
        if ext is not None and isinstance(self.c_forward, ctypes._CFuncPtr):
            fn = ctypes.cast(self.c_forward, ctypes.c_void_p).value
            self.fast = ext.FastForward(fn, self.device_index, self.hidden, self.topk, self.t_max,
                                        _lib.INDEX_INT32, _lib.INDEX_INT64)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                path: str, counts_ptr: int | None = None,
                total_ptr: int | None = None) -> torch.Tensor:
        handle = self.layer._handle
        fast = self.fast
        if fast is not None and handle is not None:
            code = _PATHS.get(path)
            if code is not None:
                # The same checks, allocation and call in C++; None: a check failed and nothing was
                # done, so the checks below name the argument (load_fast_path).
                r = fast(handle, x, topk_idx, topk_weights, code, counts_ptr or 0, total_ptr or 0)
                if r is not None:
                    if r[1]:
                        _lib.check(r[1])
                    return r[0]
        dev = self.device_index
        t = x.shape[0] if x.dim() == 2 else -1
        k = (t, self.topk)
        it = topk_idx.dtype
        # One boolean chain on the hot path; _explain() names the failing argument.
        if not (handle is not None and x.dtype is _BF16 and 0 <= t <= self.t_max
                and x.shape[1] == self.hidden and (it is _I32 or it is _I64)
                and topk_idx.shape == k and topk_weights.dtype is _F32
                and topk_weights.shape == k and x.get_device() == dev
                and topk_idx.get_device() == dev and topk_weights.get_device() == dev
                and x.is_contiguous() and topk_idx.is_contiguous()
                and topk_weights.is_contiguous() and x.data_ptr() % 16 == 0 and path in _PATHS):
            self._explain(x, topk_idx, topk_weights, path)
        out = x.new_empty((t, self.hidden))
        pack, buf, address = _forward_args()
        # int64 indices go in as they are: the kernels read either width (no conversion copy).
        pack(buf, 0, x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), out.data_ptr(),
             counts_ptr or 0, total_ptr or 0, self.raw_stream(dev), t, 1 if it is _I64 else 0,
             _PATHS[path])
        status = self.c_forward(handle, address)
        if status:
            _lib.check(status)
        return out

    def forward_counts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       path: str, want_counts: bool, total: torch.Tensor | None):
        """(y, this call's expert counts [E_loc] int32 or None); the counts are also added to
        `total` [E_loc] int64 when given (in the same launch)."""
        if total is not None:
            self.check_total(total)
        counts = torch.empty((self.e_loc,), dtype=_I32, device=x.device) if want_counts else None
        y = self.forward(x, topk_idx, topk_weights, path,
                         None if counts is None else counts.data_ptr(),
                         None if total is None else total.data_ptr())
        return y, counts

    def check_total(self, total: Any) -> None:
        """A running sum of expert counts: an int64 [E_loc] contiguous tensor on the layer's GPU."""
        if not isinstance(total, torch.Tensor):
            raise InvalidArgument(f"expert_counts_total must be a torch.Tensor, got "
                                  f"{type(total).__name__}")
        dev = self.device_index
        if total.get_device() != dev:
            here = f"cuda:{total.get_device()}" if total.get_device() >= 0 else str(total.device)
            raise InvalidArgument(f"expert_counts_total is on {here} but this epmoe layer lives on "
                                  f"{f'cuda:{dev}' if dev >= 0 else 'cpu'}")
        if total.dtype is not _I64 or tuple(total.shape) != (self.e_loc,) or not total.is_contiguous():
            raise InvalidArgument(f"expert_counts_total must be a contiguous int64 tensor of shape "
                                  f"({self.e_loc},) = (E_loc,); got "
                                  f"{str(total.dtype).replace('torch.', '')} {tuple(total.shape)}"
                                  f"{'' if total.is_contiguous() else ', not contiguous'}")

    def _explain(self, x, topk_idx, topk_weights, path) -> None:
        if self.layer._handle is None:
            raise InvalidArgument(f"epmoe::moe_forward: the layer registered as {self.key} was "
                                  f"closed")
        choice_arg("path", path, _PATHS)
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

# ---- the C++ fast path (optional) ----------------------------------------------------------------

_fast_ext = None  # the extension module of csrc/torch_fast.cpp, once loaded
_fast_lock = threading.Lock()  # one load at a time


def load_fast_path(*, build_directory: str | None = None, verbose: bool = False) -> None:
    """Builds (once; torch.utils.cpp_extension caches the build) and loads epmoe's C++ eager path,
    then makes every eager call of :class:`MoE` and :func:`moe_forward` go through it: the input
    checks, the allocation of ``y`` and the library call in one C++ call instead of Python
    (3.4-5 us less per call, about a quarter of it; docs/PYTHON.md). Results are the same bits,
    errors the same messages (a failed check falls back to the Python checks, which name the
    argument). Calls through ``torch.compile`` and torch's dispatcher reach the same kernel
    function and take it too; CUDA graph replays run no host code.

    Needs what ``torch.utils.cpp_extension.load`` needs for a CUDA-aware C++ extension: a C++
    compiler (``CXX`` picks it), ``ninja``, torch's headers and a CUDA toolkit (``CUDA_HOME``;
    the extension includes ``cuda_runtime_api.h``); takes ~30 s the first time. Raises if the
    build fails; the Python path then stays in use. ``EPMOE_TORCH_FAST_PATH=1`` in the environment calls this at import (a
    failure then warns instead of raising)."""
    global _fast_ext
    with _fast_lock:
        if _fast_ext is not None:
            return
        import os
        from torch.utils import cpp_extension
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_fast.cpp")
        ext = cpp_extension.load(name="epmoe_torch_fast", sources=[src], extra_cflags=["-O2"],
                                 with_cuda=True, build_directory=build_directory, verbose=verbose)
        if ext.ARGS_BYTES != ctypes.sizeof(_lib.ForwardArgsC):
            raise RuntimeError(f"epmoe fast path: the extension's argument struct is "
                               f"{ext.ARGS_BYTES} bytes, the library's "
                               f"{ctypes.sizeof(_lib.ForwardArgsC)} (a stale build in "
                               f"{build_directory or 'torch_extensions'}?)")
        with _registry_lock:
            # Every registered layer is bound first; only then is the extension published (for
            # layers registered later), so a failure here leaves the Python path everywhere.
            bound = list(_registry.values())
            try:
                for b in bound:
                    b.bind_fast(ext)
            except BaseException:
                for b in bound:
                    b.fast = None
                raise
            _fast_ext = ext


def fast_path_loaded() -> bool:
    """Whether :func:`load_fast_path` has loaded the C++ eager path in this process."""
    return _fast_ext is not None


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
                "str path='auto') -> Tensor")


def _moe_forward_cuda(x, topk_idx, topk_weights, layer, path="auto"):
    b = _registry.get(layer)
    if b is None:
        b = _bound(layer)
    return b.forward(x, topk_idx, topk_weights, path)


_library.impl("moe_forward", _moe_forward_cuda, "CUDA")

# The same call with this call's expert counts ([E_loc] int32: rows each local expert received from
# every rank) as a second output. A separate operator, so that moe_forward's schema stays as it is.
_library.define("moe_forward_counts(Tensor x, Tensor topk_idx, Tensor topk_weights, int layer, "
                "str path='auto') -> (Tensor, Tensor)")


def _moe_forward_counts_cuda(x, topk_idx, topk_weights, layer, path="auto"):
    return _bound(layer).forward_counts(x, topk_idx, topk_weights, path, True, None)


_library.impl("moe_forward_counts", _moe_forward_counts_cuda, "CUDA")


@torch.library.register_fake("epmoe::moe_forward")
def _moe_forward_fake(x, topk_idx, topk_weights, layer, path="auto"):
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


@torch.library.register_fake("epmoe::moe_forward_counts")
def _moe_forward_counts_fake(x, topk_idx, topk_weights, layer, path="auto"):
    y = _moe_forward_fake(x, topk_idx, topk_weights, layer, path)
    b = _bound(layer)  # the counts' length is the layer's: it must be registered
    return y, x.new_empty((b.e_loc,), dtype=_I32)


_OP = torch.ops.epmoe.moe_forward.default
_OP_COUNTS = torch.ops.epmoe.moe_forward_counts.default
for _op in (_OP, _OP_COUNTS):
    try:
        # Why: every rank must make the same number of these collective calls; an unused result
        # must not let a graph pass drop one.
        torch.fx.node.has_side_effect(_op)
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


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                layer: Any, path: str | None = None, *, return_expert_counts: bool = False,
                expert_counts_total: torch.Tensor | None = None) -> Any:
    """y [T, H] bf16 of the layer `layer` (a :class:`MoE`, or a key from :func:`register_layer`).
    `path`: "auto", "pipeline" or "fused" (bitwise the same y); by default the module's own (a
    :class:`MoE`) or "auto" (a key). A path other than a module's own is refused: set ``MoE.path``
    instead.

    Calls ``torch.ops.epmoe.moe_forward`` on torch's current stream. Collective: every rank
    calls it (with its own T, possibly 0). No host synchronization, so it can be captured in a
    CUDA graph and traced by ``torch.compile``. `topk_idx` is int32 or int64 (torch.topk's), read
    as it is. With `return_expert_counts` it returns (y, counts): counts [E_loc] int32, the rows
    each local expert received in this call (``torch.ops.epmoe.moe_forward_counts``); with
    `expert_counts_total` (int64 [E_loc], a registry key only: an MoE keeps its own) the counts
    are also added to it."""
    if isinstance(layer, MoE):
        if path is not None and path != layer.path:
            raise InvalidArgument(
                f"moe_forward: path={path!r} but the MoE module runs path={layer.path!r}; set "
                "MoE.path, or pass its registry key instead of the module to choose per call")
        if expert_counts_total is not None:
            raise InvalidArgument("moe_forward: an MoE keeps its own running sum of expert counts "
                                  "(MoE(..., count_experts=True)); pass expert_counts_total with "
                                  "a registry key")
        return layer(x, topk_idx, topk_weights, return_expert_counts=return_expert_counts)
    if path is None:
        path = "auto"
    if not return_expert_counts and expert_counts_total is None:
        if _plain_eager(x):
            return _bound(layer).forward(x, topk_idx, topk_weights, path)
        return _OP(x, topk_idx, topk_weights, layer, path)
    return _with_counts(layer, x, topk_idx, topk_weights, path, return_expert_counts,
                        expert_counts_total)


def _with_counts(key: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 path: str, want_counts: bool, total: torch.Tensor | None) -> Any:
    """A call that returns its expert counts and/or adds them to `total`. Eagerly one C call does
    both; traced, the counts operator and an add of its second output."""
    b = _bound(key)
    if _plain_eager(x):
        y, counts = b.forward_counts(x, topk_idx, topk_weights, path, want_counts, total)
    else:
        if total is not None:
            b.check_total(total)
        y, counts = _OP_COUNTS(x, topk_idx, topk_weights, key, path)
        if total is not None:
            total.add_(counts)
    return (y, counts) if want_counts else y


# ---- the module ----------------------------------------------------------------------------------


class MoE(torch.nn.Module):
    """The experts of one MoE layer on this rank: an :class:`epmoe.Layer` plus its weights as
    buffers (``w1``, ``w1_scale``, ``w2``, ``w2_scale``; the scales are None in bf16 mode).

    Creation is collective (every rank, same arguments), as for :class:`epmoe.Layer`, whose
    arguments these are; `group` is what Layer calls `group_or_comm` (None: torch's default
    group). ``forward(x, topk_idx, topk_weights)`` calls ``torch.ops.epmoe.moe_forward``.
    Inference only: the operator has no backward.

    The buffers ``w1`` ... ``w2_scale`` are this rank's experts in the SPEC layout (the
    ``state_dict``). :meth:`load_weights` copies into them; ``load_state_dict`` too. Then:

    - without `workspace`, the layer has its own buffers and its own copy of the weights in the
      kernels' layout (the weights are held twice on the GPU);
    - with ``workspace=ws`` (an :class:`epmoe.Workspace` shared by many modules; the module must
      fit it), the layer runs on the workspace's buffers and reads the weights by reference:
      ``w2`` and ``w2_scale`` as they are, and ``w13_kernel`` / ``w13_kernel_scale`` (two more
      buffers, not in the state_dict) that :func:`epmoe.transform_w13` fills from ``w1`` at each
      load. The GPU memory epmoe holds is the workspace's (:attr:`epmoe.Workspace.nbytes`). The
      layer reads these buffers for as long as it lives: never replace them (``.to(dtype)``,
      ``load_state_dict(assign=True)``); that raises.

    ``count_experts=True`` keeps ``expert_counts_total`` (int64 [E_loc], a buffer outside the
    state_dict): every call adds the rows each local expert received, on the device and without a
    sync; :meth:`reset_expert_counts` zeroes it.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, dtype: str = "fp8", *, group: Any = None,
                 activation_clamp: float | None = None, pow2_scales: bool = False,
                 combine_partials: str = "fp32", timeout_seconds: float = 10.0,
                 path: str = "auto", workspace: Workspace | None = None,
                 count_experts: bool = False):
        super().__init__()
        choice_arg("path", path, _PATHS)
        if not isinstance(count_experts, bool):
            raise InvalidArgument(f"count_experts must be a bool, got {count_experts!r}")
        options = dict(pow2_scales=pow2_scales, combine_partials=combine_partials,
                       timeout_seconds=timeout_seconds)
        wdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16

        def buffers(shapes: dict, device: torch.device, persistent: bool = True) -> None:
            for name, shape in shapes.items():
                self.register_buffer(name, None if shape is None else torch.empty(
                    shape, device=device, dtype=torch.float32 if name.endswith("_scale") else wdtype),
                    persistent=persistent)

        self._ref_ptrs = None
        if workspace is None:
            self.layer = Layer(group, num_experts, hidden, intermediate, topk, max_tokens_per_rank,
                               dtype, activation_clamp, **options)
            buffers(self.layer.config.weight_shapes(), _buffer_device(self.layer.device))
        else:
            if not isinstance(workspace, Workspace):
                raise InvalidArgument(f"workspace must be an epmoe.Workspace, got "
                                      f"{type(workspace).__module__}.{type(workspace).__qualname__}")
            # The buffers come first: the layer is created on them (by reference).
            shapes = LayerConfig(workspace.config.num_ranks, num_experts, hidden, intermediate, topk,
                                 max_tokens_per_rank, dtype, activation_clamp,
                                 **options).validate().weight_shapes()
            device = _buffer_device(workspace.device)
            buffers(shapes, device)
            buffers({"w13_kernel": shapes["w1"], "w13_kernel_scale": shapes["w1_scale"]}, device,
                    persistent=False)
            refs = {"w13": self.w13_kernel, "w13_scale": self.w13_kernel_scale, "w2": self.w2,
                    "w2_scale": self.w2_scale}
            self.layer = Layer(group, num_experts, hidden, intermediate, topk, max_tokens_per_rank,
                               dtype, activation_clamp, workspace=workspace, weights=refs, **options)
            self._ref_ptrs = self._buffer_ptrs()
        self.workspace = workspace
        self.config = self.layer.config
        self.num_experts, self.path = num_experts, path
        self.weights_loaded = False
        self.layer_key = register_layer(self.layer)
        self._bound = _registry[self.layer_key]
        self._unregister = weakref.finalize(self, unregister_layer, self.layer_key)
        self.register_buffer("expert_counts_total", torch.zeros(
            (self.config.experts_per_rank,), dtype=_I64, device=_buffer_device(self.layer.device))
            if count_experts else None, persistent=False)
        self.register_load_state_dict_post_hook(lambda module, keys: module._push_weights())

    def extra_repr(self) -> str:
        c = self.config
        return (f"E={c.num_experts}, H={c.hidden}, I={c.intermediate}, K={c.topk}, "
                f"T_max={c.max_tokens_per_rank}, dtype={c.dtype!r}, path={self.path!r}, "
                f"rank={self.layer.comm.rank}/{c.num_ranks}, key={self.layer_key}"
                f"{', on a workspace' if self.workspace is not None else ''}")

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
        stream = torch.cuda.current_stream(self.layer.device)
        if self._ref_ptrs is None:
            self.layer.load_weights(self.w1, self.w1_scale, self.w2, self.w2_scale, stream=stream)
        else:
            # By reference: w2 is read where it is; W1 goes through the one-time transform into
            # w13_kernel (on the stream, no sync). Idempotent: the source w1 is not touched.
            self._check_refs()
            transform_w13(self.w1, self.w1_scale, out=self.w13_kernel,
                          out_scale=self.w13_kernel_scale, stream=stream)
        self.weights_loaded = True

    def _buffer_ptrs(self) -> tuple:
        return tuple(None if b is None else b.data_ptr() for b in
                     (self.w13_kernel, self.w13_kernel_scale, self.w2, self.w2_scale))

    def _check_refs(self) -> None:
        if self._ref_ptrs is not None and self._buffer_ptrs() != self._ref_ptrs:
            raise InvalidArgument("this epmoe MoE reads its weight buffers by reference (it runs on a "
                                  "workspace) and they were replaced (.to(dtype), .half(), "
                                  "load_state_dict(assign=True), ...); the layer would read the old "
                                  "memory. Keep the buffers in place: copy into them instead")

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._check_refs()
        return out

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                return_expert_counts: bool = False) -> Any:
        """y [T, H] bf16; x [T, H] bf16, topk_idx [T, K] int32 or int64 (read as it is),
        topk_weights [T, K] fp32, all on this rank's GPU. Collective (every rank calls it, T may
        differ). With `return_expert_counts`, (y, counts): counts [E_loc] int32, the rows each
        local expert received in this call. With count_experts, the counts are added to
        ``expert_counts_total``."""
        if self._ref_ptrs is not None and not self.weights_loaded:
            # Why here: a layer that references its weights has nothing to check in the library;
            # it would read the buffers' uninitialized memory.
            raise InvalidArgument("MoE.forward: the weights were never loaded (load_weights or "
                                  "load_state_dict)")
        # Why _buffers: reading the buffer as an attribute goes through nn.Module.__getattr__.
        if not return_expert_counts and self._buffers.get("expert_counts_total") is None:
            if _plain_eager(x):
                return self._bound.forward(x, topk_idx, topk_weights, self.path)
            return _OP(x, topk_idx, topk_weights, self.layer_key, self.path)
        return _with_counts(self.layer_key, x, topk_idx, topk_weights, self.path,
                            return_expert_counts, self.expert_counts_total)

    def reset_expert_counts(self) -> None:
        """Zeroes ``expert_counts_total`` (stream-ordered)."""
        if self.expert_counts_total is None:
            raise InvalidArgument("reset_expert_counts: this MoE does not count (count_experts=False)")
        self.expert_counts_total.zero_()

    def check_device_error(self) -> None:
        """Synchronizes torch's current stream and raises an error the GPU recorded (e.g. an
        expert index out of range). Not for the hot path."""
        self.layer.check_device_error(torch.cuda.current_stream(self.layer.device))

    def close(self) -> None:
        """Unregisters the layer and frees it now (on a workspace: drops its share, so that the
        workspace can close). A CUDA graph that captured this module must not be replayed after."""
        self._unregister()
        self.layer.close()


def _load_fast_path_from_env() -> None:
    import os
    import warnings
    if os.environ.get("EPMOE_TORCH_FAST_PATH", "0") in ("", "0"):
        return
    try:
        load_fast_path()
    except Exception as e:  # the build's own error types vary; any failure keeps the Python path
        warnings.warn(f"epmoe.torch: EPMOE_TORCH_FAST_PATH is set but the C++ fast path did not load "
                      f"({type(e).__name__}: {e}); eager calls use the Python path", RuntimeWarning,
                      stacklevel=2)


_load_fast_path_from_env()
