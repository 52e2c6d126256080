"""CPU tests of epmoe.torch (the torch.library operator and the MoE module). No GPU needed; every
test here is skipped where torch is not installed (CI's machine). The C call is replaced by a
recorder, the tensors live on the CPU (the layer stand-in claims device -1, which is what
Tensor.get_device() says for CPU tensors) and weight buffers on "meta"."""

import ctypes
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import epmoe  # noqa: E402
from epmoe import _lib  # noqa: E402
from epmoe.layer import Layer  # noqa: E402

et = pytest.importorskip("epmoe.torch")

GOOD = dict(num_ranks=2, num_experts=8, hidden=256, intermediate=128, topk=2,
            max_tokens_per_rank=64)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def fake_layer(**over):
    """An epmoe.Layer with no GPU behind it: only its Python attributes exist."""
    layer = object.__new__(Layer)
    layer.config = epmoe.LayerConfig(**dict(GOOD, **over))
    layer.device = -1
    layer._handle = 0x1234
    return layer


@pytest.fixture
def bound(monkeypatch):
    """A registered fake layer whose C forward records its arguments."""
    layer = fake_layer()
    key = et.register_layer(layer)
    b = et._registry[key]
    rec = SimpleNamespace(key=key, b=b, layer=layer, calls=[])
    b.c_forward = unpacked(lambda *a: rec.calls.append(a) or 0)
    b.raw_stream = lambda device: 777
    yield rec
    et.unregister_layer(key)


def inputs(t=4, h=256, k=2, idx_dtype=torch.int32):
    x = torch.randn(t, h).bfloat16()
    idx = torch.randint(0, 8, (t, k), dtype=idx_dtype)
    w = torch.rand(t, k)
    return x, idx, w



def unpacked(fn):
    """A stand-in for the C call epmoe_layer_forward_args(layer, &args) that hands `fn` the
    arguments in epmoe_layer_forward_ex's order (layer, x, topk_idx, idx_type, topk_weights, y, T,
    expert_counts, expert_counts_total, stream, path)."""
    return lambda handle, address: fn(*_lib.unpack_forward_args(handle, address))

# ---- the operator's registration ----------------------------------------------------------------

def test_schema():
    schema = str(torch.ops.epmoe.moe_forward.default._schema)
    assert schema == ("epmoe::moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, "
                      "int layer, str path=\"auto\") -> Tensor")


def test_counts_schema():
    schema = str(torch.ops.epmoe.moe_forward_counts.default._schema)
    assert schema == ("epmoe::moe_forward_counts(Tensor x, Tensor topk_idx, Tensor topk_weights, "
                      "int layer, str path=\"auto\") -> (Tensor, Tensor)")


def test_counts_fake_impl(bound):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, idx, w = inputs(t=5)
        y, counts = torch.ops.epmoe.moe_forward_counts(x, idx.long(), w, bound.key)
        assert (tuple(y.shape), y.dtype) == ((5, 256), torch.bfloat16)
        assert (tuple(counts.shape), counts.dtype) == ((4,), torch.int32)  # E_loc = 8 / 2
        with pytest.raises(epmoe.InvalidArgument, match="no layer is registered under key 999999"):
            torch.ops.epmoe.moe_forward_counts(x, idx, w, 999999)


def test_fake_impl_shapes_and_errors(bound):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, idx, w = inputs(t=5)
        y = torch.ops.epmoe.moe_forward(x, idx, w, bound.key)
        assert (tuple(y.shape), y.dtype) == ((5, 256), torch.bfloat16)
        y = torch.ops.epmoe.moe_forward(x, idx.long(), w, bound.key, "fused")
        assert tuple(y.shape) == (5, 256)
        cases = [((x.float(), idx, w), "x must be bfloat16; got float32"),
                 ((x, idx.short(), w), "topk_idx must be int32 or int64; got int16"),
                 ((x, idx, w.double()), "topk_weights must be float32; got float64"),
                 ((x[:, :128], idx, w), "x must have shape (?, 256) = (T, hidden); got (5, 128)"),
                 ((x, idx[:, :1], w), "topk_idx must have shape (T, 2) = (T, topk); got (5, 1)")]
        for args, message in cases:
            with pytest.raises(epmoe.InvalidArgument) as e:
                torch.ops.epmoe.moe_forward(*args, bound.key)
            assert message in str(e.value)


def test_no_cpu_kernel():
    # The operator runs on CUDA only; a CPU call is torch's dispatcher error, not a crash.
    x, idx, w = inputs()
    with pytest.raises(NotImplementedError):
        torch.ops.epmoe.moe_forward(x, idx, w, 1)


# ---- the eager implementation (the fast path) ----------------------------------------------------

# The C call is epmoe_layer_forward_ex: (layer, x, topk_idx, idx_type, topk_weights, y, T,
# expert_counts, expert_counts_total, stream, path).

def test_forward_reaches_the_library(bound):
    x, idx, w = inputs(t=4)
    y = et._moe_forward_cuda(x, idx, w, bound.key)
    (call,) = bound.calls
    assert call[:5] == (0x1234, x.data_ptr(), idx.data_ptr(), _lib.INDEX_INT32, w.data_ptr())
    assert call[5] == y.data_ptr() and call[6:] == (4, None, None, 777, _lib.PATH_AUTO)
    assert (tuple(y.shape), y.dtype) == ((4, 256), torch.bfloat16)
    et._moe_forward_cuda(x, idx, w, bound.key, "fused")
    assert bound.calls[-1][10] == _lib.PATH_FUSED
    et._moe_forward_cuda(x, idx, w, bound.key, "pipeline")
    assert bound.calls[-1][10] == _lib.PATH_PIPELINE
    assert len({_lib.PATH_AUTO, _lib.PATH_FUSED, _lib.PATH_PIPELINE}) == 3


def test_forward_zero_tokens(bound):
    x, idx, w = inputs(t=0)
    y = et._moe_forward_cuda(x, idx, w, bound.key)
    assert tuple(y.shape) == (0, 256) and bound.calls[0][6] == 0


def test_int64_indices_reach_the_library_as_they_are(bound):
    # No conversion copy: the kernels read the caller's int64 tensor (an index beyond int32 is
    # reported by the device, never wrapped: tests/e2e and gpu_test_torch.py check that).
    x, idx, w = inputs(t=3)
    wide = torch.tensor([[-1, 7], [0, 8], [-5, 2**40]], dtype=torch.int64)
    et._moe_forward_cuda(x, wide, w, bound.key)
    call = bound.calls[-1]
    assert call[2:4] == (wide.data_ptr(), _lib.INDEX_INT64)
    et._moe_forward_cuda(x, idx, w, bound.key)
    assert bound.calls[-1][2:4] == (idx.data_ptr(), _lib.INDEX_INT32)


def test_expert_counts_reach_the_library(bound):
    x, idx, w = inputs(t=4)
    y, counts = et.moe_forward(x, idx, w, bound.key, return_expert_counts=True)
    call = bound.calls[-1]
    assert (tuple(counts.shape), counts.dtype) == ((4,), torch.int32)
    assert call[5:9] == (y.data_ptr(), 4, counts.data_ptr(), None)
    total = torch.zeros(4, dtype=torch.int64)
    y = et.moe_forward(x, idx, w, bound.key, expert_counts_total=total)
    assert isinstance(y, torch.Tensor) and bound.calls[-1][7:9] == (None, total.data_ptr())
    y, counts = et.moe_forward(x, idx, w, bound.key, return_expert_counts=True,
                               expert_counts_total=total)
    assert bound.calls[-1][7:9] == (counts.data_ptr(), total.data_ptr())


@pytest.mark.parametrize("total,message", [
    (torch.zeros(4, dtype=torch.int32), "expert_counts_total must be a contiguous int64 tensor of shape (4,) = (E_loc,); got int32 (4,)"),
    (torch.zeros(8, dtype=torch.int64), "got int64 (8,)"),
    (torch.zeros(4, 2, dtype=torch.int64)[:, 0], "not contiguous"),
    ([0, 0, 0, 0], "expert_counts_total must be a torch.Tensor, got list"),
])
def test_expert_counts_total_errors(bound, total, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        et.moe_forward(*inputs(), bound.key, expert_counts_total=total)
    assert message in str(e.value), str(e.value)
    assert not bound.calls


def test_expert_counts_total_on_another_device(bound):
    bound.b.device_index = 0  # the layer on cuda:0, the total on the CPU
    with pytest.raises(epmoe.InvalidArgument,
                       match="expert_counts_total is on cpu but this epmoe layer lives on cuda:0"):
        et.moe_forward(*inputs(), bound.key, expert_counts_total=torch.zeros(4, dtype=torch.int64))
    assert not bound.calls


@pytest.mark.parametrize("change,message", [
    (lambda x, i, w: (x.float(), i, w), "x must be bfloat16; got float32"),
    (lambda x, i, w: (x[:, :128], i, w), "x must have shape (?, 256) = (T, hidden); got (4, 128)"),
    (lambda x, i, w: (x[None], i, w), "x must have shape (?, 256) = (T, hidden); got (1, 4, 256)"),
    (lambda x, i, w: (x, i.short(), w), "topk_idx must be int32 or int64; got int16"),
    (lambda x, i, w: (x, i[:3], w), "topk_idx must have shape (4, 2) = (T, topk); got (3, 2)"),
    (lambda x, i, w: (x, i, w.half()), "topk_weights must be float32; got float16"),
    (lambda x, i, w: (x, i, w[:, :1]), "topk_weights must have shape (4, 2) = (T, topk); got (4, 1)"),
    (lambda x, i, w: (x.t().contiguous().t(), i, w), "x must be contiguous (row-major, no gaps)"),
    (lambda x, i, w: (x, i.t().contiguous().t(), w), "topk_idx must be contiguous"),
    (lambda x, i, w: (torch.zeros(65, 256, dtype=torch.bfloat16), torch.zeros(65, 2, dtype=torch.int32),
                      torch.zeros(65, 2)),
     "x has T=65 tokens but the layer was created with max_tokens_per_rank=64"),
    (lambda x, i, w: (torch.zeros(4 * 256 + 1, dtype=torch.bfloat16)[1:].view(4, 256), i, w),
     "x must start at a 16-byte aligned address"),
])
def test_forward_argument_errors(bound, change, message):
    with pytest.raises(epmoe.InvalidArgument) as e:
        et._moe_forward_cuda(*change(*inputs(t=4)), bound.key)
    assert message in str(e.value), str(e.value)
    assert not bound.calls


def test_forward_other_errors(bound):
    x, idx, w = inputs()
    with pytest.raises(epmoe.InvalidArgument, match="path='fast' must be one of 'auto', 'pipeline', 'fused'"):
        et._moe_forward_cuda(x, idx, w, bound.key, "fast")
    bound.b.device_index = 0  # the layer on cuda:0, the tensors on the CPU
    with pytest.raises(epmoe.InvalidArgument, match="x is on cpu but this epmoe layer lives on cuda:0"):
        et._moe_forward_cuda(x, idx, w, bound.key)
    bound.b.device_index = -1
    with pytest.raises(epmoe.InvalidArgument, match="no layer is registered under key 999999"):
        et._moe_forward_cuda(x, idx, w, 999999)
    bound.layer._handle = None
    with pytest.raises(epmoe.InvalidArgument, match=f"layer registered as {bound.key} was closed"):
        et._moe_forward_cuda(x, idx, w, bound.key)
    assert not bound.calls


def test_library_status_becomes_an_exception(bound, monkeypatch):
    monkeypatch.setattr(_lib, "_lib", _lib.lib())
    bound.b.c_forward = unpacked(lambda *a: 2)
    with pytest.raises(epmoe.UnsupportedError):
        et._moe_forward_cuda(*inputs(), bound.key)


# ---- the C++ fast path (load_fast_path): its Python side, with a stand-in for the extension ----


def test_fast_path_result_is_returned(bound):
    """A call the fast path takes: its y comes back, and the Python path's C call is not made."""
    x, idx, w = inputs(t=4, idx_dtype=torch.int64)
    seen = []
    y = torch.empty(4, 256, dtype=torch.bfloat16)
    bound.b.fast = lambda *a: seen.append(a) or (y, 0)
    assert et._moe_forward_cuda(x, idx, w, bound.key, "fused") is y
    assert seen == [(0x1234, x, idx, w, _lib.PATH_FUSED, 0, 0)]
    assert not bound.calls
    # With expert counts: their addresses go in as they are.
    got, c = bound.b.forward_counts(x, idx, w, "auto", True, None)
    assert got is y and seen[-1][4:] == (_lib.PATH_AUTO, c.data_ptr(), 0)


def test_fast_path_failed_check_falls_back_to_the_named_error(bound):
    """None from the fast path: nothing was done there; the Python checks name the argument, and
    arguments they accept take the Python path."""
    bound.b.fast = lambda *a: None
    x, idx, w = inputs(t=4)
    with pytest.raises(epmoe.InvalidArgument, match="x must be bfloat16; got float32"):
        et._moe_forward_cuda(x.float(), idx, w, bound.key)
    assert not bound.calls
    y = et._moe_forward_cuda(x, idx, w, bound.key)
    (call,) = bound.calls
    assert call[5] == y.data_ptr()


def test_fast_path_skipped_for_an_unknown_path_or_a_closed_layer(bound):
    bound.b.fast = lambda *a: pytest.fail("the fast path was called")
    x, idx, w = inputs()
    with pytest.raises(epmoe.InvalidArgument, match="path='fast' must be one of"):
        et._moe_forward_cuda(x, idx, w, bound.key, "fast")
    bound.layer._handle = None
    with pytest.raises(epmoe.InvalidArgument, match="was closed"):
        et._moe_forward_cuda(x, idx, w, bound.key)


def test_fast_path_status_becomes_an_exception(bound, monkeypatch):
    monkeypatch.setattr(_lib, "_lib", _lib.lib())
    bound.b.fast = lambda *a: (torch.empty(0), 2)
    with pytest.raises(epmoe.UnsupportedError):
        et._moe_forward_cuda(*inputs(), bound.key)


def test_fast_path_from_the_environment_warns_when_it_cannot_load(monkeypatch):
    from torch.utils import cpp_extension

    def fail(**kw):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setenv("EPMOE_TORCH_FAST_PATH", "1")
    monkeypatch.setattr(et, "_fast_ext", None)
    with pytest.warns(RuntimeWarning, match="did not load .RuntimeError: no compiler here.; eager calls use the Python path"):
        et._load_fast_path_from_env()
    assert not et.fast_path_loaded()
    monkeypatch.setenv("EPMOE_TORCH_FAST_PATH", "0")
    et._load_fast_path_from_env()  # off: not even tried


@pytest.mark.skipif(os.environ.get("EPMOE_TEST_BUILD_FAST_PATH", "0") in ("", "0"),
                    reason="builds a torch extension (~30-60 s); EPMOE_TEST_BUILD_FAST_PATH=1 runs it")
def test_fast_path_builds_and_declines_host_tensors(bound, monkeypatch, tmp_path):
    """The real extension (built here; TORCH_CUDA_ARCH_LIST must be set without a GPU): its
    argument struct matches the library's, and host tensors are declined (None), not called."""
    monkeypatch.setattr(et, "_fast_ext", None)
    et.load_fast_path(build_directory=os.environ.get("EPMOE_FAST_PATH_BUILD_DIR", str(tmp_path)))
    assert et.fast_path_loaded()
    assert bound.b.fast is None  # its c_forward is the tests' recorder, not a C function
    fn = ctypes.cast(_lib.lib().epmoe_layer_forward_args, ctypes.c_void_p).value
    fast = et._fast_ext.FastForward(fn, -1, 256, 2, 64, _lib.INDEX_INT32, _lib.INDEX_INT64)
    x, idx, w = inputs()
    assert fast(0x1234, x, idx, w, _lib.PATH_AUTO, 0, 0) is None
    # Not tensors, or not plain strided ones: declined too (the Python checks then name them).
    assert fast(0x1234, x, None, w, _lib.PATH_AUTO, 0, 0) is None
    assert fast(0x1234, x.to_sparse(), idx, w, _lib.PATH_AUTO, 0, 0) is None
    bound.b.fast = fast
    y = et._moe_forward_cuda(x, idx, w, bound.key)  # declined: the Python path, as before
    assert bound.calls and bound.calls[-1][5] == y.data_ptr()


def test_register_layer_arguments():
    with pytest.raises(epmoe.InvalidArgument, match="register_layer takes an epmoe.Layer"):
        et.register_layer("layer")
    closed = fake_layer()
    closed._handle = None
    with pytest.raises(epmoe.InvalidArgument, match="this Layer was closed"):
        et.register_layer(closed)
    layer = fake_layer()
    a, b = et.register_layer(layer), et.register_layer(layer)
    assert a != b and et.registered_layer(a) is layer
    et.unregister_layer(a)
    et.unregister_layer(b)
    with pytest.raises(epmoe.InvalidArgument, match="no layer is registered"):
        et.registered_layer(a)


# ---- torch.compile: one graph, the operator in it ------------------------------------------------

def compile_graphs(fn, *args):
    """Compiles fn with fullgraph=True and a backend that records the FX graph and returns
    zeros of the traced output's shape (the operator has no CPU kernel)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        metas = [o.meta["example_value"] for o in outs]

        def run(*a):
            return tuple(torch.zeros(m.shape, dtype=m.dtype) for m in metas)
        return run

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs, out


def op_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and "epmoe.moe_forward" in str(n.target)]


def test_compile_router_and_op_in_one_graph(bound):
    def block(x, router_w):
        probs = (x.float() @ router_w).softmax(dim=-1)
        weights, idx = probs.topk(2, dim=-1)          # int64 indices, as torch.topk gives them
        return x + et.moe_forward(x, idx, weights, bound.key)

    x = torch.randn(5, 256).bfloat16()
    graphs, out = compile_graphs(block, x, torch.randn(256, 8))
    (gm,) = graphs
    (op,) = op_calls(gm)
    # torch.topk's int64 indices reach the operator as they are: no conversion in the graph.
    assert op.args[1].meta["example_value"].dtype == torch.int64
    assert not any(n.op == "call_method" and n.target in ("to", "int") or "clamp" in str(n.target)
                   for n in gm.graph.nodes)
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16
    assert not bound.calls  # traced, never run


def test_compile_error_names_the_argument(bound):
    def bad(x, idx, w):
        return et.moe_forward(x.float(), idx, w, bound.key)
    with pytest.raises(Exception) as e:
        compile_graphs(bad, *inputs())
    assert "x must be bfloat16; got float32" in str(e.value)


# ---- the module (no GPU: fake layer, buffers on "meta") ------------------------------------------

@pytest.fixture
def moe(monkeypatch):
    pushed = []
    def init(self, group, e, h, i, k, t, dtype="fp8", clamp=None, **kw):
        self.__dict__.update(fake_layer(dtype=dtype).__dict__, comm=SimpleNamespace(rank=0))

    monkeypatch.setattr(Layer, "__init__", init)
    monkeypatch.setattr(et, "_buffer_device", lambda index: torch.device("meta"))
    monkeypatch.setattr(Layer, "load_weights", lambda self, *a, **kw: pushed.append(a),
                        raising=True)
    monkeypatch.setattr(et.torch.cuda, "current_stream", lambda device=None: 0)
    m = et.MoE(8, 256, 128, 2, 64, "fp8")
    m.pushed = pushed
    yield m
    m._unregister()


def test_moe_buffers_and_repr(moe):
    assert moe.w1.shape == (4, 256, 256) and moe.w1.dtype == torch.float8_e4m3fn
    assert moe.w1_scale.shape == (4, 2, 2) and moe.w2_scale.shape == (4, 2, 1)
    assert set(moe.state_dict()) == {"w1", "w1_scale", "w2", "w2_scale"}
    assert "E=8, H=256, I=128, K=2" in repr(moe)
    assert et.registered_layer(moe.layer_key) is moe.layer


def test_moe_load_weights(moe):
    meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    w1, w1s = meta((4, 256, 256), torch.uint8), meta((4, 2, 2), torch.float32)
    w2, w2s = meta((4, 256, 128), torch.float8_e4m3fn), meta((4, 2, 1), torch.float32)
    moe.load_weights(w1, w1s, w2, w2s)
    assert len(moe.pushed) == 1 and moe.pushed[0][0] is moe.w1 and moe.weights_loaded
    bad = [((w1, None, w2, w2s), "w1_scale must be a torch.Tensor"),
           ((meta((4, 256, 255), torch.uint8), w1s, w2, w2s),
            "w1 must have shape (4, 256, 256); got (4, 256, 255)"),
           ((w1, w1s, meta((4, 256, 128), torch.bfloat16), w2s),
            "w2 must be float8_e4m3fn; got bfloat16")]
    for args, message in bad:
        with pytest.raises(epmoe.InvalidArgument) as e:
            moe.load_weights(*args)
        assert message in str(e.value)
    moe.load_state_dict(moe.state_dict())  # the post-hook hands the buffers to the layer again
    assert len(moe.pushed) == 2


def test_moe_forward_with_a_module_takes_its_path(moe):
    calls = []
    moe._bound.c_forward = unpacked(lambda *a: calls.append(a) or 0)
    moe._bound.raw_stream = lambda device: 5
    x, idx, w = inputs(t=2)
    et.moe_forward(x, idx, w, moe)  # no path: the module's own ("auto" by default)
    et.moe_forward(x, idx, w, moe, "auto")
    assert len(calls) == 2 and [c[10] for c in calls] == [_lib.PATH_AUTO] * 2
    with pytest.raises(epmoe.InvalidArgument, match="path='fused' but the MoE module runs path='auto'"):
        et.moe_forward(x, idx, w, moe, "fused")
    assert len(calls) == 2


def test_moe_eager_calls_the_kernel_directly(moe):
    calls = []
    moe._bound.c_forward = unpacked(lambda *a: calls.append(a) or 0)
    moe._bound.raw_stream = lambda device: 5
    x, idx, w = inputs(t=3, idx_dtype=torch.int64)
    y = moe(x, idx, w)
    assert len(calls) == 1 and calls[0][6:] == (3, None, None, 5, _lib.PATH_AUTO)
    assert calls[0][2:4] == (idx.data_ptr(), _lib.INDEX_INT64) and y.shape == (3, 256)
    # Under a mode (here torch.device's function mode) the call goes through the operator, which
    # has no CPU kernel: the dispatcher's error shows which way it went.
    with torch.device("cpu"), pytest.raises(NotImplementedError):
        moe(x, idx, w)
    assert len(calls) == 1


def test_moe_compiles_to_one_graph(moe):
    graphs, out = compile_graphs(lambda x, i, w: moe(x, i, w) * 2, *inputs(t=3, idx_dtype=torch.int64))
    assert len(op_calls(graphs[0])) == 1 and out.shape == (3, 256)


def test_moe_closes_and_unregisters(moe, monkeypatch):
    closed = []
    monkeypatch.setattr(Layer, "close", lambda self: closed.append(self))
    key = moe.layer_key
    moe.close()
    assert closed == [moe.layer]
    with pytest.raises(epmoe.InvalidArgument, match="no layer is registered"):
        et.registered_layer(key)


def test_moe_forward_with_a_module_and_a_total_is_refused(moe):
    with pytest.raises(epmoe.InvalidArgument, match="an MoE keeps its own running sum"):
        et.moe_forward(*inputs(), moe, expert_counts_total=torch.zeros(4, dtype=torch.int64))


def test_moe_path_argument(moe):
    with pytest.raises(epmoe.InvalidArgument, match="path='x' must be one of"):
        et.MoE(8, 256, 128, 2, 64, "fp8", path="x")


# ---- the GPU scripts: they compile, and skip cleanly here ---------------------------------------

SCRIPTS = [os.path.join(HERE, "gpu_test_torch.py"), os.path.join(ROOT, "examples", "moe_stack.py"),
           os.path.join(ROOT, "python", "benchmarks", "op_overhead.py")]


@pytest.mark.parametrize("path", SCRIPTS)
def test_gpu_scripts_compile(path):
    with open(path) as f:
        compile(f.read(), path, "exec")


def test_gpu_torch_test_skips_without_gpus():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: run the GPU test itself")
    r = subprocess.run([sys.executable, SCRIPTS[0]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("SKIPPED"), (r.stdout, r.stderr)


def test_overhead_benchmark_cpu_mode():
    # The Python side of a call, measured without a GPU (the C call replaced by a no-op).
    r = subprocess.run([sys.executable, SCRIPTS[2], "--cpu", "--calls", "200", "--repeats", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "epmoe op, C call stubbed" in r.stdout


# ---- the whole torch stack on the CPU: a CPU kernel that copies x stands in for the layer --------

@pytest.fixture
def cpu_kernel(bound):
    """Registers the operator's kernel for CPU tensors, with a C stand-in that writes y = x."""
    def copy_x(h, xp, ip, it, wp, yp, t, counts, total, s, p):
        ctypes.memmove(yp, xp, t * 256 * 2)
        if counts:  # a recognizable stand-in for the counts: 10 + local expert
            (ctypes.c_int32 * 4).from_address(counts)[:] = [10, 11, 12, 13]
        if total:
            arr = (ctypes.c_int64 * 4).from_address(total)
            arr[:] = [v + 10 + e for e, v in enumerate(arr)]
        return 0

    bound.b.c_forward = unpacked(copy_x)
    impl = torch.library.Library("epmoe", "IMPL")
    impl.impl("moe_forward", et._moe_forward_cuda, "CPU")
    impl.impl("moe_forward_counts", et._moe_forward_counts_cuda, "CPU")
    yield bound
    impl._destroy()


def test_opcheck(cpu_kernel):
    # torch's own checks of a custom operator: schema, autograd registration, fake vs real, AOT.
    x, idx, w = inputs(t=4)
    for op, i in ((torch.ops.epmoe.moe_forward.default, idx),
                  (torch.ops.epmoe.moe_forward_counts.default, idx.long())):
        result = torch.library.opcheck(op, (x, i, w, cpu_kernel.key))
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_counts_eager_and_compiled_agree(cpu_kernel):
    # Eagerly one C call writes the counts and adds them to the total; compiled, the counts
    # operator's output is added by torch. Both leave the same running sum.
    router = torch.randn(256, 8)

    def block(h, total):
        w, i = (h.float() @ router).softmax(-1).topk(2, dim=-1)
        y, counts = et.moe_forward(h, i, w, cpu_kernel.key, return_expert_counts=True,
                                   expert_counts_total=total)
        return h + y, counts

    x = torch.randn(16, 256).bfloat16()
    total = torch.zeros(4, dtype=torch.int64)
    y, counts = block(x, total)
    assert torch.equal(y, 2 * x) and counts.tolist() == [10, 11, 12, 13]
    assert total.tolist() == [10, 11, 12, 13]
    torch._dynamo.reset()
    y, counts = torch.compile(block, fullgraph=True)(x, total)
    assert torch.equal(y, 2 * x) and counts.tolist() == [10, 11, 12, 13]
    assert total.tolist() == [20, 22, 24, 26]


def test_inductor_runs_the_operator(cpu_kernel):
    # torch.compile with inductor (fullgraph, then dynamic shapes) generates code that calls the
    # operator; the router runs in inductor's kernels.
    router = torch.randn(256, 8)

    def block(h):
        w, i = (h.float() @ router).softmax(-1).topk(2, dim=-1)
        return h + et.moe_forward(h, i, w / w.sum(-1, keepdim=True), cpu_kernel.key)

    x = torch.randn(16, 256).bfloat16()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(block, fullgraph=True)(x), 2 * x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(block, fullgraph=True, dynamic=True)(x[:5]), 2 * x[:5])


# ---- the module on a workspace (no GPU: fake layer, buffers on the CPU) --------------------------

@pytest.fixture
def moe_ws(monkeypatch):
    """An MoE on a stand-in workspace: Layer.__init__ records its arguments, transform_w13 its
    calls; the buffers are real CPU tensors (so that replacing one is seen)."""
    made, transforms = [], []

    def init(self, group, e, h, i, k, t, dtype="fp8", clamp=None, **kw):
        self.__dict__.update(fake_layer(dtype=dtype).__dict__, comm=SimpleNamespace(rank=0))
        made.append(kw)

    monkeypatch.setattr(Layer, "__init__", init)
    monkeypatch.setattr(Layer, "load_weights", lambda self, *a, **kw: pytest.fail("copied weights"))
    monkeypatch.setattr(et, "_buffer_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(et, "transform_w13", lambda *a, **kw: transforms.append((a, kw)))
    monkeypatch.setattr(et.torch.cuda, "current_stream", lambda device=None: 0)
    ws = object.__new__(epmoe.Workspace)
    ws.config = epmoe.WorkspaceConfig(4, 256, 128, 2, 64, num_ranks=2)
    ws.device, ws._handle = -1, 0xABC
    m = et.MoE(8, 256, 128, 2, 64, "fp8", workspace=ws, count_experts=True)
    m.made, m.transforms, m.ws = made, transforms, ws
    yield m
    m._unregister()


def test_moe_on_a_workspace_references_its_buffers(moe_ws):
    (kw,) = moe_ws.made
    assert kw["workspace"] is moe_ws.ws and moe_ws.workspace is moe_ws.ws
    refs = kw["weights"]
    assert refs["w13"] is moe_ws.w13_kernel and refs["w13_scale"] is moe_ws.w13_kernel_scale
    assert refs["w2"] is moe_ws.w2 and refs["w2_scale"] is moe_ws.w2_scale
    assert moe_ws.w13_kernel.shape == moe_ws.w1.shape and moe_ws.w13_kernel.dtype == torch.float8_e4m3fn
    # The state_dict keeps the SPEC layout only; the kernels' copy of W1 and the counts are not in it.
    assert set(moe_ws.state_dict()) == {"w1", "w1_scale", "w2", "w2_scale"}
    assert "on a workspace" in repr(moe_ws)


def test_moe_on_a_workspace_transforms_w1_at_each_load(moe_ws):
    w1, w1s = torch.zeros(4, 256, 256, dtype=torch.uint8), torch.ones(4, 2, 2)
    w2, w2s = torch.zeros(4, 256, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 2, 1)
    moe_ws.load_weights(w1, w1s, w2, w2s)
    ((args, kw),) = moe_ws.transforms
    assert args[0] is moe_ws.w1 and args[1] is moe_ws.w1_scale
    assert kw["out"] is moe_ws.w13_kernel and kw["out_scale"] is moe_ws.w13_kernel_scale
    assert torch.equal(moe_ws.w1_scale, w1s) and moe_ws.weights_loaded
    moe_ws.load_state_dict(moe_ws.state_dict())
    assert len(moe_ws.transforms) == 2


def test_moe_on_a_workspace_refuses_replaced_buffers(moe_ws):
    moe_ws.to("cpu")  # nothing moves: fine
    with pytest.raises(epmoe.InvalidArgument, match="reads its weight buffers by reference"):
        moe_ws.half()  # the fp32 scales become new fp16 tensors


def test_moe_on_a_workspace_needs_its_weights(moe_ws):
    moe_ws._bound.c_forward = unpacked(lambda *a: pytest.fail("called the library"))
    with pytest.raises(epmoe.InvalidArgument, match="the weights were never loaded"):
        moe_ws(*inputs(t=3))


def test_moe_expert_counts_total(moe_ws):
    moe_ws.weights_loaded = True
    calls = []
    moe_ws._bound.c_forward = unpacked(lambda *a: calls.append(a) or 0)
    moe_ws._bound.raw_stream = lambda device: 5
    total = moe_ws.expert_counts_total
    assert (tuple(total.shape), total.dtype) == ((4,), torch.int64) and not total.any()
    y = moe_ws(*inputs(t=3))
    assert y.shape == (3, 256) and calls[-1][7:9] == (None, total.data_ptr())
    y, counts = moe_ws(*inputs(t=3), return_expert_counts=True)
    assert calls[-1][7:9] == (counts.data_ptr(), total.data_ptr())
    total.fill_(5)
    moe_ws.reset_expert_counts()
    assert not total.any()


def test_moe_counting_eager_and_compiled(moe_ws):
    # The module's running sum through both paths, with CPU kernels for both operators standing in
    # for the CUDA ones (counts 10 + local expert, added on by the C stand-in or by torch).
    def c_call(h, xp, ip, it, wp, yp, t, counts, total, s, p):
        ctypes.memmove(yp, xp, t * 256 * 2)
        if counts:
            (ctypes.c_int32 * 4).from_address(counts)[:] = [10, 11, 12, 13]
        if total:
            arr = (ctypes.c_int64 * 4).from_address(total)
            arr[:] = [v + 10 + e for e, v in enumerate(arr)]
        return 0

    moe_ws.weights_loaded = True
    moe_ws._bound.c_forward = unpacked(c_call)
    moe_ws._bound.raw_stream = lambda device: 0
    impl = torch.library.Library("epmoe", "IMPL")
    impl.impl("moe_forward_counts", et._moe_forward_counts_cuda, "CPU")
    try:
        x, idx, w = inputs(t=3, idx_dtype=torch.int64)
        assert torch.equal(moe_ws(x, idx, w), x)
        torch._dynamo.reset()
        y, counts = torch.compile(lambda a, b, c: moe_ws(a, b, c, return_expert_counts=True),
                                  fullgraph=True)(x, idx, w)
        assert torch.equal(y, x) and counts.tolist() == [10, 11, 12, 13]
        assert moe_ws.expert_counts_total.tolist() == [20, 22, 24, 26]
    finally:
        impl._destroy()


def test_moe_without_counting(moe):
    assert moe.expert_counts_total is None
    with pytest.raises(epmoe.InvalidArgument, match="does not count"):
        moe.reset_expert_counts()


def test_moe_workspace_argument(moe):
    with pytest.raises(epmoe.InvalidArgument, match="workspace must be an epmoe.Workspace"):
        et.MoE(8, 256, 128, 2, 64, "fp8", workspace="ws")
    with pytest.raises(epmoe.InvalidArgument, match="count_experts must be a bool"):
        et.MoE(8, 256, 128, 2, 64, "fp8", count_experts=1)
