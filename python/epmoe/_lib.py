"""Loading libepmoe_c.so (the C API of include/epmoe/c_api.h) and calling into it."""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_uint8
from ctypes import c_void_p, c_size_t

from ._errors import LibraryError, error_for

# Must equal EPMOE_C_API_VERSION of the library this package was written for.
C_API_VERSION = 5
UNIQUE_ID_BYTES = 128
LIBRARY_NAME = "libepmoe_c.so"

DTYPE_FP8 = 0
DTYPE_BF16 = 1
PATH_PIPELINE = 0
PATH_FUSED = 1
PATH_AUTO = 2
PARTIALS_FP32 = 0
PARTIALS_BF16 = 1
INDEX_INT32 = 0
INDEX_INT64 = 1


class LayerConfigC(ctypes.Structure):
    """epmoe_layer_config."""

    _fields_ = [
        ("num_ranks", c_int32),
        ("num_experts", c_int32),
        ("hidden", c_int32),
        ("intermediate", c_int32),
        ("topk", c_int32),
        ("max_tokens_per_rank", c_int32),
        ("dtype", c_int32),
        ("activation_clamp", c_float),
        ("pow2_scales", c_int32),
        ("combine_partials", c_int32),
        ("timeout_seconds", c_double),
        ("strict_routing", c_int32),
        ("reserved", c_int32),
    ]


class ForwardArgsC(ctypes.Structure):
    """epmoe_forward_args (epmoe_layer_forward_args: epmoe_layer_forward_ex's arguments in a struct,
    ~1 us less per call through ctypes than eleven converted arguments)."""

    _fields_ = [
        ("x", c_void_p),
        ("topk_idx", c_void_p),
        ("topk_weights", c_void_p),
        ("y", c_void_p),
        ("expert_counts", c_void_p),
        ("expert_counts_total", c_void_p),
        ("stream", c_void_p),
        ("num_tokens", c_int64),
        ("idx_type", c_int32),
        ("path", c_int32),
    ]


_forward_args_tls = threading.local()
# ForwardArgsC's layout for struct.pack_into: one call fills all ten fields (~0.4 us, against ~1 us
# for ten ctypes field assignments). Pointers as unsigned 64-bit, 0 for NULL.
_FORWARD_ARGS = struct.Struct("=7Qq2i")


def forward_args() -> tuple:
    """(pack, buffer, address): this thread's epmoe_forward_args as a 72-byte buffer at `address`,
    filled per call by pack(buffer, 0, x, topk_idx, topk_weights, y, expert_counts,
    expert_counts_total, stream, num_tokens, idx_type, path) (pointers as ints, 0 for NULL) and read
    by the C call before it returns. Why per thread: ctypes releases the GIL during the call, so
    another thread's fill must not land in the struct a call is reading."""
    try:
        return _forward_args_tls.pba
    except AttributeError:
        buf = bytearray(_FORWARD_ARGS.size)
        view = (ctypes.c_char * len(buf)).from_buffer(buf)  # pins buf; keeps the address valid
        _forward_args_tls.view = view
        _forward_args_tls.pba = (_FORWARD_ARGS.pack_into, buf, ctypes.addressof(view))
        return _forward_args_tls.pba


def unpack_forward_args(handle: int, address: int) -> tuple:
    """The arguments of an epmoe_layer_forward_args call in epmoe_layer_forward_ex's order: (layer,
    x, topk_idx, idx_type, topk_weights, y, T, expert_counts, expert_counts_total, stream, path);
    NULL pointers as None. For tests and debugging."""
    a = ForwardArgsC.from_address(address)
    return (handle, a.x, a.topk_idx, a.idx_type, a.topk_weights, a.y, a.num_tokens, a.expert_counts,
            a.expert_counts_total, a.stream, a.path)


class WorkspaceConfigC(ctypes.Structure):
    """epmoe_workspace_config."""

    _fields_ = [
        ("num_ranks", c_int32),
        ("max_experts_per_rank", c_int32),
        ("max_hidden", c_int32),
        ("max_intermediate", c_int32),
        ("max_topk", c_int32),
        ("max_tokens_per_rank", c_int32),
        ("dtype", c_int32),
        ("reserved", c_int32),
        ("timeout_seconds", c_double),
    ]


class WeightRefsC(ctypes.Structure):
    """epmoe_weight_refs."""

    _fields_ = [("w13", c_void_p), ("w13_scale", c_void_p), ("w2", c_void_p), ("w2_scale", c_void_p)]


class DispatchConfigC(ctypes.Structure):
    """epmoe_dispatch_config."""

    _fields_ = [
        ("num_experts", c_int32),
        ("hidden", c_int32),
        ("topk", c_int32),
        ("max_tokens_per_rank", c_int32),
        ("row_align", c_int32),
        ("intermediate", c_int32),
        ("dtype", c_int32),
        ("pow2_scales", c_int32),
        ("combine_partials", c_int32),
        ("num_blocks", c_int32),
        ("timeout_seconds", c_double),
    ]


class PoolViewC(ctypes.Structure):
    """epmoe_pool_view."""

    _fields_ = [
        ("base", c_void_p),
        ("bytes", c_int64),
        ("max_rows", c_int64),
        ("scale_stride", c_int64),
        ("x_pool", c_void_p),
        ("x_scale", c_void_p),
        ("row_weight", c_void_p),
        ("row_source", c_void_p),
        ("a_pool", c_void_p),
        ("a_scale", c_void_p),
        ("o_pool", c_void_p),
        ("expert_count", c_void_p),
        ("expert_offset", c_void_p),
    ]


_P = c_void_p  # opaque handles, device pointers and streams all travel as void*
_PROTOTYPES = {
    "epmoe_c_api_version": (c_int, []),
    "epmoe_version_string": (c_char_p, []),
    "epmoe_status_name": (c_char_p, [c_int]),
    "epmoe_last_error": (c_char_p, []),
    "epmoe_nccl_runtime_version": (c_int, [POINTER(c_int)]),
    "epmoe_validate_config": (c_int, [POINTER(LayerConfigC)]),
    "epmoe_validate_call": (c_int, [POINTER(LayerConfigC), c_int64, _P, _P, _P, _P]),
    "epmoe_validate_routing_host": (c_int, [POINTER(LayerConfigC), c_int64, _P]),
    "epmoe_get_unique_id": (c_int, [POINTER(c_uint8)]),
    "epmoe_comm_create": (c_int, [POINTER(c_uint8), c_int, c_int, c_int, POINTER(_P)]),
    "epmoe_comm_from_nccl": (c_int, [c_size_t, POINTER(_P)]),
    "epmoe_comm_info": (c_int, [_P, POINTER(c_int), POINTER(c_int), POINTER(c_int)]),
    "epmoe_comm_destroy": (c_int, [_P]),
    "epmoe_layer_create": (c_int, [_P, POINTER(LayerConfigC), POINTER(_P)]),
    "epmoe_layer_get_config": (c_int, [_P, POINTER(LayerConfigC)]),
    "epmoe_layer_load_weights": (c_int, [_P, _P, _P, _P, _P, c_int, _P]),
    "epmoe_layer_forward": (c_int, [_P, _P, _P, _P, _P, c_int64, _P, c_int]),
    "epmoe_layer_check_device_error": (c_int, [_P, _P]),
    "epmoe_layer_last_path": (c_int, [_P, POINTER(c_int)]),
    "epmoe_layer_destroy": (c_int, [_P]),
    "epmoe_layer_forward_ex": (c_int, [_P, _P, _P, c_int, _P, _P, c_int64, _P, _P, _P, c_int]),
    "epmoe_layer_forward_args": (c_int, [_P, _P]),
    "epmoe_validate_workspace_config": (c_int, [POINTER(WorkspaceConfigC)]),
    "epmoe_workspace_sizes": (c_int, [POINTER(WorkspaceConfigC), POINTER(c_int64), POINTER(c_int64), POINTER(c_int64)]),
    "epmoe_check_layer_fits": (c_int, [POINTER(WorkspaceConfigC), POINTER(LayerConfigC)]),
    "epmoe_workspace_create": (c_int, [_P, POINTER(WorkspaceConfigC), POINTER(_P)]),
    "epmoe_workspace_get_config": (c_int, [_P, POINTER(WorkspaceConfigC)]),
    "epmoe_workspace_nbytes": (c_int, [_P, POINTER(c_int64)]),
    "epmoe_workspace_num_layers": (c_int, [_P, POINTER(c_int32)]),
    "epmoe_workspace_destroy": (c_int, [_P]),
    "epmoe_layer_create_on": (c_int, [_P, POINTER(LayerConfigC), POINTER(WeightRefsC), POINTER(_P)]),
    "epmoe_w13_transform_bytes": (c_int, [c_int, c_int, c_int, c_int, POINTER(c_int64), POINTER(c_int64)]),
    "epmoe_transform_w13": (c_int, [c_int, _P, _P, _P, _P, c_int, c_int, c_int, _P]),
    "epmoe_dispatch_create": (c_int, [_P, POINTER(DispatchConfigC), POINTER(_P)]),
    "epmoe_dispatch_get_pool": (c_int, [_P, POINTER(PoolViewC)]),
    "epmoe_dispatch_run": (c_int, [_P, _P, _P, _P, c_int64, _P]),
    "epmoe_combine_run": (c_int, [_P, _P, c_int64, _P]),
    "epmoe_dispatch_check_errors": (c_int, [_P, _P]),
    "epmoe_dispatch_destroy": (c_int, [_P]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def library_candidates() -> list[str]:
    """Where the library is looked for: $EPMOE_LIBRARY alone if set, else inside this package."""
    env = os.environ.get("EPMOE_LIBRARY")
    if env:
        return [env]
    return [os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)]


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    errors = []
    for path in library_candidates():
        if not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise LibraryError(
                    f"{path} lacks the C function {name}: it was built from another version of "
                    f"epmoe; rebuild it (pip install ./python) or point EPMOE_LIBRARY at a "
                    f"matching build") from None
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.epmoe_c_api_version()
        if version != C_API_VERSION:
            raise LibraryError(
                f"{path} has C API version {version} but this package needs {C_API_VERSION}; "
                f"rebuild it (pip install ./python) or point EPMOE_LIBRARY at a matching build")
        _lib, _lib_path = lib, path
        return lib
    raise LibraryError(
        "cannot load libepmoe_c.so (" + "; ".join(errors) + "). Install the package with "
        "`pip install ./python` from the epmoe repository, or set EPMOE_LIBRARY to the path of a "
        "libepmoe_c.so built by `cmake --build <build> --target epmoe_c` (it is written to "
        "<build>/python/libepmoe_c.so).")


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    if _lib is None:
        with _lock:
            if _lib is None:
                return _load()
    return _lib


def library_path() -> str:
    """The file the library was loaded from (loads it if needed)."""
    lib()
    return _lib_path  # type: ignore[return-value]


def check(status: int) -> None:
    """Raises the epmoe exception for a nonzero status, with the library's message."""
    if status != 0:
        raw = _lib.epmoe_last_error() if _lib is not None else None
        message = raw.decode("utf-8", "replace") if raw else "(no message)"
        raise error_for(status, message)


def call(name: str, *args) -> None:
    """Calls a C function that returns a status; raises on failure."""
    check(getattr(lib(), name)(*args))
