"""On a real GPU: apply_cuda_graphs captures one graph per input signature after a warm-up on a
side stream, replays it without running the model's Python, and gives the eager results; calls
that need gradients run eagerly with the eager gradients; an evicted signature is captured
again. (tests/unit/test_optimize_cuda_graphs.py checks the same logic on the fake device; the
speed check is its gpu test.)

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from perfsdk.errors import PerfSDKWarning
from perfsdk.optimize import fallbacks
from perfsdk.optimize.cuda_graphs import apply_cuda_graphs
from perfsdk.testing import capture

pytestmark = pytest.mark.gpu


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)
        self.streams: list[torch.cuda.Stream] = []  # the current stream at each Python forward

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.streams.append(torch.cuda.current_stream())
        return self.fc2(torch.relu(self.fc1(x))) * scale


def pair(cls: type[Net] = Net, **kwargs) -> tuple[Net, Net]:
    """A graphed ``cls`` on the GPU and an eager copy of it."""
    torch.manual_seed(0)
    eager = cls().cuda()
    model = cls().cuda()
    model.load_state_dict(eager.state_dict())
    return apply_cuda_graphs(model, **kwargs), eager


def test_one_capture_per_shape_bucket_and_replays_equal_eager():
    model, eager = pair(warmup=2)
    default = torch.cuda.current_stream()
    buckets = (1, 4, 16)
    with torch.no_grad():
        for _ in range(3):
            for batch in buckets:
                x = torch.randn(batch, 32, device="cuda")
                torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 32, device="cuda")
        torch.testing.assert_close(model(x, 0.5), eager(x, 0.5), rtol=1e-5, atol=1e-5)
    runner = model._compiled_call_impl
    assert (runner.captures, runner.replays, len(runner.entries)) == (4, 10, 4)
    # Python forward ran only for the warm-ups and the captures: 4 signatures x (2 + 1)
    assert len(model.streams) == 4 * 3
    assert all(s != default for s in model.streams)  # warm-up and capture on side streams
    assert torch.cuda.current_stream() == default
    assert fallbacks(model) == {}


def test_replays_read_new_inputs_and_static_outputs_are_overwritten():
    model, eager = pair(clone_outputs=False)
    x1, x2 = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        out1 = model(x1)
        expected1 = out1.clone()
        out2 = model(x2)
        assert out2 is out1  # the graph's static output
        torch.testing.assert_close(out2, eager(x2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(expected1, eager(x1), rtol=1e-5, atol=1e-5)


def test_each_replay_is_a_timed_region_with_device_time():
    model, _ = pair()
    x = torch.randn(2, 32, device="cuda")
    with capture() as cap, torch.no_grad():
        for _ in range(4):
            model(x)
    replays = cap.named("cuda_graph.replay")
    assert len(replays) == 4
    assert all(r.device_ms is not None and r.device_ms >= 0 for r in replays)


def test_calls_that_need_gradients_run_eagerly_with_eager_gradients():
    model, eager = pair()
    x = torch.randn(4, 32, device="cuda")
    x_graphed, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    with pytest.warns(PerfSDKWarning, match="inference only"):
        out = model(x_graphed, 0.5)
    (out ** 2).sum().backward()
    (eager(x_eager, 0.5) ** 2).sum().backward()
    torch.testing.assert_close(x_graphed.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert model._compiled_call_impl.captures == 0
    with torch.no_grad():  # the same model, inference: graphed
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    assert model._compiled_call_impl.captures == 1


def test_an_evicted_signature_is_captured_again_and_still_right():
    model, eager = pair(max_shapes=1, warmup=1)
    xs = [torch.randn(n, 32, device="cuda") for n in (1, 2)]
    with torch.no_grad():
        for x in xs:  # the second evicts the first: once is no pattern yet
            torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
        with pytest.warns(PerfSDKWarning, match="input shapes keep changing"):
            out = model(xs[0])  # the second eviction: warned, once
        torch.testing.assert_close(out, eager(xs[0]), rtol=1e-5, atol=1e-5)
        for x in (xs[1], xs[0], xs[1]):
            torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    runner = model._compiled_call_impl
    assert (runner.captures, runner.evictions, len(runner.entries)) == (6, 5, 1)


def test_a_capture_that_syncs_falls_back_to_eager():
    class Syncs(Net):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            y = super().forward(x, scale)
            return y / (1 + 0 * y.abs().sum().item())  # .item(): not allowed in a capture

    model, eager = pair(Syncs)
    x = torch.randn(3, 32, device="cuda")
    with torch.no_grad(), pytest.warns(PerfSDKWarning, match="capturing Syncs failed"):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    assert list(fallbacks(model)) == ["cuda_graphs"]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(4, device="cuda")  # the device's random numbers still work


def test_a_capture_that_fails_leaves_the_stream_and_the_rng_working():
    """A capture that fails for a reason no warm-up shows (querying a stream while it
    captures): torch's graph exit raised before it restored the stream and ended its
    generators' capture (an H200 run: every later random op raised "Offset increment outside
    graph capture"); perfsdk puts both back."""
    class Queries(Net):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            torch.cuda.current_stream().query()  # not permitted while the stream captures
            return super().forward(x, scale)

    model, eager = pair(Queries)
    x = torch.randn(3, 32, device="cuda")
    with torch.no_grad(), pytest.warns(PerfSDKWarning, match="capturing Queries failed"):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    assert list(fallbacks(model)) == ["cuda_graphs"]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.randn(4, device="cuda").isfinite().all()
    assert torch.nn.Linear(8, 8, device="cuda").weight.isfinite().all()
