"""instrument_module's ranges as an NVTX tool receives them (the recording injection library):
forward ranges pushed and popped, nested like the modules; backward ranges started and ended
(they may interleave with other tasks), one per module per pass; and every range closed, also
when a backward pass raised, once the model's next forward call cleans up."""

from __future__ import annotations

import textwrap
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.nvtx_injection.recorder import ranges, run_with_recorder, start_end_ranges

pytestmark = pytest.mark.skipif(find_spec("nvtx") is None, reason="nvtx package not installed")

SCENARIO = """
import torch
from torch import nn

import perfsdk


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


class Gate(nn.Module):
    fail = False

    def forward(self, x):
        return Fails.apply(x) if self.fail else x + 0


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), Gate())
x = torch.randn(2, 4)
with perfsdk.instrument_module(model):
    model(x).sum().backward()
    model[3].fail = True
    try:
        model(x).sum().backward()
    except RuntimeError:
        pass
    model[3].fail = False
    model(x).sum().backward()  # closes what the failed pass left open, first
perfsdk.flush()
"""

NAMES = ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2", "Sequential.3"]


@pytest.fixture(scope="module")
def events(nvtx_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    found = run_with_recorder(textwrap.dedent(SCENARIO), nvtx_lib,
                              tmp_path_factory.mktemp("nvtx_module"))
    assert any(e["kind"] == "init" for e in found), "the injection library was not loaded"
    return found


def test_forward_ranges_are_pushed_popped_and_nest_like_the_modules(events):
    rs = ranges(events)  # raises on any unbalanced push/pop
    assert Counter(r["message"] for r in rs) == {name: 3 for name in NAMES}
    for r in rs:
        if r["message"] != "Sequential":
            assert r["path"] == ("Sequential", r["message"]), r


def test_backward_ranges_are_started_and_ended_once_per_module_per_pass(events):
    rs = start_end_ranges(events)  # raises on any range started and never ended
    counts = Counter(r["message"] for r in rs)
    # the failed pass: only the Gate's output node ran (and raised) before the error, so the
    # model's and the Gate's backward ranges opened; the next forward call ended them
    assert counts == {"Sequential.backward": 3, "Sequential.3.backward": 3,
                      "Sequential.2.backward": 2, "Sequential.1.backward": 2,
                      "Sequential.0.backward": 2}
    assert all(r["domain"] == "perfsdk" for r in rs)
