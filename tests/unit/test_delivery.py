"""Span delivery (perfsdk.export.delivery): bounded queues, the account of every span, backoff.

Each test drives a Destination with an exporter whose every call the test controls (a gate it
opens, a result it chooses), so counts are exact and nothing depends on how fast the machine
is: waits are on events, and only their upper bounds (generous, never reached when the code is
right) are times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from perfsdk.export import delivery
from perfsdk.export.delivery import BUILD_CHUNK, PACE_S, REASONS, Backoff, Destination, classify

LONG = 30.0  # the most any wait here may take; reached only when the code under test is broken


class Controlled:
    """An exporter whose answers the test chooses: ``results`` in order (then SUCCESS), each
    call optionally held until ``gate`` is set. Records the batch sizes and threads."""

    def __init__(self, results: Sequence[Any] = (), *, gate: threading.Event | None = None
                 ) -> None:
        self.results = list(results)
        self.gate = gate
        self.entered = threading.Event()
        self.batches: list[int] = []
        self.threads: list[str] = []
        self.shut = False

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(LONG), "the test never opened the gate"
        self.batches.append(len(spans))
        result = self.results.pop(0) if self.results else SpanExportResult.SUCCESS
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self) -> None:
        self.shut = True


def destination(exporter: Any, *, queue_size: int = 100, batch_size: int = 10,
                delay: float = 0.0, backoff: Backoff | None = None,
                make: Callable[[], Any] | None = None) -> Destination:
    return Destination("test", "the test's exporter", make or (lambda: exporter), list,
                       queue_size=queue_size, batch_size=batch_size, delay=delay,
                       backoff=backoff or Backoff(1e-3, 1e-3))


def identity(d: Destination) -> None:
    stats = d.stats()
    assert stats["exported"] + sum(stats["lost"].values()) + stats["pending"] == \
        stats["produced"], stats


# -- bounded, and every span counted -------------------------------------------------------
def test_queue_is_bounded_and_overflow_is_counted_as_queue_full() -> None:
    gate = threading.Event()
    exporter = Controlled(gate=gate)
    d = destination(exporter, queue_size=10, batch_size=5)
    d.offer([0])
    assert exporter.entered.wait(LONG)  # the export thread holds one item in a blocked export
    d.offer(list(range(100)))
    stats = d.stats()
    assert stats["pending"] == 1 + 10  # in flight + a full queue, never more
    assert stats["lost"]["queue_full"] == 90
    identity(d)
    gate.set()
    assert d.flush(time.monotonic() + LONG)
    d.close(time.monotonic() + LONG)
    stats = d.stats()
    assert stats["exported"] == 11
    assert stats["produced"] == 101
    assert stats["pending"] == 0
    identity(d)
    assert exporter.shut


def test_spans_in_flight_at_close_are_counted_as_shutdown_and_a_late_answer_is_ignored() -> None:
    gate = threading.Event()
    exporter = Controlled(gate=gate)
    d = destination(exporter, batch_size=4)
    d.offer(list(range(10)))
    assert exporter.entered.wait(LONG)
    d.close(time.monotonic() + 0.05)  # the exporter is stuck: the budget runs out
    stats = d.stats()
    assert stats["lost"]["shutdown"] == 10
    assert stats["exported"] == 0
    gate.set()  # the hung call now returns SUCCESS, after its spans were counted as lost
    deadline = time.monotonic() + LONG
    while not exporter.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exporter.batches == [4]
    assert d.stats()["exported"] == 0  # not counted twice
    identity(d)
    d.offer([1, 2])  # after close: counted, not queued
    assert d.stats()["lost"]["shutdown"] == 12
    identity(d)


def test_a_batch_accepted_after_the_flush_timeout_counts_as_exported() -> None:
    gate = threading.Event()
    exporter = Controlled(gate=gate)
    d = destination(exporter)
    d.offer(list(range(7)))
    assert exporter.entered.wait(LONG)
    assert d.flush(time.monotonic() + 0.01) is False  # flush gives up; the export goes on
    gate.set()
    assert d.flush(time.monotonic() + LONG)
    stats = d.stats()
    assert stats["exported"] == 7
    assert stats["lost"] == dict.fromkeys(REASONS, 0)


def test_flush_returns_without_waiting_for_a_hung_exporter() -> None:
    gate = threading.Event()
    exporter = Controlled(gate=gate)
    d = destination(exporter)
    d.offer([1])
    assert exporter.entered.wait(LONG)
    returned: list[bool] = []
    caller = threading.Thread(target=lambda: returned.append(d.flush(time.monotonic() + 0.05)))
    caller.start()
    caller.join(LONG)
    assert returned == [False]  # flush came back while the exporter is still inside export()
    assert not exporter.batches
    gate.set()


def test_exports_run_on_the_export_thread_never_the_callers() -> None:
    exporter = Controlled()
    built_on: list[str] = []

    def make() -> Controlled:
        built_on.append(threading.current_thread().name)
        return exporter

    d = destination(exporter, make=make)
    d.offer(list(range(25)))
    assert d.flush(time.monotonic() + LONG)
    assert built_on == ["perfsdk-export-test"]
    assert set(exporter.threads) == {"perfsdk-export-test"}
    assert exporter.batches == [10, 10, 5]  # at most batch_size per call


def test_a_partial_batch_waits_for_the_delay_a_full_one_goes_at_once() -> None:
    exporter = Controlled()
    d = destination(exporter, batch_size=10, delay=LONG)  # the delay never runs out here
    d.offer(list(range(3)))
    time.sleep(0.1)
    assert exporter.batches == []  # partial: waits for the schedule delay
    d.offer(list(range(7)))  # now a full batch: exported without waiting
    assert exporter.entered.wait(LONG)
    assert d.flush(time.monotonic() + LONG)
    assert exporter.batches == [10]


class Keeping(Controlled):
    """Also keeps what each export call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Any] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans.extend(spans)
        return super().export(spans)


def test_a_large_batch_is_built_in_chunks_with_a_rest_between_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rests: list[float] = []
    monkeypatch.setattr(delivery, "_rest", rests.append)
    chunks: list[tuple[int, str]] = []

    def build(items: list[Any]) -> list[Any]:
        chunks.append((len(items), threading.current_thread().name))
        return [f"span {item}" for item in items]

    exporter = Keeping()
    n = 2 * BUILD_CHUNK + 44
    d = Destination("test", "the test's exporter", lambda: exporter, build, queue_size=4 * n,
                    batch_size=n, delay=LONG, backoff=Backoff(1e-3, 1e-3))
    d.offer(list(range(n)))  # a full batch: exported at once, nobody waiting for it
    assert exporter.entered.wait(LONG)
    assert [size for size, _ in chunks] == [BUILD_CHUNK, BUILD_CHUNK, 44]
    assert {thread for _, thread in chunks} == {"perfsdk-export-test"}
    assert rests == [PACE_S, PACE_S]  # between chunks, not after the last
    assert exporter.spans == [f"span {i}" for i in range(n)]  # one export call, in order
    assert exporter.batches == [n]
    # Someone waits (a flush): the same chunks, no rest.
    del chunks[:], rests[:]
    d.offer(list(range(n - 1)))  # a partial batch: it goes at the flush
    assert d.flush(time.monotonic() + LONG)
    assert [size for size, _ in chunks] == [BUILD_CHUNK, BUILD_CHUNK, 43]
    assert rests == []
    assert exporter.batches == [n, n - 1]
    d.close(time.monotonic() + LONG)
    identity(d)


def test_a_rest_that_waited_for_a_forced_switch_ends_the_rests_of_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller never lets the GIL go (pure Python): a rest came back only at Python's switch
    interval; the batch's other chunks are built back to back."""
    now = [0.0]
    rests: list[float] = []

    def rest(seconds: float) -> None:
        rests.append(seconds)
        now[0] += 0.005  # the GIL back after the 5 ms switch interval

    monkeypatch.setattr(delivery, "_rest", rest)
    monkeypatch.setattr(delivery, "_clock", lambda: now[0])
    exporter = Keeping()
    n = 4 * BUILD_CHUNK
    d = Destination("test", "the test's exporter", lambda: exporter, list, queue_size=4 * n,
                    batch_size=n, delay=LONG, backoff=Backoff(1e-3, 1e-3))
    d.offer(list(range(n)))
    assert exporter.entered.wait(LONG)
    assert rests == [PACE_S]  # one rest, then none: three would be 15 ms of the export thread's
    assert exporter.spans == list(range(n))
    d.close(time.monotonic() + LONG)
    identity(d)


def test_no_rest_between_chunks_while_the_queue_is_filling_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst: resting then would lose spans (queue_full) to spare the caller a few ms."""
    rests: list[float] = []
    monkeypatch.setattr(delivery, "_rest", rests.append)
    first_chunk, filled = threading.Event(), threading.Event()

    def build(items: list[Any]) -> list[Any]:
        if not first_chunk.is_set():
            first_chunk.set()
            assert filled.wait(LONG)  # the test fills the queue while the batch is built
        return list(items)

    gate = threading.Event()
    exporter = Controlled(gate=gate)  # holds the first export: the next batch waits for it
    n = 3 * BUILD_CHUNK
    d = Destination("test", "the test's exporter", lambda: exporter, build, queue_size=2 * n,
                    batch_size=n, delay=LONG, backoff=Backoff(1e-3, 1e-3))
    d.offer(list(range(n)))
    assert first_chunk.wait(LONG)
    d.offer(list(range(n + 1)))  # more than half of the queue
    filled.set()
    assert exporter.entered.wait(LONG)
    assert rests == []  # three chunks built back to back
    gate.set()
    assert d.flush(time.monotonic() + LONG)
    assert exporter.batches == [n, n, 1]
    d.close(time.monotonic() + LONG)
    identity(d)


# -- failures, backoff and recovery ---------------------------------------------------------
def test_failed_batches_are_counted_with_their_reason_and_the_rest_waits_then_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    refused = ConnectionError("HTTPConnectionPool: [Errno 111] Connection refused")
    exporter = Controlled([SpanExportResult.FAILURE, refused, SpanExportResult.SUCCESS])
    d = destination(exporter, batch_size=5)
    d.offer(list(range(5)))
    assert exporter.entered.wait(LONG)
    d.offer(list(range(10)))  # produced while backing off: queued, exported after recovery
    assert d.flush(time.monotonic() + LONG)
    warned = [r.getMessage() for r in caplog.records if "could not deliver" in r.getMessage()]
    assert len(warned) == 1  # once, not per batch
    assert warned[0].startswith("perfsdk: the test exporter could not deliver 5 spans to the "
                                "test's exporter: the exporter reported failure.")
    stats = d.stats()
    assert stats["lost"]["export_failed"] == 10  # the two failed batches of 5
    assert stats["exported"] == 5
    assert stats["last_cause"] == "connection refused"
    assert stats["failures_in_a_row"] == 0  # the success ended the backoff
    identity(d)


def test_overflow_while_backing_off_is_counted_as_backing_off() -> None:
    exporter = Controlled([SpanExportResult.FAILURE] * 1000)
    backoff = Backoff(LONG, LONG)  # one failure, then a long rest
    d = destination(exporter, queue_size=4, batch_size=4, backoff=backoff)
    d.offer(list(range(4)))
    assert exporter.entered.wait(LONG)
    deadline = time.monotonic() + LONG
    while d.stats()["lost"]["export_failed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    d.offer(list(range(10)))
    stats = d.stats()
    assert stats["lost"]["export_failed"] == 4
    assert stats["lost"]["backing_off"] == 6  # 4 fit in the queue, 6 did not
    d.close(time.monotonic() + 0.05)  # exit while resting: no attempt, counted at once
    stats = d.stats()
    assert stats["lost"]["backing_off"] == 10
    assert stats["pending"] == 0
    identity(d)


def test_an_exporter_that_cannot_be_built_loses_every_span_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    def make() -> Any:
        raise ValueError("Invalid IPv6 URL")

    d = destination(None, make=make)
    d.offer(list(range(12)))
    assert d.flush(time.monotonic() + LONG)
    assert any("cannot create the test exporter for the test's exporter (Invalid IPv6 URL)"
               in r.getMessage() for r in caplog.records)
    stats = d.stats()
    assert stats["lost"]["export_failed"] == 12
    assert "Invalid IPv6 URL" in stats["last_cause"]
    identity(d)


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets() -> None:
    now = [100.0]
    draws = iter([0.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    backoff = Backoff(0.5, 3.0, clock=lambda: now[0], rng=lambda: next(draws))
    rests = [backoff.failed() for _ in range(5)]
    assert rests == [0.25, 1.0, 2.0, 3.0, 3.0]  # half to all of 0.5, 1, 2, then the 3 s cap
    assert backoff.remaining() == 3.0
    now[0] += 1.0
    assert backoff.remaining() == 2.0
    backoff.succeeded()
    assert (backoff.failures, backoff.remaining()) == (0, 0.0)
    assert backoff.failed() == 0.375  # back to the first step: 0.5 * (0.5 + 0.5 * 0.5)


@pytest.mark.parametrize(("text", "reason", "cause"), [
    ("Failed to export spans batch code: 503, reason: Service Unavailable", "export_failed",
     "HTTP 503"),
    ("Transient error ConnectionError(... [Errno 111] Connection refused) encountered",
     "export_failed", "connection refused"),
    ("Failed to export traces to 127.0.0.1:1, error code: StatusCode.UNAVAILABLE",
     "export_failed", "gRPC UNAVAILABLE"),
    ("error code: StatusCode.DEADLINE_EXCEEDED", "export_timeout", "gRPC DEADLINE_EXCEEDED"),
    ("ReadTimeout(HTTPConnectionPool(host='127.0.0.1'): Read timed out. (read timeout=2))",
     "export_timeout", "timeout"),
    ("", "export_failed", "the exporter reported failure"),
])
def test_classify_names_the_cause(text: str, reason: str, cause: str) -> None:
    assert classify(text) == (reason, cause)
