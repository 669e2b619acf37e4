"""The pending queue: finished regions wait here until their device time is known, then go to
the sinks (summary, spans, test captures) in the background.

The training thread only appends to a deque. A daemon thread wakes every ``interval`` seconds,
resolves the regions whose end event's ``query()`` says done and hands them to the sinks; the
rest wait for a later round. :meth:`Pipeline.flush` does the same on the caller's thread and
waits for what is still on the GPU (the user asked to flush); so does interpreter exit.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from perfsdk import _device, clocks
from perfsdk.errors import warn_once
from perfsdk.record import END, REGION, START, T1

__all__ = ["PIPELINE", "Pipeline", "Sink"]

CHUNK = 512
"""Records per hand-off to the sinks: spans built for one chunk die before the next is built,
so they never live long enough to be promoted to the old GC generation."""


class Sink(Protocol):
    """Where resolved records (see :mod:`perfsdk.record`) go."""

    def consume(self, records: list[Any]) -> None: ...
    def flush(self, timeout: float) -> None: ...
    def shutdown(self, timeout: float) -> None: ...


class Pipeline:
    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.sinks: list[Sink] = []
        self.gate: Callable[[int], bool] | None = None
        """Holds back a record until ``gate(record end, perf_counter ns)`` is true."""
        self.on_round: list[Callable[[], None]] = []
        """Called on the pipeline thread before each round (e.g. to start the GPU sampler)."""
        self.started = False
        self._init_state()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _init_state(self) -> None:
        self._queue: deque[Any] = deque()
        self._waiting: list[Any] = []
        self._drain_lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.started = False

    # -- the hot path ----------------------------------------------------------------------
    def submit(self, record: Any) -> None:
        self._queue.append(record)

    def poke(self) -> None:
        """At a region's exit on the GPU: if the oldest region still waiting for the GPU is done,
        wake the background thread now instead of at its next interval. One ``query()``."""
        waiting = self._waiting
        if waiting:
            try:
                done = waiting[0][END].query()
            except Exception:  # the list changed under us, or CUDA trouble: the poller copes
                return
            if done:
                self._wake.set()

    # -- background ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread; run once per process, at the first region's enter,
        on the caller's thread (so sinks set up exporters before any user span is opened)."""
        with self._drain_lock:
            if self._thread is not None or self._stopping:
                return
            thread = threading.Thread(target=self._run, name="perfsdk-pipeline", daemon=True)
            self._thread = thread
            self.started = True
        thread.start()
        if multiprocessing.parent_process() is not None:
            # A multiprocessing child (e.g. a DataLoader worker) ends with os._exit(), which
            # skips atexit; multiprocessing's own finalizers still run, so flush there.
            multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)
        for sink in list(self.sinks):
            prepare = getattr(sink, "prepare", None)
            if prepare is not None:
                try:
                    prepare()
                except Exception as exc:
                    warn_once(f"prepare:{type(sink).__name__}",
                              f"perfsdk: setting up {type(sink).__name__} failed ({exc!r}).")

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stopping:
                for hook in self.on_round:
                    try:
                        hook()
                    except Exception as exc:  # never break the program
                        warn_once(f"round:{getattr(hook, '__name__', hook)}",
                                  f"perfsdk: background task failed ({exc!r}).")
                self.drain(wait=False)

    def wake(self) -> None:
        self._wake.set()

    @property
    def pending(self) -> int:
        """Regions not yet handed to the sinks (queued or waiting for the GPU)."""
        return len(self._queue) + len(self._waiting)

    def drain(self, wait: bool, timeout: float = -1) -> int:
        """Hand every resolvable record to the sinks; with ``wait``, wait for the GPU first.

        With a ``timeout`` (seconds), give up if another drain (a slow exporter) holds the
        pipeline that long.
        """
        if not self._drain_lock.acquire(timeout=timeout):
            warn_once("drain-timeout", f"perfsdk: an exporter kept the pipeline busy for more "
                      f"than {timeout:g} s; {self.pending} regions were not exported.")
            return 0
        try:
            batch, self._waiting = self._waiting, []
            queue = self._queue
            while queue:
                batch.append(queue.popleft())
            ready: list[Any] = []
            gate = self.gate
            for rec in batch:
                if gate is not None and not wait and not gate(rec[T1]):
                    self._waiting.append(rec)  # e.g. the GPU sampler has not passed its end yet
                elif rec[END] is None:
                    ready.append(rec)
                else:
                    resolved = self.resolve(rec, wait)
                    if resolved is None:
                        self._waiting.append(rec)
                    else:
                        ready.append(resolved)
            del batch
            for i in range(0, len(ready), CHUNK):
                self._deliver(ready[i:i + CHUNK])
            return len(ready)
        finally:
            self._drain_lock.release()

    def _deliver(self, records: list[Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.consume(records)
            except Exception as exc:
                warn_once(f"sink:{type(sink).__name__}",
                          f"perfsdk: {type(sink).__name__} failed ({exc!r}); "
                          "continuing without it for these regions.")

    def resolve(self, rec: Any, wait: bool) -> Any:
        """The record with its device time once its end event is done (or, with ``wait``, after
        waiting for that event only, never a device-wide sync); None while the GPU is busy."""
        region = rec[REGION]
        if not self.resolve_region(region, wait):
            return None
        pool = clocks.event_pool(_device.get_backend())
        pool.put(rec[START])
        pool.put(rec[END])
        return (*rec[:START], None, None, None, region.device_ms)

    def resolve_region(self, region: Any, wait: bool) -> bool:
        """Fill in ``region.device_ms`` if its end event is done; False while it is not."""
        if region.resolved:
            return True
        with self._resolve_lock:
            if region.resolved:
                return True
            start, end = region.start_event, region.end_event
            try:
                if not end.query():
                    if not wait:
                        return False
                    end.synchronize()
                region.device_ms = start.elapsed_time(end)
            except Exception as exc:
                warn_once("device-timing", f"perfsdk: could not read CUDA event timing "
                          f"({exc!r}); device_ms is left empty.")
            region.resolved = True
            return True

    def flush(self, timeout: float) -> None:
        self.drain(wait=True, timeout=timeout)
        for sink in list(self.sinks):
            try:
                sink.flush(timeout)
            except Exception as exc:
                warn_once(f"flush:{type(sink).__name__}",
                          f"perfsdk: flushing {type(sink).__name__} failed ({exc!r}).")

    def shutdown(self, timeout: float) -> None:
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
        self.drain(wait=True, timeout=timeout)
        self.started = False
        for sink in list(self.sinks):
            try:
                sink.shutdown(timeout)
            except Exception as exc:
                warn_once(f"shutdown:{type(sink).__name__}",
                          f"perfsdk: shutting down {type(sink).__name__} failed ({exc!r}).")
        self._stopping = False

    def _after_fork(self) -> None:
        # The child has no pipeline thread and must not re-export the parent's regions.
        self._init_state()
        for sink in self.sinks:
            after_fork = getattr(sink, "after_fork", None)
            if after_fork is not None:
                after_fork()


PIPELINE = Pipeline()


def _at_exit() -> None:
    from perfsdk.config import get_config

    PIPELINE.shutdown(get_config().export_timeout_s)


atexit.register(_at_exit)
