"""instrument_module: per-module forward and backward regions on real nn.Modules, the
Transformer fast path kept (seen by torch.profiler), one graph under torch.compile.

Every test runs twice: with the compiled inner entries and backward hook
(``perfsdk._fastpath``: ``open_inner``, ``InnerRegion.exit``, ``NodeHook``) where the module is
built, and with their pure-Python twins."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
import torch
from torch import nn

import perfsdk
import perfsdk.auto.backward as _bwd
import perfsdk.auto.module as _mod
from perfsdk import region as _region
from perfsdk.auto import instrument_module
from perfsdk.context import current_span
from perfsdk.region import InnerRegion, Region
from perfsdk.testing import capture
from perfsdk.testing.models import SimpleNet, encoder

_COMPILED = (_region._fastpath is not None
             and _region.inner_gate is getattr(_region._fastpath, "InnerGate", None))


@pytest.fixture(autouse=True, params=[
    pytest.param("compiled", marks=pytest.mark.skipif(
        not _COMPILED, reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")),
    "python"])
def implementation(request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> str:
    """Inner entries and the backward hook: compiled (as perfsdk chose at import) or the
    pure-Python twins."""
    if request.param == "compiled":
        assert _bwd._make_hook is _region._fastpath.NodeHook
        assert _mod._track is _region._fastpath.track
        assert InnerRegion.exit is not _region.exit_inner_python
        assert _mod._module_call is _region._fastpath.ModuleCall
    else:  # gates are made when a module is instrumented: after this
        for owner, name, twin in _region.python_twins():  # inner gates and exits, ...
            monkeypatch.setattr(owner, name, twin)
        monkeypatch.setattr(_bwd, "_make_hook", _bwd._partial(_bwd._partial, _bwd._on_node))
        monkeypatch.setattr(_mod, "_track", _bwd.track_python)
        monkeypatch.setattr(_mod, "_module_call", None)
    return str(request.param)


CHILDREN = ["conv1", "conv2", "conv3", "pool", "fc1", "fc2", "relu"]


def _net() -> tuple[SimpleNet, torch.Tensor]:
    torch.manual_seed(0)
    return SimpleNet(image_size=8), torch.randn(2, 3, 8, 8)


def _by_id(regions):
    return {r.span_id: r for r in regions}


def _inside(inner, outer) -> bool:
    return outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns


def test_forward_and_backward_regions_are_named_by_path_and_nest():
    model, x = _net()
    with capture() as cap, instrument_module(model) as handle:
        model(x).sum().backward()
    assert handle.regions == ["SimpleNet", *(f"SimpleNet.{c}" for c in CHILDREN)]
    names = [r.name for r in cap.regions]
    for child in CHILDREN:
        calls = 4 if child == "relu" else 2 if child == "pool" else 1
        assert names.count(f"SimpleNet.{child}") == calls, child
        assert names.count(f"SimpleNet.{child}.backward") == calls, child
    by_id = _by_id(cap.regions)
    root = cap.named("SimpleNet")[0]
    root_bwd = cap.named("SimpleNet.backward")[0]
    assert root.attributes["perfsdk.module"] == ""
    assert root.attributes["perfsdk.category"] == "module"
    for child in CHILDREN:
        for r in cap.named(f"SimpleNet.{child}"):
            assert by_id[r.parent_span_id] is root
            assert r.attributes["perfsdk.module"] == child
            assert _inside(r, root)
        for r in cap.named(f"SimpleNet.{child}.backward"):
            assert by_id[r.parent_span_id] is root_bwd
            assert r.attributes["perfsdk.category"] == "module.backward"
            assert _inside(r, root_bwd)
    # backward runs in reverse: the last layer's backward ends before the first layer's starts
    fc2, conv1 = cap.named("SimpleNet.fc2.backward")[0], cap.named("SimpleNet.conv1.backward")[0]
    assert fc2.end_ns <= conv1.start_ns
    assert root.end_ns <= root_bwd.start_ns


def test_first_layer_backward_covers_its_weight_gradient():
    """conv1's input does not require grad; its backward region still holds its
    convolution_backward (a full backward hook would fire before that runs), as torch.profiler
    sees both."""
    model, x = _net()
    with capture() as cap, instrument_module(model), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    assert cap.named("SimpleNet.conv1.backward")[0].host_ms > 0
    events = prof.events()
    convs = sorted((e for e in events if e.name == "aten::convolution_backward"),
                   key=lambda e: e.time_range.start)
    assert len(convs) == 3
    region = next(e for e in events if e.name == "SimpleNet.conv1.backward")
    assert region.time_range.start <= convs[-1].time_range.start
    assert convs[-1].time_range.end <= region.time_range.end


def test_gradients_unchanged_and_inplace_relu_after_a_hooked_layer_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3),
                          nn.ReLU(inplace=True))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    with capture() as cap, instrument_module(model):
        model(x).sum().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    names = [r.name for r in cap.regions]
    assert names.count("Sequential.1.backward") == 1  # the in-place ReLU has its own backward
    assert names.count("Sequential.0.backward") == 1


def test_regions_stay_balanced_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    with capture() as cap, instrument_module(model):
        with pytest.raises(KeyError, match="boom"):
            model(torch.ones(1, 2))
        assert not isinstance(current_span(), Region)  # nothing left open
        with perfsdk.timed_region("after"):
            pass
    errors = {r.name: r.error for r in cap.regions}
    assert isinstance(errors["Sequential.1"], KeyError)
    assert isinstance(errors["Sequential"], KeyError)
    assert errors["Sequential.0"] is None
    assert cap.named("after")[0].parent_span_id == 0


def test_depth_include_exclude():
    model = _net()[0]
    with instrument_module(model, depth=0) as h:
        assert h.regions == ["SimpleNet"]
    with instrument_module(model, include="conv*") as h:
        assert h.regions == ["SimpleNet.conv1", "SimpleNet.conv2", "SimpleNet.conv3"]
    with instrument_module(model, include=nn.Linear, exclude="*fc2") as h:
        assert h.regions == ["SimpleNet.fc1"]
    with instrument_module(model, exclude=[nn.ReLU, nn.MaxPool2d, "SimpleNet"]) as h:
        assert h.regions == [f"SimpleNet.{c}" for c in ("conv1", "conv2", "conv3", "fc1", "fc2")]
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    with instrument_module(nested, depth=1) as h:
        assert h.regions == ["Sequential", "Sequential.0"]
    with instrument_module(nested) as h:
        assert h.regions == ["Sequential", "Sequential.0", "Sequential.0.0"]


@pytest.mark.parametrize(("kwargs", "arg"), [
    ({"depth": -1}, "depth"), ({"depth": True}, "depth"), ({"include": 3}, "include"),
    ({"exclude": [int]}, "exclude"), ({"backward": "yes"}, "backward"),
])
def test_bad_arguments_are_named(kwargs, arg):
    with pytest.raises(ValueError, match=f"{arg}="):
        instrument_module(nn.Linear(2, 2), **kwargs)
    with pytest.raises(ValueError, match="model="):
        instrument_module("model")  # type: ignore[arg-type]


def test_remove_takes_out_every_hook_and_wrapper():
    model, x = _net()
    enc = encoder(16, 1, 2)
    handles = [instrument_module(model), instrument_module(enc)]
    for h in handles:
        h.remove()
        h.remove()  # idempotent
    for m in [*model.modules(), *enc.modules()]:
        assert not m._forward_hooks
        assert not m._forward_pre_hooks
        assert "forward" not in m.__dict__
    with capture() as cap:
        model(x).sum().backward()
        enc(torch.randn(1, 3, 16))
    assert cap.regions == []


def test_disabled_records_nothing_and_a_later_enable_does():
    model, x = _net()
    with capture() as cap, instrument_module(model):
        perfsdk.configure(enabled=False)
        model(x).sum().backward()
        perfsdk.configure(enabled=True)
        model(x)
    assert sorted({r.name for r in cap.regions}) == sorted(
        ["SimpleNet", *(f"SimpleNet.{c}" for c in CHILDREN)])


def test_threads_nest_under_their_own_root():
    model, _ = _net()
    errors = []

    def run() -> None:
        try:
            for _ in range(5):
                model(torch.randn(1, 3, 8, 8)).sum().backward()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with capture() as cap, instrument_module(model):
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    by_id = _by_id(cap.regions)
    assert len(cap.named("SimpleNet")) == len(cap.named("SimpleNet.backward")) == 10
    for r in cap.named("SimpleNet.conv1"):
        parent = by_id[r.parent_span_id]
        assert parent.name == "SimpleNet"
        assert parent.thread_id == r.thread_id


def test_backward_that_raises_leaves_no_region_open():
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 1

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            raise RuntimeError("backward failed")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return Fails.apply(y) if self.fail else y

    model = Net()
    with capture() as cap, instrument_module(model):
        with pytest.raises(RuntimeError, match="backward failed"):
            model(torch.ones(1, 2)).sum().backward()
        model.fail = False
        model(torch.ones(1, 2)).sum().backward()  # the next call closes what the failure left
        assert not isinstance(current_span(), Region)
    roots = cap.named("Net")
    assert len(roots) == 2
    assert roots[1].parent_span_id == 0
    assert len(cap.named("Net.backward")) == 2


# -- where backward regions start and end (autograd sequence numbers) ----------------------------
def _profile(fn):  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def _event(events, name):  # type: ignore[no-untyped-def]
    found = [e for e in events if e.name == name]
    assert len(found) == 1, (name, len(found))
    return found[0]


def _contains(outer, inner) -> bool:  # type: ignore[no-untyped-def]
    return (outer.time_range.start <= inner.time_range.start
            and inner.time_range.end <= outer.time_range.end)


def test_a_backward_region_ends_where_its_input_s_backward_starts():
    """Only the Linears are instrumented: each one's backward holds its own nodes and ends when
    the uninstrumented node that made its input starts (a ReLU's, the model input's exp)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4, requires_grad=True)
    with capture() as cap, instrument_module(model, include=nn.Linear) as h:
        events = _profile(lambda: model(x.exp()).sum().backward())
    assert h.regions == ["Sequential.0", "Sequential.2"]
    assert sorted(r.name for r in cap.regions) == [
        "Sequential.0", "Sequential.0.backward", "Sequential.2", "Sequential.2.backward"]
    first, second = (_event(events, f"Sequential.{i}.backward") for i in (0, 2))
    addmm = sorted((e for e in events if e.name == "AddmmBackward0"),
                   key=lambda e: e.time_range.start)
    relus = sorted((e for e in events if e.name == "ReluBackward0"),
                   key=lambda e: e.time_range.start)
    exp = _event(events, "ExpBackward0")
    assert len(addmm) == len(relus) == 2
    assert _contains(second, addmm[0])
    assert _contains(first, addmm[1])
    assert second.time_range.end <= relus[1].time_range.start  # the ReLU between them
    assert relus[1].time_range.end <= first.time_range.start
    assert first.time_range.end <= exp.time_range.start
    assert cap.named("Sequential.0.backward")[0].parent_span_id == 0  # siblings, not nested


@contextlib.contextmanager
def _counting_registrations():  # type: ignore[no-untyped-def]
    """The sequence numbers of the autograd nodes instrument_module hooks, in order."""
    import perfsdk.auto.backward as bwd

    registered = []
    original = bwd._make_hook

    def counting(seq, entries):  # type: ignore[no-untyped-def]
        registered.append(seq)  # a node's pre-hook, _on_node(seq, entries, grad) when called
        return original(seq, entries)

    bwd._make_hook = counting
    try:
        yield registered
    finally:
        bwd._make_hook = original


def test_a_node_that_ends_one_call_and_starts_another_has_one_hook():
    """The outer module returns the tensor it passed to the inner one: that node is the inner
    call's input (where its backward ends) and the outer call's output (where its starts)."""
    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            self.inner(y)  # its result unused: only y reaches the output
            return y

    model = Outer()
    with capture() as cap, instrument_module(model), _counting_registrations() as registered:
        out = model(torch.ones(2, requires_grad=True))
        out.sum().backward()
    # Inner's output node (x * 2, never run) and y's node, once: Inner's end, Outer's start
    exp = out.grad_fn._sequence_nr()  # type: ignore[union-attr]
    assert registered == [exp + 1, exp]
    assert Counter(r.name for r in cap.regions) == Counter(
        {"Outer": 1, "Outer.inner": 1, "Outer.backward": 1})


def test_a_failure_in_backward_bookkeeping_never_breaks_backward(monkeypatch):
    import perfsdk.auto.backward as bwd
    from perfsdk.errors import PerfSDKWarning, counts

    def broken(callback) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("bookkeeping")

    model, x = _net()
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with capture() as cap, instrument_module(model):
        monkeypatch.setattr(bwd, "_queue_callback", broken)
        with pytest.warns(PerfSDKWarning, match="bookkeeping"):
            model(x).sum().backward()
        monkeypatch.undo()
        assert not isinstance(current_span(), Region)
        model(x).sum().backward()  # and the next step records again
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), expected,
                                                           strict=True))
    assert counts()["auto-backward:RuntimeError"] >= 1
    assert len(cap.named("SimpleNet")) == 2
    assert len(cap.named("SimpleNet.backward")) == 1


def test_a_failure_in_forward_bookkeeping_costs_that_call_its_backward_region_only(monkeypatch):
    import perfsdk.auto.backward as bwd
    from perfsdk.errors import PerfSDKWarning, counts

    def broken() -> int:
        raise RuntimeError("sequence")

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.ones(2, 4, requires_grad=True)
    expected = model(x)
    with capture() as cap, instrument_module(model):
        monkeypatch.setattr(_mod, "_first_node", broken)
        with pytest.warns(PerfSDKWarning, match="sequence"):
            out = model(x)
        monkeypatch.undo()
        assert torch.equal(out, expected)
        out.sum().backward()
        assert bwd._tls.nodes == {}
        model(x).sum().backward()  # and the next call records its backward again
    assert counts()["auto-backward:RuntimeError"] >= 1
    names = Counter(r.name for r in cap.regions)
    assert names["Sequential"] == names["Sequential.0"] == names["Sequential.1"] == 2
    assert names["Sequential.backward"] == names["Sequential.0.backward"] == 1
    assert not isinstance(current_span(), Region)


def test_an_exit_that_raises_still_ends_the_call_s_count(monkeypatch):
    """A submodule's region exit failing (never expected: perfsdk's own error) propagates, and
    the call still counts as returned: the nodes hooked in the forward are let go."""
    import perfsdk.auto.backward as bwd

    original = InnerRegion.exit
    failed: list[int] = []

    def exit_once_failing(self, error=None, t1=0):  # type: ignore[no-untyped-def]
        original(self, error, t1)
        if not failed:
            failed.append(1)
            raise RuntimeError("exit")

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.ones(2, 4, requires_grad=True)
    with capture() as cap, instrument_module(model):
        monkeypatch.setattr(InnerRegion, "exit", exit_once_failing)
        with pytest.raises(RuntimeError, match="exit"):
            model(x)
        monkeypatch.undo()
        assert bwd._tls.nodes == {}
        out = model(x)
        assert bwd._tls.nodes == {}  # the outermost call ended: its nodes are let go
        out.sum().backward()
    assert not isinstance(current_span(), Region)
    assert Counter(r.name for r in cap.regions)["Sequential"] == 2


class _ManyArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, *rest: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(a + sum(rest)) * scale


@pytest.mark.parametrize(("args", "kwargs"), [
    (1, {}), (2, {}), (12, {}), (1, {"scale": 2.0}), (12, {"scale": 3.0})])
def test_a_module_gets_its_arguments_positional_or_keyword_any_number(args, kwargs):
    torch.manual_seed(0)
    model = _ManyArgs()
    inputs = [torch.full((2, 4), float(i + 1), requires_grad=True) for i in range(args)]
    expected = model(*inputs, **kwargs)
    with capture() as cap, instrument_module(model):
        out = model(*inputs, **kwargs)
        out.sum().backward()
    assert torch.equal(out, expected)
    assert all(t.grad is not None for t in inputs)
    names = Counter(r.name for r in cap.regions)
    assert names["_ManyArgs"] == names["_ManyArgs.lin"] == 1
    assert names["_ManyArgs.backward"] == names["_ManyArgs.lin.backward"] == 1


def test_parallel_branches_get_one_backward_region_each_inside_their_parent():
    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) * self.b(x)

    torch.manual_seed(0)
    model = Fork()
    with capture() as cap, instrument_module(model):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    by_id = _by_id(cap.regions)
    [fork] = cap.named("Fork.backward")
    [a] = cap.named("Fork.a.backward")
    [b] = cap.named("Fork.b.backward")
    assert by_id[a.parent_span_id] is fork
    assert by_id[b.parent_span_id] is fork
    assert _inside(a, fork)
    assert _inside(b, fork)
    assert b.end_ns <= a.start_ns  # b was created last: its backward runs first, apart


def test_a_retained_graph_records_each_backward_pass():
    model, x = _net()
    with capture() as cap, instrument_module(model):
        out = model(x).sum()
        out.backward(retain_graph=True)
        out.backward()
        assert not isinstance(current_span(), Region)
    assert len(cap.named("SimpleNet")) == 1
    assert len(cap.named("SimpleNet.backward")) == 2
    assert len(cap.named("SimpleNet.conv1.backward")) == 2
    assert len(cap.named("SimpleNet.relu.backward")) == 8


def test_a_module_that_returns_its_input_gets_no_backward_region():
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Dropout(0.5).eval())
    with capture() as cap, instrument_module(model):
        model(torch.ones(2, 4)).sum().backward()
    names = Counter(r.name for r in cap.regions)
    assert names == Counter({"Sequential": 1, "Sequential.0": 1, "Sequential.1": 1,
                             "Sequential.2": 1, "Sequential.backward": 1,
                             "Sequential.0.backward": 1})


def test_no_backward_tracking_without_grad_or_graph():
    model, x = _net()
    with capture() as cap, instrument_module(model):
        with torch.no_grad():
            model(x)
        model.requires_grad_(False)
        out = model(x)  # no parameter needs grad, nor the input: no autograd graph at all
    assert out.grad_fn is None
    assert not [r for r in cap.regions if r.name.endswith(".backward")]
    assert len(cap.named("SimpleNet")) == 2


def test_reentrant_checkpoint_backward_regions_balance_and_nest():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(0)
    model = Ckpt()
    with capture() as cap, instrument_module(model):
        for _ in range(2):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
            assert not isinstance(current_span(), Region)
    names = Counter(r.name for r in cap.regions)
    assert names["Ckpt.backward"] == names["Ckpt.head.backward"] == 2
    # the first forward runs the block under no_grad; its recomputation in backward is tracked
    assert names["Ckpt.block"] == 4
    assert names["Ckpt.block.backward"] == names["Ckpt.block.0.backward"] == 2
    by_id = _by_id(cap.regions)
    for r in cap.named("Ckpt.block.backward"):
        assert by_id[r.parent_span_id].name == "Ckpt.backward"
    for r in cap.named("Ckpt.block.0.backward"):
        assert by_id[r.parent_span_id].name == "Ckpt.block.backward"


def test_one_pre_hook_per_node_between_consecutive_layers():
    """Consecutive layers share their hooks: a ReLU's output node starts the ReLU's region and
    ends the next Linear's, with one hook."""
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(4, 4), nn.ReLU())])
    with capture() as cap, instrument_module(model), _counting_registrations() as registered:
        model(torch.ones(2, 4)).sum().backward()
    assert len(registered) == len(set(registered)) == 8  # one per layer's output node
    assert len([r for r in cap.regions if r.name.endswith(".backward")]) == 9


# -- Transformer fast path ---------------------------------------------------------------------
FAST_OP = "aten::_transformer_encoder_layer_fwd"


def _profiled_ops(model: nn.Module, x: torch.Tensor) -> Counter[str]:
    """How often each operator (and record_function range) ran in one inference call."""
    with torch.no_grad(), torch.profiler.profile(activities=[
            torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    return Counter(e.name for e in prof.events())


def test_transformer_encoder_keeps_its_fast_path():
    torch.manual_seed(0)
    enc = encoder(32, 2, 4).eval()
    x = torch.randn(2, 16, 32)
    assert _profiled_ops(enc, x)[FAST_OP] == 2  # one per layer
    with capture() as cap, instrument_module(enc) as h:
        ops = _profiled_ops(enc, x)
    assert ops[FAST_OP] == 2
    assert h.wrapped == ["TransformerEncoder", "TransformerEncoder.layers.0",
                         "TransformerEncoder.layers.1"]
    assert "TransformerEncoder.layers.0.self_attn" in h.skipped
    assert h.hooked == []  # kept, empty: every module is wrapped
    names = [r.name for r in cap.regions]
    assert names == ["TransformerEncoder.layers.0", "TransformerEncoder.layers.1",
                     "TransformerEncoder"]
    assert "TransformerEncoder.layers.0" in ops  # our regions are in the profile too
    # what the test guards against: one ordinary hook inside a layer turns the fast path off
    handle = enc.layers[0].linear1.register_forward_hook(lambda *a: None)
    try:
        assert _profiled_ops(enc, x)[FAST_OP] == 1
    finally:
        handle.remove()


def test_encoder_inside_a_model_and_its_backward():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 32)
            self.enc = encoder(32, 2, 4)
            self.head = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.embed(x)))

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 5, 8)
    with capture() as cap, instrument_module(model) as h:
        model(x).sum().backward()
        model.eval()
        assert _profiled_ops(model, x)[FAST_OP] == 2
    assert "Model.enc.layers.0" in h.wrapped
    assert "Model.embed" in h.wrapped
    by_id = _by_id(cap.regions)
    layer = cap.named("Model.enc.layers.1")[0]
    assert by_id[layer.parent_span_id].name == "Model.enc"
    bwd = cap.named("Model.enc.layers.0.backward")
    assert len(bwd) == 1
    assert by_id[bwd[0].parent_span_id].name == "Model.enc.backward"


# -- torch.compile -----------------------------------------------------------------------------
@pytest.mark.initializes_cuda
def test_instrumented_model_compiles_to_one_graph():
    model, x = _net()
    with instrument_module(model):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0


def test_compiled_instrumented_model_runs_and_records_nothing_inside():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    model, x = _net()
    expected = model(x)
    with capture() as cap, instrument_module(model):
        compiled = torch.compile(model, backend=backend)
        out = compiled(x)
        out2 = compiled(x)
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert torch.allclose(out, expected)
    assert torch.allclose(out2, expected)
    assert cap.regions == []


# -- submodules ride on their model's region (RegionSpec.open_inner) ---------------------------
class _Seen(nn.Module):
    """A submodule that notes the current span and its span context while it runs, and opens
    a perfsdk region and, with a tracer, an OpenTelemetry span inside."""

    def __init__(self, tracer=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tracer = tracer
        self.seen: list[tuple[object, int]] = []
        self.user_parent: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        span = current_span()
        self.seen.append((span, span.get_span_context().span_id))
        with perfsdk.timed_region("inside"):
            if self.tracer is not None:
                with self.tracer.start_as_current_span("user.inside") as user:
                    self.user_parent.append(user.parent.span_id)
            return self.lin(x)


@pytest.mark.usefixtures("no_cuda")  # a region with device events gives its child one too
def test_a_submodule_rides_on_its_model_region_and_stands_as_the_parent():
    """A child module gets no Region of its own: its model's region stays the current span and
    stands for it (its span context is the child's), so what runs inside nests under it."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("user")  # a private provider: nothing global changes
    model = nn.Sequential(_Seen(tracer), nn.ReLU())
    with capture() as cap, instrument_module(model):
        model(torch.ones(2, 4))
    child = cap.named("Sequential.0")[0]
    root = cap.named("Sequential")[0]
    (span, seen_id), = model[0].seen
    assert type(span) is Region  # the model's region...
    assert span.span_id == root.span_id
    assert seen_id == child.span_id  # ... standing for the child
    assert child.span_id != root.span_id
    assert span.inner_id == 0  # and no longer, once the child returned
    inside = cap.named("inside")[0]
    assert inside.parent_span_id == child.span_id
    assert model[0].user_parent == [inside.span_id]
    lin = cap.named("Sequential.0.lin")[0]
    assert lin.parent_span_id == inside.span_id  # under the region that was current
    assert cap.named("Sequential.1")[0].parent_span_id == root.span_id
    assert {r.trace_id for r in cap.regions} == {root.trace_id}
    assert {r.thread_id for r in cap.regions} == {root.thread_id}
    for r in (child, inside, lin):
        assert _inside(r, root)


def test_submodules_get_regions_of_their_own_where_a_region_is_needed():
    """Under torch.profiler (record_function ranges) and with memory readings, every module's
    region is a full Region: the profiler sees each module, each carries its memory."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with instrument_module(model), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.ones(2, 4))
    names = Counter(e.name for e in prof.events())
    assert names["Sequential.0"] == names["Sequential.1"] == names["Sequential"] == 1
    perfsdk.configure(memory=True)
    try:
        with capture() as cap, instrument_module(model):
            model(torch.ones(2, 4))
    finally:
        perfsdk.configure(memory=False)
    assert len(cap.regions) == 3
    assert all(r.memory is not None for r in cap.regions)


def test_a_submodule_that_raises_closes_with_the_error_and_restores_its_model_region():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    with capture() as cap, instrument_module(model):
        with pytest.raises(ValueError, match="boom"):
            model(torch.ones(2, 4))
        with perfsdk.timed_region("after"):
            pass
    boom, root = cap.named("Sequential.1")[0], cap.named("Sequential")[0]
    assert isinstance(boom.error, ValueError)
    assert isinstance(root.error, ValueError)
    assert boom.parent_span_id == root.span_id
    assert cap.named("after")[0].parent_span_id == 0


# -- backward hooks through the output tensor ---------------------------------------------------
def test_user_hooks_on_a_module_output_see_the_gradients_torch_gives_them():
    """perfsdk hooks a module's output tensor as Tensor.register_hook does; hooks the user adds
    to that tensor (before, inside forward, or after) still run, get the same gradients as
    without perfsdk, and can be removed."""
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.inside: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x) * 3
            y.register_hook(lambda g: self.inside.append(g.clone()))  # before perfsdk's
            return y

    def run(instrument: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(Hooked(), nn.ReLU(), nn.Linear(4, 2))
        after: list[torch.Tensor] = []
        removed: list[torch.Tensor] = []
        with capture() as cap, (instrument_module(model) if instrument
                                else contextlib.nullcontext()):
            x = torch.randn(3, 4, requires_grad=True)
            hidden = model[1](model[0](x))
            out = model[2](hidden)
            hidden.register_hook(lambda g: after.append(g.clone()))  # after perfsdk's
            model[2](hidden).sum()  # another use, not backpropagated
            handle = out.register_hook(lambda g: removed.append(g))
            handle.remove()
            (out * torch.arange(2.0)).sum().backward()
        if instrument:
            names = Counter(r.name for r in cap.regions)
            assert names["Sequential.0.backward"] == names["Sequential.1.backward"] == 1
            assert names["Sequential.2.backward"] == 1
        assert removed == []
        assert x.grad is not None
        return model[0].inside, after, x.grad

    inside, after, grad = run(True)
    inside0, after0, grad0 = run(False)
    assert len(inside) == len(after) == 1
    torch.testing.assert_close(inside, inside0)
    torch.testing.assert_close(after, after0)
    torch.testing.assert_close(grad, grad0)


def test_wrappers_keep_the_fast_call_path_the_signature_and_come_out_again():
    """No hooks: nn.Module.__call__ keeps its fast path; inspect.signature still sees the
    module's own forward (HF's Trainer reads it to pick input columns); remove() restores."""
    import inspect

    model = SimpleNet(image_size=8)
    before = inspect.signature(model.forward)
    with instrument_module(model) as handle:
        for m in model.modules():
            assert not m._forward_pre_hooks
            assert not m._forward_hooks
            assert not m._backward_hooks
        assert inspect.signature(model.forward) == before
        assert inspect.signature(model.conv1.forward) == inspect.signature(
            nn.Conv2d.forward.__get__(model.conv1))
        assert handle.wrapped == handle.regions
        assert handle.hooked == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_hooked_nodes_are_forgotten_after_the_outermost_tracked_call():
    """Only some submodules instrumented (the model's own forward is not): the nodes hooked in
    a forward are still let go when the outermost instrumented call returns, or raises."""
    import perfsdk.auto.backward as bwd

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with capture() as cap, instrument_module(model, include=["0", "2"]):
        for _ in range(3):
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()
            assert bwd._tls.nodes == {}
        with pytest.raises(RuntimeError):
            model[0](torch.ones(2, 5, requires_grad=True))  # wrong width: forward raises
        assert bwd._tls.nodes == {}
    names = Counter(r.name for r in cap.regions)
    assert names["Sequential.0"] == 4
    assert names["Sequential.2"] == 3
    assert names["Sequential.0.backward"] == names["Sequential.2.backward"] == 3


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_submodules_are_left_alone_and_a_scripted_model_is_refused():
    """Scripted code calls its submodules itself, past any Python wrapper (and the class of a
    scripted module has no plain ``forward`` to wrap): they get no region, and are listed."""
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = nn.Sequential(scripted, nn.ReLU())
    with capture() as cap, instrument_module(model) as h:
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert h.regions == ["Sequential", "Sequential.1"]
    assert h.skipped == ["Sequential.0", "Sequential.0.0", "Sequential.0.1"]
    assert Counter(r.name for r in cap.regions) == Counter({
        "Sequential": 1, "Sequential.1": 1, "Sequential.backward": 1,
        "Sequential.1.backward": 1})
    with pytest.raises(ValueError, match=r"(?s)model=.*not TorchScript modules"):
        instrument_module(scripted)


def test_remove_leaves_a_forward_wrapped_after_ours_in_place_and_ours_passes_through():
    """Code that wraps ``module.forward`` after instrument_module (accelerate's hooks do) keeps
    its wrapper when ours is removed; ours, still inside its chain, records nothing more."""
    model = nn.Sequential(nn.Linear(4, 4))
    layer = model[0]
    calls = []
    with capture() as cap:
        handle = instrument_module(model)
        ours = layer.forward

        def theirs(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return ours(*args, **kwargs)

        layer.forward = theirs
        model(torch.ones(2, 4))
        handle.remove()
        assert layer.forward is theirs
        assert "forward" not in model.__dict__  # the model's own wrapper is gone
        model(torch.ones(2, 4))
    assert calls == [1, 1]
    assert Counter(r.name for r in cap.regions) == Counter(
        {"Sequential": 1, "Sequential.0": 1})


def test_a_data_parallel_replica_runs_its_own_forward_on_its_own_parameters():
    """nn.DataParallel copies a module's __dict__ into each replica (replicate() on a GPU
    each step): the replica's forward wrapper must run the replica, not the original."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.ones(2, 4)
    with capture() as cap, instrument_module(model):
        replica = model._replicate_for_data_parallel()
        layer = model[0]._replicate_for_data_parallel()
        replica._modules["0"] = layer
        replica._modules["1"] = model[1]._replicate_for_data_parallel()
        layer.weight = torch.zeros(4, 4)  # what replicate() does: the replica's own tensors
        layer.bias = torch.full((4,), 2.0)
        out = replica(x)
        assert torch.equal(out, torch.full((2, 4), 2.0))  # the replica's weights, not the model's
        assert not torch.equal(model(x), out)
    names = Counter(r.name for r in cap.regions)
    assert names["Sequential.0"] == names["Sequential"] == 2  # replica and model both timed
    assert "forward" not in model[0].__dict__
    assert "_replicate_for_data_parallel" not in model[0].__dict__


def test_on_a_gpu_every_module_gets_its_device_time(fake_cuda):
    """Where the region a submodule would ride on has device events (CUDA initialized), each
    submodule gets a Region of its own, with its device time from its own events."""
    class Work(nn.Module):
        def __init__(self, ms: float) -> None:
            super().__init__()
            self.ms = ms

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fake_cuda.launch(self.ms)
            return x

    model = nn.Sequential(Work(2.0), Work(3.0))
    with capture() as cap, instrument_module(model, backward=False):
        model(torch.ones(2))
        fake_cuda.advance(5.0)
        perfsdk.flush()
    device = {r.name: r.device_ms for r in cap.regions}
    assert device == {"Sequential": 5.0, "Sequential.0": 2.0, "Sequential.1": 3.0}
    assert fake_cuda.sync_calls == []
