"""perfsdk.export.metrics.MetricsSink: region records in, OpenTelemetry metrics out.

Records come from real perfsdk regions (captured from the pipeline); the metrics are read
through OpenTelemetry's own InMemoryMetricReader and exporters. The sinks here keep their
MeterProvider private (``global_provider=False``), so nothing is installed globally in the test
process; the global-provider scenarios (owned / user / off) run in subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import perfsdk
from perfsdk import errors
from perfsdk.config import Config
from perfsdk.export import metrics as metrics_module
from perfsdk.export.metrics import BUCKETS_MS, THROUGHPUT_BUCKETS, MetricsSink, rss_bytes
from perfsdk.pipeline import PIPELINE
from perfsdk.record import ATTRS, DEVICE_MS, ERROR, host_ms, spec_of
from tests.integration._scripts.harness import clean_env

SCRIPTS = Path(__file__).resolve().parents[1] / "integration" / "_scripts"


class _Grab:
    """A pipeline sink that keeps the raw record tuples."""

    def __init__(self) -> None:
        self.records: list[tuple[Any, ...]] = []

    def consume(self, records: list[tuple[Any, ...]]) -> None:
        self.records.extend(records)

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        pass


def records_of(work: Callable[[], None]) -> list[tuple[Any, ...]]:
    """The records perfsdk's pipeline hands its sinks for the regions ``work`` runs."""
    PIPELINE.drain(wait=True)
    grab = _Grab()
    PIPELINE.sinks.append(grab)
    try:
        work()
        PIPELINE.drain(wait=True)
    finally:
        PIPELINE.sinks.remove(grab)
    return grab.records


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Metric name -> its data points, from one collection of ``reader``."""
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            assert scope.scope.name == "perfsdk"
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def by_attrs(pts: list[Any]) -> dict[tuple[tuple[str, Any], ...], Any]:
    return {tuple(sorted(p.attributes.items())): p for p in pts}


def counts_by_name(reader: InMemoryMetricReader) -> dict[str, int]:
    return {p.attributes["perfsdk.region"]: p.count
            for p in points(reader)["perfsdk.region.duration"]}


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def sink(reader: InMemoryMetricReader) -> Iterator[MetricsSink]:
    s = MetricsSink(Config(exporters=(reader,)), global_provider=False)
    yield s
    s.shutdown(5.0)


def _work() -> None:
    for _ in range(3):
        with perfsdk.timed_region("fwd"):
            sum(range(2000))
    for _ in range(2):
        with perfsdk.timed_region("bwd"):
            sum(range(500))
    for exc in (ValueError("a"), ValueError("b"), KeyError("c")):
        with pytest.raises(type(exc)), perfsdk.timed_region("step"):
            raise exc


def test_duration_histogram_per_region_name(sink: MetricsSink, reader: InMemoryMetricReader):
    recs = records_of(_work)
    assert sink.mode == "owned"
    sink.consume(recs)
    hist = by_attrs(points(reader)["perfsdk.region.duration"])
    for name, error, n in (("fwd", False, 3), ("bwd", False, 2), ("step", True, 3)):
        mine = [host_ms(r) for r in recs if spec_of(r).name == name]
        point = hist.pop((("perfsdk.region", name), ("perfsdk.region.error", error)))
        assert point.count == len(mine) == n
        assert point.sum == pytest.approx(sum(mine), rel=1e-12, abs=0)
        assert (point.min, point.max) == (min(mine), max(mine))
        assert tuple(point.explicit_bounds) == BUCKETS_MS
        assert sum(point.bucket_counts) == n
    assert hist == {}


def test_step_throughput_histogram(sink: MetricsSink, reader: InMemoryMetricReader):
    """Steps given samples= feed perfsdk.step.throughput with their samples/s; other regions
    and steps without samples do not."""
    from perfsdk.auto import Steps

    def work() -> None:
        steps = Steps()
        for samples in (32, 64, None):
            with steps.step(samples=samples), perfsdk.timed_region("inner"):
                sum(range(2000))

    recs = records_of(work)
    sink.consume(recs)
    (point,) = points(reader)["perfsdk.step.throughput"]
    assert dict(point.attributes) == {"perfsdk.region": "step"}
    rates = [r[ATTRS]["perfsdk.samples_per_s"] for r in recs
             if r[ATTRS] and "perfsdk.samples_per_s" in r[ATTRS]]
    assert point.count == len(rates) == 2
    assert point.sum == pytest.approx(sum(rates))
    assert all(rate > 0 for rate in rates)


def test_errors_counted_per_region_and_type(sink: MetricsSink, reader: InMemoryMetricReader):
    recs = records_of(_work)
    assert sum(r[ERROR] is not None for r in recs) == 3
    sink.consume(recs[:6])  # a later batch adds to the same counts
    sink.consume(recs[6:])
    errors_ = by_attrs(points(reader)["perfsdk.region.errors"])
    assert {k: p.value for k, p in errors_.items()} == {
        (("error.type", "ValueError"), ("perfsdk.region", "step")): 2,
        (("error.type", "KeyError"), ("perfsdk.region", "step")): 1,
    }
    sink.consume(recs)
    again = points(reader)["perfsdk.region.errors"]
    assert {p.attributes["error.type"]: p.value for p in again} == {"ValueError": 4,
                                                                     "KeyError": 2}


def test_regions_the_pipeline_could_not_queue_are_counted(
        sink: MetricsSink, reader: InMemoryMetricReader, monkeypatch: pytest.MonkeyPatch):
    """Past the pending queue's bound a region reaches no histogram: the sink counts it in
    perfsdk.region.unrecorded (and its error, of unknown type), so the histograms' counts are
    not silently short of the calls."""
    PIPELINE.start()  # a first region starts it, under the lock held below
    PIPELINE.drain(wait=True)
    PIPELINE.sinks.append(sink)
    try:
        with PIPELINE._drain_lock:  # the pipeline thread drains nothing meanwhile
            monkeypatch.setattr(PIPELINE, "max_pending", len(PIPELINE.queue) + 3)
            for i in range(8):
                with contextlib.suppress(ValueError), perfsdk.timed_region("full"):
                    if i in (5, 6):
                        raise ValueError(i)
        monkeypatch.undo()
        PIPELINE.drain(wait=True)
    finally:
        PIPELINE.sinks.remove(sink)
    got = points(reader)
    assert counts_by_name(reader) == {"full": 3}  # the three the queue took
    (unrecorded,) = got["perfsdk.region.unrecorded"]
    assert unrecorded.value == 5
    assert dict(unrecorded.attributes) == {"perfsdk.region": "full"}
    (errors,) = got["perfsdk.region.errors"]
    assert errors.value == 2
    assert dict(errors.attributes) == {"perfsdk.region": "full", "error.type": "_OTHER"}


def test_device_histogram_only_for_regions_with_device_time(fake_cuda: Any,
                                                            sink: MetricsSink,
                                                            reader: InMemoryMetricReader):
    def work() -> None:
        with perfsdk.timed_region("gpu"):
            fake_cuda.launch(2.5)
        with perfsdk.timed_region("gpu"):
            fake_cuda.launch(1.5)
        fake_cuda.complete_all()

    recs = records_of(work)
    assert [r[DEVICE_MS] for r in recs] == [2.5, 1.5]
    sink.consume(recs)
    found = points(reader)
    (device,) = found["perfsdk.region.device_duration"]
    assert dict(device.attributes) == {"perfsdk.region": "gpu", "perfsdk.region.error": False}
    assert (device.count, device.sum, device.min, device.max) == (2, 4.0, 1.5, 2.5)
    assert found["perfsdk.region.duration"][0].count == 2


def test_no_device_histogram_without_device_time(sink: MetricsSink,
                                                 reader: InMemoryMetricReader):
    recs = records_of(_work)
    assert all(r[DEVICE_MS] is None for r in recs)
    sink.consume(recs)
    found = points(reader)
    assert "perfsdk.region.duration" in found
    assert "perfsdk.region.device_duration" not in found


def test_process_memory_usage_is_the_current_rss(sink: MetricsSink,
                                                 reader: InMemoryMetricReader):
    """Current RSS, not the peak: it rises with a buffer and falls when the buffer is freed."""
    sink.settle()

    def rss() -> int:
        (point,) = points(reader)["process.memory.usage"]
        assert point.attributes == {}
        return int(point.value)

    # Pages of its own, mapped and written here and unmapped after: a malloc'd buffer may reuse
    # memory the allocator kept resident from earlier tests (CI saw RSS not move at all).
    size = 256 * 2**20
    base = rss()
    buffer = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        buffer[offset] = 1  # written, so resident
    grown = rss()
    buffer.close()
    shrunk = rss()
    assert base > 10 * 2**20
    assert grown - base > 200 * 2**20
    assert grown - shrunk > 200 * 2**20


def test_rss_falls_back_to_peak_rss_without_proc(monkeypatch: pytest.MonkeyPatch):
    def no_proc(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("/proc/self/statm")

    monkeypatch.setattr(metrics_module, "open", no_proc, raising=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    value = rss_bytes()
    assert value is not None
    assert before <= value <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


GPU = {0: {"utilization": 0.75, "memory_used_bytes": 3.0e9, "power_w": 250.5,
           "temperature_c": 61.0, "energy_j": 1234.5},
       1: {"utilization": 0.25, "power_w": float("nan")}}


def test_gpu_instruments_report_the_readings(reader: InMemoryMetricReader):
    calls = []

    def readings() -> dict[int, dict[str, float]]:
        calls.append(1)
        return GPU

    sink = MetricsSink(Config(exporters=(reader,)), gpu_readings=readings, global_provider=False)
    sink.settle()
    found = points(reader)
    gpu0, gpu1 = (("hw.id", "0"), ("hw.type", "gpu")), (("hw.id", "1"), ("hw.type", "gpu"))
    values = {name: {k: p.value for k, p in by_attrs(found[name]).items()} for name in
              ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.energy",
               "hw.temperature")}
    assert values == {
        "hw.gpu.utilization": {gpu0: 0.75, gpu1: 0.25},
        "hw.gpu.memory.usage": {gpu0: 3_000_000_000},  # By: an integer
        "hw.power": {gpu0: 250.5},  # NaN is no reading
        "hw.energy": {gpu0: 1234.5},
        "hw.temperature": {gpu0: 61.0},
    }
    assert len(calls) == 5  # once per GPU instrument and collection
    sink.shutdown(5.0)


def test_failing_gpu_readings_warn_once_and_leave_the_rest(reader: InMemoryMetricReader):
    def broken() -> dict[int, dict[str, float]]:
        raise RuntimeError("NVML gone")

    sink = MetricsSink(Config(exporters=(reader,)), gpu_readings=broken, global_provider=False)
    sink.consume(records_of(_work))
    found = points(reader)
    assert "hw.power" not in found
    assert found["perfsdk.region.duration"]
    assert found["process.memory.usage"][0].value > 0
    assert errors.counts()["metrics-gpu"] == 5
    sink.shutdown(5.0)


class _Recording(MetricExporter):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.batches: list[Any] = []
        self.closed = False

    def export(self, metrics_data: Any, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        if self.fail:
            raise ConnectionError("collector down")
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.closed = True


def _names(batch: Any) -> set[str]:
    return {m.name for rm in batch.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}


def test_exporter_instances_are_read_periodically_and_on_flush():
    exporter = _Recording()
    sink = MetricsSink(Config(exporters=(exporter, InMemorySpanExporter()), service_name="svc"),
                       global_provider=False)
    sink.consume(records_of(_work))
    assert sink.mode == "owned"
    assert len(sink.exporters) == 1  # the span exporter is not a metrics exporter
    assert exporter.batches == []  # the periodic reader waits its interval (10 s)
    sink.flush(5.0)
    (batch,) = exporter.batches
    assert {"perfsdk.region.duration", "perfsdk.region.errors",
            "process.memory.usage"} <= _names(batch)
    assert batch.resource_metrics[0].resource.attributes["service.name"] == "svc"
    assert sink.stats() == {"metrics_mode": "owned", "metric_exports": 1,
                            "metric_exports_failed": 0}
    sink.shutdown(5.0)
    assert exporter.closed
    assert len(exporter.batches) == 2  # the last export at shutdown


def test_a_failing_exporter_warns_once_and_never_raises():
    exporter = _Recording(fail=True)
    sink = MetricsSink(Config(exporters=(exporter,)), global_provider=False)
    sink.consume(records_of(_work))
    sink.flush(5.0)
    sink.flush(5.0)
    assert errors.counts()["metrics-export:_Recording"] == 2
    assert sink.stats()["metric_exports_failed"] == 2
    sink.shutdown(5.0)


def test_no_exporters_is_off_and_makes_nothing():
    sink = MetricsSink(Config(exporters=(InMemorySpanExporter(),)), global_provider=False)
    sink.consume(records_of(_work))
    assert sink.mode == "off"
    assert sink._provider is None
    assert sink._instruments is None
    sink.flush(1.0)
    sink.shutdown(1.0)


def test_configure_moves_to_the_new_exporters(reader: InMemoryMetricReader):
    first, kept = _Recording(), InMemoryMetricReader()
    sink = MetricsSink(Config(exporters=(first, kept)), global_provider=False)
    recs = records_of(_work)
    sink.consume(recs)
    sink.configure(Config(exporters=(kept, reader), service_name="after"), timeout=5.0)
    assert first.closed
    assert len(first.batches) == 1  # a last export, then closed
    sink.consume(recs)
    sink.flush(5.0)
    assert len(first.batches) == 1
    assert counts_by_name(reader) == {"fwd": 3, "bwd": 2, "step": 3}  # only what came after
    assert counts_by_name(kept) == {"fwd": 6, "bwd": 4, "step": 6}  # kept across the change
    data = reader.get_metrics_data()
    assert data is not None
    assert data.resource_metrics[0].resource.attributes["service.name"] == "after"
    sink.shutdown(5.0)


def test_file_exporter_writes_json_lines(tmp_path: Path):
    sink = MetricsSink(Config(exporters=("file",), output_dir=tmp_path / "out"),
                       global_provider=False)
    sink.consume(records_of(_work))
    sink.flush(5.0)
    sink.shutdown(5.0)
    path = tmp_path / "out" / f"metrics-{os.getpid()}.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # the flush and the last export at shutdown
    for line in lines:
        data = json.loads(line)
        (scope,) = data["resource_metrics"][0]["scope_metrics"]
        hist = next(m for m in scope["metrics"] if m["name"] == "perfsdk.region.duration")
        counts = {p["attributes"]["perfsdk.region"]: p["count"]
                  for p in hist["data"]["data_points"]}
        assert counts == {"fwd": 3, "bwd": 2, "step": 3}


def test_console_exporter_prints_metrics(capsys: pytest.CaptureFixture[str]):
    sink = MetricsSink(Config(exporters=("console",)), global_provider=False)
    sink.consume(records_of(_work))
    sink.flush(5.0)
    out = capsys.readouterr().out
    assert '"name": "perfsdk.region.duration"' in out
    sink.shutdown(5.0)


# -- the global MeterProvider: one fresh interpreter per scenario ----------------------------
def _run(scenario: str, tmp_path: Path, **env: str) -> dict[str, Any]:
    result = tmp_path / f"{scenario}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "metrics_modes.py"), str(result), scenario],
        env=clean_env(**env), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        check=False)
    assert proc.returncode == 0, proc.stderr
    assert "MeterProvider" not in proc.stderr  # no "Overriding of current MeterProvider"
    data: dict[str, Any] = json.loads(result.read_text())
    data["stdout"] = proc.stdout
    return data


def test_owned_provider_is_installed_globally_when_the_app_has_none(tmp_path: Path):
    got = _run("owned", tmp_path, PERFSDK_EXPORTER="file", PERFSDK_OUTPUT_DIR=str(tmp_path))
    assert got["before"] == {"mode": "undecided", "global": "_ProxyMeterProvider"}
    assert got["mode"] == "owned"
    assert got["global_is_perfsdk"] is True
    assert got["region_counts"] == {"train": 4}
    # The app's counter fetched before perfsdk installed its provider counts from then on
    # (the proxy drops what came earlier), and one fetched after: both reach perfsdk's exporter.
    assert got["app_counters"] == {"app.early": 2, "app.late": 1}


def test_user_provider_is_used_and_left_alone(tmp_path: Path):
    got = _run("user", tmp_path, PERFSDK_EXPORTER="console")
    assert got["mode"] == "user"
    assert got["global_is_app"] is True
    assert got["readers_added"] == 0
    assert got["readers_on_app_provider"] == 1
    assert got["region_counts"] == {"train": 4}
    assert got["app_counters"] == {"app.early": 7, "app.late": 1}
    assert "perfsdk.region.duration" not in got["stdout"]  # no console metrics exporter made


def test_off_without_exporters_makes_nothing(tmp_path: Path):
    got = _run("off", tmp_path)
    assert got["mode"] == "off"
    assert got["provider_made"] is False
    assert got["global"] == "_ProxyMeterProvider"


# -- exporter instances through perfsdk.configure(): modules owned by the lead ---------------
def test_configure_accepts_a_metric_reader():
    reader = InMemoryMetricReader()
    assert perfsdk.configure(exporter=reader).exporters == (reader,)


def test_span_sink_leaves_metric_exporters_alone():
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    from perfsdk.export.otel import SpanSink

    spans = SpanSink(Config(exporters=(ConsoleMetricExporter(),)))
    spans._install_exporters()  # what its first region does, without a global provider
    assert spans.destinations == []


# -- perfsdk's own histogram aggregation (perfsdk.export.histograms) ----------------------------
def _timed(records: list[tuple[Any, ...]], ms: list[float],
           device: list[float | None] | None = None) -> list[tuple[Any, ...]]:
    """``records`` with host times of exactly ``ms`` (and device times ``device``)."""
    from perfsdk.record import T0, T1

    out = []
    for i, (rec, value) in enumerate(zip(records, ms, strict=True)):
        rec = (*rec[:T0], 10**9, 10**9 + round(value * 1e6), *rec[T1 + 1:])
        if device is not None:
            rec = (*rec[:DEVICE_MS], device[i], *rec[DEVICE_MS + 1:])
        out.append(rec)
    return out


def _hist_points(data: Any, name: str) -> dict[tuple[tuple[str, Any], ...], dict[str, Any]]:
    found = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for p in metric.data.data_points:
                        found[tuple(sorted(p.attributes.items()))] = {
                            "count": p.count, "sum": p.sum, "min": p.min, "max": p.max,
                            "buckets": tuple(p.bucket_counts),
                            "bounds": tuple(p.explicit_bounds),
                            "temporality": metric.data.aggregation_temporality,
                            "unit": metric.unit, "description": metric.description}
    return found


def _own_and_sdk(temporality: str) -> tuple[Any, MetricsSink, Any, MetricsSink]:
    """(exporter, a sink aggregating in perfsdk around it, reader, a sink through the SDK's
    instruments to it), both with ``temporality`` for histograms."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    chosen = {Histogram: AggregationTemporality[temporality.upper()]}
    exporter = _Recording()
    exporter._preferred_temporality = chosen
    ours = MetricsSink(Config(exporters=(exporter,)), global_provider=False)
    reader = InMemoryMetricReader(preferred_temporality=chosen)
    sdk = MetricsSink(Config(exporters=(reader,)), global_provider=False)
    return exporter, ours, reader, sdk


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_own_histograms_equal_the_sdks(temporality: str):
    """perfsdk's aggregation (a MetricExporter of perfsdk's) and the SDK's (a MetricReader) give
    the same points, export after export: values on bucket bounds, two blocks with one name,
    errors, device times, a stream that appears later and one with no new value."""
    exporter, ours, reader, sdk = _own_and_sdk(temporality)

    def work() -> None:
        _work()
        with perfsdk.timed_region("fwd"):  # a second block with the name "fwd"
            pass

    recs = records_of(work)
    rounds = [
        _timed(recs, [0.01, 1.0, 2.5, 0.3, 60000.0, 70000.0, 0.004, 5.0, 1.0],
               [0.5, None, 1.0, None, None, None, 0.25, None, 2.0]),
        _timed(recs[:3], [0.02, 0.01, 100.0]),  # only fwd: bwd and step get no new value
        _timed(recs, [float(i) for i in range(1, 10)]),
    ]
    for batch in rounds:
        ours.consume(batch)
        sdk.consume(batch)
        ours.flush(5.0)
        got = exporter.batches[-1]
        want = reader.get_metrics_data()
        for name in ("perfsdk.region.duration", "perfsdk.region.device_duration"):
            assert _hist_points(got, name) == _hist_points(want, name), name
    assert ours._instruments is not None
    assert ours._instruments.histograms is not None  # the values never reached the SDK
    assert sdk._instruments is not None
    assert sdk._instruments.histograms is None
    ours.shutdown(5.0)
    sdk.shutdown(5.0)


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_own_throughput_histogram_equals_the_sdks(temporality: str):
    """Steps' samples/s go into perfsdk's own aggregation too (the SDK's Histogram.record cost
    about 6 us a step on the pipeline thread): the same points as the SDK's, its default
    bounds, export after export, and none reached the SDK's instrument."""
    from perfsdk.auto import Steps

    exporter, ours, reader, sdk = _own_and_sdk(temporality)

    def work() -> None:
        steps = Steps()
        for samples in (32, 64, None, 8, 20000):
            with steps.step(samples=samples):
                sum(range(500))

    to_sdk: dict[str, int] = {"ours": 0, "sdk": 0}
    for round_ in range(2):  # a second export: cumulative adds up, delta starts again
        recs = records_of(work)
        ours.consume(recs)
        sdk.consume(recs)
        if round_ == 0:  # the instruments exist now: count what reaches the SDK's from here
            for key, sink in (("ours", ours), ("sdk", sdk)):
                assert sink._instruments is not None
                instrument = sink._instruments.throughput
                sink._instruments.throughput = _Counting(instrument, to_sdk, key)
        ours.flush(5.0)
        got = _hist_points(exporter.batches[-1], "perfsdk.step.throughput")
        want = _hist_points(reader.get_metrics_data(), "perfsdk.step.throughput")
        assert got == want
        ((attrs, point),) = got.items()
        assert attrs == (("perfsdk.region", "step"),)
        assert point["bounds"] == THROUGHPUT_BUCKETS
    assert ours._instruments is not None
    assert ours._instruments.histograms is not None
    assert to_sdk == {"ours": 0, "sdk": 4}  # round two's four steps with samples
    ours.shutdown(5.0)
    sdk.shutdown(5.0)


class _Counting:
    """An SDK instrument whose ``record`` calls are counted under ``key``."""

    def __init__(self, inner: Any, counts: dict[str, int], key: str) -> None:
        self.inner, self.counts, self.key = inner, counts, key

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.counts[self.key] += 1
        self.inner.record(*args, **kwargs)


def test_own_histograms_cumulative_points_keep_their_start():
    exporter = _Recording()
    sink = MetricsSink(Config(exporters=(exporter,)), global_provider=False)
    recs = records_of(_work)
    sink.consume(recs)
    sink.flush(5.0)
    sink.consume(recs)
    sink.flush(5.0)
    first, second = (
        {p.attributes["perfsdk.region"]: p for rm in b.resource_metrics
         for sm in rm.scope_metrics for m in sm.metrics if m.name == "perfsdk.region.duration"
         for p in m.data.data_points} for b in exporter.batches)
    for name, point in second.items():
        assert point.start_time_unix_nano == first[name].start_time_unix_nano
        assert point.time_unix_nano > first[name].time_unix_nano
        assert point.count == 2 * first[name].count
    sink.shutdown(5.0)


def test_a_metric_reader_or_another_aggregation_keeps_the_sdks_histograms():
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    exponential = _Recording()
    exponential._preferred_aggregation = {Histogram: ExponentialBucketHistogramAggregation()}
    for exporters in ((_Recording(), InMemoryMetricReader()), (exponential,)):
        sink = MetricsSink(Config(exporters=exporters), global_provider=False)
        sink.consume(records_of(_work))
        assert sink._instruments is not None
        assert sink._instruments.histograms is None, exporters
        sink.flush(5.0)
        recorded = next(e for e in exporters if isinstance(e, _Recording))
        names = {m.name for rm in recorded.batches[-1].resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics}
        assert "perfsdk.region.duration" in names
        sink.shutdown(5.0)
