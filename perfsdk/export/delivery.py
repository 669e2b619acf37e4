"""Span delivery: one bounded queue and one export thread per exporter, with backoff and an exact
account of every span.

The pipeline thread (and, on perfsdk's own provider, the application's spans at their end)
:meth:`Destination.offer` s items; they never wait. The export thread takes batches of at most
``export_batch_size`` — at once when a batch is full, else every ``export_delay_s`` or when
someone flushes — turns region records into spans there, and calls the exporter. So building
spans, serializing, the network and a slow or hung collector all cost the export thread only.

The account: every item offered is *produced*; it ends *exported*, or *lost* with one reason:

``queue_full``
    the queue was full (the exporter is slower than the program makes spans);
``backing_off``
    the queue was full, or exit came, while the exporter was resting after failures;
``export_failed``
    the exporter refused the batch (connection refused, an HTTP or gRPC error, ...);
``export_timeout``
    the exporter gave up on the batch after its timeout;
``shutdown``
    still queued, or in an export call that had not returned, when the exit budget ran out.

So ``exported + sum(lost.values()) == produced`` once the destination is closed (before that, the
difference is what is queued or in flight). A batch counts as exported only when the exporter
says so, however late.

After a failed export the destination rests (:class:`Backoff`): exponential from
``export_backoff_min_s`` up to ``export_backoff_max_s``, each rest a random draw between half
and all of it, reset by the first success. Spans produced meanwhile wait in the bounded queue.
"""

from __future__ import annotations

import http
import logging
import os
import random
import re
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from perfsdk.errors import warn_once
from perfsdk.pipeline import PACE_S

__all__ = ["CAPTURE", "REASONS", "Backoff", "Destination", "capture_logs", "classify",
           "note_failure", "probe", "run_within"]

REASONS = ("queue_full", "backing_off", "export_failed", "export_timeout", "shutdown")
"""Why a span was lost, in the order :func:`perfsdk.diagnostics` lists them."""

Clock = Callable[[], float]

BUILD_CHUNK = 128
"""Spans the export thread builds at a time. Building holds the GIL (about 0.7 us a span
compiled, 1.5 us in Python); between chunks the thread rests ``PACE_S`` (the pipeline
thread's rest between its chunks, :data:`perfsdk.pipeline.PACE_S`), so a training
thread that wants the GIL back waits at most a chunk's work (0.1 to 0.2 ms), never a whole
batch's (milliseconds at 2,048 spans). No rest while someone waits (a flush, exit), nor while
the queue is more than half full, nor for the rest of a batch once a rest took more than
:data:`SLOW_REST_S`: a thread that never lets the GIL go (a loop of pure Python) gives it back
only at Python's 5 ms switch interval, so each rest would cost the export thread 5 ms and turn
a burst into spans lost (``queue_full``) rather than a millisecond of the caller's."""

SLOW_REST_S = 0.002
"""A rest that took longer than this got the GIL back only at a forced switch: the rest of the
batch is built without rests."""

_rest = time.sleep
_clock = time.perf_counter


class Backoff:
    """Exponential backoff with jitter and a cap; ``clock`` and ``rng`` are injectable."""

    def __init__(self, low: float, high: float, *, clock: Clock = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        self.low, self.high = low, high
        self.clock, self.rng = clock, rng
        self.failures = 0
        """Failed exports in a row (0: healthy)."""
        self.until = 0.0

    def failed(self) -> float:
        """Note a failure; returns the rest before the next attempt (seconds)."""
        self.failures += 1
        ceiling = min(self.high, self.low * 2.0 ** min(self.failures - 1, 60))
        rest = ceiling * (0.5 + 0.5 * self.rng())
        self.until = self.clock() + rest
        return rest

    def succeeded(self) -> None:
        self.failures = 0
        self.until = 0.0

    def remaining(self) -> float:
        """Seconds of rest left (0 when an attempt may be made now)."""
        return max(0.0, self.until - self.clock()) if self.until else 0.0


class _Capture(logging.Filter):
    """While an export runs on a thread, OpenTelemetry's exporter log records on that thread are
    kept (to name the cause) instead of printed: the destination warns once itself."""

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        kept = getattr(self.local, "kept", None)
        if kept is None:
            return True
        if len(kept) < 8:
            try:
                text = record.getMessage()
            except Exception:  # a bad format string in someone's log call
                text = str(record.msg)
            if record.exc_info and record.exc_info[1] is not None:
                text += f" {record.exc_info[1]!r}"
            kept.append(text)
        return False


CAPTURE = _Capture()
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)
for _name in _EXPORTER_LOGGERS:
    logging.getLogger(_name).addFilter(CAPTURE)


def note_failure(text: str) -> None:
    """Add ``text`` to this thread's captured export log, when an export is being captured
    (e.g. the HTTP status a transport saw)."""
    kept = getattr(_Capture.local, "kept", None)
    if kept is not None and len(kept) < 8:
        kept.append(text)


class capture_logs:  # used like a function, as a context manager
    """``with capture_logs() as kept:`` the exporter log lines of this thread land in ``kept``."""

    def __enter__(self) -> list[str]:
        self.previous = getattr(_Capture.local, "kept", None)
        kept: list[str] = []
        _Capture.local.kept = kept
        return kept

    def __exit__(self, *exc: object) -> None:
        _Capture.local.kept = self.previous


_HTTP_STATUS = re.compile(r"code: (\d{3})")
_HTTP_ERRORS = sorted((c for c in http.HTTPStatus if c.value >= 400),
                      key=lambda c: -len(c.phrase))  # longest first: "Gateway Timeout" wins
_GRPC_STATUS = re.compile(r"StatusCode\.([A-Z_]+)")


def classify(text: str) -> tuple[str, str]:
    """(reason, cause) of a failed export from what the exporter raised or logged: the reason
    is ``export_timeout`` or ``export_failed``; the cause is short and names the kind."""
    low = text.lower()
    status = _HTTP_STATUS.search(text)
    if status and status.group(1) != "None":
        return "export_failed", f"HTTP {status.group(1)}"
    for known in _HTTP_ERRORS:  # "Transient error Service Unavailable encountered ..."
        if known.phrase.lower() in low:
            return "export_failed", f"HTTP {known.value}"
    grpc = _GRPC_STATUS.search(text)
    if grpc:
        code = grpc.group(1)
        return ("export_timeout" if code == "DEADLINE_EXCEEDED" else "export_failed",
                f"gRPC {code}")
    if "connection refused" in low or "errno 111" in low or "connectionrefused" in low:
        return "export_failed", "connection refused"
    if "timed out" in low or "timeout" in low:
        return "export_timeout", "timeout"
    if "name or service not known" in low or "nodename nor servname" in low or \
            "failed to resolve" in low:
        return "export_failed", "unknown host"
    first = text.strip().splitlines()[0] if text.strip() else "the exporter reported failure"
    return "export_failed", first[:200]


def probe(url: str, timeout: float = 0.5) -> str | None:
    """What a TCP connect to ``url``'s host and port finds: ``connection refused``, ``unknown
    host``, or None (it connects, or does not answer in time). OpenTelemetry's exporters say
    only "timeout, max retries or shutdown" when their retries run out; this names the cause.
    Runs on an export thread, never the caller's."""
    try:
        parts = urllib.parse.urlsplit(url if "//" in url else f"//{url}")
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "connection refused"
    except socket.gaierror:
        return "unknown host"
    except OSError:
        return None
    return None


class Destination:
    """One exporter's bounded queue, its export thread and its account.

    Args:
        label: the exporter's name in warnings and diagnostics (``otlp``, ``file``, ...).
        target: where it sends, for people (``http://host:4318/v1/traces (http/protobuf)``).
        make: builds the exporter, on the export thread (never on the caller's).
        build: turns a batch of offered items into what the exporter takes (spans).
        queue_size, batch_size, delay: see ``OTEL_BSP_*``.
        backoff: the rest after failures.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, label: str, target: str, make: Callable[[], Any],
                 build: Callable[[list[Any]], Sequence[Any]], *, queue_size: int,
                 batch_size: int, delay: float, backoff: Backoff,
                 clock: Clock = time.monotonic) -> None:
        self.label, self.target = label, target
        self._make, self._build = make, build
        self.queue_size, self.batch_size, self.delay = queue_size, batch_size, delay
        self.backoff = backoff
        self.clock = clock
        self._fresh()

    def _fresh(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Any] = deque()
        self._thread: threading.Thread | None = None
        self._inflight: list[Any] | None = None
        self._flushing = 0
        self._closing: float | None = None
        self._closed = False
        self._enqueued = 0
        self._settled = 0
        self._last_export = self.clock()
        self.exporter: Any = None
        self._built = threading.Event()
        self.produced = 0
        self.exported = 0
        self.lost = dict.fromkeys(REASONS, 0)
        self.cause: str | None = None
        """The last failure's cause (``connection refused``, ``HTTP 503``, ...)."""

    # -- any thread ------------------------------------------------------------------------
    def offer(self, items: Sequence[Any]) -> None:
        """Queue ``items`` for export; what does not fit is counted as lost, never waited for."""
        n = len(items)
        if not n:
            return
        with self._cond:
            self.produced += n
            if self._closed:
                self.lost["shutdown"] += n
                return
            room = self.queue_size - len(self._queue)
            if room < n:
                lost, reason = n - max(room, 0), self._full_reason()
                self.lost[reason] += lost
                items = items[:max(room, 0)]
            else:
                lost = 0
            queue = self._queue
            queue.extend(items)
            self._enqueued += len(items)
            if len(queue) >= self.batch_size or len(queue) == len(items):
                self._cond.notify_all()  # a full batch, or the first item: start the delay
            start = self._thread is None
            if start:
                self._start()
        if lost:
            warn_once(f"queue:{self.label}:{reason}",
                      f"perfsdk: the {self.label} exporter's queue ({self.queue_size:,} spans, "
                      f"OTEL_BSP_MAX_QUEUE_SIZE) is full{self._why_full(reason)}; spans beyond "
                      "it are dropped and counted in perfsdk.diagnostics()['spans_lost']"
                      f"['{reason}'].")

    def count_lost(self, count: int, reason: str) -> None:
        """Spans that never reached the queue (the pipeline overflowed): produced and lost."""
        with self._cond:
            self.produced += count
            self.lost[reason] += count

    def _full_reason(self) -> str:
        return "backing_off" if self.backoff.failures else "queue_full"

    def _why_full(self, reason: str) -> str:
        if reason == "backing_off":
            return f" while {self.target} fails ({self.cause})"
        return f": {self.target} takes spans more slowly than the program makes them"

    def start(self) -> None:
        """Start the export thread now (it builds the exporter first), if not yet running."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._start()

    def _start(self) -> None:
        """Start the export thread (under the lock)."""
        thread = threading.Thread(target=self._run, name=f"perfsdk-export-{self.label}",
                                  daemon=True)
        self._thread = thread
        thread.start()

    def wait_built(self, deadline: float) -> bool:
        """Wait until the export thread has built its exporter (or failed to), or ``deadline``."""
        if self._thread is None:
            return True
        return self._built.wait(max(0.0, deadline - self.clock()))

    @property
    def pending(self) -> int:
        """Items queued or in an export call."""
        inflight = self._inflight
        return len(self._queue) + (len(inflight) if inflight else 0)

    def flush(self, deadline: float) -> bool:
        """Export everything offered so far now; wait until it is settled or ``deadline``
        (this destination's clock). True when everything was settled in time."""
        with self._cond:
            target = self._enqueued
            if self._settled >= target:
                return True
            if self._thread is None and not self._closed:
                self._start()
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._settled < target:
                    left = deadline - self.clock()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._flushing -= 1

    def close(self, deadline: float) -> None:
        """Export what is queued until ``deadline``, then count what is left as lost
        (``shutdown``) and shut the exporter down with whatever time remains."""
        with self._cond:
            if self._closed:
                return
            self._closing = deadline
            if self._queue and self._thread is None:
                self._start()
            self._cond.notify_all()
            while (self._queue or self._inflight) and self._thread is not None:
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            left_over = self.pending
            if left_over:
                self.lost["shutdown"] += left_over
                self._settled += left_over
                self._queue.clear()
                self._inflight = None  # a late answer from the exporter is ignored
            self._closed = True
            self._cond.notify_all()
            exporter = self.exporter
        if exporter is not None:
            def shut() -> None:
                with capture_logs():
                    exporter.shutdown()

            run_within(shut, deadline - self.clock(), f"{self.label}-shutdown")

    def after_fork(self) -> None:
        """In a forked child: a new queue, thread, exporter and account; what the parent knew
        about the collector (failures, rest) is kept, so a child does not wait on a collector
        the parent already found down."""
        self._fresh()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"produced": self.produced, "exported": self.exported,
                    "lost": dict(self.lost), "pending": self.pending, "target": self.target,
                    "failures_in_a_row": self.backoff.failures, "last_cause": self.cause}

    # -- the export thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            exporter = self._make()
        except Exception as exc:  # e.g. a malformed endpoint: every batch is counted as failed
            exporter = None
            self.cause = f"cannot create the exporter: {exc}"
            warn_once(f"export:{self.label}", f"perfsdk: cannot create the {self.label} "
                      f"exporter for {self.target} ({exc}); its spans are counted as lost "
                      "(export_failed) in perfsdk.diagnostics().")
        with self._cond:
            self.exporter = exporter
        self._built.set()
        pid = os.getpid()
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None or os.getpid() != pid:
                    return
                self._inflight = batch
            ok, reason = self._export(exporter, batch)
            with self._cond:
                self._last_export = self.clock()
                if self._inflight is batch:  # else close() already counted it
                    self._inflight = None
                    self._settled += len(batch)
                    if ok:
                        self.exported += len(batch)
                    else:
                        self.lost[reason] += len(batch)
                self._cond.notify_all()

    def _next_batch(self) -> list[Any] | None:
        """The next batch to export (under the lock), waiting as the settings say; None when
        the destination is closing and nothing is left."""
        queue = self._queue
        while True:
            if self._closed:
                return None
            closing = self._closing
            now = self.clock()
            if closing is not None and now >= closing:
                return None
            if not queue:
                if closing is not None:
                    return None
                self._cond.wait(None if self._flushing == 0 else 0.05)
                continue
            rest = self.backoff.remaining()
            if rest > 0:
                if closing is not None and now + rest >= closing:
                    # Exit while resting: no attempt would end in time; count, do not wait.
                    n = len(queue)
                    self.lost["backing_off"] += n
                    self._settled += n
                    queue.clear()
                    self._cond.notify_all()
                    return None
                self._cond.wait(rest if closing is None else min(rest, closing - now))
                continue
            due = self._last_export + self.delay - now
            if len(queue) >= self.batch_size or closing is not None or self._flushing or due <= 0:
                n = min(len(queue), self.batch_size)
                return [queue.popleft() for _ in range(n)]
            self._cond.wait(due)

    def _spans(self, batch: list[Any]) -> Sequence[Any]:
        """The batch's spans, built :data:`BUILD_CHUNK` at a time with a rest between chunks
        unless someone waits or the queue is filling up."""
        build = self._build
        if len(batch) <= BUILD_CHUNK:
            return build(batch)
        spans: list[Any] = []
        half, pace = self.queue_size // 2, True
        for start in range(0, len(batch), BUILD_CHUNK):
            if (start and pace and not self._flushing and self._closing is None
                    and len(self._queue) <= half):
                began = _clock()
                _rest(PACE_S)
                pace = _clock() - began <= SLOW_REST_S
            spans.extend(build(batch[start:start + BUILD_CHUNK]))
        return spans

    def _export(self, exporter: Any, batch: list[Any]) -> tuple[bool, str]:
        if exporter is None:
            return False, "export_failed"
        with capture_logs() as said:
            try:
                result = exporter.export(self._spans(batch))
                text = " ".join(said)
            except Exception as exc:
                result = None
                text = " ".join([*said, repr(exc)])
        if getattr(result, "name", None) == "SUCCESS":
            self.backoff.succeeded()
            return True, ""
        reason, cause = classify(text)
        if cause == "timeout" and "max retries" in text:  # the exporter gave up: why?
            found = probe(self.target.split(" ", 1)[0])
            if found is not None:
                reason, cause = "export_failed", found
        self.cause = cause
        rest = self.backoff.failed()
        warn_once(f"export:{self.label}",
                  f"perfsdk: the {self.label} exporter could not deliver {len(batch):,} spans to "
                  f"{self.target}: {cause}. The program continues; perfsdk retries after "
                  f"{rest:.1f} s, backing off up to {self.backoff.high:g} s "
                  "(PERFSDK_EXPORT_BACKOFF_MAX); spans wait in the queue meanwhile and every "
                  "loss is counted in perfsdk.diagnostics()['spans_lost'].")
        return False, reason


def run_within(fn: Callable[[], object], timeout: float, name: str) -> bool:
    """Run ``fn`` on a daemon thread (``perfsdk-<name>``) and wait at most ``timeout`` seconds
    for it (0: do not wait); True when it finished in time. An exception warns once."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:
            warn_once(f"{name}-error", f"perfsdk: {name.replace('-', ' ')} failed: {exc!r}")
        finally:
            done.set()

    threading.Thread(target=run, name=f"perfsdk-{name}", daemon=True).start()
    return done.wait(max(timeout, 0.0))
