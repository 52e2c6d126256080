"""CPU-side tests of the Python package: no GPU and no torch needed (CI runs them).

They cover loading libepmoe_c.so, the library's validation messages reaching Python as
exceptions, and the Python-side checks of tensors read through DLPack."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import epmoe
from epmoe import _dlpack, _lib
from epmoe._errors import error_for
from epmoe.layer import Layer

CUDA, CPU = (2, 0), (1, 0)
GOOD = dict(num_ranks=2, num_experts=8, hidden=256, intermediate=384, topk=2,
            max_tokens_per_rank=64)


# ---- the library ----------------------------------------------------------------------------------

def test_import_and_library():
    assert epmoe.__version__ == epmoe.version() == "0.1.0"
    assert os.path.isfile(epmoe.library_path())
    assert _lib.lib().epmoe_c_api_version() == epmoe.C_API_VERSION
    assert epmoe.nccl_version() >= 22809


def test_missing_library_is_a_clear_error(tmp_path):
    code = ("import epmoe\n"
            "try:\n    epmoe.version()\n"
            "except epmoe.LibraryError as e:\n    print('LibraryError:', e)\n")
    env = dict(os.environ, EPMOE_LIBRARY=str(tmp_path / "nope.so"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "LibraryError: cannot load libepmoe_c.so" in out
    assert "nope.so: no such file" in out and "EPMOE_LIBRARY" in out


def test_exception_classes():
    assert issubclass(epmoe.InvalidArgument, epmoe.Error)
    assert issubclass(epmoe.InvalidArgument, ValueError)
    assert issubclass(epmoe.Error, RuntimeError)
    assert issubclass(epmoe.LibraryError, ImportError)
    for code, cls in [(1, epmoe.InvalidArgument), (2, epmoe.UnsupportedError),
                      (3, epmoe.CudaError), (4, epmoe.NcclError), (5, epmoe.DeviceTimeout),
                      (6, epmoe.InternalError)]:
        err = error_for(code, "msg")
        assert type(err) is cls and err.code == code and str(err) == "msg"
        assert err.code_name == _lib.lib().epmoe_status_name(code).decode()


# ---- configuration: the library's own validate() --------------------------------------------------

def test_good_config_validates():
    cfg = epmoe.LayerConfig(**GOOD).validate()
    assert cfg.experts_per_rank == 4
    assert cfg.weight_shapes() == {"w1": (4, 768, 256), "w1_scale": (4, 6, 2),
                                   "w2": (4, 256, 384), "w2_scale": (4, 2, 3)}
    bf16 = epmoe.LayerConfig(**GOOD, dtype="bf16", activation_clamp=7.0).validate()
    assert bf16.weight_shapes()["w1_scale"] is None
    epmoe.LayerConfig(**GOOD, combine_partials="bf16").validate()


@pytest.mark.parametrize("field,value,message", [
    ("hidden", 100, "hidden=100 must be a positive multiple of 128, at most 32768"),
    ("intermediate", 0, "intermediate=0 must be a positive multiple of 128"),
    ("num_experts", 7, "num_experts=7 must be divisible by num_ranks=2"),
    ("num_ranks", 9, "num_ranks=9 must be in [1, 8]"),
    ("topk", 9, "topk=9 must be in [1, min(num_experts=8, 32)]"),
    ("max_tokens_per_rank", 0, "max_tokens_per_rank=0 must be in [1, 1048576]"),
])
def test_bad_config_carries_library_message(field, value, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.LayerConfig(**dict(GOOD, **{field: value})).validate()
    assert message in str(e.value)
    assert e.value.code == 1 and e.value.code_name == "InvalidArgument"


@pytest.mark.parametrize("field,value,message", [
    ("hidden", "256", "hidden must be an int, got str '256'"),
    ("hidden", 256.0, "hidden must be an int, got float 256.0"),
    ("topk", True, "topk must be an int, got bool True"),
    ("max_tokens_per_rank", 2**40, "max_tokens_per_rank=1099511627776 does not fit in a 32-bit int"),
    ("dtype", "fp16", "dtype='fp16' must be one of 'fp8', 'bf16'"),
    ("activation_clamp", float("nan"), "activation_clamp=nan must be finite"),
    ("combine_partials", "fp16", "combine_partials='fp16' must be one of 'fp32', 'bf16'"),
])
def test_bad_config_types_checked_in_python(field, value, message):
    with pytest.raises(epmoe.InvalidArgument, match=None) as e:
        epmoe.LayerConfig(**dict(GOOD, **{field: value})).validate()
    assert message in str(e.value)


def test_numpy_integers_are_accepted():
    epmoe.LayerConfig(**dict(GOOD, hidden=np.int64(512))).validate()


def test_validate_call_and_routing_use_the_library():
    cfg = epmoe.LayerConfig(**GOOD)
    cfg.validate_call(0)
    cfg.validate_call(64)
    with pytest.raises(epmoe.InvalidArgument, match=r"num_tokens=65 must be in \[0, max_tokens_per_rank=64\]"):
        cfg.validate_call(65)
    cfg.check_routing(np.array([[0, 7], [-1, 3]], dtype=np.int32))
    with pytest.raises(epmoe.InvalidArgument) as e:
        cfg.check_routing(np.array([[0, 1], [8, 2]], dtype=np.int32))
    assert "topk_idx[1][0]=8 must be in [0, num_experts=8) or -1 for an unused slot" in str(e.value)
    with pytest.raises(epmoe.InvalidArgument, match="topk_idx must be int32; got int64"):
        cfg.check_routing(np.zeros((2, 2), dtype=np.int64))


# ---- communicator ---------------------------------------------------------------------------------

def test_unique_id():
    uid = epmoe.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128


@pytest.mark.parametrize("kwargs,message", [
    (dict(unique_id=b"short"), "unique_id must be 128 bytes"),
    (dict(rank=2, size=2), "rank=2 must be in [0, size=2)"),
    (dict(size=9), "size=9 must be in [1, 8]"),
    (dict(rank=-1), "rank=-1 must be in [0, size=1)"),
])
def test_communicator_arguments(kwargs, message):
    args = dict(unique_id=bytes(128), rank=0, size=1, device=0)
    args.update(kwargs)
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.Communicator.create(**args)
    assert message in str(e.value)


def test_communicator_without_gpu_raises_cuda_error():
    try:
        comm = epmoe.Communicator.create(epmoe.get_unique_id(), 0, 1, 0)
    except epmoe.CudaError as e:  # the usual case here: no GPU or no driver
        assert "cudaGetDeviceCount" in str(e)
    else:  # a machine with a GPU: a one-rank communicator
        assert (comm.rank, comm.size) == (0, 1)
        comm.close()


def test_from_nccl_comm_arguments():
    with pytest.raises(epmoe.InvalidArgument, match="not a valid ncclComm_t"):
        epmoe.Communicator.from_nccl_comm(0)
    with pytest.raises(epmoe.InvalidArgument, match="must be an ncclComm_t as an int"):
        epmoe.Communicator.from_nccl_comm("comm")


def test_layer_group_argument():
    with pytest.raises(epmoe.InvalidArgument, match="group_or_comm must be an epmoe.Communicator"):
        epmoe.Layer("group", 8, 256, 256, 2, 64)
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            with pytest.raises(epmoe.UnsupportedError, match="needs PyTorch"):
                epmoe.Layer(None, 8, 256, 256, 2, 64)


# ---- DLPack reading -------------------------------------------------------------------------------

def test_view_numpy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = _dlpack.view(a, "a")
    assert (v.dtype, v.shape, v.device_type) == ("float32", (3, 4), 1)
    assert v.ptr == a.ctypes.data and v.is_contiguous()
    t = _dlpack.view(a.T, "a")
    assert t.shape == (4, 3) and not t.is_contiguous()


def test_view_fake_cuda(fake):
    for versioned in (True, False):
        f = fake((5, 256), "bfloat16", CUDA, versioned=versioned, strides=(256, 1))
        v = _dlpack.view(f, "x", stream=77)
        assert (v.dtype, v.shape, v.device_type, v.ptr) == ("bfloat16", (5, 256), 2, f.ptr)
        assert f.streams == [77]


def test_view_rejects_non_tensors():
    with pytest.raises(epmoe.InvalidArgument, match="x must be a tensor that supports DLPack"):
        _dlpack.view([1, 2, 3], "x")


def test_device_array_round_trip():
    arr = epmoe.DeviceArray(0x7F0000001000, (4, 8), "float32", 0, owner=None)
    assert arr.__cuda_array_interface__["typestr"] == "<f4"
    for max_version in (None, (1, 0)):
        capsule = arr.__dlpack__(max_version=max_version)
        v = _dlpack.view(arr, "pool")  # reads its own capsule, as a consumer would
        assert (v.ptr, v.shape, v.dtype, v.device_type) == (arr.ptr, (4, 8), "float32", 2)
        assert v.strides == (8, 1) and v.is_contiguous()
        del capsule, v
    gc.collect()
    assert not _dlpack._live  # every untaken capsule released its managed tensor


class HostArray(epmoe.DeviceArray):
    device_type = 1  # kDLCPU: lets numpy consume the producer side for real


def test_device_array_consumed_by_numpy():
    backing = np.arange(24, dtype=np.float32).reshape(4, 6)
    owner = object()
    arr = HostArray(backing.ctypes.data, (4, 6), "float32", 0, owner)
    seen = np.from_dlpack(arr)  # numpy takes the capsule over and calls our deleter later
    assert seen.shape == (4, 6) and np.array_equal(seen, backing)
    backing[1, 2] = -7.0
    assert seen[1, 2] == -7.0  # same memory, no copy
    assert any(entry[-1] is arr for entry in _dlpack._live.values())
    del seen
    gc.collect()
    assert not _dlpack._live  # the consumer released it through the DLPack deleter
    legacy = arr.__dlpack__()  # an unversioned capsule, dropped untaken
    del legacy
    gc.collect()
    assert not _dlpack._live


# ---- forward / load_weights argument checks (the C call is replaced by a recorder) ---------------

@pytest.fixture
def layer(monkeypatch):
    calls = []
    monkeypatch.setattr(_lib, "call", lambda name, *args: calls.append((name, args)))
    obj = object.__new__(Layer)  # a layer without a GPU: only the Python side runs
    obj.config = epmoe.LayerConfig(**GOOD)
    obj.device = 0
    obj._handle = 0x1234
    obj.calls = calls
    return obj


def args(fake, t=4, **over):
    h, k = GOOD["hidden"], GOOD["topk"]
    a = dict(x=fake((t, h), "bfloat16", CUDA, ptr=0x10000),
             topk_idx=fake((t, k), "int32", CUDA, ptr=0x20000),
             topk_weights=fake((t, k), "float32", CUDA, ptr=0x30000),
             out=fake((t, h), "bfloat16", CUDA, ptr=0x40000))
    a.update(over)
    return a


def test_forward_reaches_the_library(layer, fake):
    a = args(fake)
    y = layer(**a, path="pipeline", stream=5)
    assert y is a["out"]
    (name, c_args), = layer.calls
    assert name == "epmoe_layer_forward_ex"
    assert c_args == (0x1234, 0x10000, 0x20000, _lib.INDEX_INT32, 0x30000, 0x40000, 4, None, None, 5,
                      _lib.PATH_PIPELINE)
    assert a["x"].streams == [5]  # the producer was told which stream epmoe runs on


def test_forward_path_default_and_fused(layer, fake):
    # The default is "auto" (the library chooses per call and rank, docs/PYTHON.md); each path
    # reaches the library as its own code.
    layer(**args(fake), stream=5)
    layer(**args(fake), path="fused", stream=5)
    layer(**args(fake), path="pipeline", stream=5)
    assert [c[1][10] for c in layer.calls] == [_lib.PATH_AUTO, _lib.PATH_FUSED, _lib.PATH_PIPELINE]
    assert len({_lib.PATH_AUTO, _lib.PATH_FUSED, _lib.PATH_PIPELINE}) == 3


def test_forward_legacy_stream_is_dlpack_1(layer, fake):
    a = args(fake)
    layer(**a, stream=0)
    assert a["x"].streams == [1] and layer.calls[0][1][9] == 0


def test_forward_zero_tokens(layer, fake):
    layer(**args(fake, t=0, x=fake((0, 256), "bfloat16", CUDA, ptr=0)))
    assert layer.calls[0][1][6] == 0


@pytest.mark.parametrize("over,message", [
    (dict(x=np.zeros((4, 256), np.uint16)), "x must be on the CUDA device cuda:0; got a tensor on cpu:0"),
    (dict(x="x"), "x must be a tensor that supports DLPack"),
    (dict(x=("fake", (4, 256), "float32")), "x must be bfloat16 (or uint16 / int16 holding its bits); got float32"),
    (dict(x=("fake", (4, 128), "bfloat16")), "x must have shape (?, 256) = (T, hidden); got (4, 128)"),
    (dict(x=("fake", (4, 256, 1), "bfloat16")), "x must have shape (?, 256) = (T, hidden); got (4, 256, 1)"),
    (dict(x=("fake", (65, 256), "bfloat16")), "x has T=65 tokens but the layer was created with max_tokens_per_rank=64"),
    (dict(topk_idx=("fake", (4, 2), "int16")), "topk_idx must be int32 or int64; got int16"),
    (dict(topk_idx=("fake", (3, 2), "int32")), "topk_idx must have shape (4, 2) = (T, topk); got (3, 2)"),
    (dict(topk_weights=("fake", (4, 2), "bfloat16")), "topk_weights must be float32; got bfloat16"),
    (dict(out=("fake", (4, 256), "float32")), "out must be bfloat16"),
    (dict(out=("fake", (5, 256), "bfloat16")), "out must have shape (4, 256) = (T, hidden); got (5, 256)"),
])
def test_forward_argument_errors(layer, fake, over, message):
    over = {k: fake(v[1], v[2], CUDA, ptr=0x80000) if isinstance(v, tuple) else v
            for k, v in over.items()}
    with pytest.raises(epmoe.InvalidArgument) as e:
        layer(**args(fake, **over))
    assert message in str(e.value)
    assert not layer.calls


def test_forward_layout_errors(layer, fake):
    cases = [
        (dict(x=fake((4, 256), "bfloat16", (2, 1))), "x is on cuda:1 but this epmoe object lives on cuda:0"),
        (dict(x=fake((4, 256), "bfloat16", CUDA, strides=(1, 4))), "x must be contiguous (row-major, no gaps); got strides (1, 4)"),
        (dict(x=fake((4, 256), "bfloat16", CUDA, ptr=0x10002)), "x must start at a 16-byte aligned address; its data starts at 0x10002"),
        (dict(out=fake((4, 256), "bfloat16", CUDA, ptr=0x40000, read_only=True)), "out is read-only"),
        (dict(out=fake((4, 256), "bfloat16", CUDA, ptr=0x10000 + 512)), "out overlaps x in memory"),
        (dict(x=fake((4, 256), "bfloat16", (13, 0))), "x must be on the CUDA device cuda:0; got a tensor on cuda_managed:0"),
    ]
    for over, message in cases:
        with pytest.raises(epmoe.InvalidArgument) as e:
            layer(**args(fake, **over))
        assert message in str(e.value), (message, str(e.value))
    assert not layer.calls


def test_forward_other_arguments(layer, fake):
    with pytest.raises(epmoe.InvalidArgument, match="path='fast' must be one of 'auto', 'fused', 'pipeline'"):
        layer(**args(fake), path="fast")
    with pytest.raises(epmoe.InvalidArgument, match="stream must be a torch.cuda.Stream"):
        layer(**args(fake), stream="s")
    with pytest.raises(epmoe.InvalidArgument, match="out= is required for inputs of type conftest.FakeTensor"):
        layer(**dict(args(fake), out=None))
    layer._handle = None
    with pytest.raises(epmoe.InvalidArgument, match="this Layer was closed"):
        layer(**args(fake))


def test_contiguous_unit_dims_are_fine(layer, fake):
    a = args(fake, t=1, x=fake((1, 256), "bfloat16", CUDA, ptr=0x10000, strides=(999, 1)))
    layer(**a)
    assert layer.calls


def test_load_weights(layer, fake):
    e, h, i = 4, 256, 384
    w = dict(w1=fake((e, 2 * i, h), "float8_e4m3fn", CUDA, ptr=0x100000),
             w1_scale=fake((e, 6, 2), "float32", CUDA, ptr=0x200000),
             w2=fake((e, h, i), "uint8", CUDA, ptr=0x300000),
             w2_scale=fake((e, 2, 3), "float32", CUDA, ptr=0x400000))
    layer.load_weights(**w, stream=3)
    (name, c_args), = layer.calls
    assert name == "epmoe_layer_load_weights"
    assert c_args == (0x1234, 0x100000, 0x200000, 0x300000, 0x400000, 1, 3)

    host = dict(w1=np.zeros((e, 2 * i, h), np.uint8), w1_scale=np.ones((e, 6, 2), np.float32),
                w2=np.zeros((e, h, i), np.uint8), w2_scale=np.ones((e, 2, 3), np.float32))
    layer.load_weights(**host)
    assert layer.calls[1][1][5] == 0  # host memory

    bad = [
        (dict(w, w1_scale=None), "w1_scale is required in fp8 mode"),
        (dict(w, w2=fake((e, h, i + 128), "uint8", CUDA)), "w2 must have shape (4, 256, 384) = (E_loc, H, I); got (4, 256, 512)"),
        (dict(w, w1=fake((e, 2 * i, h), "bfloat16", CUDA)), "w1 must be float8_e4m3fn (or uint8 / int8 holding its bits); got bfloat16"),
        (dict(w, w1_scale=fake((e, 6, 2), "float16", CUDA)), "w1_scale must be float32; got float16"),
        (dict(host, w2=w["w2"]), "must all be on the GPU or all in host memory"),
    ]
    for kwargs, message in bad:
        with pytest.raises(epmoe.InvalidArgument) as err:
            layer.load_weights(**kwargs)
        assert message in str(err.value), (message, str(err.value))
    assert len(layer.calls) == 2


def test_load_weights_bf16(layer, fake):
    layer.config = epmoe.LayerConfig(**GOOD, dtype="bf16")
    e, h, i = 4, 256, 384
    w1 = fake((e, 2 * i, h), "bfloat16", CUDA, ptr=0x100000)
    w2 = fake((e, h, i), "bfloat16", CUDA, ptr=0x300000)
    layer.load_weights(w1, None, w2, None)
    assert layer.calls[0][1][1:5] == (0x100000, None, 0x300000, None)
    with pytest.raises(epmoe.InvalidArgument, match="w1_scale must be None in bf16 mode"):
        layer.load_weights(w1, fake((e, 6, 2), "float32", CUDA), w2, None)


# ---- Dispatcher (the C calls are replaced by a stand-in) ----------------------------------------

def test_dispatcher_without_gpu(monkeypatch, fake):
    calls = []

    def c_call(name, *args):
        calls.append(name)
        if name == "epmoe_dispatch_create":
            args[2]._obj.value = 0x5678
        elif name == "epmoe_dispatch_get_pool":
            v = args[1]._obj
            v.max_rows, v.scale_stride = 512, 512
            v.x_pool, v.x_scale, v.row_weight, v.row_source = 0x1000, 0x2000, 0x3000, 0x4000
            v.o_pool, v.expert_count, v.expert_offset = 0x5000, 0x6000, 0x7000

    monkeypatch.setattr(_lib, "call", c_call)
    comm = object.__new__(epmoe.Communicator)
    comm._handle, comm.rank, comm.size, comm.device = 0x42, 0, 2, 0
    monkeypatch.setattr(epmoe.dispatch, "_destroy", lambda handle, comm: calls.append("destroy"))
    d = epmoe.Dispatcher(comm, 8, 256, 2, 64, dtype="fp8")
    assert d.pool["x_pool"].shape == (512, 256) and d.pool["x_pool"].dtype == "uint8"
    assert d.pool["x_scale"].shape == (2, 512) and d.pool["expert_offset"].shape == (5,)
    with pytest.raises(epmoe.InvalidArgument, match="combine\\(\\) needs a dispatch\\(\\) before it"):
        d.combine(out=fake((4, 256), "bfloat16", CUDA))
    d.dispatch(fake((4, 256), "bfloat16", CUDA), fake((4, 2), "int32", CUDA),
               fake((4, 2), "float32", CUDA))
    with pytest.raises(epmoe.InvalidArgument, match=r"out must have shape \(4, 256\)"):
        d.combine(out=fake((3, 256), "bfloat16", CUDA))
    d.combine(out=fake((4, 256), "bfloat16", CUDA))
    assert calls[-2:] == ["epmoe_dispatch_run", "epmoe_combine_run"]
    with pytest.raises(epmoe.InvalidArgument, match="combine_partials='fp16' must be one of"):
        epmoe.Dispatcher(comm, 8, 256, 2, 64, combine_partials="fp16")
    pool = d.pool
    d.close()
    assert calls[-1] == "destroy"
    del pool


# ---- the GPU-only scripts: they compile, and the GPU test skips cleanly here --------------------

HERE = os.path.dirname(os.path.abspath(__file__))


def test_gpu_scripts_compile():
    for path in (os.path.join(HERE, "gpu_test_layer.py"),
                 os.path.join(HERE, "..", "..", "examples", "python_layer.py")):
        if os.path.exists(path):
            with open(path) as f:
                compile(f.read(), path, "exec")


def test_gpu_test_skips_without_gpus():
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            pytest.skip("this machine has GPUs: run the GPU test itself")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_test_layer.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("SKIPPED"), (r.stdout, r.stderr)


@pytest.mark.parametrize("value,message", [
    (0, "timeout_seconds=0 must be in (0, 3600]"),
    (-1.5, "timeout_seconds=-1.5 must be in (0, 3600]"),
    (float("inf"), "timeout_seconds=inf must be finite"),
    ("10", "timeout_seconds must be a number"),
])
def test_bad_timeout_checked_in_python(value, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.LayerConfig(**dict(GOOD, timeout_seconds=value)).validate()
    assert message in str(e.value)


def test_timeout_reaches_the_library():
    # A valid value passes; one above the library's bound is rejected by the C API's own check.
    epmoe.LayerConfig(**dict(GOOD, timeout_seconds=2.5)).validate()
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.LayerConfig(**dict(GOOD, timeout_seconds=4000.0)).validate()
    assert "timeout_seconds=4000 must be in (0, 3600]" in str(e.value)


def test_c_struct_zero_timeout_means_the_default():
    # C callers that zero-initialise epmoe_layer_config keep the default bound.
    import ctypes
    c = epmoe.LayerConfig(**GOOD).to_c()
    c.timeout_seconds = 0.0
    _lib.call("epmoe_validate_config", ctypes.byref(c))


def test_library_rejects_unknown_combine_partials():
    # The C API's own check, below Python's: a raw struct with an out-of-range value.
    import ctypes
    c = epmoe.LayerConfig(**GOOD).to_c()
    c.combine_partials = 7
    with pytest.raises(epmoe.InvalidArgument) as e:
        _lib.call("epmoe_validate_config", ctypes.byref(c))
    assert "combine_partials=7" in str(e.value)


def test_strict_routing_reaches_the_c_struct():
    import ctypes
    assert epmoe.LayerConfig(**GOOD).to_c().strict_routing == 0
    c = epmoe.LayerConfig(**GOOD, strict_routing=True).validate().to_c()
    assert c.strict_routing == 1
    # The struct's size is the C ABI's (unchanged since EPMOE_C_API_VERSION 4; 5 added
    # EPMOE_PATH_AUTO and epmoe_layer_last_path): a mismatch would shift every field.
    assert ctypes.sizeof(_lib.LayerConfigC) == 56
    assert _lib.C_API_VERSION == 5


def test_strict_routing_must_be_a_bool():
    with pytest.raises(epmoe.InvalidArgument, match="strict_routing must be a bool, got 'yes'"):
        epmoe.LayerConfig(**GOOD, strict_routing="yes").validate()


def test_library_rejects_nonzero_reserved_field():
    import ctypes
    c = epmoe.LayerConfig(**GOOD).to_c()
    c.reserved = 1
    with pytest.raises(epmoe.InvalidArgument) as e:
        _lib.call("epmoe_validate_config", ctypes.byref(c))
    assert "reserved=1 must be 0" in str(e.value)


def test_workspace_config_checks_and_sizes():
    from epmoe import WorkspaceConfig
    from epmoe._errors import InvalidArgument
    w = WorkspaceConfig(max_experts_per_rank=64, max_hidden=7168, max_intermediate=2048, max_topk=8,
                        max_tokens_per_rank=1024, num_ranks=4)
    w.validate()
    z = w.sizes()
    assert z["total"] == z["symmetric"] + z["local"] + z["pool"] > 0
    with pytest.raises(InvalidArgument, match="max_hidden"):
        WorkspaceConfig(max_experts_per_rank=64, max_hidden=100, max_intermediate=2048, max_topk=8,
                        max_tokens_per_rank=1024, num_ranks=4).validate()


def test_last_path_reads_the_library(monkeypatch, layer):
    seen = []

    def fake_call(name, handle, code):
        seen.append((name, handle))
        code._obj.value = answer

    monkeypatch.setattr(_lib, "call", fake_call)
    for answer, text in ((_lib.PATH_FUSED, "fused"), (_lib.PATH_PIPELINE, "pipeline")):
        assert layer.last_path == text
    assert seen == [("epmoe_layer_last_path", 0x1234)] * 2
    layer._handle = None
    with pytest.raises(epmoe.InvalidArgument, match="this Layer was closed"):
        layer.last_path


def test_forward_args_struct_matches_the_library():
    # epmoe_forward_args: 72 bytes (c_api.cpp static_asserts the same), filled per thread.
    import ctypes
    import threading
    assert ctypes.sizeof(_lib.ForwardArgsC) == 72 == _lib._FORWARD_ARGS.size
    pack, buf, address = _lib.forward_args()
    assert _lib.forward_args()[2] == address
    other = []
    t = threading.Thread(target=lambda: other.append(_lib.forward_args()[2]))
    t.start()
    t.join()
    assert other and other[0] != address  # another thread fills its own struct
    # The offsets c_api.cpp static_asserts, in both Python mirrors: ForwardArgsC and the pack format.
    offsets = dict(x=0, topk_idx=8, topk_weights=16, y=24, expert_counts=32, expert_counts_total=40,
                   stream=48, num_tokens=56, idx_type=64, path=68)
    assert {f: getattr(_lib.ForwardArgsC, f).offset for f, _ in _lib.ForwardArgsC._fields_} == offsets
    import struct
    assert _lib._FORWARD_ARGS.format == "=7Qq2i"  # 7 pointers, then num_tokens, idx_type, path
    assert [struct.calcsize("=" + p) for p in ("7Q", "7Qq", "7Qqi")] == [56, 64, 68]
    # pack_into's layout is ForwardArgsC's, field by field.
    pack(buf, 0, 0x10, 0x20, 0x30, 0x40, 0, 0x50, 7, 3, _lib.INDEX_INT64, _lib.PATH_AUTO)
    assert _lib.unpack_forward_args(0x1234, address) == (
        0x1234, 0x10, 0x20, _lib.INDEX_INT64, 0x30, 0x40, 3, None, 0x50, 7, _lib.PATH_AUTO)
    # The real function: a null layer and a null struct are errors, not crashes.
    with pytest.raises(epmoe.InvalidArgument, match="layer"):
        _lib.call("epmoe_layer_forward_args", None, address)
    with pytest.raises(epmoe.InvalidArgument, match="args is null"):
        _lib.call("epmoe_layer_forward_args", None, None)


def test_last_path_c_function_rejects_bad_arguments():
    import ctypes
    code = ctypes.c_int(-1)
    with pytest.raises(epmoe.InvalidArgument, match="layer"):
        _lib.call("epmoe_layer_last_path", None, ctypes.byref(code))
    assert code.value == -1  # nothing written on an error
    assert _lib.PATH_AUTO == 2 and _lib.lib().epmoe_c_api_version() == 5
