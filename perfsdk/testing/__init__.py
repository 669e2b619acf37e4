"""Test helpers, for perfsdk's tests and for users' own: capture regions and spans in memory,
a fake CUDA device whose events complete when the test says so, a fake host clock that
moves only when the test says so, and the reference models (the course lab's ``SimpleNet``
and its synthetic images, a small Transformer encoder).

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
import time
from collections.abc import Iterator
from typing import Any

from perfsdk import _device, clocks, region
from perfsdk.config import get_config
from perfsdk.distributed import rank_attributes
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult, to_result
from perfsdk.testing.fake_cuda import (
    FakeCuda,
    FakeDeviceProperties,
    FakeEvent,
    FakeGraph,
    FakeStream,
)
from perfsdk.testing.fake_nvml import FakeGpu, FakeNvml
from perfsdk.testing.fake_tensor import FakeCudaTensor, FakePinnedTensor
from perfsdk.testing.models import SimpleNet, SyntheticImages, encoder, simplenet_inputs

__all__ = ["Capture", "FakeClock", "FakeCuda", "FakeCudaTensor", "FakeDeviceProperties",
           "FakeEvent", "FakeGpu", "FakeGraph", "FakeNvml", "FakePinnedTensor", "FakeStream",
           "SimpleNet", "SyntheticImages", "capture", "encoder", "reset", "simplenet_inputs",
           "use_fake_clock", "use_fake_cuda"]


class Capture:
    """Collects every region that resolves while it is active, and the span built from each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.regions: list[RegionResult] = []
        self.spans: list[Any] = []
        self.records: list[tuple[Any, ...]] = []
        """The record tuples themselves, as every sink gets them (``perfsdk.record``)."""
        self._resource: Any = None

    def consume(self, records: list[Any]) -> None:
        results = [to_result(r) for r in records]
        spans: list[Any] = []
        try:
            from perfsdk.export.otel import build_resource
            from perfsdk.export.spans import build_spans
        except ImportError:  # no OpenTelemetry SDK: regions only
            pass
        else:
            if self._resource is None:
                self._resource = build_resource(get_config())
            # As the span sink's exporters get them (compiled where it is built).
            spans = build_spans(records, self._resource, rank_attributes())
        with self._lock:
            self.regions.extend(results)
            self.spans.extend(spans)
            self.records.extend(records)

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


def reset() -> None:
    """Put perfsdk's process-wide state back as a fresh process has it, for a test's teardown:
    an open step is ended (and every step recorded again), every finished region is handed to
    the sinks, the settings are read from the environment again, the warn-once counts, the
    summary and the sync sites are cleared, and the GPU sampler is stopped (the next pipeline
    round starts one again if the application has initialized CUDA).

    Example:
        >>> import perfsdk
        >>> from perfsdk.testing import reset
        >>> with perfsdk.timed_region("before"):
        ...     pass
        >>> reset()
        >>> len(perfsdk.summary(show=False))
        0
    """
    from perfsdk import errors, lifecycle
    from perfsdk.auto.steps import STEPS
    from perfsdk.config import reset_from_env
    from perfsdk.gpu import TELEMETRY
    from perfsdk.sync import reset as reset_syncs

    STEPS.set_schedule(None)
    PIPELINE.drain(wait=True)
    TELEMETRY.reset()  # a sampler left running held later records and gave their spans readings
    reset_from_env()
    errors.reset_counts()
    lifecycle.SUMMARY.reset()
    reset_syncs()


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


class FakeClock:
    """A host clock (``perf_counter_ns``-like, in ns) that moves only when told to.

    Args:
        start_ns: its first reading (default: the real ``perf_counter_ns()`` now, so span
            timestamps stay near the present).
    """

    def __init__(self, start_ns: int | None = None) -> None:
        self.ns = time.perf_counter_ns() if start_ns is None else int(start_ns)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self.ns

    def advance(self, ms: float) -> None:
        """Move the clock ``ms`` milliseconds forward (what a sleep of that long would do)."""
        if not ms >= 0:
            raise ValueError(f"FakeClock.advance: ms={ms!r}; accepted values are >= 0")
        with self._lock:
            self.ns += round(ms * 1e6)


@contextlib.contextmanager
def use_fake_clock(clock: FakeClock | None = None) -> Iterator[FakeClock]:
    """Regions read their host time from a :class:`FakeClock` for the block, so host
    durations, span times and step rates are exactly what the test advanced, on any machine.

    Example:
        >>> import perfsdk
        >>> with use_fake_clock() as clock, capture() as cap:
        ...     with perfsdk.timed_region("load"):
        ...         clock.advance(20)  # stands in for 20 ms of work
        >>> cap.regions[0].host_ms
        20.0
    """
    clock = clock if clock is not None else FakeClock()
    PIPELINE.drain(wait=True)
    previous = region.set_host_clock(clock)
    try:
        yield clock
    finally:
        region.set_host_clock(previous)
