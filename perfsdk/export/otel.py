"""OpenTelemetry spans from finished regions: the only module that imports the OTel SDK.

Spans are built in the background from region records, never on the training thread:

* **perfsdk's own pipeline** (``PERFSDK_EXPORTER`` = ``otlp``, ``console``, ``file``): perfsdk
  creates an SDK ``TracerProvider`` with those exporters and installs it globally *only if the
  application has none*, so the user's own spans reach the same backend. Region spans are built
  directly as ``ReadableSpan`` objects with the ids that were handed out at enter and fed to the
  span processors, which skips the tracer machinery (about 10 us a span).
* **the application's provider**: if the application installed a TracerProvider, perfsdk uses
  it through the public tracer API and adds no processor, exporter or resource of its own.

Exporters come from OpenTelemetry itself: OTLP over gRPC or HTTP/protobuf (chosen by the standard
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, default ``http/protobuf``), console, and a JSON-lines
file (the console exporter writing to ``<output_dir>/spans-<pid>.jsonl``). A failing exporter
warns once and counts its failures; exit waits at most ``PERFSDK_EXPORT_TIMEOUT`` seconds.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from perfsdk import _device, clocks
from perfsdk import record as _record
from perfsdk._version import __version__
from perfsdk.config import Config
from perfsdk.errors import MissingDependencyError, warn_once
from perfsdk.record import (
    DEVICE_MS,
    ERROR,
    EVENTS,
    PARENT,
    SPAN,
    SPEC,
    SPECS,
    T0,
    T1,
    THREAD,
    TRACE,
    Record,
)

__all__ = ["SpanSink", "build_resource", "make_exporter", "region_attributes", "region_span"]

SCOPE = InstrumentationScope("perfsdk", __version__)
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)


def build_resource(config: Config) -> Resource:
    """``service.name``, ``host.name``, ``process.*``, torch version and, when the application
    has initialized CUDA, the GPU name; ``OTEL_RESOURCE_ATTRIBUTES`` is merged in by OTel."""
    attrs: dict[str, Any] = {
        "service.name": config.service_name,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "process.runtime.name": platform.python_implementation().lower(),
        "process.runtime.version": platform.python_version(),
        "perfsdk.version": __version__,
        "perfsdk.torch.version": torch.__version__,
    }
    device = _device.active()
    if device is not None:
        try:
            attrs["perfsdk.gpu.name"] = device.get_device_name()
        except Exception:
            pass
    return Resource.create(attrs)


def region_attributes(rec: Record) -> dict[str, Any]:
    """Declared, per-call and set-while-running attributes plus the measured times."""
    attrs = _record.attributes(rec)
    attrs["perfsdk.host_ms"] = (rec[T1] - rec[T0]) / 1e6
    device_ms = rec[DEVICE_MS]
    if device_ms is not None:
        attrs["perfsdk.device_ms"] = device_ms
    attrs["thread.id"] = rec[THREAD]
    return attrs


def _exception_event(error: BaseException, timestamp: int) -> Event:
    return Event("exception", {
        "exception.type": f"{type(error).__module__}.{type(error).__qualname__}"
        if type(error).__module__ != "builtins" else type(error).__qualname__,
        "exception.message": str(error),
        "exception.stacktrace": "".join(
            traceback.format_exception(type(error), error, error.__traceback__)),
        "exception.escaped": True,
    }, timestamp)


_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NO_EVENTS: tuple[Event, ...] = ()


def _status(error: BaseException | None) -> Status:
    if error is None:
        return _UNSET
    return Status(StatusCode.ERROR, f"{type(error).__qualname__}: {error}")


def region_span(rec: Record, resource: Resource) -> ReadableSpan:
    """The finished span of a region, with the ids it was given at enter."""
    trace_id = rec[TRACE]
    error = rec[ERROR]
    if rec[EVENTS] is None and error is None:
        events: Sequence[Event] = _NO_EVENTS
    else:
        events = [Event(n, a, t) for n, a, t in rec[EVENTS] or ()]
        if error is not None:
            events.append(_exception_event(error, clocks.epoch_ns(rec[T1])))
    parent_id = rec[PARENT]
    return ReadableSpan(
        SPECS[rec[SPEC]].name,
        SpanContext(trace_id, rec[SPAN], False, _SAMPLED),
        SpanContext(trace_id, parent_id, False, _SAMPLED) if parent_id else None,
        resource,
        region_attributes(rec),
        events,
        (),
        SpanKind.INTERNAL,
        None,
        _status(error),
        clocks.epoch_ns(rec[T0]),
        clocks.epoch_ns(rec[T1]),
        SCOPE,
    )


# -- exporters ---------------------------------------------------------------------------------
class _Quiet(logging.Filter):
    """Drops OTel exporter log records on a thread while a guarded export runs there; the guard
    reports the failure once instead of a retry message per batch."""

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.local, "depth", 0):
            self.local.dropped = getattr(self.local, "dropped", 0) + 1
            return False
        return True


_QUIET = _Quiet()
for _name in _EXPORTER_LOGGERS:
    logging.getLogger(_name).addFilter(_QUIET)


class GuardedExporter(SpanExporter):
    """Wraps an OTel exporter: a failure warns once (naming the exporter) and is counted.

    After a failure the exporter rests for ``backoff`` seconds: batches in that window are
    counted as dropped at once instead of each waiting out the exporter's own retries, so an
    unreachable collector costs the program neither time nor memory.
    """

    def __init__(self, inner: SpanExporter, label: str, backoff: float = 30.0) -> None:
        self.inner = inner
        self.label = label
        self.backoff = backoff
        self.exported = 0
        self.failed = 0
        self.dropped = 0
        self._rest_until = 0.0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._rest_until and time.monotonic() < self._rest_until:
            self.dropped += len(spans)
            return SpanExportResult.FAILURE
        local = _Quiet.local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            result = SpanExportResult.FAILURE
            reason = repr(exc)
        else:
            reason = "the exporter reported failure"
        finally:
            local.depth -= 1
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self._rest_until = 0.0
        else:
            self.failed += len(spans)
            self._rest_until = time.monotonic() + self.backoff
            warn_once(f"export:{self.label}",
                      f"perfsdk: the {self.label} exporter could not deliver spans ({reason}); "
                      f"the program continues; spans are dropped for {self.backoff:g} s after "
                      "each failure and counted in perfsdk.diagnostics().")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def _otlp_exporter(export_timeout: float = 5.0) -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            if protocol != "http/protobuf":
                warn_once("otlp-protocol", f"perfsdk: OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} "
                          "is not supported; accepted values are grpc, http/protobuf. "
                          "Using http/protobuf.")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
    except ImportError:
        raise MissingDependencyError(
            "opentelemetry-exporter-otlp", "otlp", "The otlp exporter") from None
    timeout = None
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        # OTel's default is 10 s of retries per batch; without the user's own choice, keep
        # one batch within perfsdk's export bound so exit is never held longer than that.
        timeout = export_timeout
    exporter: SpanExporter = OTLPSpanExporter(timeout=timeout)
    return exporter


def make_exporter(name: Any, config: Config) -> SpanExporter:
    """The exporter for one ``PERFSDK_EXPORTER`` name (or a user's SpanExporter), guarded."""
    if not isinstance(name, str):
        return GuardedExporter(name, type(name).__name__)
    if name == "otlp":
        return GuardedExporter(_otlp_exporter(config.export_timeout_s), "otlp")
    if name == "console":
        return GuardedExporter(ConsoleSpanExporter(), "console")
    if name == "file":
        return GuardedExporter(_JsonLinesFile(config.output_dir), "file")
    raise ValueError(f"unknown exporter {name!r}")


class _JsonLinesFile(ConsoleSpanExporter):
    """OTel's console exporter and span JSON, one span per line, to a file opened on first use."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(formatter=lambda span: span.to_json(indent=None) + "\n")
        self.path = output_dir / f"spans-{os.getpid()}.jsonl"
        self._file: IO[str] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write("".join(self.formatter(span) for span in spans))
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Fanout(SpanProcessor):
    """perfsdk's processor on its own provider: forwards the user's spans to our exporters."""

    def __init__(self) -> None:
        self.processors: list[SpanProcessor] = []

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        for p in self.processors:
            p.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for p in self.processors:
            p.on_end(span)

    def shutdown(self) -> None:
        """perfsdk shuts its processors down itself, with a bound."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self.processors)


class _PresetIds(IdGenerator):
    """Hands the tracer the ids a region was given at enter; random ones otherwise."""

    def __init__(self, fallback: IdGenerator | None) -> None:
        self.fallback = fallback
        self.span_id = 0
        self.trace_id = 0

    def generate_span_id(self) -> int:
        value, self.span_id = self.span_id, 0
        if value:
            return value
        return self.fallback.generate_span_id() if self.fallback else 1

    def generate_trace_id(self) -> int:
        value, self.trace_id = self.trace_id, 0
        if value:
            return value
        return self.fallback.generate_trace_id() if self.fallback else 1


class SpanSink:
    """Turns resolved regions into spans for perfsdk's own exporters or the user's provider."""

    def __init__(self, config: Config) -> None:
        self._lock = threading.Lock()
        self._provider: TracerProvider | None = None
        self._fanout = _Fanout()
        self.configure(config)

    # -- set-up ----------------------------------------------------------------------------
    def configure(self, config: Config, timeout: float | None = None) -> None:
        """Adopt a new configuration; perfsdk's previous exporters are flushed and closed."""
        with self._lock:
            old = list(self._fanout.processors)
            self.config = config
            self._resource: Resource | None = None
            self._mode: str | None = None
            self._tracer: Any = None
            self._fanout.processors = []
            self.exporters: list[GuardedExporter] = []
        _shutdown_bounded(old, timeout if timeout is not None else config.export_timeout_s)

    def validate(self) -> None:
        """Raise now (e.g. a missing OTLP package) when the user asked for exporters explicitly."""
        if "otlp" in self.config.exporters:
            _otlp_exporter().shutdown()

    @property
    def resource(self) -> Resource:
        if self._resource is None:
            self._resource = build_resource(self.config)
        return self._resource

    def _decide(self) -> str:
        current = trace.get_tracer_provider()
        if self._provider is not None and current is self._provider:
            if not self._fanout.processors:
                self._install_exporters()
            return "owned" if self._fanout.processors else "off"
        if not isinstance(current, trace.ProxyTracerProvider):
            self._tracer = current.get_tracer("perfsdk", __version__)
            fallback = getattr(self._tracer, "id_generator", None)
            if isinstance(fallback, IdGenerator):
                self._tracer.id_generator = _PresetIds(fallback)
            return "user"
        if not self.config.exporters:
            return "off"
        self._install_exporters()
        if not self._fanout.processors:
            return "off"
        provider = TracerProvider(resource=self.resource, shutdown_on_exit=False)
        provider.add_span_processor(self._fanout)
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is provider:
            self._provider = provider
            return "owned"
        return self._decide()  # someone else won the race: use theirs

    def _install_exporters(self) -> None:
        for name in self.config.exporters:
            try:
                exporter = make_exporter(name, self.config)
            except Exception as exc:
                warn_once(f"exporter:{name}", f"perfsdk: cannot use the {name} exporter: {exc}")
                continue
            self.exporters.append(exporter)  # type: ignore[arg-type]
            # For the application's own spans on perfsdk's provider; region spans skip it.
            self._fanout.processors.append(
                BatchSpanProcessor(exporter, schedule_delay_millis=1000))

    @property
    def mode(self) -> str:
        """``owned`` (perfsdk's exporters), ``user`` (the app's provider) or ``off``."""
        with self._lock:
            if self._mode is None:
                self._mode = self._decide()
            return self._mode

    # -- the sink --------------------------------------------------------------------------
    def consume(self, records: list[Record]) -> None:
        mode = self.mode
        if mode == "owned":
            # The pipeline thread already batches: export directly, no second queue.
            resource = self.resource
            spans = [region_span(rec, resource) for rec in records]
            for exporter in self.exporters:
                exporter.export(spans)
        elif mode == "user":
            for rec in records:
                self._through_tracer(rec)

    def _through_tracer(self, rec: Record) -> None:
        tracer = self._tracer
        ids = getattr(tracer, "id_generator", None)
        trace_id, parent_id = rec[TRACE], rec[PARENT]
        if isinstance(ids, _PresetIds):
            ids.span_id, ids.trace_id = rec[SPAN], trace_id
        parent = Context()
        if parent_id:
            parent = trace.set_span_in_context(
                NonRecordingSpan(SpanContext(trace_id, parent_id, False, _SAMPLED)))
        span = tracer.start_span(SPECS[rec[SPEC]].name, context=parent, kind=SpanKind.INTERNAL,
                                 attributes=region_attributes(rec),
                                 start_time=clocks.epoch_ns(rec[T0]))
        for name, attrs, when in rec[EVENTS] or ():
            span.add_event(name, attrs, when)
        error = rec[ERROR]
        if error is not None:
            span.record_exception(error, escaped=True, timestamp=clocks.epoch_ns(rec[T1]))
            span.set_status(_status(error))
        span.end(end_time=clocks.epoch_ns(rec[T1]))

    def flush(self, timeout: float) -> None:
        if self._mode == "owned":
            _bounded(lambda: self._fanout.force_flush(int(timeout * 1000)), timeout, "flush")
        elif self._mode == "user":
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            if flush is not None:
                _bounded(lambda: flush(int(timeout * 1000)), timeout, "flush")

    def shutdown(self, timeout: float) -> None:
        if self._mode == "user":
            self.flush(timeout)  # the application owns its provider and shuts it down itself
            return
        with self._lock:
            processors, self._fanout.processors = list(self._fanout.processors), []
            self._mode = None
        _shutdown_bounded(processors, timeout)

    def prepare(self) -> None:
        """Decide where spans go, on the caller's thread at the first region: an owned provider
        must be in place before the user opens spans inside that region, and exporters must
        not first be built during interpreter exit."""
        _ = self.mode

    def after_fork(self) -> None:
        """In a forked child: new exporters (own file, own connections) and resource (own pid),
        made on first use; the parent's are left alone."""
        self._lock = threading.Lock()
        self._resource = None
        self._mode = None
        self._fanout.processors = []
        self.exporters = []

    def stats(self) -> dict[str, int]:
        return {
            "spans_exported": sum(e.exported for e in self.exporters),
            "spans_failed": sum(e.failed for e in self.exporters),
            "spans_dropped": sum(e.dropped for e in self.exporters),
        }


def _bounded(fn: Any, timeout: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds for it."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:
            warn_once(f"{what}-error", f"perfsdk: span {what} failed: {exc!r}")
        finally:
            done.set()

    threading.Thread(target=run, name=f"perfsdk-{what}", daemon=True).start()
    if not done.wait(timeout):
        warn_once(f"{what}-timeout", f"perfsdk: span {what} did not finish within {timeout:g} s "
                  "(PERFSDK_EXPORT_TIMEOUT); unsent spans are dropped so the program can go on.")
        return False
    return True


def _shutdown_bounded(processors: list[SpanProcessor], timeout: float) -> None:
    if processors:
        def shut() -> None:
            for processor in processors:
                processor.shutdown()

        _bounded(shut, timeout, "shutdown")
