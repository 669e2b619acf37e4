"""apply_cuda_graphs on the fake device: capture once per input signature after a warm-up on a
side stream, replay with the inputs copied into static buffers, a bounded cache of signatures
with one warning when shapes keep changing, eager fallbacks, and the fake graph's own contract.
A gpu-marked test checks the real thing."""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch
from torch import nn

from perfsdk import _device
from perfsdk.errors import NoEffectWarning, PerfSDKWarning
from perfsdk.optimize import cuda_graphs, fallbacks
from perfsdk.optimize.compile import apply_compile
from perfsdk.optimize.cuda_graphs import apply_cuda_graphs
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import FakeCudaTensor, FakeGraph
from tests.signatures import assert_stands_in, params


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 16)
        self.fc2 = nn.Linear(16, 4)
        self.calls: list[object] = []  # the stream current at each Python-level forward
        self.stream_of = None

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.stream_of is not None:
            self.calls.append(self.stream_of())
        return self.fc2(torch.relu(self.fc1(x))) * scale


def cuda(t: torch.Tensor) -> torch.Tensor:
    return FakeCudaTensor(t)


def graphed(fake, **kwargs) -> tuple[MLP, MLP]:
    """A graphed MLP and an eager copy of it."""
    torch.manual_seed(0)
    eager = MLP()
    model = MLP()
    model.load_state_dict(eager.state_dict())
    model.stream_of = fake.current_stream
    kwargs.setdefault("device", "cuda")
    assert apply_cuda_graphs(model, **kwargs) is model
    return model, eager


def runner(model):
    return model._compiled_call_impl


def test_replays_follow_the_inputs_and_match_eager(fake_cuda):
    model, eager = graphed(fake_cuda)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        out1 = model(cuda(x1))
        out2 = model(cuda(x2))
        out3 = model(cuda(x1))
        expected1, expected2 = eager(x1), eager(x2)
    assert out1.device.type == "cuda"
    torch.testing.assert_close(out1.cpu(), expected1)
    torch.testing.assert_close(out2.cpu(), expected2)
    torch.testing.assert_close(out3.cpu(), expected1)
    torch.testing.assert_close(out1.cpu(), expected1)  # cloned: not overwritten by later calls
    r = runner(model)
    assert (r.captures, r.replays, fake_cuda.graphs_captured, fake_cuda.replays) == (1, 3, 1, 3)
    assert model.__dict__["_perfsdk_applied"]["cuda_graphs"] == {
        "max_shapes": 8, "warmup": 3, "clone_outputs": True, "device": "cuda"}


def test_warmup_runs_on_a_side_stream_and_replays_run_no_python(fake_cuda):
    model, _ = graphed(fake_cuda, warmup=2)
    with torch.no_grad():
        for _ in range(5):
            model(cuda(torch.randn(2, 8)))
    default = fake_cuda.default_stream
    warm1, warm2, capture = model.calls  # two warm-ups and the capture; replays skip forward()
    assert warm1 is warm2
    assert warm1 is not default
    assert capture is not default
    assert fake_cuda.current_stream() is default
    assert fake_cuda.sync_calls == ["synchronize"]  # the one torch.cuda.graph makes on entry


def test_without_warmup_no_side_stream(fake_cuda):
    model, eager = graphed(fake_cuda, warmup=0)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(cuda(x)).cpu(), eager(x))
    assert len(model.calls) == 1


def test_clone_outputs_false_returns_the_static_output(fake_cuda):
    model, eager = graphed(fake_cuda, clone_outputs=False)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        out1 = model(cuda(x1))
        torch.testing.assert_close(out1.cpu(), eager(x1))
        out2 = model(cuda(x2))
        assert out2 is out1  # the same memory, overwritten by the second call
        torch.testing.assert_close(out1.cpu(), eager(x2))


def test_one_graph_per_signature(fake_cuda):
    model, eager = graphed(fake_cuda)
    xs = [torch.randn(1, 8), torch.randn(5, 8), torch.randn(1, 8)]
    with torch.no_grad():
        outs = [model(cuda(x)) for x in xs]
        scaled = model(cuda(xs[0]), 2.0)  # a non-tensor argument is part of the signature
        kw = model(cuda(xs[0]), scale=2.0)  # and so is passing it by keyword
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out.cpu(), eager(x))
        torch.testing.assert_close(scaled.cpu(), eager(xs[0], 2.0))
        torch.testing.assert_close(kw.cpu(), eager(xs[0], 2.0))
        model(cuda(xs[0]).to(torch.float64).to(torch.float32))  # same signature again
    assert runner(model).captures == 4
    assert len(runner(model).entries) == 4


def test_changing_shapes_evict_and_warn_once(fake_cuda):
    model, eager = graphed(fake_cuda, max_shapes=2, warmup=1)
    r = runner(model)
    with torch.no_grad():
        for batch in (1, 2, 3):
            model(cuda(torch.randn(batch, 8)))
        assert (r.evictions, len(r.entries)) == (1, 2)
        with pytest.warns(PerfSDKWarning, match=r"input shapes keep changing .*max_shapes=2.*"
                                                r"pytorch#119640"):
            model(cuda(torch.randn(4, 8)))
        for batch in (5, 6, 1):  # no second warning
            x = torch.randn(batch, 8)
            torch.testing.assert_close(model(cuda(x)).cpu(), eager(x))
    assert (r.captures, r.evictions, len(r.entries)) == (7, 5, 2)
    assert list(k[1][0][0] for k in r.entries) == [(6, 8), (1, 8)]  # the two most recent


def test_recently_used_graphs_stay(fake_cuda):
    model, _ = graphed(fake_cuda, max_shapes=2, warmup=0)
    with torch.no_grad():
        a, b, c = (cuda(torch.randn(n, 8)) for n in (1, 2, 3))
        model(a)
        model(b)
        model(a)  # a is now the most recent: c evicts b
        model(c)
        model(a)
    assert runner(model).captures == 3


def test_calls_that_need_gradients_run_eagerly(fake_cuda):
    model, eager = graphed(fake_cuda)
    x = torch.randn(2, 8)
    with pytest.warns(PerfSDKWarning, match="inference only.*make_graphed_callables"):
        out = model(cuda(x))
    assert out.device.type == "cuda"
    out.sum().backward()
    assert model.fc1.weight.grad is not None
    assert runner(model).captures == 0
    model(cuda(x))  # warned once
    model.requires_grad_(False)  # nothing needs gradients: graphed even with grad mode on
    torch.testing.assert_close(model(cuda(x)).cpu(), eager(x).detach())
    assert runner(model).captures == 1


def test_eager_gradients_equal_plain_eager_gradients(fake_cuda):
    """The path for calls that need gradients, on fake CUDA tensors: the input's and every
    parameter's gradient are the plain eager ones, and nothing was captured or replayed."""
    model, eager = graphed(fake_cuda)
    x = torch.randn(4, 8)
    x_ref = x.clone().requires_grad_()
    x_fake = cuda(x.clone().requires_grad_())
    with pytest.warns(PerfSDKWarning, match="inference only"):
        out = model(x_fake, 0.5)
    assert out.device.type == "cuda"
    assert out.requires_grad
    (out ** 2).sum().backward()
    (eager(x_ref, 0.5) ** 2).sum().backward()
    assert x_fake.grad is not None
    assert x_fake.grad.device.type == "cuda"
    torch.testing.assert_close(x_fake.grad.cpu(), x_ref.grad)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    r = runner(model)
    assert (r.captures, r.replays, fake_cuda.graphs_captured) == (0, 0, 0)
    assert model.calls == [fake_cuda.default_stream]  # one eager call, on the caller's stream


def test_host_inputs_and_unhashable_arguments_run_eagerly(fake_cuda):
    model, eager = graphed(fake_cuda)
    x = torch.randn(2, 8)
    with torch.no_grad():
        with pytest.warns(PerfSDKWarning, match="an input is on cpu.*run eagerly"):
            torch.testing.assert_close(model(x), eager(x))
        model(cuda(x), scale=2)  # hashable: part of the signature
        with pytest.warns(PerfSDKWarning, match="type Unhashable"):
            out = model(cuda(x), Unhashable(2.0))
        torch.testing.assert_close(out.cpu(), eager(x, 2.0))
    assert runner(model).captures == 1


class Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: float) -> None:
        self.value = value

    def __rmul__(self, other):
        return other * self.value


def eager_and_graphed(cls: type[MLP]) -> tuple[MLP, MLP]:
    """An eager ``cls`` and a graphed copy with the same weights (on the CPU: fake CUDA)."""
    torch.manual_seed(0)
    eager = cls()
    model = cls()
    model.load_state_dict(eager.state_dict())
    apply_cuda_graphs(model, device="cuda")
    return eager, model


def test_a_failing_capture_falls_back_to_eager(fake_cuda):
    class Syncs(MLP):
        def forward(self, x, scale=1.0):
            y = super().forward(x, scale)
            return y / (1 + 0 * y.abs().sum().item())  # .item(): a host sync, not capturable

    eager, model = eager_and_graphed(Syncs)
    x = torch.randn(3, 8)
    with torch.no_grad():
        with pytest.warns(PerfSDKWarning, match=r"capturing Syncs failed \(RuntimeError: the "
                                                r"call synchronizes with the host \(1 time.*"
                                                r"running eagerly"):
            out = model(cuda(x))
        torch.testing.assert_close(out.cpu(), eager(x))
        torch.testing.assert_close(model(cuda(x)).cpu(), eager(x))  # eager, no new warning
    assert list(fallbacks(model)) == ["cuda_graphs"]
    assert isinstance(fallbacks(model)["cuda_graphs"], RuntimeError)
    # seen in the last warm-up call, with torch's debug mode: no capture was tried (on a GPU a
    # failed one left the capture stream current and the RNG broken), the mode is off again
    assert fake_cuda.graphs_captured == 0
    assert "synchronize" not in fake_cuda.sync_calls  # torch.cuda.graph's entry never ran
    assert fake_cuda.sync_debug_mode == 0
    assert fake_cuda.capturing is None
    assert fake_cuda.current_stream() is fake_cuda.default_stream


def test_a_capture_that_fails_puts_the_stream_and_the_rng_back(fake_cuda):
    """A capture that fails for another reason (querying an event, say): torch's graph exit
    leaves the capture stream current and the generators mid-capture; afterwards the stream is
    the caller's again and an empty capture has run torch's epilogue."""
    class Queries(MLP):
        def forward(self, x, scale=1.0):
            if fake_cuda.capturing is not None:  # not allowed while a stream is capturing
                fake_cuda.capturing._invalid = True
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return super().forward(x, scale)

    eager, model = eager_and_graphed(Queries)
    x = torch.randn(3, 8)
    with torch.no_grad():
        with pytest.warns(PerfSDKWarning, match=r"capturing Queries failed \(RuntimeError: .*"
                                                r"not permitted when stream is capturing; then "
                                                r"RuntimeError: .*running eagerly"):
            out = model(cuda(x))
        torch.testing.assert_close(out.cpu(), eager(x))
    assert list(fallbacks(model)) == ["cuda_graphs"]
    assert fake_cuda.current_stream() is fake_cuda.default_stream
    assert fake_cuda.capturing is None
    assert fake_cuda.graphs_captured == 1  # the empty one that puts the generators back


# dynamo meets the fake device's tensor subclass (torch's own warning; the compile fails anyway)
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning")
@pytest.mark.initializes_cuda
def test_fallbacks_sees_a_failed_compile_under_the_graphs(fake_cuda):
    def no_compiler(gm, example_inputs):
        raise RuntimeError("no compiler")

    torch.manual_seed(0)
    eager = MLP()
    model = MLP()
    model.load_state_dict(eager.state_dict())
    apply_cuda_graphs(apply_compile(model, backend=no_compiler), device="cuda")
    x = torch.randn(3, 8)
    with torch.no_grad():
        with pytest.warns(PerfSDKWarning, match="torch.compile failed for MLP"):
            out = model(cuda(x))  # the warm-up compiles, fails, runs eagerly; then the capture
        torch.testing.assert_close(out.cpu(), eager(x))
    failed = fallbacks(model)
    assert list(failed) == ["compile"]  # the graphs themselves work
    assert "no compiler" in str(failed["compile"])
    assert runner(model).captures == 1


def test_the_models_own_error_propagates(fake_cuda):
    model, _ = graphed(fake_cuda)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(cuda(torch.randn(2, 5)))  # raised by the eager warm-up
    assert fallbacks(model) == {}
    assert fake_cuda.current_stream() is fake_cuda.default_stream
    with torch.no_grad():
        model(cuda(torch.randn(2, 8)))
    assert runner(model).captures == 1


def test_each_replay_is_a_region(fake_cuda, captured):
    model, _ = graphed(fake_cuda)
    with torch.no_grad():
        for _ in range(3):
            model(cuda(torch.randn(2, 8)))
    fake_cuda.complete_all()
    PIPELINE.drain(wait=True)
    assert len(captured.named("cuda_graph.replay")) == 3


def test_autocast_is_part_of_the_signature_and_capture_disables_its_cache(fake_cuda,
                                                                          monkeypatch):
    seen = []
    state = [(True, torch.bfloat16)]
    monkeypatch.setattr(cuda_graphs, "_autocast_state", lambda device_type: state[0])
    real = cuda_graphs._capture_autocast
    monkeypatch.setattr(cuda_graphs, "_capture_autocast",
                        lambda device_type, dtype: seen.append((device_type, dtype)) or
                        real("cpu", None))
    model, _ = graphed(fake_cuda, warmup=1)
    x = cuda(torch.randn(2, 8))
    with torch.no_grad():
        model(x)
        model(x)
        state[0] = (False, None)
        model(x)
    assert seen == [("cuda", torch.bfloat16)] * 2 + [("cuda", None)] * 2
    assert runner(model).captures == 2
    with real("cpu", torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_cache_enabled()


def test_no_effect_on_cpu_or_without_cuda(fake_cuda):
    model = MLP()
    for kwargs, match in [({}, "is on cpu; CUDA graphs need a CUDA device"),
                          ({"device": "cpu"}, "is on cpu")]:
        with pytest.warns(NoEffectWarning, match=match):
            assert apply_cuda_graphs(model, **kwargs) is model
    with pytest.warns(NoEffectWarning, match="no parameters or buffers"):
        apply_cuda_graphs(nn.ReLU())
    fake_cuda.initialized = False
    with pytest.warns(NoEffectWarning, match="CUDA is not initialized"):
        apply_cuda_graphs(model, device="cuda")
    assert model._compiled_call_impl is None
    assert "_perfsdk_applied" not in model.__dict__


def test_no_effect_twice_or_with_reduce_overhead(fake_cuda):
    model, _ = graphed(fake_cuda)
    r = runner(model)
    with pytest.warns(NoEffectWarning, match="already applied"):
        apply_cuda_graphs(model, device="cuda")
    assert runner(model) is r
    other = apply_compile(MLP(), mode="reduce-overhead", backend="eager")  # never called
    guard = other._compiled_call_impl
    with pytest.warns(NoEffectWarning, match="reduce-overhead"):
        apply_cuda_graphs(other, device="cuda")
    assert other._compiled_call_impl is guard
    with pytest.warns(NoEffectWarning, match="already compiled"):
        apply_compile(model)  # compile first, then graph the compiled call
    assert runner(model) is r
    model.stream_of = None
    twin = copy.deepcopy(model)  # a copy keeps the marks, not the graphs (torch drops the
    assert twin._compiled_call_impl is None  # call wrapper): applying again is no mistake
    assert runner(apply_cuda_graphs(twin, device="cuda")) is not r


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_shapes": 0}, "max_shapes=0"), ({"max_shapes": True}, "max_shapes=True"),
    ({"warmup": -1}, "warmup=-1"), ({"clone_outputs": "yes"}, "clone_outputs='yes'"),
    ({"device": "gpu7"}, "device='gpu7'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_cuda_graphs(MLP(), **kwargs)
    with pytest.raises(ValueError, match=r"not an nn\.Module"):
        apply_cuda_graphs(lambda x: x)  # type: ignore[arg-type]


# -- the fake graph ---------------------------------------------------------------------------
def test_fake_capture_leaves_garbage_until_replay_and_skips_host_ops(fake_cuda):
    static = cuda(torch.ones(3))
    host = torch.ones(3)
    graph = fake_cuda.CUDAGraph()
    with fake_cuda.graph(graph):
        out = static * 2
        host_out = host * 2  # a CPU op: runs now, never again
    assert torch.isnan(out.cpu()).all()  # not computed yet, as on a GPU
    graph.replay()
    torch.testing.assert_close(out.cpu(), torch.full((3,), 2.0))
    torch.ops.aten.copy_.default(static, torch.full((3,), 5.0))  # (x.copy_ needs real CUDA)
    host.fill_(7.0)
    graph.replay()
    torch.testing.assert_close(out.cpu(), torch.full((3,), 10.0))
    torch.testing.assert_close(host_out, torch.full((3,), 2.0))


def test_fake_capture_refuses_syncs(fake_cuda):
    graph = fake_cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="previous error during capture"), \
            fake_cuda.graph(graph):
        fake_cuda.synchronize()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()
    assert fake_cuda.capturing is None


def test_fake_graph_matches_torch_cuda_graph():
    public = {name for name, value in vars(FakeGraph).items()
              if callable(value) and not name.startswith("_")}
    assert public == {"capture_begin", "capture_end", "replay", "reset", "pool"}
    for name in public:
        assert_stands_in(params(getattr(FakeGraph, name)),
                         params(getattr(torch.cuda.CUDAGraph, name)))
    assert params(FakeGraph.__init__, drop=("self", "fake")) == \
        params(torch.cuda.CUDAGraph.__new__)
    for name, value in vars(_device.Graph).items():
        if callable(value) and not name.startswith("_"):
            assert hasattr(FakeGraph, name)
            assert hasattr(torch.cuda.CUDAGraph, name)


# -- the real thing ---------------------------------------------------------------------------
def _median_ms(fn, iters=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@pytest.mark.gpu
def test_real_graphs_match_eager_and_replay_faster():
    torch.manual_seed(0)
    eager = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(64, 64), nn.ReLU())])
    eager = eager.cuda().eval()
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(64, 64), nn.ReLU())])
    model.load_state_dict(eager.state_dict())
    model = apply_cuda_graphs(model.cuda().eval())
    x = torch.randn(1, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 64, device="cuda")
            torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
        with torch.autocast("cuda", torch.float16):  # captured with the cast cache off
            torch.testing.assert_close(model(x), eager(x), rtol=1e-2, atol=1e-3)
        graphed_ms = _median_ms(lambda: model(x))
        eager_ms = _median_ms(lambda: eager(x))
    assert model._compiled_call_impl.captures == 2
    assert graphed_ms < eager_ms, (graphed_ms, eager_ms)
