"""CPU tests of the workspace in Python: WorkspaceConfig, Workspace's lifetime, layers on a
workspace (weights by reference), int64 routing and the expert counts reaching the C call, and
transform_w13's checks. No GPU, no torch: the C calls that need a GPU are replaced by a recorder,
the tensors are conftest's stand-ins that claim to live on cuda:0; the host-only C calls are real."""

import ctypes

import numpy as np
import pytest

import epmoe
from epmoe import _lib
from epmoe import layer as layer_mod
from epmoe import workspace as ws_mod

CUDA = (2, 0)
E, H, I, K, T_MAX = 8, 256, 384, 2, 64   # two ranks: E_loc = 4
E_LOC = 4


def ws_config(**over):
    return epmoe.WorkspaceConfig(**dict(dict(max_experts_per_rank=E_LOC, max_hidden=H,
                                             max_intermediate=I, max_topk=K,
                                             max_tokens_per_rank=T_MAX, num_ranks=2), **over))


# ---- WorkspaceConfig ---------------------------------------------------------------------------

def test_for_layers_takes_each_largest_field():
    a = epmoe.LayerConfig(2, 16, 512, 256, 4, 96)
    b = epmoe.LayerConfig(2, 8, 256, 384, 2, 64, dtype="bf16")
    w = epmoe.WorkspaceConfig.for_layers([a, b])
    assert (w.num_ranks, w.max_experts_per_rank, w.max_hidden, w.max_intermediate, w.max_topk,
            w.max_tokens_per_rank, w.dtype) == (2, 8, 512, 384, 4, 96, "bf16")
    assert epmoe.WorkspaceConfig.for_layers([a]).dtype == "fp8"
    # Each layer fits the result, by the library's own check.
    for c in (a, b):
        _lib.call("epmoe_check_layer_fits", ctypes.byref(w._c()), ctypes.byref(c.to_c()))
    # Objects with a .config (an epmoe.Layer, an epmoe.torch.MoE) are taken too.
    holder = type("Holder", (), {"config": a})()
    assert epmoe.WorkspaceConfig.for_layers([holder]).max_hidden == 512


def test_for_layers_errors():
    with pytest.raises(epmoe.InvalidArgument, match="at least one layer config"):
        epmoe.WorkspaceConfig.for_layers([])
    with pytest.raises(epmoe.InvalidArgument, match=r"num_ranks differ \(\[2, 4\]\)"):
        epmoe.WorkspaceConfig.for_layers([epmoe.LayerConfig(2, 8, 256, 256, 2, 64),
                                          epmoe.LayerConfig(4, 8, 256, 256, 2, 64)])


def test_a_layer_that_does_not_fit_is_named():
    too_wide = epmoe.LayerConfig(2, 8, 512, 256, 2, 64)
    with pytest.raises(epmoe.InvalidArgument,
                       match="LayerConfig.hidden=512 exceeds the workspace's max_hidden=256"):
        _lib.call("epmoe_check_layer_fits", ctypes.byref(ws_config()._c()),
                  ctypes.byref(too_wide.to_c()))


@pytest.mark.parametrize("over,message", [
    (dict(max_hidden="256"), "WorkspaceConfig.max_hidden must be an int, got str '256'"),
    (dict(max_topk=True), "WorkspaceConfig.max_topk must be an int, got bool True"),
    (dict(dtype="fp16"), "WorkspaceConfig.dtype='fp16' must be one of 'fp8', 'bf16'"),
    (dict(timeout_seconds=0), "WorkspaceConfig.timeout_seconds=0 must be in (0, 3600]"),
    (dict(max_tokens_per_rank=0), "WorkspaceConfig.max_tokens_per_rank=0 must be in [1,"),
])
def test_workspace_config_field_errors(over, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        ws_config(**over).validate()
    assert message in str(e.value)


def test_sizes_grow_with_t_max_not_with_layers():
    small, large = ws_config().sizes(), ws_config(max_tokens_per_rank=4 * T_MAX).sizes()
    assert small["total"] == small["symmetric"] + small["local"] + small["pool"]
    assert large["pool"] > small["pool"] and large["symmetric"] > small["symmetric"]


def test_c_workspace_calls_refuse_a_null_handle():
    n, b = ctypes.c_int32(), ctypes.c_int64()
    for name, args in (("epmoe_workspace_num_layers", (None, ctypes.byref(n))),
                       ("epmoe_workspace_nbytes", (None, ctypes.byref(b))),
                       ("epmoe_workspace_get_config", (None, ctypes.byref(_lib.WorkspaceConfigC()))),
                       ("epmoe_layer_create_on", (None, ctypes.byref(epmoe.LayerConfig(2, 8, 256, 256, 2, 64).to_c()),
                                                  None, ctypes.byref(ctypes.c_void_p())))):
        with pytest.raises(epmoe.InvalidArgument, match="workspace is null"):
            _lib.call(name, *args)
    _lib.call("epmoe_workspace_destroy", None)  # NULL is a no-op


# ---- a workspace and layers on it, the C calls recorded ----------------------------------------

HOST_ONLY = ("epmoe_validate_config", "epmoe_validate_workspace_config", "epmoe_workspace_sizes",
             "epmoe_check_layer_fits")


class Library:
    """Stands in for the C calls that need a GPU; records every call, answers the queries."""

    def __init__(self):
        self.calls, self.live_layers, self.refuse = [], 0, None

    def __call__(self, name, *args):
        self.calls.append((name, args))
        if name == "epmoe_workspace_create":
            args[2]._obj.value = 0xABC0
        elif name == "epmoe_workspace_nbytes":
            args[1]._obj.value = 12345
        elif name == "epmoe_workspace_num_layers":
            args[1]._obj.value = self.live_layers
        elif name == "epmoe_workspace_destroy" and self.live_layers:
            raise epmoe.InvalidArgument(f"Workspace::close on rank 0: {self.live_layers} layer "
                                        f"created on this workspace still lives")
        elif name == "epmoe_layer_create_on":
            refs = args[2]._obj if args[2] is not None else None
            if refs is not None and not refs.w13:  # what the library says of a null reference
                raise epmoe.InvalidArgument("rank 0: ExpertWeightRefs.w13 is null")
            args[3]._obj.value = 0xBEE0
            self.live_layers += 1
        elif name == "epmoe_layer_destroy":
            self.live_layers -= 1
        elif name in HOST_ONLY:
            return _lib.check(getattr(_lib.lib(), name)(*args))  # the real ones
        # Any other call (forward, load_weights, transform_w13) is only recorded.

    def names(self):
        return [n for n, _ in self.calls]


@pytest.fixture
def lib(monkeypatch):
    rec = Library()
    monkeypatch.setattr(_lib, "call", rec)
    monkeypatch.setattr(layer_mod, "_destroy", lambda *a: rec.calls.append(("destroy_layer", a)))
    monkeypatch.setattr(ws_mod, "_destroy", lambda *a: rec.calls.append(("destroy_ws", a)))
    return rec


@pytest.fixture
def comm():
    c = object.__new__(epmoe.Communicator)
    c._handle, c.rank, c.size, c.device = 0x42, 0, 2, 0
    return c


@pytest.fixture
def ws(lib, comm):
    return epmoe.Workspace(comm, ws_config(num_ranks=0))


def refs(fake, dtype="fp8", **over):
    w = dict(w13=fake((E_LOC, 2 * I, H), "float8_e4m3fn", CUDA, ptr=0x100000),
             w13_scale=fake((E_LOC, 6, 2), "float32", CUDA, ptr=0x200000),
             w2=fake((E_LOC, H, I), "uint8", CUDA, ptr=0x300000),
             w2_scale=fake((E_LOC, 2, 3), "float32", CUDA, ptr=0x400000))
    if dtype == "bf16":
        w = dict(w13=fake((E_LOC, 2 * I, H), "bfloat16", CUDA, ptr=0x100000),
                 w2=fake((E_LOC, H, I), "bfloat16", CUDA, ptr=0x300000))
    w.update(over)
    return w


def test_workspace_create_and_queries(ws, lib, comm):
    assert lib.names() == ["epmoe_workspace_create"]
    assert lib.calls[0][1][0] == 0x42
    assert ws.config.num_ranks == 2 and ws.comm is comm and ws.device == 0
    assert ws.nbytes == 12345 and ws.num_layers == 0 and not ws.closed
    assert "T_max=64" in repr(ws)
    with pytest.raises(epmoe.InvalidArgument, match="config must be an epmoe.WorkspaceConfig"):
        epmoe.Workspace(comm, {"max_hidden": 256})


def test_workspace_close_refused_while_a_layer_is_open(ws, lib, fake):
    layer = epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws)
    assert ws.num_layers == 1
    with pytest.raises(epmoe.InvalidArgument, match="1 layer created on this workspace still lives"):
        ws.close()
    assert not ws.closed and ws.nbytes == 12345  # nothing released, still usable
    layer.close()
    ws.close()
    assert ws.closed and ws.num_layers == 0
    assert lib.names().count("epmoe_workspace_destroy") == 2
    with pytest.raises(epmoe.InvalidArgument, match="this Workspace was closed"):
        ws.nbytes
    ws.close()  # a second close does nothing
    assert lib.names().count("epmoe_workspace_destroy") == 2
    # The closed layer (the only way its workspace could close) says so; nothing reaches the library.
    n = len(lib.calls)
    with pytest.raises(epmoe.InvalidArgument, match="this Layer was closed"):
        layer(**call_args(fake))
    assert len(lib.calls) == n


def test_layer_on_a_closed_workspace_is_refused(ws, lib):
    ws.close()
    n = len(lib.calls)
    with pytest.raises(epmoe.InvalidArgument, match="this Workspace was closed"):
        epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws)
    assert len(lib.calls) == n  # refused before any C call


def test_layer_on_a_workspace_copies_its_weights_by_default(ws, lib, fake):
    layer = epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws)
    name, args = lib.calls[-1]
    assert name == "epmoe_layer_create_on" and args[0] == 0xABC0 and args[2] is None
    assert layer.workspace is ws and not layer.by_reference and layer.comm is ws.comm
    # The finalizer keeps the workspace (and its communicator) alive as long as the layer.
    assert ws in layer._finalizer.peek()[2]
    w = refs(fake)
    layer.load_weights(fake((E_LOC, 2 * I, H), "uint8", CUDA, ptr=0x100000), w["w13_scale"],
                       w["w2"], w["w2_scale"])
    assert lib.names()[-1] == "epmoe_layer_load_weights"


def test_layer_by_reference(ws, lib, fake):
    w = refs(fake)
    layer = epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws, weights=w)
    c_refs = lib.calls[-1][1][2]._obj
    assert (c_refs.w13, c_refs.w13_scale, c_refs.w2, c_refs.w2_scale) == (0x100000, 0x200000, 0x300000,
                                                                          0x400000)
    assert layer.by_reference
    kept = layer._finalizer.peek()[2][3]
    assert kept == (w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])  # alive as long as the layer
    with pytest.raises(epmoe.InvalidArgument, match="references its weights"):
        layer.load_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    bf16 = epmoe.Layer(None, E, H, I, K, T_MAX, "bf16", workspace=epmoe.Workspace(
        ws.comm, ws_config(dtype="bf16")), weights=refs(fake, "bf16"))
    c_refs = lib.calls[-1][1][2]._obj
    assert (c_refs.w13, c_refs.w13_scale, c_refs.w2, c_refs.w2_scale) == (0x100000, None, 0x300000, None)
    assert bf16.by_reference


@pytest.mark.parametrize("change,message", [
    (lambda f: dict(w2=f((E_LOC, H, I + 128), "uint8", CUDA)),
     "weights['w2'] must have shape (4, 256, 384) = (E_loc, H, I); got (4, 256, 512)"),
    (lambda f: dict(w13_scale=None), "weights['w13_scale'] is required in fp8 mode"),
    (lambda f: dict(w13=f((E_LOC, 2 * I, H), "bfloat16", CUDA)),
     "weights['w13'] must be float8_e4m3fn (or uint8 / int8 holding its bits); got bfloat16"),
    (lambda f: dict(w13=f((E_LOC, 2 * I, H), "uint8", (2, 1))),
     "weights['w13'] is on cuda:1 but this epmoe object lives on cuda:0"),
    (lambda f: dict(w2=np.zeros((E_LOC, H, I), np.uint8)),
     "weights['w2'] must be on the CUDA device cuda:0; got a tensor on cpu:0"),
    (lambda f: dict(w13=f((E_LOC, 2 * I, H), "uint8", CUDA, ptr=0x100008)),
     "weights['w13'] must start at a 16-byte aligned address"),
    (lambda f: dict(w1=f((1,), "uint8", CUDA)), "weights has unknown keys ['w1']"),
])
def test_bad_references_fail_every_rank_together(ws, lib, fake, change, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws, weights=refs(fake, **change(fake)))
    assert message in str(e.value), str(e.value)
    # The rank still took part in the collective creation, with references the library refuses
    # (so its peers fail with it instead of waiting), and raises its own message.
    name, args = lib.calls[-1]
    assert name == "epmoe_layer_create_on" and not args[2]._obj.w13
    assert "ExpertWeightRefs.w13 is null" in str(e.value.__cause__)


def test_layer_workspace_argument_errors(ws, lib, fake, comm):
    n = len(lib.calls)
    other = object.__new__(epmoe.Communicator)
    other._handle, other.rank, other.size, other.device = 0x43, 0, 2, 0
    cases = [
        (dict(workspace="ws"), "workspace must be an epmoe.Workspace, got builtins.str"),
        (dict(workspace=ws, group_or_comm=other), "group_or_comm must be None or the workspace's communicator"),
        (dict(weights=refs(fake)), "weights= (weights by reference) needs workspace="),
        (dict(workspace=ws, weights=[1, 2]), "weights must be a dict with keys 'w13'"),
    ]
    for kwargs, message in cases:
        group = kwargs.pop("group_or_comm", None)
        with pytest.raises(epmoe.InvalidArgument) as e:
            epmoe.Layer(group, E, H, I, K, T_MAX, **kwargs)
        assert message in str(e.value), (message, str(e.value))
    # The bad dict still went in (with null references, see above); nothing else reached the C API
    # (the config's checks are the library's, agreed across ranks inside the create).
    assert lib.names()[n:] == ["epmoe_layer_create_on"]
    # Its own communicator, passed explicitly, is fine.
    epmoe.Layer(comm, E, H, I, K, T_MAX, workspace=ws)


# ---- forward: int64 routing and the expert counts ----------------------------------------------

@pytest.fixture
def layer(ws, lib):
    return epmoe.Layer(None, E, H, I, K, T_MAX, workspace=ws)


def call_args(fake, t=4, idx_dtype="int32", **over):
    a = dict(x=fake((t, H), "bfloat16", CUDA, ptr=0x10000),
             topk_idx=fake((t, K), idx_dtype, CUDA, ptr=0x20000),
             topk_weights=fake((t, K), "float32", CUDA, ptr=0x30000),
             out=fake((t, H), "bfloat16", CUDA, ptr=0x40000))
    a.update(over)
    return a


def test_int64_routing_reaches_the_library_as_it_is(layer, lib, fake):
    layer(**call_args(fake, idx_dtype="int64"), stream=5)
    name, args = lib.calls[-1]
    assert name == "epmoe_layer_forward_ex"
    assert args[2:4] == (0x20000, _lib.INDEX_INT64)  # the caller's tensor, no int32 copy
    layer(**call_args(fake), stream=5)
    assert lib.calls[-1][1][3] == _lib.INDEX_INT32


def test_expert_counts_reach_the_library(layer, lib, fake):
    counts = fake((E_LOC,), "int32", CUDA, ptr=0x50000)
    total = fake((E_LOC,), "int64", CUDA, ptr=0x60000)
    layer(**call_args(fake), expert_counts=counts, expert_counts_total=total, stream=5)
    assert lib.calls[-1][1][7:9] == (0x50000, 0x60000)
    layer(**call_args(fake), expert_counts_total=total, stream=5)
    assert lib.calls[-1][1][7:9] == (None, 0x60000)


@pytest.mark.parametrize("over,message", [
    (dict(topk_idx=("int64", (4, 2), 0x20004)), "topk_idx (int64) must start at an 8-byte aligned address"),
    (dict(expert_counts=("int64", (E_LOC,), 0x50000)), "expert_counts must be int32; got int64"),
    (dict(expert_counts=("int32", (8,), 0x50000)), "expert_counts must have shape (4) = (E_loc); got (8,)"),
    (dict(expert_counts_total=("int32", (E_LOC,), 0x60000)), "expert_counts_total must be int64; got int32"),
    (dict(expert_counts_total=("int64", (E_LOC,), 0x60004)),
     "expert_counts_total must start at a 8-byte aligned address"),
    (dict(expert_counts=("int32", (E_LOC,), 0x40000)), "expert_counts overlaps out in memory"),
])
def test_forward_count_and_index_errors(layer, lib, fake, over, message):
    a = call_args(fake)
    for k, (dtype, shape, ptr) in over.items():
        a[k] = fake(shape, dtype, CUDA, ptr=ptr)
    n = len(lib.calls)
    with pytest.raises(epmoe.InvalidArgument) as e:
        layer(**a)
    assert message in str(e.value), str(e.value)
    assert len(lib.calls) == n


# ---- transform_w13 ------------------------------------------------------------------------------

def test_transform_w13_reaches_the_library(lib, fake):
    w13, s = fake((E_LOC, 2 * I, H), "float8_e4m3fn", CUDA, ptr=0x100000), fake((E_LOC, 6, 2), "float32", CUDA, ptr=0x200000)
    out, out_s = fake((E_LOC, 2 * I, H), "float8_e4m3fn", CUDA, ptr=0x500000), fake((E_LOC, 6, 2), "float32", CUDA, ptr=0x600000)
    assert epmoe.transform_w13(w13, s, out=out, out_scale=out_s, stream=7) == (out, out_s)
    name, args = lib.calls[-1]
    assert name == "epmoe_transform_w13"
    assert args == (_lib.DTYPE_FP8, 0x100000, 0x200000, 0x500000, 0x600000, E_LOC, I, H, 7)
    b = fake((E_LOC, 2 * I, H), "uint16", CUDA, ptr=0x100000)
    epmoe.transform_w13(b, out=fake((E_LOC, 2 * I, H), "uint16", CUDA, ptr=0x500000), stream=7)
    assert lib.calls[-1][1][:5] == (_lib.DTYPE_BF16, 0x100000, None, 0x500000, None)


@pytest.mark.parametrize("change,message", [
    (lambda f: dict(w13=np.zeros((E_LOC, 2 * I, H), np.uint8)), "w13 must be on a CUDA device"),
    (lambda f: dict(w13=f((E_LOC, 2 * I, H), "float32", CUDA)),
     "w13 must be float8_e4m3fn or bfloat16 (or a same-width integer type holding the bits); got float32"),
    (lambda f: dict(w13=f((E_LOC, 2 * 64, H), "uint8", CUDA)), "I, H positive multiples of 128; got (4, 128, 256)"),
    (lambda f: dict(w13_scale=None), "w13_scale is required for an e4m3 w13"),
    (lambda f: dict(w13_scale=f((E_LOC, 3, 2), "float32", CUDA)),
     "w13_scale must have shape (4, 6, 2) = (E_loc, 2*I/128, H/128); got (4, 3, 2)"),
    (lambda f: dict(out=f((E_LOC, 2 * I, H), "bfloat16", CUDA)), "out must be uint8; got bfloat16"),
    (lambda f: dict(out=f((E_LOC, 2 * I, H), "uint8", CUDA, ptr=0x100000 + 4096)), "out overlaps w13 in memory"),
    (lambda f: dict(out=f((E_LOC, 2 * I, H), "uint8", (2, 1))), "out is on cuda:1 but this epmoe object lives on cuda:0"),
    (lambda f: dict(out=None), "out= is required for inputs of type conftest.FakeTensor"),
])
def test_transform_w13_errors(lib, fake, change, message):
    a = dict(w13=fake((E_LOC, 2 * I, H), "uint8", CUDA, ptr=0x100000),
             w13_scale=fake((E_LOC, 6, 2), "float32", CUDA, ptr=0x200000),
             out=fake((E_LOC, 2 * I, H), "uint8", CUDA, ptr=0x500000),
             out_scale=fake((E_LOC, 6, 2), "float32", CUDA, ptr=0x600000))
    a.update(change(fake))
    with pytest.raises(epmoe.InvalidArgument) as e:
        epmoe.transform_w13(a.pop("w13"), a.pop("w13_scale"), **a)
    assert message in str(e.value), str(e.value)
    assert "epmoe_transform_w13" not in lib.names()


def test_transform_w13_c_checks_device_memory():
    # The library's own checks, below Python's (real calls, no GPU needed to be refused).
    host = np.zeros(16, np.uint8)
    with pytest.raises(epmoe.InvalidArgument, match="transform_w13: w13 is null"):
        _lib.call("epmoe_transform_w13", _lib.DTYPE_BF16, None, None, host.ctypes.data, None, 1, 128, 128, None)
    with pytest.raises(epmoe.InvalidArgument, match="w13=0x[0-9a-f]+ "):
        _lib.call("epmoe_transform_w13", _lib.DTYPE_BF16, host.ctypes.data, None, host.ctypes.data + 8,
                  None, 1, 128, 128, None)
