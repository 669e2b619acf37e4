"""On a real GPU: perfsdk.auto.capture() calls cudaProfilerStart before the first chosen step
and cudaProfilerStop after the last, through torch.cuda.profiler into the CUDA runtime, which
accepts both (the range ``nsys profile --capture-range=cudaProfilerApi`` records).

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from perfsdk import auto
from perfsdk.testing import capture

pytestmark = pytest.mark.gpu


class CountingRuntime:
    """The CUDA runtime module torch.cuda.profiler calls, with its profiler calls counted."""

    def __init__(self, real: Any, calls: list[tuple[str, int]]) -> None:
        self.real, self.calls = real, calls

    def cudaProfilerStart(self) -> Any:
        result = self.real.cudaProfilerStart()
        self.calls.append(("start", int(result)))
        return result

    def cudaProfilerStop(self) -> Any:
        result = self.real.cudaProfilerStop()
        self.calls.append(("stop", int(result)))
        return result


def test_capture_range_starts_and_stops_the_cuda_profiler(monkeypatch):
    x = torch.randn(256, 256, device="cuda")
    real = torch.cuda.cudart()
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda.profiler, "cudart", lambda: CountingRuntime(real, calls))
    steps = auto.Steps()
    rng = auto.capture(range(1, 3), tracker=steps)
    seen = []
    with capture() as cap:
        for _ in range(5):
            with steps.step():
                x = torch.tanh(x @ x)
                seen.append([what for what, _ in calls])
    torch.cuda.synchronize()
    assert calls == [("start", 0), ("stop", 0)]  # cudaSuccess both times
    assert seen == [[], ["start"], ["start"], ["start", "stop"], ["start", "stop"]]
    assert rng.calls == ["start", "stop"]
    assert rng not in steps.listeners
    assert len(cap.named("step")) == 5
    assert all(r.device_ms is not None for r in cap.named("step"))
