"""epmoe: the expert-parallel MoE layer of SPEC.md on the GPUs of one Hopper node.

One process per GPU. Tensors come in through DLPack (torch, CuPy, JAX, ...); kernels run on the
caller's current stream. See docs/PYTHON.md in the repository.

    import epmoe
    layer = epmoe.Layer(None, num_experts=256, hidden=7168, intermediate=2048, topk=8,
                        max_tokens_per_rank=4096, dtype="fp8")   # None: torch's default group
    layer.load_weights(w1, w1_scale, w2, w2_scale)
    y = layer(x, topk_idx, topk_weights)

Many layers share one set of device buffers through an epmoe.Workspace
(``Layer(..., workspace=ws, weights=...)``).
"""

from ._dlpack import DeviceArray
from ._errors import (CudaError, DeviceTimeout, Error, InternalError, InvalidArgument,
                      LibraryError, NcclError, UnsupportedError)
from ._lib import C_API_VERSION, library_path
from .comm import Communicator, get_unique_id
from .dispatch import Dispatcher
from .layer import Layer, LayerConfig
from .weights import transform_w13
from .workspace import Workspace, WorkspaceConfig

__version__ = "0.1.0"

__all__ = [
    "Communicator", "CudaError", "DeviceArray", "DeviceTimeout", "Dispatcher", "Error",
    "InternalError", "InvalidArgument", "Layer", "LayerConfig", "LibraryError", "NcclError",
    "UnsupportedError", "Workspace", "WorkspaceConfig", "get_unique_id", "library_path",
    "nccl_version", "transform_w13", "version",
]


def version() -> str:
    """The version of the loaded libepmoe_c.so (loads it)."""
    from . import _lib
    return _lib.lib().epmoe_version_string().decode()


def nccl_version() -> int:
    """The version code of the libnccl the library loaded (e.g. 22809); raises NcclError if it is
    older than epmoe needs."""
    import ctypes
    from . import _lib
    code = ctypes.c_int()
    _lib.call("epmoe_nccl_runtime_version", ctypes.byref(code))
    return code.value
