"""Faults between perfsdk and a real OTLP collector (tests/otlp_receiver.py on 127.0.0.1): slow,
refusing, never answering, coming back, a malformed endpoint, fork and DataLoader workers.

Every span is accounted for (exported, or lost with its reason) and the calling thread never
exports. Counts and threads are asserted, never durations: waits are bounded by generous limits
that only a broken implementation reaches.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)
from opentelemetry.sdk.resources import Resource

from perfsdk.export.delivery import REASONS, Backoff, Destination
from perfsdk.export.exporters import otlp_exporter
from perfsdk.export.spans import region_span
from tests.integration._scripts.harness import PROTOCOLS, clean_env
from tests.otlp_receiver import BlackHole, OTLPProtocol, OTLPReceiver

LONG = 30.0
RESOURCE = Resource.create({"service.name": "faults"})


def records(n: int, first: int = 0) -> list[tuple[Any, ...]]:
    """``n`` region records of one spec, with distinct span ids from ``first + 1``."""
    from perfsdk.region import RegionSpec

    spec = RegionSpec.create("fault")
    return [(spec.index, 7, first + i + 1, 0, 1_000, 2_000, 1, None, None, None, None, None,
             None, None, None) for i in range(n)]


def to_endpoint(protocol: OTLPProtocol, endpoint: str, timeout: float = 5.0) -> Destination:
    """A destination with OpenTelemetry's real OTLP exporter, built by perfsdk's own
    ``otlp_exporter`` (as ``PERFSDK_EXPORTER=otlp`` builds it) for ``endpoint``."""
    def make() -> Any:
        variables = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
                     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": PROTOCOLS[protocol],
                     "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)
        try:
            exporter = otlp_exporter(timeout)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        assert isinstance(exporter, GrpcExporter if protocol == "grpc" else HttpExporter)
        return exporter

    return Destination(
        "otlp", endpoint, make, lambda items: [region_span(r, RESOURCE) for r in items],
        queue_size=1000, batch_size=100, delay=0.0, backoff=Backoff(0.05, 0.2))


def settle(d: Destination) -> dict[str, Any]:
    assert d.flush(time.monotonic() + LONG), d.stats()
    return d.stats()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_slow_collector_never_holds_flush_and_a_late_answer_counts_as_exported(
        protocol: OTLPProtocol) -> None:
    with OTLPReceiver(protocol, delay_s=0.5) as receiver:
        d = to_endpoint(protocol, receiver.endpoint)
        d.offer(records(50))
        assert d.flush(time.monotonic() + 0.01) is False  # flush gives up; export goes on
        stats = settle(d)
        d.close(time.monotonic() + LONG)
        assert len(receiver.spans()) == 50
    assert stats["exported"] == 50
    assert stats["lost"] == dict.fromkeys(REASONS, 0)


@pytest.mark.parametrize(("protocol", "cause"), [("http", "HTTP 503"),
                                                 ("grpc", "gRPC UNAVAILABLE")])
def test_a_refusing_collector_then_recovery(protocol: OTLPProtocol, cause: str) -> None:
    """While the collector refuses, each failed batch is counted (with the cause) and the
    spans made meanwhile wait in the queue; once it accepts again, they all arrive."""
    with OTLPReceiver(protocol, reject=503) as receiver:
        d = to_endpoint(protocol, receiver.endpoint, timeout=1.0)
        d.offer(records(100))
        deadline = time.monotonic() + LONG
        while d.stats()["lost"]["export_failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.offer(records(250, first=100))  # produced while the exporter backs off
        receiver.reject = None
        stats = settle(d)
        d.close(time.monotonic() + LONG)
        received = {int(s.span_id, 16) for s in receiver.spans()}
    failed = stats["lost"]["export_failed"]
    assert failed % 100 == 0
    assert failed >= 100  # the first batch, at least
    assert stats["exported"] == 350 - failed
    assert len(received) == stats["exported"]
    assert set(range(101, 351)) <= received  # everything made while backing off arrived
    assert stats["last_cause"] == cause
    assert stats["failures_in_a_row"] == 0


def test_a_collector_that_never_answers_costs_its_timeout_and_is_counted() -> None:
    with BlackHole() as hole:
        d = to_endpoint("http", hole.endpoint + "/v1/traces", timeout=0.3)
        d.offer(records(100))
        deadline = time.monotonic() + LONG
        while d.stats()["lost"]["export_timeout"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.offer(records(10, first=100))
        d.close(time.monotonic() + 0.1)
        assert hole.connections >= 1
    stats = d.stats()
    assert stats["lost"]["export_timeout"] == 100
    assert stats["last_cause"] == "timeout"
    assert stats["exported"] == 0
    assert stats["produced"] == 110
    assert sum(stats["lost"].values()) == 110


def run_app(tmp_path: Path, code: str, env: dict[str, str], timeout: float = 120) -> Any:
    import subprocess
    import sys

    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out.json")],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_caller_never_builds_exporters_nor_exports(protocol: OTLPProtocol,
                                                       tmp_path: Path) -> None:
    """Exporter construction, export calls and the trace file's writes happen on perfsdk's
    threads: never on the thread that runs regions, flush() or summary()."""
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    with OTLPReceiver(protocol) as receiver:
        run = run_app(tmp_path, f"""
            import json, sys, threading
            import {module} as otlp
            import perfsdk.export.trace as trace_file
            seen = []
            def note(what, fn):
                def wrapper(*args, **kwargs):
                    seen.append((what, threading.current_thread().name))
                    return fn(*args, **kwargs)
                return wrapper
            otlp.OTLPSpanExporter.__init__ = note("build", otlp.OTLPSpanExporter.__init__)
            otlp.OTLPSpanExporter.export = note("export", otlp.OTLPSpanExporter.export)
            trace_file._atomic_write = note("trace", trace_file._atomic_write)
            import perfsdk
            for i in range(300):
                with perfsdk.timed_region("work", i=i):
                    pass
            perfsdk.flush(timeout=30)
            perfsdk.summary(show=False)
            perfsdk.shutdown(timeout=30)
            json.dump({{"seen": seen, "diagnostics": perfsdk.diagnostics()}},
                      open(sys.argv[1], "w"))
        """, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
                       OTEL_EXPORTER_OTLP_PROTOCOL={"grpc": "grpc",
                                                    "http": "http/protobuf"}[protocol],
                       PERFSDK_EXPORTER="otlp,trace", PERFSDK_OUTPUT_DIR=str(tmp_path)))
        assert run.returncode == 0, run.stderr
        spans = receiver.spans()
    out = json.loads((tmp_path / "out.json").read_text())
    kinds = {what for what, _ in out["seen"]}
    assert kinds == {"build", "export", "trace"}
    assert "MainThread" not in {thread for _, thread in out["seen"]}, out["seen"]
    diagnostics = out["diagnostics"]
    assert diagnostics["spans_produced"] == 300
    assert diagnostics["spans_exported"] == 300
    assert sum(diagnostics["spans_lost"].values()) == 0
    assert len(spans) == 300


def test_a_malformed_endpoint_warns_at_configuration_and_every_span_is_counted(
        tmp_path: Path) -> None:
    run = run_app(tmp_path, """
        import json, sys
        import perfsdk
        for i in range(20):
            with perfsdk.timed_region("work"):
                pass
        perfsdk.shutdown(timeout=5)
        json.dump(perfsdk.diagnostics(), open(sys.argv[1], "w"))
    """, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://[::1", PERFSDK_EXPORTER="otlp"))
    assert run.returncode == 0, run.stderr
    assert "OTEL_EXPORTER_OTLP_ENDPOINT='http://[::1' is not a usable endpoint" in run.stderr
    diagnostics = json.loads((tmp_path / "out.json").read_text())
    assert diagnostics["spans_produced"] == 20
    assert diagnostics["spans_lost"]["export_failed"] == 20
    assert diagnostics["spans_failed"] == 20
    assert "perfsdk: 20 of 20 spans were not exported" in run.stderr


def test_dataloader_workers_spans_reach_a_healthy_collector(tmp_path: Path) -> None:
    """Non-persistent workers (fork) exit after every epoch; their regions still arrive, and
    the parent's open region (the epoch) is never sent again by a worker."""
    with OTLPReceiver("http") as receiver:
        run = run_app(tmp_path, """
            import torch
            import perfsdk
            from torch.utils.data import DataLoader, Dataset

            class Items(Dataset):
                def __len__(self):
                    return 8
                def __getitem__(self, i):
                    with perfsdk.timed_region("load", i=i):
                        return torch.full((2,), float(i))

            if __name__ == "__main__":
                for epoch in range(2):
                    with perfsdk.timed_region("epoch", epoch=epoch):
                        for batch in DataLoader(Items(), batch_size=2, num_workers=2,
                                                multiprocessing_context="fork"):
                            pass
        """, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
                       PERFSDK_EXPORTER="otlp"))
        assert run.returncode == 0, run.stderr
        spans = receiver.wait_for_spans(18, timeout=LONG)
    names = sorted(s.name for s in spans)
    assert names == ["epoch"] * 2 + ["load"] * 16, names
    assert len({s.span_id for s in spans}) == 18
    assert len({s.resource["process.pid"] for s in spans}) >= 2  # parent + workers
    assert "were not exported" not in run.stderr, run.stderr


def test_exit_says_on_stderr_how_many_spans_were_lost_and_why(tmp_path: Path) -> None:
    with BlackHole() as hole:
        run = run_app(tmp_path, """
            import perfsdk
            for i in range(30):
                with perfsdk.timed_region("work"):
                    pass
        """, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=hole.endpoint, PERFSDK_EXPORTER="otlp",
                       PERFSDK_EXPORT_TIMEOUT="0.5"))
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "were not exported" in line]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"perfsdk: 30 of 30 spans were not exported by the otlp "
                               f"exporter to {hole.endpoint}/v1/traces (http/protobuf) (")
    reasons = lines[0].split("(http/protobuf) (", 1)[1]
    total = sum(int(part.split()[1].rstrip(";)").replace(",", ""))
                for part in reasons.split(";")[0].split(", "))
    assert total == 30  # e.g. "shutdown 30", or "export_timeout 30"


def test_threads_are_not_left_behind_by_a_closed_destination() -> None:
    before = {t.name for t in threading.enumerate()}
    with OTLPReceiver("http") as receiver:
        d = to_endpoint("http", receiver.endpoint)
        d.offer(records(5))
        settle(d)
        d.close(time.monotonic() + LONG)
    deadline = time.monotonic() + LONG
    while "perfsdk-export-otlp" in {t.name for t in threading.enumerate()} - before and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    assert "perfsdk-export-otlp" not in {t.name for t in threading.enumerate()} - before


def test_a_short_lived_forked_child_exports_its_own_regions_once(tmp_path: Path) -> None:
    """os.fork() inside a region; the child runs a few regions and exits at once (its exporter
    is built in the child, not lazily at interpreter shutdown); the inherited open region is
    exported only by the parent, and no span id repeats across the processes."""
    with OTLPReceiver("http") as receiver:
        run = run_app(tmp_path, """
            import os, sys
            import perfsdk
            with perfsdk.timed_region("warmup"):
                pass
            with perfsdk.timed_region("outer"):
                pid = os.fork()
                if pid == 0:
                    for i in range(3):
                        with perfsdk.timed_region("child_work", i=i):
                            pass
            if pid == 0:
                sys.exit(0)
            os.waitpid(pid, 0)
        """, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
                       PERFSDK_EXPORTER="otlp"))
        assert run.returncode == 0, run.stderr
        spans = receiver.wait_for_spans(5, timeout=LONG)
        time.sleep(0.2)  # nothing more arrives: a second "outer" would be a defect
        spans = receiver.spans()
    names = sorted(s.name for s in spans)
    assert names == ["child_work"] * 3 + ["outer", "warmup"], names
    assert len({s.span_id for s in spans}) == 5
    outer = next(s for s in spans if s.name == "outer")
    children = [s for s in spans if s.name == "child_work"]
    assert {s.parent_span_id for s in children} == {outer.span_id}
    assert {s.resource["process.pid"] for s in children} != {outer.resource["process.pid"]}
    assert "Traceback" not in run.stderr, run.stderr
    assert "were not exported" not in run.stderr, run.stderr
