"""Where region spans go: perfsdk's own exporters or the application's TracerProvider.

The OpenTelemetry SDK is imported only under ``perfsdk/export/`` (this module, ``spans.py``,
``exporters.py``); ``import perfsdk`` works without it.

Spans are built in the background from region records, never on the training thread:

* **perfsdk's own pipeline** (``PERFSDK_EXPORTER`` = ``otlp``, ``console``, ``file``): perfsdk
  creates an SDK ``TracerProvider`` with those exporters and installs it globally *only if the
  application has none*, so the user's own spans reach the same backend. Region spans are built
  directly as ``ReadableSpan`` objects with the ids that were handed out at enter and handed to
  the exporters from the pipeline thread in chunks, which skips the tracer machinery and a
  second queue (about 1 us a span instead of about 10).
* **the application's provider**: if the application installed a TracerProvider, perfsdk uses
  it through the public tracer API and adds no processor, exporter or resource of its own.

Exporters come from OpenTelemetry itself: OTLP over gRPC or HTTP/protobuf (chosen by the standard
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, default ``http/protobuf``), console, and a JSON-lines
file (the console exporter writing to ``<output_dir>/spans-<pid>.jsonl``). A failing exporter
warns once and counts its failures; exit waits at most ``PERFSDK_EXPORT_TIMEOUT`` seconds.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind

from perfsdk import clocks
from perfsdk._version import __version__
from perfsdk.config import Config
from perfsdk.errors import warn_once
from perfsdk.export.exporters import GuardedExporter, bounded, make_exporter, otlp_exporter
from perfsdk.export.spans import (
    SAMPLED,
    build_resource,
    region_attributes,
    region_span,
    status_of,
)
from perfsdk.record import ERROR, EVENTS, PARENT, SPAN, SPEC, SPECS, T0, T1, TRACE, Record

__all__ = ["GuardedExporter", "SpanSink", "build_resource", "make_exporter", "region_span"]


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
            otlp_exporter().shutdown()

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
            if not isinstance(name, (str, SpanExporter)):
                continue  # a metric exporter or reader: perfsdk.export.metrics takes it
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
                NonRecordingSpan(SpanContext(trace_id, parent_id, False, SAMPLED)))
        span = tracer.start_span(SPECS[rec[SPEC]].name, context=parent, kind=SpanKind.INTERNAL,
                                 attributes=region_attributes(rec),
                                 start_time=clocks.epoch_ns(rec[T0]))
        for name, attrs, when in rec[EVENTS] or ():
            span.add_event(name, attrs, when)
        error = rec[ERROR]
        if error is not None:
            span.record_exception(error, escaped=True, timestamp=clocks.epoch_ns(rec[T1]))
            span.set_status(status_of(error))
        span.end(end_time=clocks.epoch_ns(rec[T1]))

    def flush(self, timeout: float) -> None:
        if self._mode == "owned":
            bounded(lambda: self._fanout.force_flush(int(timeout * 1000)), timeout, "flush")
        elif self._mode == "user":
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            if flush is not None:
                bounded(lambda: flush(int(timeout * 1000)), timeout, "flush")

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


def _shutdown_bounded(processors: list[SpanProcessor], timeout: float) -> None:
    if processors:
        def shut() -> None:
            for processor in processors:
                processor.shutdown()

        bounded(shut, timeout, "shutdown")
