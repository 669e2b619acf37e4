"""GPU telemetry wiring: start the NVML sampler when the application has initialized CUDA, hold
each finished region until the sampler has read past its end, and give spans and gauges their
readings. Everything here runs on the pipeline thread; the caller's hot path never sees NVML."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from perfsdk import _device
from perfsdk.config import get_config
from perfsdk.nvml import GpuSampler
from perfsdk.pipeline import PIPELINE

__all__ = ["TELEMETRY", "GpuTelemetry"]


class GpuTelemetry:
    """A pipeline sink (for shutdown and fork) plus a per-round hook (to start sampling)."""

    def __init__(self) -> None:
        self.nvml: Any = None  # None: nvidia-ml-py; tests put a FakeNvml here
        self.device_uuids: Callable[[], list[str]] | None = None
        self.clock: Callable[[], int] | None = None
        self.sampler: GpuSampler | None = None
        self.window: Callable[[int, int], dict[str, Any]] | None = None
        """While sampling: GPU readings over a region's host window (span attributes)."""
        self._interval = 0.0
        self._gave_up = False
        self._lock = threading.Lock()  # ticks come from the pipeline thread and from tests

    def tick(self) -> None:
        with self._lock:
            self._tick()

    def _tick(self) -> None:
        interval = get_config().gpu_sample_interval_s
        if self.sampler is not None and interval != self._interval:
            self._stop(2.0)  # the interval changed: start again with the new one
            self._gave_up = False
        if self.sampler is not None or self._gave_up or interval <= 0:
            return
        if not _device.initialized():  # perfsdk never initializes CUDA itself
            return
        if self.nvml is None and not isinstance(_device.get_backend(), _device.TorchCuda):
            return  # a fake device (perfsdk.testing) has no real GPU for NVML to read
        options: dict[str, Any] = {"nvml": self.nvml, "device_uuids": self.device_uuids}
        if self.clock is not None:
            options["clock"] = self.clock
        sampler = GpuSampler(interval, **options)
        if not sampler.start():  # no NVML library or driver: warned once, never retried
            self._gave_up = True
            return
        self.sampler, self._interval = sampler, interval
        PIPELINE.gate = sampler.ready
        self.window = sampler.window

    def latest(self) -> dict[int, dict[str, float]]:
        return {} if self.sampler is None else self.sampler.latest()

    def _stop(self, timeout: float) -> None:
        sampler, self.sampler = self.sampler, None
        PIPELINE.gate = None
        self.window = None
        if sampler is not None:
            sampler.stop(timeout)

    def reset(self) -> None:
        """Forget everything (tests); the next round may start a sampler again. Waits for a
        round's tick under way, which could otherwise start a sampler from what it read before
        (a test's fake NVML) just after this cleared it."""
        with self._lock:
            self._stop(2.0)
            self._gave_up = False
            self.nvml = self.device_uuids = self.clock = None

    # -- the pipeline sink protocol --------------------------------------------------------
    def consume(self, records: list[Any]) -> None:
        pass

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        self._stop(timeout)

    def after_fork(self) -> None:
        self.sampler = None  # the sampler stops itself in a forked child
        PIPELINE.gate = None
        self.window = None
        self._gave_up = False


TELEMETRY = GpuTelemetry()
"""The process's GPU telemetry; :mod:`perfsdk.lifecycle` registers it with the pipeline."""
