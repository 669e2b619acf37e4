"""Test helpers, for perfsdk's tests and for users' own: capture regions and spans in memory,
and a fake CUDA device whose events complete when the test says so.

Example:
    >>> import perfsdk
    >>> from perfsdk.testing import capture
    >>> @perfsdk.profiled("double")
    ... def double(x):
    ...     return 2 * x
    >>> with capture() as cap:
    ...     _ = double(4)
    >>> [r.name for r in cap.regions], cap.spans[0].name
    (['double'], 'double')
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from perfsdk import _device, clocks
from perfsdk._fake_cuda import FakeCuda, FakeEvent, FakeGraph, FakeStream
from perfsdk._fake_tensor import FakeCudaTensor, FakePinnedTensor
from perfsdk.config import get_config
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult, to_result

__all__ = ["Capture", "FakeCuda", "FakeCudaTensor", "FakeEvent", "FakeGraph", "FakePinnedTensor",
           "FakeStream", "capture", "use_fake_cuda"]


class Capture:
    """Collects every region that resolves while it is active, and the span built from each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.regions: list[RegionResult] = []
        self.spans: list[Any] = []
        self._resource: Any = None

    def consume(self, records: list[Any]) -> None:
        results = [to_result(r) for r in records]
        spans: list[Any] = []
        try:
            from perfsdk.export.otel import build_resource, region_span
        except ImportError:  # no OpenTelemetry SDK: regions only
            pass
        else:
            if self._resource is None:
                self._resource = build_resource(get_config())
            spans = [region_span(r, self._resource) for r in records]
        with self._lock:
            self.regions.extend(results)
            self.spans.extend(spans)

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        pass

    def named(self, name: str) -> list[RegionResult]:
        """The captured regions called ``name``, in the order they resolved."""
        with self._lock:
            return [r for r in self.regions if r.name == name]

    def span(self, name: str) -> Any:
        """The one captured span called ``name`` (AssertionError if there are 0 or several)."""
        with self._lock:
            found = [s for s in self.spans if s.name == name]
        if len(found) != 1:
            raise AssertionError(f"expected one span {name!r}, found {len(found)}: "
                                 f"{sorted(s.name for s in self.spans)}")
        return found[0]


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Capture resolved regions and their spans until the block ends (then flushes)."""
    PIPELINE.drain(wait=True)  # regions from before the block are not captured
    cap = Capture()
    PIPELINE.sinks.append(cap)
    try:
        yield cap
    finally:
        try:
            PIPELINE.drain(wait=True)
        finally:
            PIPELINE.sinks.remove(cap)


@contextlib.contextmanager
def use_fake_cuda(fake: FakeCuda | None = None) -> Iterator[FakeCuda]:
    """Route perfsdk's device interface to a :class:`FakeCuda` for the block."""
    fake = fake if fake is not None else FakeCuda()
    previous = _device.set_backend(fake)
    try:
        yield fake
    finally:
        PIPELINE.drain(wait=True)
        _device.set_backend(previous)
        clocks.event_pool(previous)
