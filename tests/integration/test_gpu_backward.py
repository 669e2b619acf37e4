"""instrument_module's backward regions where autograd really runs them. On a GPU the engine
runs CUDA nodes on its own per-device thread, not the thread that called ``backward()``: the
node hooks behind the regions fire there, with that thread's region stack. Each test runs on
the CPU (the calling thread) and on CUDA (autograd's device thread, ``gpu``-marked): regions
are counted once per pass, nest inside the root module's backward, close at the end of their
own pass even when one output got no gradient, and carry device time on the GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import perfsdk
from perfsdk.auto import instrument_module
from perfsdk.testing import capture

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Two(nn.Module):
    """Two outputs; the model uses only the first for its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = Two()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.two(x)
        return self.head(a), b


def _inside(inner, outer) -> bool:
    return outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns


@pytest.mark.parametrize("device", DEVICES)
def test_backward_regions_are_counted_and_nest_on_the_engines_thread(device):
    torch.manual_seed(0)
    model = Net().to(device)
    x = torch.randn(16, 32, device=device)
    with capture() as cap, instrument_module(model):
        for _ in range(3):
            model(x).sum().backward()
    children = ["Net.fc1.backward", "Net.act.backward", "Net.fc2.backward"]
    roots = cap.named("Net.backward")
    assert len(roots) == 3
    for name in children:
        assert len(cap.named(name)) == 3, name
    by_id = {r.span_id: r for r in roots}
    for name in children:
        for r in cap.named(name):
            assert r.parent_span_id in by_id, name
            assert _inside(r, by_id[r.parent_span_id]), name
    for fc2, fc1 in zip(cap.named("Net.fc2.backward"), cap.named("Net.fc1.backward"),
                        strict=True):
        assert fc2.end_ns <= fc1.start_ns  # backward runs in reverse
    main = threading.get_ident()
    backward = [*roots, *(r for name in children for r in cap.named(name))]
    forward = cap.named("Net")
    assert {r.thread_id for r in forward} == {main}
    if device == "cuda":
        # autograd's device thread ran them, and CUDA events timed them there
        assert main not in {r.thread_id for r in backward}
        assert all(r.device_ms is not None and r.device_ms >= 0 for r in backward)
        assert all(r.device_ms > 0 for r in roots)
    else:
        assert {r.thread_id for r in backward} == {main}


@pytest.mark.parametrize("device", DEVICES)
def test_a_region_whose_output_got_no_gradient_closes_with_its_pass(device):
    torch.manual_seed(0)
    model = Branchy().to(device)
    x = torch.randn(8, 32, device=device)
    with capture() as cap, instrument_module(model):
        for _ in range(3):
            out, _unused = model(x)
            out.sum().backward()
    two = cap.named("Branchy.two.backward")
    forwards = cap.named("Branchy")
    assert len(two) == 3
    assert len(cap.named("Branchy.head.backward")) == 3
    for i in range(2):  # closed by its own pass's end, not by the next forward call
        assert two[i].end_ns <= forwards[i + 1].start_ns


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason="expected on a GPU: the engine's device thread does not see the caller's "
               "current region (contextvars are per thread), so the backward regions start a "
               "trace of their own; remove this mark once perfsdk/auto/backward.py carries "
               "the caller's context over")]),
])
def test_backward_regions_nest_under_the_region_that_called_backward(device):
    torch.manual_seed(0)
    model = Net().to(device)
    x = torch.randn(16, 32, device=device)
    with capture() as cap, instrument_module(model):
        out = model(x)
        with perfsdk.timed_region("train.backward"):
            out.sum().backward()
    [outer] = cap.named("train.backward")
    [root] = cap.named("Net.backward")
    assert root.trace_id == outer.trace_id
    assert root.parent_span_id == outer.span_id
