"""Region spans through the application's own TracerProvider (``user`` mode).

When the application has installed an SDK ``TracerProvider``, region spans go through it: its
sampler decides, its span limits apply, its span processors (and so its exporters) receive the
spans, and perfsdk adds no processor, exporter or resource. This runs on the export thread of
perfsdk's ``provider`` destination (:mod:`perfsdk.export.delivery`), never on the caller's.

Two ways to make a span, with the same result for the processors:

* **direct** (the usual case): ask the provider's sampler, then build the finished
  ``ReadableSpan`` (the provider's resource, its ``SpanLimits`` applied to the attributes) and
  hand it to the provider's span processor's ``on_end``, as the SDK's ``Span.end()`` does. This
  skips the tracer's live ``Span`` (its lock, its attribute cleaning, the ``on_start`` and
  ``_on_ending`` calls), which processors that do nothing there never see: the SDK's
  ``BatchSpanProcessor`` and ``SimpleSpanProcessor`` and any processor that overrides only
  ``on_end``. The sampler is not called for the SDK's own always-on samplers (``ALWAYS_ON`` and
  the default ``ParentBased(ALWAYS_ON)``), whose answer is known.
* **through the tracer** (``tracer.start_span`` then ``end``), for everything else: a processor
  with its own ``on_start`` or ``_on_ending`` (it may change the live span), a region with
  events or an exception, a tracer that is not the SDK's, the SDK's internal span metrics on
  (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``), or an SDK whose internals differ from what
  :func:`direct_path` expects.

Both treat a region's parent as a sampled, local span: a region record does not carry its
parent's trace flags, so a ``ParentBased`` sampler takes its ``local_parent_sampled`` branch
for every nested region and for a region under the application's span (see
docs/reference.md, "Spans through the application's TracerProvider").
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import (
    ConcurrentMultiSpanProcessor,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    Tracer,
)
from opentelemetry.sdk.trace import sampling as _sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from perfsdk import clocks
from perfsdk._version import __version__
from perfsdk.distributed import rank_attributes
from perfsdk.export.spans import SAMPLED, SCOPE, region_attributes, status_of
from perfsdk.record import ERROR, EVENTS, PARENT, SPAN, SPEC, SPECS, T0, T1, TRACE, Record

__all__ = ["ProviderExporter", "direct_path", "user_tracer"]

_INTERNAL = SpanKind.INTERNAL
_EMPTY = Context()
_RECORD_AND_SAMPLE = _sampling.Decision.RECORD_AND_SAMPLE
_DROP = _sampling.Decision.DROP
_ROOT = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)  # perfsdk's ids are random
_CHILD = SAMPLED  # the parent a record names is taken as sampled, without the random flag
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSAMPLED_ROOT = TraceFlags(TraceFlags.RANDOM_TRACE_ID)
_UNSET = status_of(None)
_PLAIN = frozenset((str, bool, int, float))
"""Attribute value types the SDK keeps as they are (its cleaning changes nothing)."""
_ALWAYS_SAMPLED = (_sampling.ALWAYS_ON, _sampling.DEFAULT_ON)
"""Samplers whose answer is known: sample, with the attributes given and no trace state."""
_QUIET = (SpanProcessor.on_start, BatchSpanProcessor.on_start, SimpleSpanProcessor.on_start)
_QUIET_ENDING = (SpanProcessor._on_ending, BatchSpanProcessor._on_ending,
                 SimpleSpanProcessor._on_ending)
"""``on_start`` / ``_on_ending`` that do nothing: a processor with these needs no live span."""


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

    def is_trace_id_random(self) -> bool:
        return True  # perfsdk's trace ids are 128 random bits


def user_tracer(provider: Any) -> Any:
    """perfsdk's tracer on the application's provider; with an SDK tracer, its id generator
    hands out the ids regions were given at enter."""
    tracer = provider.get_tracer("perfsdk", __version__)
    fallback = getattr(tracer, "id_generator", None)
    if isinstance(fallback, IdGenerator) and not isinstance(fallback, _PresetIds):
        tracer.id_generator = _PresetIds(fallback)
    return tracer


class _Direct:
    """What the direct path reads from the tracer, once per batch."""

    __slots__ = ("info", "limits", "on_end", "resource", "sampler")

    def __init__(self, tracer: Tracer, limits: SpanLimits) -> None:
        self.sampler = tracer.sampler
        self.resource = tracer.resource
        self.on_end = tracer.span_processor.on_end
        self.info = tracer.instrumentation_info
        self.limits = limits


def direct_path(tracer: Any) -> _Direct | None:
    """The direct path's settings for ``tracer``, or None when spans must go through the
    tracer (see the module docstring).

    The one place that reads OpenTelemetry SDK internals, each checked and none written: the
    tracer's ``_span_limits`` (the provider's ``SpanLimits``, which the SDK keeps no public
    handle to), ``_is_enabled()`` (a tracer configurator may disable perfsdk's tracer) and the
    multi-processor's ``_span_processors`` (to know that none of them acts in ``on_start`` or
    ``_on_ending``). Anything missing or unexpected: None, the tracer path, which is always
    correct.
    """
    if type(tracer) is not Tracer:  # a subclass may start spans its own way
        return None
    if os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").strip().lower() == "true":
        return None  # the SDK counts the spans its tracer starts: let it see ours
    enabled = getattr(tracer, "_is_enabled", None)
    limits = getattr(tracer, "_span_limits", None)
    processor = tracer.span_processor
    if enabled is None or not enabled() or not isinstance(limits, SpanLimits):
        return None
    if type(processor) not in (SynchronousMultiSpanProcessor, ConcurrentMultiSpanProcessor):
        return None
    processors = getattr(processor, "_span_processors", None)
    if not isinstance(processors, tuple):
        return None
    for each in processors:
        kind = type(each)
        if kind.on_start not in _QUIET or getattr(kind, "_on_ending", None) not in _QUIET_ENDING:
            return None
    return _Direct(tracer, limits)


class ProviderExporter:
    """The application's provider as a destination's exporter: each region record becomes a
    span that its sampler, limits and processors see (module docstring). Runs on the
    destination's export thread. A batch counts as exported once the provider has been handed
    it; its sampler may have dropped some (they are the application's to drop)."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.direct = 0
        """Spans made on the direct path."""
        self.through = 0
        """Regions that went through the tracer (its sampler may have dropped some)."""
        self.sampled_out = 0
        """Regions the provider's sampler dropped on the direct path."""

    def counts(self) -> dict[str, int]:
        """For ``perfsdk.diagnostics()['exporters']['provider']``."""
        return {"direct": self.direct, "through_tracer": self.through,
                "sampled_out": self.sampled_out}

    def export(self, records: list[Record]) -> SpanExportResult:
        direct = direct_path(self.tracer)
        ranks = rank_attributes()  # once a batch: about 1 us a read
        if direct is None:
            for rec in records:
                self.through_tracer(rec, ranks)
        else:
            self._direct(records, direct, ranks)
        return SpanExportResult.SUCCESS

    def _direct(self, records: list[Record], direct: _Direct, ranks: dict[str, Any]) -> None:
        sampler, resource, on_end, info = (direct.sampler, direct.resource, direct.on_end,
                                           direct.info)
        limits = direct.limits
        max_attrs, max_len = limits.max_span_attributes, limits.max_span_attribute_length
        known = sampler in _ALWAYS_SAMPLED
        parents: dict[tuple[int, int], SpanContext] = {}
        epoch, plain, specs = clocks.epoch_ns, _PLAIN, SPECS
        made = dropped = 0
        for rec in records:
            if rec[EVENTS] is not None or rec[ERROR] is not None:
                self.through_tracer(rec, ranks)  # rare: events, exceptions: as the SDK does
                continue
            trace_id, parent_id = rec[TRACE], rec[PARENT]
            name = specs[rec[SPEC]].name
            attrs: Any = region_attributes(rec, ranks)
            parent = None
            if parent_id:
                key = (trace_id, parent_id)
                parent = parents.get(key)
                if parent is None:
                    parent = parents[key] = SpanContext(trace_id, parent_id, False, _CHILD)
            if known:
                context = SpanContext(trace_id, rec[SPAN], False, _CHILD if parent_id else _ROOT)
            else:
                result = sampler.should_sample(
                    _EMPTY if parent is None else trace.set_span_in_context(
                        NonRecordingSpan(parent)),
                    trace_id, name, _INTERNAL, attrs, None)
                decision = result.decision
                if decision is _DROP:
                    dropped += 1
                    continue
                sampled = decision is _RECORD_AND_SAMPLE
                flags = ((_CHILD if sampled else _UNSAMPLED) if parent_id else
                         (_ROOT if sampled else _UNSAMPLED_ROOT))
                context = SpanContext(trace_id, rec[SPAN], False, flags, result.trace_state)
                attrs = result.attributes
            if (max_len is not None or (max_attrs is not None and len(attrs) > max_attrs)
                    or not plain.issuperset(map(type, attrs.values()))):
                attrs = BoundedAttributes(max_attrs, attrs, immutable=True,
                                          max_value_len=max_len)  # as the SDK's span does
            elif not known:
                attrs = dict(attrs)  # the sampler's read-only view: a plain copy, as the SDK
            on_end(ReadableSpan(name, context, parent, resource, attrs, (), (), _INTERNAL,
                                info, _UNSET, epoch(rec[T0]), epoch(rec[T1]), SCOPE))
            made += 1
        self.direct += made
        self.sampled_out += dropped

    def through_tracer(self, rec: Record, ranks: dict[str, Any] | None = None) -> None:
        """One span through the tracer's own ``start_span`` and ``end``."""
        tracer = self.tracer
        self.through += 1
        ids = getattr(tracer, "id_generator", None)
        trace_id, parent_id = rec[TRACE], rec[PARENT]
        if isinstance(ids, _PresetIds):
            ids.span_id, ids.trace_id = rec[SPAN], trace_id
        parent = _EMPTY
        if parent_id:
            parent = trace.set_span_in_context(
                NonRecordingSpan(SpanContext(trace_id, parent_id, False, _CHILD)))
        span = tracer.start_span(SPECS[rec[SPEC]].name, context=parent, kind=_INTERNAL,
                                 attributes=region_attributes(rec, ranks),
                                 start_time=clocks.epoch_ns(rec[T0]))
        for name, attrs, when in rec[EVENTS] or ():
            span.add_event(name, attrs, when)
        error = rec[ERROR]
        if error is not None:
            span.record_exception(error, escaped=True, timestamp=clocks.epoch_ns(rec[T1]))
            span.set_status(status_of(error))
        span.end(end_time=clocks.epoch_ns(rec[T1]))

    def shutdown(self) -> None:
        """The application shuts its provider down itself."""
