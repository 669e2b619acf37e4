"""OpenTelemetry metrics from region records, through the same exporter choice as spans.

Recorded on the pipeline thread from resolved records, never on the training thread (meter
``perfsdk``): ``perfsdk.region.duration`` and ``perfsdk.region.device_duration`` (histograms, ms;
attributes ``perfsdk.region``, ``perfsdk.region.error``), ``perfsdk.region.errors`` (counter;
``perfsdk.region``, ``error.type``), ``perfsdk.region.unrecorded`` (counter: regions perfsdk's
pipeline could not queue, which the histograms lack; ``perfsdk.region``),
``perfsdk.step.throughput`` (histogram, samples/s of each
step given ``samples``; ``perfsdk.region``), ``process.memory.usage`` (RSS, By; an up-down
counter as the semantic conventions define it; where ``/proc`` is missing, the peak RSS from
``getrusage``) and, with a GPU readings callable, the hardware conventions'
``hw.gpu.utilization``,
``hw.gpu.memory.usage``, ``hw.power``, ``hw.energy``, ``hw.temperature`` (``hw.id``, ``hw.type``).

Modes, like spans: ``owned`` (perfsdk's SDK MeterProvider with a PeriodicExportingMetricReader
per exporter, every ``OTEL_METRIC_EXPORT_INTERVAL`` ms, default 10 s; made global if the app set
none), ``user`` (instruments from the application's provider; nothing added), ``off``.

In ``owned`` mode with perfsdk's own exporters only, the two duration histograms are aggregated
by perfsdk and added to each export (:mod:`perfsdk.export.histograms`: about 0.5 us a region
instead of the SDK's 6 to 7 us a ``Histogram.record``); with a ``MetricReader`` instance, an
exporter that wants another histogram aggregation, or in ``user`` mode (the application's Views
apply), each value goes to the SDK's instruments.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import Histogram as _HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation
from opentelemetry.sdk.resources import Resource

from perfsdk._version import __version__
from perfsdk.config import Config
from perfsdk.errors import MissingDependencyError, warn_once
from perfsdk.export.delivery import CAPTURE, capture_logs, classify, probe
from perfsdk.export.exporters import bounded
from perfsdk.export.histograms import Histograms, Stream, View
from perfsdk.export.spans import build_resource
from perfsdk.record import ATTRS, DEVICE_MS, ERROR, SPEC, SPECS, T0, T1, Record

__all__ = ["GpuReadings", "GuardedMetricExporter", "MetricsSink", "rss_bytes"]

GpuReadings = Callable[[], dict[int, dict[str, float]]]
"""Latest readings, cheap to call (once per GPU instrument and collection): ``{device index:
{"utilization" (0..1), "memory_used_bytes", "power_w", "temperature_c", "energy_j"}}``."""

# Histogram bucket bounds, advisory (an application's View wins): 10 us to 1 min.
BUCKETS_MS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0,
              500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0)
DEFAULT_INTERVAL_MS = 10_000.0  # OTel's own default is 60 s
DURATION, DEVICE = "perfsdk.region.duration", "perfsdk.region.device_duration"
THROUGHPUT = "perfsdk.step.throughput"
UNRECORDED = "perfsdk.region.unrecorded"
THROUGHPUT_BUCKETS = (0.0, 5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 250.0, 500.0, 750.0, 1000.0,
                      2500.0, 5000.0, 7500.0, 10000.0)
"""The SDK's default explicit bucket bounds, which the throughput histogram has always had."""
DESCRIBED = {DURATION: ("Host time of a region.", "ms"), DEVICE: ("Device time of a region.", "ms"),
             THROUGHPUT: ("Samples per second of a step (perfsdk.step(samples=...)).",
                          "{sample}/s")}
"""The histograms perfsdk can aggregate itself (perfsdk.export.histograms): description, unit."""
_GPU_METRICS = (  # (instrument, kind, unit, reading key, description)
    ("hw.gpu.utilization", "gauge", "1", "utilization", "Fraction of time the GPU was busy."),
    ("hw.gpu.memory.usage", "updown", "By", "memory_used_bytes", "GPU memory used."),
    ("hw.power", "gauge", "W", "power_w", "Power drawn by the GPU."),
    ("hw.energy", "counter", "J", "energy_j", "Energy used by the GPU."),
    ("hw.temperature", "gauge", "Cel", "temperature_c", "GPU temperature."),
)
for _name in ("opentelemetry.exporter.otlp.proto.http.metric_exporter",
              "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
              "opentelemetry.sdk.metrics._internal", "opentelemetry.sdk.metrics._internal.export"):
    logging.getLogger(_name).addFilter(CAPTURE)


def _placeholder(provider: metrics.MeterProvider) -> bool:
    """Whether ``provider`` is the OpenTelemetry API's stand-in, i.e. no application set one.

    The one use of an OpenTelemetry internal: the metrics API has no public name for its
    stand-in (the trace API has ``trace.ProxyTracerProvider``; ``opentelemetry.metrics`` exports
    no proxy class, up to opentelemetry-api 1.45), and no public call says whether a provider
    was set. ``isinstance(provider, sdk.MeterProvider)`` would not do: an application may set
    ``NoOpMeterProvider`` or another implementation, and perfsdk must then use it."""
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    return isinstance(provider, _ProxyMeterProvider)


def rss_bytes() -> int | None:
    """Current resident set size (a few us on Linux); without ``/proc``, the peak RSS."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource
        except ImportError:  # Windows
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class GuardedMetricExporter(MetricExporter):
    """A failure warns once and is counted (the next cumulative export carries the data); in a
    forked child it drops everything, the copy of the parent's state."""

    def __init__(self, inner: MetricExporter, label: str, target: str = "") -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner, self.label, self.target, self.pid = inner, label, target, os.getpid()
        self.exported = self.failed = 0
        self.histograms: Histograms | None = None
        self.view: View | None = None

    @property
    def temporality(self) -> AggregationTemporality:
        """The temporality this exporter asks for histograms (cumulative unless it says)."""
        preferred = self._preferred_temporality or {}
        return preferred.get(_HistogramInstrument, AggregationTemporality.CUMULATIVE)

    @property
    def injectable(self) -> bool:
        """Whether perfsdk's own histogram points are what the SDK would give this exporter:
        it takes the default aggregation for histograms (explicit buckets, the bounds the
        instrument advises)."""
        preferred = (self._preferred_aggregation or {}).get(_HistogramInstrument)
        return preferred is None or type(preferred) is DefaultAggregation

    def attach(self, histograms: Histograms, resource: Resource) -> None:
        """From now on each export carries ``histograms``' points (perfsdk.export.histograms)."""
        self.histograms, self.view = histograms, histograms.view(self.temporality, resource)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        if os.getpid() != self.pid:
            return MetricExportResult.SUCCESS
        with capture_logs() as said:
            try:
                if self.view is not None and self.histograms is not None:
                    metrics_data = self.histograms.inject(self.view, metrics_data) or \
                        metrics_data
                result = self.inner.export(metrics_data, timeout_millis=timeout_millis)
            except Exception as exc:
                result = MetricExportResult.FAILURE
                said.append(repr(exc))
        self.exported += result is MetricExportResult.SUCCESS
        if result is not MetricExportResult.SUCCESS:
            self.failed += 1
            text = " ".join(said)
            _, cause = classify(text)
            if cause == "timeout" and "max retries" in text and self.target:
                cause = probe(self.target) or cause
            target = f" to {self.target}" if self.target else ""
            warn_once(f"metrics-export:{self.label}", f"perfsdk: the {self.label} exporter "
                      f"could not deliver metrics{target}: {cause}; the program continues "
                      "(failures are counted in perfsdk.diagnostics()['metric_exports_failed']).")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return os.getpid() != self.pid or bool(self.inner.force_flush(timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if self.view is not None and self.histograms is not None:
            self.histograms.forget(self.view)  # after the last export (the reader's shutdown)
            self.view = None
        if os.getpid() == self.pid:
            with capture_logs():
                self.inner.shutdown(timeout_millis=timeout_millis)


class _JsonLinesMetrics(ConsoleMetricExporter):
    """One ``MetricsData`` JSON a line in ``<output_dir>/metrics-<pid>.jsonl``."""

    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / f"metrics-{os.getpid()}.jsonl"
        super().__init__(out=path.open("a", encoding="utf-8"),
                         formatter=lambda data: data.to_json(indent=None) + "\n")

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.out.close()


def otlp_metric_exporter(export_timeout: float = 5.0) -> MetricExporter:
    """OTLPMetricExporter over ``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL`` (default http/protobuf);
    without ``OTEL_EXPORTER_OTLP_[METRICS_]TIMEOUT`` an export waits at most ``export_timeout``."""
    env = os.environ
    protocol = (env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol not in ("grpc", "http/protobuf"):
        warn_once("otlp-metrics-protocol", f"perfsdk: OTLP protocol {protocol!r} is not "
                  "supported; accepted values are grpc, http/protobuf. Using http/protobuf.")
    kind = "grpc" if protocol == "grpc" else "http"
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{kind}"
                                         ".metric_exporter")
    except ImportError:
        raise MissingDependencyError(
            "opentelemetry-exporter-otlp", "otlp", "The otlp exporter") from None
    own = env.get("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT") or env.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    exporter: MetricExporter = module.OTLPMetricExporter(timeout=None if own else export_timeout)
    return exporter


class _Instruments:
    """perfsdk's instruments on one meter, and the recording of one batch of records."""

    def __init__(self, meter: Meter, sink: MetricsSink) -> None:
        self.duration = meter.create_histogram(
            DURATION, unit="ms", description=DESCRIBED[DURATION][0],
            explicit_bucket_boundaries_advisory=BUCKETS_MS)
        self.device = meter.create_histogram(
            DEVICE, unit="ms", description=DESCRIBED[DEVICE][0],
            explicit_bucket_boundaries_advisory=BUCKETS_MS)
        self.errors = meter.create_counter(
            "perfsdk.region.errors", unit="{error}", description="Regions left by an exception.")
        self.throughput = meter.create_histogram(
            THROUGHPUT, unit=DESCRIBED[THROUGHPUT][1], description=DESCRIBED[THROUGHPUT][0])
        self.unrecorded = meter.create_counter(
            UNRECORDED, unit="{region}", description="Regions perfsdk's pipeline could not "
            "queue (its pending queue was full): counted here, absent from the histograms.")
        meter.create_observable_up_down_counter(
            "process.memory.usage", [lambda _: [Observation(v) for v in (rss_bytes(),) if v]],
            unit="By", description="The amount of physical memory in use.")
        make: dict[str, Callable[..., Any]] = {
            "gauge": meter.create_observable_gauge, "counter": meter.create_observable_counter,
            "updown": meter.create_observable_up_down_counter}
        for name, kind, unit, key, text in _GPU_METRICS if sink.gpu_readings else ():
            make[kind](name, [sink._gpu_callback(key, unit == "By")], unit=unit, description=text)
        self._attrs: dict[tuple[str, bool], dict[str, Any]] = {}
        self.histograms: Histograms | None = None
        """Set when perfsdk aggregates the duration histograms itself (perfsdk's own exporters
        only): their values go there instead of to the instruments above."""

    def record(self, records: list[Record]) -> None:
        throughput: list[tuple[float, str]] = []
        errors: dict[tuple[str, str], int] = {}
        for rec in records:
            extra = rec[ATTRS]
            if extra and "perfsdk.samples_per_s" in extra:  # a step with samples
                throughput.append((extra["perfsdk.samples_per_s"], SPECS[rec[SPEC]].name))
            error = rec[ERROR]
            if error is not None:
                kind = type(error)
                counted = (SPECS[rec[SPEC]].name, kind.__qualname__ if kind.__module__ ==
                           "builtins" else f"{kind.__module__}.{kind.__qualname__}")
                errors[counted] = errors.get(counted, 0) + 1
        histograms = self.histograms
        if histograms is not None:
            with histograms.lock:  # one lock a batch; an export takes it to read
                self._aggregate(records, histograms.pending)
                if throughput:
                    self._aggregate_throughput(throughput, histograms.pending)
        else:
            self._record(records)
            for rate, name in throughput:  # about 6 us each, on the pipeline thread
                self.throughput.record(rate, {"perfsdk.region": name})
        for (name, etype), n in errors.items():  # one add per name and type in the batch
            self.errors.add(n, {"perfsdk.region": name, "error.type": etype})

    def tally(self, overflow: dict[int, list[int]]) -> None:
        """Regions the pipeline could not queue (``{spec index: [calls, host ns, errors]}``):
        their calls in ``perfsdk.region.unrecorded``, their errors in ``perfsdk.region.errors``
        (of unknown type: ``_OTHER``, as the semantic conventions name it)."""
        by_name: dict[str, list[int]] = {}
        for index, (calls, _, errors) in overflow.items():
            counts = by_name.setdefault(SPECS[index].name, [0, 0])
            counts[0] += calls
            counts[1] += errors
        for name, (calls, errors) in by_name.items():
            self.unrecorded.add(calls, {"perfsdk.region": name})
            if errors:
                self.errors.add(errors, {"perfsdk.region": name, "error.type": "_OTHER"})

    def _attributes(self, key: tuple[str, bool]) -> dict[str, Any]:
        attrs = self._attrs[key] = {"perfsdk.region": key[0], "perfsdk.region.error": key[1]}
        return attrs  # one dict per region name and outcome, reused

    def _record(self, records: list[Record]) -> None:
        """Each value into the OpenTelemetry instruments (about 6 us each)."""
        attrs_of, duration, device = self._attrs, self.duration.record, self.device.record
        for rec in records:
            key = (SPECS[rec[SPEC]].name, rec[ERROR] is not None)
            attrs = attrs_of.get(key) or self._attributes(key)
            duration((rec[T1] - rec[T0]) / 1e6, attrs)
            device_ms = rec[DEVICE_MS]
            if device_ms is not None:
                device(device_ms, attrs)

    def _aggregate(self, records: list[Record], pending: dict[Any, Stream]) -> None:
        """Each value into perfsdk's own streams (perfsdk.export.histograms), under its lock."""
        attrs_of, now = self._attrs, 0
        for rec in records:  # one stream per attribute set, as the SDK: regions declared in
            key = (SPECS[rec[SPEC]].name, rec[ERROR] is not None)  # two places share a name
            stream = pending.get(key)
            if stream is None:
                now = now or time.time_ns()
                stream = pending[key] = Stream(DURATION, attrs_of.get(key) or
                                               self._attributes(key), BUCKETS_MS, now)
            stream.add((rec[T1] - rec[T0]) / 1e6)
            device_ms = rec[DEVICE_MS]
            if device_ms is not None:
                dkey = (DEVICE, key)
                stream = pending.get(dkey)
                if stream is None:
                    now = now or time.time_ns()
                    stream = pending[dkey] = Stream(DEVICE, attrs_of.get(key) or
                                                    self._attributes(key), BUCKETS_MS, now)
                stream.add(device_ms)


    def _aggregate_throughput(self, throughput: list[tuple[float, str]],
                              pending: dict[Any, Stream]) -> None:
        """Steps' samples/s into perfsdk's own streams, as :meth:`_aggregate` does durations."""
        for rate, name in throughput:
            key = (THROUGHPUT, name)
            stream = pending.get(key)
            if stream is None:
                stream = pending[key] = Stream(THROUGHPUT, {"perfsdk.region": name},
                                               THROUGHPUT_BUCKETS, time.time_ns())
            stream.add(rate)


class MetricsSink:
    """Region metrics for perfsdk's own readers or the application's MeterProvider.

    Args:
        config: exporters (``otlp``, ``console``, ``file``, OTel ``MetricExporter`` or
            ``MetricReader`` instances; span exporters are ignored), output_dir, service_name.
        gpu_readings: latest GPU readings (:data:`GpuReadings`); adds the ``hw.*`` instruments.
        global_provider: False keeps perfsdk's MeterProvider private (for tests and embedding).
    """

    def __init__(self, config: Config, gpu_readings: GpuReadings | None = None, *,
                 global_provider: bool = True) -> None:
        self.config, self.gpu_readings, self._global = config, gpu_readings, global_provider
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._provider: MeterProvider | None = None  # perfsdk's, once made
        self._instruments: _Instruments | None = None
        self._instruments_for: object = None
        self._built: list[MetricReader] = []  # readers perfsdk made
        self._given: list[MetricReader] = []  # MetricReader instances from the configuration
        self._orphans: list[MetricReader] = []  # in a forked child: copies of the parent's
        self.exporters: list[GuardedMetricExporter] = []
        self._histograms = Histograms(DESCRIBED)

    def configure(self, config: Config, timeout: float | None = None) -> None:
        """Adopt a new configuration: perfsdk's readers export once more and close; new ones
        are made on next use. MetricReader instances still in the configuration stay."""
        with self._lock:
            stay = [r for r in self._given if any(r is e for e in config.exporters)]
            old = self._built + [r for r in self._given if not any(r is s for s in stay)]
            self._built, self._given, self.exporters = [], stay, []
            self.config, self._mode, provider = config, None, self._provider
            _set_resource(provider, config)
        _retire(provider, old, config.export_timeout_s if timeout is None else timeout)

    @property
    def mode(self) -> str:
        """``owned`` (perfsdk's readers), ``user`` (the app's MeterProvider) or ``off``."""
        with self._lock:
            if self._mode is None:
                self._mode = self._decide()
            return self._mode

    def _decide(self) -> str:
        if self._global:
            current = metrics.get_meter_provider()
            if current is not self._provider and not _placeholder(current):
                self._use(current)
                return "user"
        if self._orphans:  # in a forked child: the parent's readers go; the resource is ours
            _retire(self._provider, self._orphans, self.config.export_timeout_s)
            self._orphans = []
            _set_resource(self._provider, self.config)
        readers = self._readers()
        if not readers:
            return "off"
        provider = self._provider
        if provider is None:
            provider = MeterProvider(resource=build_resource(self.config), shutdown_on_exit=False)
            if self._global:  # if another thread set one just now, ours stays private
                with capture_logs():
                    metrics.set_meter_provider(provider)
            self._provider = provider
        with capture_logs():  # a MetricReader instance kept from the last configuration: a no-op
            for reader in readers:
                provider.add_metric_reader(reader)
        self._use(provider)
        self._own_histograms()
        return "owned"

    def _own_histograms(self) -> None:
        """Aggregate the duration histograms in perfsdk (perfsdk.export.histograms) when every
        reader is one perfsdk made around an exporter that takes the SDK's default histogram
        aggregation; else each value goes to the instruments (a MetricReader instance, such as
        a Prometheus reader, reads only what the SDK holds)."""
        built = self.exporters[len(self.exporters) - len(self._built):]  # this decision's
        own = bool(built) and not self._given and all(e.injectable for e in built)
        if own:
            resource = build_resource(self.config)
            for exporter in built:
                if exporter.view is None:
                    exporter.attach(self._histograms, resource)
        if self._instruments is not None:
            self._instruments.histograms = self._histograms if own else None

    def _use(self, provider: metrics.MeterProvider) -> None:
        if self._instruments_for is not provider:
            self._instruments = _Instruments(provider.get_meter("perfsdk", __version__), self)
            self._instruments_for = provider
        if self._instruments is not None:
            self._instruments.histograms = None  # the instruments, unless _own_histograms says

    def _readers(self) -> list[MetricReader]:
        config, env = self.config, os.environ  # OTel reads its own variables when they are set
        interval = None if env.get("OTEL_METRIC_EXPORT_INTERVAL") else DEFAULT_INTERVAL_MS
        timeout = None if env.get("OTEL_METRIC_EXPORT_TIMEOUT") else config.export_timeout_s * 1e3
        for item in config.exporters:
            if isinstance(item, MetricReader):
                if not any(item is r for r in self._given):
                    self._given.append(item)
                continue
            try:
                if isinstance(item, MetricExporter):
                    inner, label = item, type(item).__name__
                elif item == "otlp":
                    inner, label = otlp_metric_exporter(config.export_timeout_s), "otlp"
                elif item == "console":
                    inner, label = ConsoleMetricExporter(out=sys.stdout), "console"
                elif item == "file":
                    inner, label = _JsonLinesMetrics(config.output_dir), "file"
                else:
                    continue  # a span exporter
            except Exception as exc:
                warn_once(f"exporter:{item}",
                          f"perfsdk: cannot use the {item} exporter for metrics: {exc}")
                continue
            exporter = GuardedMetricExporter(inner, label, str(getattr(inner, "_endpoint", "")))
            self.exporters.append(exporter)
            self._built.append(PeriodicExportingMetricReader(exporter, interval, timeout))
        return self._built + self._given

    def consume(self, records: list[Record]) -> None:
        if self.mode != "off" and self._instruments is not None:
            self._instruments.record(records)

    def tally(self, overflow: dict[int, list[int]]) -> None:
        """Regions the pipeline could not queue: counted, so that the histograms' counts are
        not silently short of the calls (``perfsdk.region.unrecorded``)."""
        if self.mode != "off" and self._instruments is not None:
            self._instruments.tally(overflow)

    def _gpu_callback(self, key: str, integer: bool) -> Callable[[CallbackOptions],
                                                                 Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            try:
                readings = self.gpu_readings() if self.gpu_readings is not None else {}
            except Exception as exc:
                warn_once("metrics-gpu", f"perfsdk: reading the GPU for metrics failed "
                          f"({exc!r}); the GPU instruments are left out.")
                return ()
            return [Observation(int(value) if integer else value,
                                {"hw.id": str(index), "hw.type": "gpu"})
                    for index, values in readings.items()
                    if (value := values.get(key)) is not None and math.isfinite(value)]
        return observe

    def flush(self, timeout: float) -> None:
        """Export now: perfsdk's readers, or the application's provider in ``user`` mode."""
        if self._mode == "owned":
            readers = self._built + self._given
            bounded(lambda: [r.force_flush(timeout * 1000) for r in readers], timeout, "flush",
                    "metrics")
        elif self._mode == "user":
            flush = getattr(metrics.get_meter_provider(), "force_flush", None)
            if flush is not None:
                bounded(lambda: flush(timeout * 1000), timeout, "flush", "metrics")

    def shutdown(self, timeout: float) -> None:
        """A last export and close; a later region makes new readers."""
        if self._mode == "user":
            self.flush(timeout)  # the application shuts its provider down itself
            return
        with self._lock:
            readers, self._built, self._given, self._mode = self._built + self._given, [], [], None
        _retire(self._provider, readers, timeout)

    def settle(self) -> None:
        """Decide where metrics go (building readers and exporters): on the pipeline thread,
        at its first round, never on the caller's."""
        _ = self.mode

    def after_fork(self) -> None:
        """In a forked child: new readers on first use; the parent's copies are closed then."""
        self._lock = threading.Lock()
        self._orphans, self._built, self.exporters = self._orphans + self._built, [], []
        self._mode = None
        self._histograms.reset()

    def stats(self) -> dict[str, Any]:
        return {"metrics_mode": self._mode or "undecided",
                "metric_exports": sum(e.exported for e in self.exporters),
                "metric_exports_failed": sum(e.failed for e in self.exporters)}


def _set_resource(provider: MeterProvider | None, config: Config) -> None:
    update = getattr(provider, "_update_resource", None)  # OTel SDK >= 1.39
    if update is not None:
        update(build_resource(config))


def _retire(provider: MeterProvider | None, readers: list[MetricReader], timeout: float) -> None:
    """Shut readers down (a last export each) and detach them from the provider, bounded."""
    def run() -> None:
        with capture_logs():  # the guard has warned about export trouble; OTel would log it again
            for reader in readers:
                reader.shutdown(timeout_millis=timeout * 1000)
                if provider is not None:
                    provider.remove_metric_reader(reader)
    if readers:
        bounded(run, timeout, "shutdown", "metrics")
