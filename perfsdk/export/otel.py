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
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode

from perfsdk import _device, clocks
from perfsdk._version import __version__
from perfsdk.config import Config
from perfsdk.context import span_context
from perfsdk.errors import MissingDependencyError, warn_once

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
        except Exception:  # noqa: BLE001 - a name is not worth failing for
            pass
    return Resource.create(attrs)


def region_attributes(region: Any) -> dict[str, Any]:
    """Declared, per-call and set-while-running attributes plus the measured times."""
    attrs = dict(region.attributes)
    attrs["perfsdk.host_ms"] = (region.t1 - region.t0) / 1e6
    if region.device_ms is not None:
        attrs["perfsdk.device_ms"] = region.device_ms
    attrs["thread.id"] = region.thread_id
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


def _status(error: BaseException | None) -> Status:
    if error is None:
        return Status(StatusCode.UNSET)
    return Status(StatusCode.ERROR, f"{type(error).__qualname__}: {error}")


def region_span(region: Any, resource: Resource) -> ReadableSpan:
    """The finished span of a region, with the ids it was given at enter."""
    start = clocks.epoch_ns(region.t0)
    end = clocks.epoch_ns(region.t1)
    events = [Event(n, a, t) for n, a, t in region.events or ()]
    if region.error is not None:
        events.append(_exception_event(region.error, end))
    return ReadableSpan(
        name=region.spec.name,
        context=span_context(region.trace_id, region.span_id),
        parent=span_context(region.trace_id, region.parent_id) if region.parent_id else None,
        resource=resource,
        attributes=region_attributes(region),
        events=events,
        kind=SpanKind.INTERNAL,
        status=_status(region.error),
        start_time=start,
        end_time=end,
        instrumentation_scope=SCOPE,
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
    """Wraps an OTel exporter: failures warn once (naming the exporter) and are counted."""

    def __init__(self, inner: SpanExporter, label: str) -> None:
        self.inner = inner
        self.label = label
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        local = _Quiet.local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - exporters must never raise into the app
            result = SpanExportResult.FAILURE
            reason = repr(exc)
        else:
            reason = "the exporter reported failure"
        finally:
            local.depth -= 1
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
            warn_once(f"export:{self.label}",
                      f"perfsdk: the {self.label} exporter could not deliver spans ({reason}); "
                      "the program continues, later failures are only counted "
                      "(perfsdk.diagnostics()).")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def _otlp_exporter() -> SpanExporter:
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
    exporter: SpanExporter = OTLPSpanExporter()
    return exporter


def make_exporter(name: str, config: Config) -> SpanExporter:
    """The OpenTelemetry exporter for one ``PERFSDK_EXPORTER`` name, wrapped in a guard."""
    if name == "otlp":
        return GuardedExporter(_otlp_exporter(), "otlp")
    if name == "console":
        return GuardedExporter(ConsoleSpanExporter(), "console")
    if name == "file":
        return GuardedExporter(_JsonLinesFile(config.output_dir), "file")
    raise ValueError(f"unknown exporter {name!r}")


class _JsonLinesFile(ConsoleSpanExporter):
    """OTel's console exporter writing one JSON span per line to a file, opened on first use."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / f"spans-{os.getpid()}.jsonl"
        super().__init__(out=None, formatter=lambda span: span.to_json(indent=None) + "\n")  # type: ignore[arg-type]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.out = self.path.open("a", encoding="utf-8")
        return super().export(spans)

    def shutdown(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None


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
            except Exception as exc:  # noqa: BLE001 - e.g. the otlp extra is missing
                warn_once(f"exporter:{name}", f"perfsdk: cannot use the {name} exporter: {exc}")
                continue
            self.exporters.append(exporter)  # type: ignore[arg-type]
            self._fanout.processors.append(
                BatchSpanProcessor(exporter, max_queue_size=65536, max_export_batch_size=2048,
                                   schedule_delay_millis=1000))

    @property
    def mode(self) -> str:
        """``owned`` (perfsdk's exporters), ``user`` (the app's provider) or ``off``."""
        with self._lock:
            if self._mode is None:
                self._mode = self._decide()
            return self._mode

    # -- the sink --------------------------------------------------------------------------
    def consume(self, regions: list[Any]) -> None:
        mode = self.mode
        if mode == "owned":
            resource = self.resource
            processors = self._fanout.processors
            for region in regions:
                span = region_span(region, resource)
                for processor in processors:
                    processor.on_end(span)
        elif mode == "user":
            for region in regions:
                self._through_tracer(region)

    def _through_tracer(self, region: Any) -> None:
        tracer = self._tracer
        ids = getattr(tracer, "id_generator", None)
        if isinstance(ids, _PresetIds):
            ids.span_id, ids.trace_id = region.span_id, region.trace_id
        parent = Context()
        if region.parent_id:
            parent = trace.set_span_in_context(
                NonRecordingSpan(span_context(region.trace_id, region.parent_id)))
        span = tracer.start_span(region.spec.name, context=parent, kind=SpanKind.INTERNAL,
                                 attributes=region_attributes(region),
                                 start_time=clocks.epoch_ns(region.t0))
        for name, attrs, when in region.events or ():
            span.add_event(name, attrs, when)
        if region.error is not None:
            span.record_exception(region.error, escaped=True,
                                  timestamp=clocks.epoch_ns(region.t1))
            span.set_status(_status(region.error))
        span.end(end_time=clocks.epoch_ns(region.t1))

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

    def stats(self) -> dict[str, int]:
        return {
            "spans_exported": sum(e.exported for e in self.exporters),
            "spans_failed": sum(e.failed for e in self.exporters),
        }


def _bounded(fn: Any, timeout: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds for it."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
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
        _bounded(lambda: [p.shutdown() for p in processors], timeout, "shutdown")
