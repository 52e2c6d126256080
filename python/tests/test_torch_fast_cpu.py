"""CPU tests of Layer.__call__'s torch hot path (epmoe/_torch_fast.py). No GPU: the layer stand-in
claims device -1 (what Tensor.get_device() says for CPU tensors), the C function is a recorder and
the current-stream lookup a constant. Skipped where torch is not installed."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import epmoe  # noqa: E402
from epmoe import _frameworks, _lib, _torch_fast  # noqa: E402
from epmoe.layer import Layer  # noqa: E402

GOOD = dict(num_ranks=2, num_experts=8, hidden=256, intermediate=128, topk=2,
            max_tokens_per_rank=64)
STREAM = 0x5EED


def fake_layer():
    layer = object.__new__(Layer)
    layer.config = epmoe.LayerConfig(**GOOD)
    layer.device = -1
    layer._handle = 0x1234
    return layer


@pytest.fixture
def calls(monkeypatch):
    """The C forward's recorded arguments; status 0."""
    seen = []

    def forward(handle, address):  # epmoe_layer_forward_args: recorded in epmoe_layer_forward_ex's order
        seen.append(_lib.unpack_forward_args(handle, address))
        return 0

    monkeypatch.setattr(_lib, "lib", lambda: SimpleNamespace(epmoe_layer_forward_args=forward))
    monkeypatch.setattr(_torch_fast, "_raw_stream", lambda dev: STREAM)
    monkeypatch.setattr(_torch_fast.forward, "__defaults__", (lambda dev: STREAM,))
    # The DLPack path asks torch for its current stream (no CUDA here).
    monkeypatch.setattr(_frameworks, "current_stream", lambda like, device: 0)
    return seen


def inputs(t=5):
    x = torch.randn(t, GOOD["hidden"]).to(torch.bfloat16)
    idx = torch.randint(0, GOOD["num_experts"], (t, GOOD["topk"]), dtype=torch.int32)
    w = torch.rand(t, GOOD["topk"], dtype=torch.float32)
    return x, idx, w


def test_hot_path_passes_the_tensors_pointers(calls):
    layer = fake_layer()
    x, idx, w = inputs()
    y = torch.empty(5, GOOD["hidden"], dtype=torch.bfloat16)
    assert layer(x, idx, w, out=y, path="fused") is y
    assert calls == [(0x1234, x.data_ptr(), idx.data_ptr(), _lib.INDEX_INT32, w.data_ptr(),
                      y.data_ptr(), 5, None, None, STREAM, _lib.PATH_FUSED)]


def test_hot_path_passes_int64_indices_as_they_are(calls):
    x, idx, w = inputs()
    idx = idx.long()
    y = fake_layer()(x, idx, w)
    assert calls == [(0x1234, x.data_ptr(), idx.data_ptr(), _lib.INDEX_INT64, w.data_ptr(),
                      y.data_ptr(), 5, None, None, STREAM, _lib.PATH_AUTO)]


E_LOC = GOOD["num_experts"] // GOOD["num_ranks"]


def test_hot_path_passes_the_expert_counts(calls):
    x, idx, w = inputs()
    counts = torch.zeros(E_LOC, dtype=torch.int32)
    totals = torch.zeros(E_LOC, dtype=torch.int64)
    y = fake_layer()(x, idx, w, expert_counts=counts, expert_counts_total=totals)
    assert len(calls) == 1
    assert calls[0][7:9] == (counts.data_ptr(), totals.data_ptr())
    assert calls[0][5] == y.data_ptr()
    fake_layer()(x, idx, w, expert_counts_total=totals)
    assert calls[1][7:9] == (None, totals.data_ptr())


def test_hot_path_zero_tokens_passes_the_expert_counts(calls):
    """T = 0: no token pointer, but the counts are still written (zeros) and summed."""
    x, idx, w = inputs(0)
    counts = torch.zeros(E_LOC, dtype=torch.int32)
    totals = torch.zeros(E_LOC, dtype=torch.int64)
    fake_layer()(x, idx, w, expert_counts=counts, expert_counts_total=totals)
    assert calls == [(0x1234, None, None, _lib.INDEX_INT32, None, None, 0, counts.data_ptr(),
                      totals.data_ptr(), STREAM, _lib.PATH_AUTO)]


def _bad_counts():
    """Expert-count arguments the hot path must leave to the DLPack path, which names them."""
    x, idx, w = inputs()
    y = torch.empty(5, GOOD["hidden"], dtype=torch.bfloat16)
    shared = torch.zeros(E_LOC, dtype=torch.int64)  # totals, with the counts in its first bytes
    partial = torch.zeros(2 * E_LOC, dtype=torch.int64)
    return x, idx, w, y, [
        ("counts int64", dict(expert_counts=torch.zeros(E_LOC, dtype=torch.int64))),
        ("counts of E_loc + 1", dict(expert_counts=torch.zeros(E_LOC + 1, dtype=torch.int32))),
        ("counts strided", dict(expert_counts=torch.zeros(2 * E_LOC, dtype=torch.int32)[::2])),
        ("counts 2-D", dict(expert_counts=torch.zeros(1, E_LOC, dtype=torch.int32))),
        ("totals int32", dict(expert_counts_total=torch.zeros(E_LOC, dtype=torch.int32))),
        ("counts inside out", dict(out=y, expert_counts=y.view(torch.int32).reshape(-1)[:E_LOC])),
        ("counts inside x", dict(expert_counts=x.view(torch.int32).reshape(-1)[:E_LOC])),
        ("totals over counts", dict(expert_counts=shared.view(torch.int32)[:E_LOC],
                                    expert_counts_total=shared)),
        # The last bytes of the totals only (a range check shorter than E_loc entries misses it).
        ("counts over the totals' tail", dict(expert_counts=partial.view(torch.int32)[6:6 + E_LOC],
                                              expert_counts_total=partial[:E_LOC])),
        ("counts misaligned", dict(expert_counts=torch.frombuffer(bytearray(64), dtype=torch.int32,
                                                                  offset=2, count=E_LOC))),
        ("totals misaligned", dict(expert_counts_total=torch.frombuffer(bytearray(64), dtype=torch.int64,
                                                                        offset=4, count=E_LOC))),
    ]


def test_bad_expert_counts_take_the_dlpack_path(calls):
    x, idx, w, y, cases = _bad_counts()
    for name, kw in cases:
        with pytest.raises(epmoe.InvalidArgument):
            fake_layer()(x, idx, w, **kw)
        assert calls == [], name


def test_hot_path_allocates_out(calls):
    x, idx, w = inputs(3)
    y = fake_layer()(x, idx, w)
    assert y.shape == (3, GOOD["hidden"]) and y.dtype == torch.bfloat16
    assert calls[0][5] == y.data_ptr() and calls[0][10] == _lib.PATH_AUTO  # the default path


def test_hot_path_zero_tokens_passes_null_pointers(calls):
    x, idx, w = inputs(0)
    fake_layer()(x, idx, w)
    (args,) = calls
    assert args[6] == 0
    assert all(p is None or isinstance(p, int) for p in (args[1], args[2], args[4], args[5]))


def test_library_status_raises(monkeypatch):
    monkeypatch.setattr(_lib, "lib", lambda: SimpleNamespace(epmoe_layer_forward_args=lambda *a: 3))
    monkeypatch.setattr(_torch_fast.forward, "__defaults__", (lambda dev: STREAM,))
    raised = []
    monkeypatch.setattr(_lib, "check", lambda status: raised.append(status))
    x, idx, w = inputs()
    fake_layer()(x, idx, w)
    assert raised == [3]


def _bad(case):
    x, idx, w = inputs()
    y = torch.empty(5, GOOD["hidden"], dtype=torch.bfloat16)
    if case == "x dtype":
        x = x.float()
    elif case == "x shape":
        x = torch.zeros(5, 128, dtype=torch.bfloat16)
    elif case == "too many tokens":
        x, idx, w = inputs(65)
        y = torch.empty(65, GOOD["hidden"], dtype=torch.bfloat16)
    elif case == "idx int16":
        idx = idx.short()
    elif case == "idx int64 not contiguous":
        idx = torch.zeros(GOOD["topk"], 5, dtype=torch.int64).t()
    elif case == "idx shape":
        idx = idx[:, :1].contiguous()
    elif case == "weights dtype":
        w = w.double()
    elif case == "x not contiguous":
        x = torch.zeros(GOOD["hidden"], 5, dtype=torch.bfloat16).t()
    elif case == "x misaligned":
        x = torch.zeros(5 * GOOD["hidden"] + 1, dtype=torch.bfloat16)[1:].view(5, GOOD["hidden"])
    elif case == "out aliases x":
        y = x
    elif case == "out dtype":
        y = y.float()
    elif case == "not a tensor":
        x = x.tolist()
    return x, idx, w, y


CASES = ["x dtype", "x shape", "too many tokens", "idx int16", "idx int64 not contiguous", "idx shape",
         "weights dtype",
         "x not contiguous", "x misaligned", "out aliases x", "out dtype", "not a tensor"]


@pytest.mark.parametrize("case", CASES)
def test_hot_path_not_taken_on_bad_arguments(case, calls):
    """Any argument the checks would refuse leaves the hot path without a call; the DLPack path
    then raises (here about the CPU tensors too, since the stand-in lives on device -1)."""
    x, idx, w, y = _bad(case)
    taken, result, status = _torch_fast.forward(
        lambda *a: calls.append(a), 0x1234, -1, GOOD["hidden"], GOOD["topk"],
        GOOD["max_tokens_per_rank"], x, idx, w, y, _lib.PATH_PIPELINE, _lib.INDEX_INT32,
        _lib.INDEX_INT64, lambda dev: STREAM)
    assert (taken, result, status) == (False, None, 0)
    with pytest.raises(epmoe.InvalidArgument):
        fake_layer()(x, idx, w, out=y)
    assert calls == []


def test_explicit_stream_takes_the_dlpack_path(calls):
    """With another stream= given, torch must order its pending work before that stream (the
    DLPack export does it): no hot path. On the CPU stand-in the DLPack path then refuses the
    tensors."""
    x, idx, w = inputs()
    for other in (7, SimpleNamespace(cuda_stream=7), True, "stream"):
        with pytest.raises(epmoe.InvalidArgument, match="CUDA|stream"):
            fake_layer()(x, idx, w, stream=other)
    assert calls == []


@pytest.mark.parametrize("current", [STREAM, SimpleNamespace(cuda_stream=STREAM)],
                         ids=["int", "torch.cuda.Stream-like"])
def test_explicit_current_stream_takes_the_hot_path(current, calls):
    """stream=torch.cuda.current_stream() (or its handle) has nothing to order: the hot path, on
    that stream."""
    x, idx, w = inputs()
    y = fake_layer()(x, idx, w, stream=current)
    assert y.shape == (5, GOOD["hidden"]) and y.dtype is torch.bfloat16
    assert len(calls) == 1 and calls[0][9] == STREAM
