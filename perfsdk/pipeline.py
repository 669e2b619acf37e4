"""The pending queue: finished regions wait here until their device time is known, then go to
the sinks (summary, trace file, metrics, the span export queues, test captures) in the
background.

The training thread only appends to a deque, at most :data:`MAX_PENDING` records; beyond that a
region still counts in the summary (calls, total, errors), and its span is counted as lost
(``queue_full``). A daemon thread wakes every ``interval`` seconds, resolves the regions whose
end event's ``query()`` says done and hands them to the sinks; the rest wait for a later round.
No sink exports or writes files on this thread either: spans go to bounded export queues with
threads of their own (:mod:`perfsdk.export.delivery`), the trace file to its writer thread.

Whoever waits (:meth:`Pipeline.flush`, :meth:`Pipeline.settle`, :meth:`Pipeline.shutdown`)
asks the pipeline thread to do the work and waits at most its timeout: the caller never
resolves, builds or exports anything itself. Exit (:func:`at_exit`) adds at most
``PERFSDK_EXPORT_TIMEOUT`` in total, and says on stderr how many spans were lost, and why.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any, Protocol

from perfsdk import _device, clocks
from perfsdk.errors import warn_once
from perfsdk.record import END, ERROR, REGION, SPEC, START, T0, T1

__all__ = ["FORK", "MAX_PENDING", "PIPELINE", "WORKER_EXIT_BUDGET", "Pipeline", "Sink",
           "chunk_for"]

CHUNK = 64
"""Records per hand-off to the sinks, where nobody waits for the GPU or for a rest (flush,
summary, exit); the pipeline thread's routine rounds size theirs by time (:data:`HOLD_S`)."""

HOLD_S = 0.0002
"""The work a routine round does between two rests: chunks are sized so that handing one to
the sinks takes about this long (measured, per round, from the chunk before: the sinks' cost
per record varies from under a microsecond to ten with metrics on), between :data:`MIN_CHUNK`
and :data:`MAX_CHUNK` records. The caller waits for the GIL at most about this long when it
wants it back in the middle of a chunk."""

MIN_CHUNK = 8
MAX_CHUNK = 512

PACE_S = 0.0002
"""The rest the pipeline thread takes after each chunk of a routine round. Python lets a thread
that wants the GIL wait up to its switch interval (5 ms) while a busy thread holds it; resting
between short chunks hands the GIL back at once, so the training thread waits about a chunk's
work at most, even when perfsdk's thread is saturated (it then falls behind instead, and the
bounded pending queue counts what it cannot take). Rounds that someone waits for (flush,
summary, exit) run without rests."""

POKE_GAP_S = 0.002
"""At most one wake-up of the pipeline thread by region exits in this many seconds. Woken at
every exit, it took the GIL from the training thread at every region: on an H200, a region
around a small kernel cost 44 us instead of 26 (a drain per region, each re-checking every
record that waits for the GPU sampler)."""

_rest = time.sleep
_clock = time.perf_counter
_monotonic = time.monotonic  # flush's deadline (a test injects a clock here)


def _gate_limit(gate: Callable[[int], bool], batch: list[Any]) -> int:
    """The latest end among ``batch``'s records that ``gate`` lets through (-1: none). The gate
    passes every end at or before one it passes, so a binary search over the ends asks it
    about log2(n) of them, not each record (a drain asked it about every waiting record: on an
    H200, 214,000 times for 2,000 regions)."""
    ends = sorted({rec[T1] for rec in batch})
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if gate(ends[mid]):
            lo = mid + 1
        else:
            hi = mid
    return ends[lo - 1] if lo else -1


def chunk_for(size: int, took: float) -> int:
    """The next chunk's size, after a chunk of ``size`` records took ``took`` seconds: about
    :data:`HOLD_S` of work, moving at most halfway there at once (one slow chunk, e.g. a
    garbage collection, does not shrink the next to nothing)."""
    if took <= 0:
        return min(MAX_CHUNK, size * 2)
    target = size * HOLD_S / took
    return max(MIN_CHUNK, min(MAX_CHUNK, round((size + target) / 2)))

MAX_PENDING = 65_536
"""Regions waiting for the pipeline thread at most (about 300 bytes each). Beyond it a region
is tallied for the summary only and its span counted as lost (``queue_full``)."""

WORKER_EXIT_BUDGET = 0.5
"""Seconds a multiprocessing child (a DataLoader worker) spends at most on its exit flush: a
worker's spans reach a healthy collector in milliseconds, and a down one must not stall every
epoch. Counted as lost (``shutdown``) past that."""


def shutdown_margin(timeout: float) -> float:
    """What a shutdown keeps of its budget for its bookkeeping after the waits: a tenth, at
    most a quarter of a second."""
    return min(0.1 * timeout, 0.25)


class _Fork:
    """The process's fork generation: a region entered in another generation (the parent) and
    exited in a forked child is the parent's, and the child never records it."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0


FORK = _Fork()


class Sink(Protocol):
    """Where resolved records (see :mod:`perfsdk.record`) go. ``consume`` runs on the pipeline
    thread and must not block (no export, no file I/O); ``flush`` and ``shutdown`` may wait
    for their own threads, at most ``timeout`` seconds."""

    def consume(self, records: list[Any]) -> None: ...
    def flush(self, timeout: float) -> None: ...
    def shutdown(self, timeout: float) -> None: ...


class _Ticket:
    """A request to the pipeline thread: drain (waiting for the GPU), then set ``done``."""

    __slots__ = ("done", "final")

    def __init__(self, final: bool) -> None:
        self.done = threading.Event()
        self.final = final


class Pipeline:
    # Two slots the compiled region paths read at their offsets on every region (no attribute
    # lookup); the rest live in the instance dict.
    __slots__ = ("__dict__", "__weakref__", "max_pending", "started")

    def __init__(self, interval: float = 0.05, *, max_pending: int = MAX_PENDING) -> None:
        self.interval = interval
        self.max_pending = max_pending
        self.sinks: list[Sink] = []
        self.gate: Callable[[int], bool] | None = None
        """Holds back a record until ``gate(record end, perf_counter ns)`` is true."""
        self.on_round: list[Callable[[], None]] = []
        """Called on the pipeline thread before each round (e.g. to start the GPU sampler)."""
        self.on_lost: Callable[[int, str], None] | None = None
        """Told how many regions never reached the sinks, and why (``queue_full``: the pending
        queue overflowed; ``shutdown``: still pending when exit's budget ran out); the span sink
        counts their spans as lost."""
        self.started = False
        self.queue: deque[Any] = deque()
        """The pending queue (see :meth:`submit`). The same object for the pipeline's lifetime
        (emptied, never replaced, in a forked child), so the region hot path appends to it
        directly, at most :attr:`max_pending` long, and hands the rest to :meth:`spill`."""
        self._init_state()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._await_set_up, after_in_child=self._after_fork)

    def _init_state(self) -> None:
        self.queue.clear()
        self._waiting: list[Any] = []
        self._overflow: dict[int, list[int]] = {}
        self._overflow_lock = threading.Lock()
        self.overflowed = 0
        self._drain_lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._wake = threading.Event()
        self._tickets: deque[_Ticket] = deque()
        self._in_hand = 0
        self._abandoned = 0
        self._chunk = CHUNK
        self._poked = -POKE_GAP_S
        self._hand_lock = threading.Lock()
        self._set_up = threading.Event()
        self._ready_hook = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.started = False

    # -- the hot path ----------------------------------------------------------------------
    def submit(self, record: Any) -> None:
        queue = self.queue
        if len(queue) < self.max_pending:
            queue.append(record)
        else:
            self.spill(record)

    def spill(self, record: Any) -> None:
        """The pending queue is full: tally the region for the summary (calls, host time,
        errors) and count its span as lost; never block, never grow."""
        with self._overflow_lock:
            tally = self._overflow.get(record[SPEC])
            if tally is None:
                tally = self._overflow[record[SPEC]] = [0, 0, 0]
            tally[0] += 1
            tally[1] += record[T1] - record[T0]
            tally[2] += record[ERROR] is not None
            self.overflowed += 1
        warn_once("pipeline-full", f"perfsdk: more than {self.max_pending:,} regions are "
                  "waiting for perfsdk's background thread; further regions count in the "
                  "summary (calls, total, errors) and the metric perfsdk.region.unrecorded, "
                  "but their spans are dropped and counted "
                  "(perfsdk.diagnostics()['spans_lost']['queue_full']).")

    def poke(self) -> None:
        """At a region's exit on the GPU: if the oldest region still waiting for the GPU is done,
        wake the background thread now instead of at its next interval. One ``query()``, at
        most once in :data:`POKE_GAP_S`."""
        waiting = self._waiting
        if waiting:
            now = _monotonic()
            if now - self._poked < POKE_GAP_S:
                return
            self._poked = now
            try:
                done = waiting[0][END].query()
            except Exception:  # the list changed under us, or CUDA trouble: the poller copes
                return
            if done:
                self._wake.set()

    # -- background ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread; run once per process, at the first region's enter, on
        the caller's thread. Sinks' ``prepare`` hooks run here and must be cheap (the span
        sink installs its provider; exporters are built on their own threads).

        The composition root, :mod:`perfsdk.lifecycle`, is imported first: ``import perfsdk``
        is light (the ``perfsdk`` command parses its arguments before torch is imported), so a
        program that imports only submodules (``from perfsdk.region import Region``, as an
        integration does) still has the summary, trace and span sinks before its first
        region."""
        importlib.import_module("perfsdk.lifecycle")
        with self._drain_lock:
            if self._thread is not None or self._stopping:
                return
            thread = threading.Thread(target=self._run, name="perfsdk-pipeline", daemon=True)
            self._thread = thread
            self.started = True
        thread.start()
        if not self._ready_hook:
            self._ready_hook = True
            register = getattr(threading, "_register_atexit", None)
            if register is not None:  # CPython: runs before concurrent.futures shuts down
                try:
                    register(self._await_set_up)
                except RuntimeError:  # the interpreter is already shutting down
                    pass
        if multiprocessing.parent_process() is not None:
            # A multiprocessing child (e.g. a DataLoader worker) ends with os._exit(), which
            # skips atexit; multiprocessing's own finalizers still run, so flush there.
            multiprocessing.util.Finalize(None, at_exit, exitpriority=100)
        for sink in list(self.sinks):
            prepare = getattr(sink, "prepare", None)
            if prepare is not None:
                try:
                    prepare()
                except Exception as exc:
                    warn_once(f"prepare:{type(sink).__name__}",
                              f"perfsdk: setting up {type(sink).__name__} failed ({exc!r}).")

    def _run(self) -> None:
        for sink in list(self.sinks):  # set-up that may be slow: here, not on the caller
            settle = getattr(sink, "settle", None)
            if settle is not None:
                self._guard(settle, f"settle:{type(sink).__name__}")
        self._set_up.set()
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            tickets = self._take_tickets()
            final = any(t.final for t in tickets)
            if not final and not self._stopping:
                for hook in self.on_round:
                    self._guard(hook, f"round:{getattr(hook, '__name__', hook)}")
            self._guard(functools.partial(self.drain, wait=bool(tickets), pace=not tickets),
                        "pipeline-round")  # a failing round never ends the thread
            for ticket in tickets:
                ticket.done.set()
            if final:  # only once the final request is served: shutdown waits for it
                return

    def _guard(self, fn: Callable[[], object], key: str) -> None:
        try:
            fn()
        except Exception as exc:  # never break the program
            warn_once(key, f"perfsdk: background task failed ({exc!r}).")

    def _take_tickets(self) -> list[_Ticket]:
        tickets = []
        while self._tickets:
            try:
                tickets.append(self._tickets.popleft())
            except IndexError:
                break
        return tickets

    def wake(self) -> None:
        self._wake.set()

    @property
    def pending(self) -> int:
        """Regions not yet handed to the sinks (queued, waiting for the GPU, or in a drain)."""
        return len(self.queue) + len(self._waiting) + self._in_hand

    def settle(self, timeout: float, *, final: bool = False) -> bool:
        """Have the pipeline thread hand every finished region to the sinks (waiting for the
        GPU's work of each); wait at most ``timeout`` seconds. True when done in time.

        Without a running pipeline thread (none started yet, or called from that thread), the
        drain runs here: there is nobody else to do it."""
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            self.drain(wait=True, timeout=timeout)
            return True
        ticket = _Ticket(final)
        self._tickets.append(ticket)
        self._wake.set()
        return ticket.done.wait(max(timeout, 0.0))

    def drain(self, wait: bool, timeout: float = -1, *, pace: bool = False) -> int:
        """Hand every resolvable record to the sinks; with ``wait``, wait for the GPU first.

        With a ``timeout`` (seconds), give up if another drain holds the pipeline that long.
        Sinks only queue or aggregate here, so a drain never waits for an exporter. With
        ``pace``, rest :data:`PACE_S` between chunks (the pipeline thread's routine rounds).
        """
        if not self._drain_lock.acquire(timeout=timeout):
            warn_once("drain-timeout", f"perfsdk: the pipeline was busy for more than "
                      f"{timeout:g} s; {self.pending} regions wait for a later round.")
            return 0
        abandoned = self._abandoned
        try:
            self._deliver_overflow()
            queue = self.queue
            with self._hand_lock:  # exit's count of what is left sees each record once
                if abandoned != self._abandoned:
                    return 0
                batch, self._waiting = self._waiting, []
                batch += islice(iter(queue.popleft, None), len(queue))  # in C: no frame per record
                self._in_hand = len(batch)
            gate = self.gate
            ready: list[Any] | None = None
            waiting: list[Any] = []
            if gate is None or wait:  # no GPU sampler to wait for: only GPU records wait
                ready = [rec for rec in batch if rec[END] is None]
            if ready is None or len(ready) != len(batch):
                ready = []
                limit = None if gate is None or wait else _gate_limit(gate, batch)
                for rec in batch:
                    if limit is not None and rec[T1] > limit:
                        waiting.append(rec)  # e.g. the GPU sampler has not passed its end yet
                    elif rec[END] is None:
                        ready.append(rec)
                    else:
                        resolved = self.resolve(rec, wait)
                        if resolved is None:
                            waiting.append(rec)
                        else:
                            ready.append(resolved)
            del batch
            count, done = len(ready), 0
            while True:
                size = self._chunk if pace else CHUNK
                began = _clock()
                with self._hand_lock:  # exit's count of what is left sees whole chunks only
                    if abandoned != self._abandoned:  # exit counted the rest as lost
                        return done
                    if done == 0:
                        self._waiting = waiting + self._waiting
                        self._in_hand = count
                    if ready:
                        self._deliver(ready[done:done + size])
                    done += size
                    self._in_hand = max(0, count - done)
                if done >= count:
                    return count
                if pace:  # outside the lock: exit's count never waits for a rest
                    self._chunk = chunk_for(size, _clock() - began)
                    _rest(PACE_S)
        finally:
            self._in_hand = 0
            self._drain_lock.release()

    def _deliver_overflow(self) -> None:
        if not self._overflow:
            return
        with self._overflow_lock:
            overflow, self._overflow = self._overflow, {}
            count, self.overflowed = self.overflowed, 0
        for sink in list(self.sinks):
            tally = getattr(sink, "tally", None)
            if tally is not None:
                self._guard(functools.partial(tally, overflow), f"tally:{type(sink).__name__}")
        if self.on_lost is not None:
            self.on_lost(count, "queue_full")

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
        """Resolve and hand over every finished region, then let each sink push out what it
        holds; returns within ``timeout`` seconds whatever the exporters do.

        Each sink waits at most its share of what is left (what is left over the sinks still
        to flush), and what one leaves unused goes to the next: one exporter waiting on an
        unreachable collector (spans queued for a retry) cannot use up the others' time, so
        the metrics after it are still exported, or their failure said."""
        deadline = _monotonic() + timeout
        self.settle(timeout)
        sinks = list(self.sinks)
        for index, sink in enumerate(sinks):
            left = deadline - _monotonic()
            if left <= 0:
                break
            try:
                sink.flush(left / (len(sinks) - index))
            except Exception as exc:
                warn_once(f"flush:{type(sink).__name__}",
                          f"perfsdk: flushing {type(sink).__name__} failed ({exc!r}).")

    def shutdown(self, timeout: float) -> None:
        """Stop the pipeline thread after a last drain, then shut the sinks down, all within
        ``timeout`` seconds in total; what is not out by then is counted as lost. The waits end
        :func:`shutdown_margin` before the budget does: counting what is left and closing the
        exporters still takes the GIL from perfsdk's busy threads."""
        deadline = time.monotonic() + timeout - shutdown_margin(timeout)
        self._stopping = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and \
                thread.is_alive():
            ticket = _Ticket(final=True)
            self._tickets.append(ticket)
            self._wake.set()
            if not ticket.done.wait(max(0.0, deadline - time.monotonic())):
                # e.g. waiting for a GPU that does not finish: what is left is counted, and
                # neither the drain in progress nor a later one delivers it.
                with self._hand_lock:
                    self._abandoned += 1
                    queue, queued = self.queue, len(self.queue)
                    for _ in range(queued):
                        queue.popleft()
                    with self._overflow_lock:
                        spilled, self.overflowed, self._overflow = self.overflowed, 0, {}
                    stuck = queued + len(self._waiting) + self._in_hand + spilled
                    self._waiting = []
                if stuck and self.on_lost is not None:
                    self.on_lost(stuck, "shutdown")
        else:
            self.drain(wait=True, timeout=max(0.0, deadline - time.monotonic()))
        self._thread = None
        self.started = False
        for sink in list(self.sinks):  # every sink's threads start at once ...
            begin = getattr(sink, "begin_shutdown", None)
            if begin is not None:
                self._guard(begin, f"begin-shutdown:{type(sink).__name__}")
        for sink in list(self.sinks):  # ... and share what is left of the one budget
            try:
                sink.shutdown(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                warn_once(f"shutdown:{type(sink).__name__}",
                          f"perfsdk: shutting down {type(sink).__name__} failed ({exc!r}).")
        self._stopping = False

    def _await_set_up(self) -> None:
        """If perfsdk's threads are still importing and building exporters (they start at the
        first region), let them finish, at most the export timeout. Runs just before
        ``fork()``, so the child does not inherit a half-imported module or a lock held by a
        thread it does not have; and at the start of interpreter shutdown, before
        ``concurrent.futures`` refuses new work (OpenTelemetry's resource detection and gRPC
        exporter need it). Exports nothing: exit's shutdown (atexit) does that."""
        if self._thread is None:
            return
        from perfsdk.config import get_config

        deadline = time.monotonic() + get_config().export_timeout_s
        self._set_up.wait(max(0.0, deadline - time.monotonic()))
        for sink in list(self.sinks):
            ready = getattr(sink, "wait_ready", None)
            if ready is not None:
                self._guard(functools.partial(ready, deadline), f"ready:{type(sink).__name__}")

    def _after_fork(self) -> None:
        # The child has no pipeline thread and must not re-export the parent's regions.
        FORK.generation += 1
        self._init_state()
        for sink in self.sinks:
            after_fork = getattr(sink, "after_fork", None)
            if after_fork is not None:
                after_fork()


PIPELINE = Pipeline()

lost_report: Callable[[], list[str]] | None = None
"""Set by :mod:`perfsdk.lifecycle`: the lines to print at exit when spans were lost."""


def at_exit() -> None:
    """Interpreter (or multiprocessing child) exit: shut down within the export timeout (in a
    child, at most :data:`WORKER_EXIT_BUDGET`), then one stderr line per exporter that lost
    spans."""
    from perfsdk.config import get_config

    budget = get_config().export_timeout_s
    if multiprocessing.parent_process() is not None:
        budget = min(budget, WORKER_EXIT_BUDGET)
    PIPELINE.shutdown(budget)
    lines = lost_report() if lost_report is not None else []
    if lines:
        try:
            sys.stderr.write("".join(f"{line}\n" for line in lines))
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr at exit: nothing more to do
            pass


atexit.register(at_exit)
