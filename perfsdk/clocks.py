"""Clocks: the anchored host clock and the pool of CUDA timing events.

Host durations come from ``perf_counter_ns``; span timestamps map them onto wall time through
one anchor taken at import, so no span has a negative or epoch-confused duration. Device
durations come from a start/end pair of CUDA events recorded on the current stream and read
only after the end event's ``query()`` reports it done: nothing here ever waits for the GPU.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from perfsdk import _device

__all__ = ["EventPool", "epoch_ns", "event_pool"]


def _anchor(tries: int = 5) -> int:
    """``time_ns() - perf_counter_ns()`` from the tightest of a few bracketed readings: a
    preemption between the two reads (a busy machine) would otherwise skew every timestamp."""
    best_width, best = -1, 0
    for _ in range(tries):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best_width < 0 or after - before < best_width:
            best_width, best = after - before, wall - (before + after) // 2
    return best


_ANCHOR_NS = _anchor()


def epoch_ns(perf_ns: int) -> int:
    """Wall-clock nanoseconds since the epoch for a ``perf_counter_ns`` reading."""
    return _ANCHOR_NS + perf_ns


class EventPool:
    """Reusable timing events, so a region costs no event allocation after warm-up."""

    def __init__(self, backend: _device.CudaBackend, limit: int = 4096) -> None:
        self.backend = backend
        self._free: deque[_device.Event] = deque()
        self._limit = limit
        self.created = 0

    def get(self) -> _device.Event:
        try:
            return self._free.pop()
        except IndexError:
            self.created += 1
            return self.backend.Event(enable_timing=True)

    def put(self, event: _device.Event) -> None:
        if len(self._free) < self._limit:
            self._free.append(event)

    @property
    def free(self) -> int:
        return len(self._free)


_lock = threading.Lock()
_pool: EventPool | None = None


def event_pool(backend: _device.CudaBackend) -> EventPool:
    """The pool for ``backend`` (a new one when the backend was swapped)."""
    global _pool
    pool = _pool
    if pool is None or pool.backend is not backend:
        with _lock:
            if _pool is None or _pool.backend is not backend:
                _pool = EventPool(backend)
            pool = _pool
    return pool
