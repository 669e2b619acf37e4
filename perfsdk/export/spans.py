"""Spans from region records: attributes, resource, the ``ReadableSpan`` built with the ids a
region was given at enter (no tracer, no sampler: about 1 us a span, on the background thread).
"""

from __future__ import annotations

import os
import platform
import socket
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode, TraceFlags

from perfsdk import _device, clocks
from perfsdk import gpu as _gpu
from perfsdk import record as _record
from perfsdk._version import __version__
from perfsdk.config import Config, extensions_enabled
from perfsdk.context import span_context
from perfsdk.errors import warn_once
from perfsdk.memory import memory_attributes
from perfsdk.record import (
    ATTRS,
    DEVICE_MS,
    ERROR,
    EVENTS,
    MEMORY,
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

__all__ = ["COMPILED", "SCOPE", "HashedResource", "build_resource", "build_spans",
           "build_spans_python", "region_attributes", "region_span", "same_span"]

SCOPE = InstrumentationScope("perfsdk", __version__)


class HashedResource(Resource):
    """An OpenTelemetry ``Resource`` whose hash is computed once, when it is made.

    OpenTelemetry's OTLP encoder (``encode_spans``) groups a batch's spans by resource in a
    dict, so it hashes every span's resource, and ``Resource.__hash__`` serializes the
    attributes to sorted JSON each time: 4.8 us with perfsdk's resource on the development
    machine, a fifth of what encoding a span costs there. A resource is immutable (its
    attributes cannot change after it is made), so its hash cannot either; equality is
    ``Resource``'s own."""

    def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def _hashed(resource: Resource) -> HashedResource:
    return HashedResource(resource.attributes, resource.schema_url)


_BUILT: dict[tuple[str | None, ...], Resource] = {}
"""Resources built in this process (or inherited through fork), by what they are made of."""


def build_resource(config: Config) -> Resource:
    """``service.name``, ``host.name``, ``process.*``, torch version and, when the application
    has initialized CUDA, the GPU name; ``OTEL_RESOURCE_ATTRIBUTES`` is merged in by OTel.

    Built once per process and settings: OpenTelemetry's resource detection runs on a thread
    pool, which no longer takes work once the interpreter is shutting down. A forked child
    takes its parent's resource with its own ``process.pid``, without detecting again, so a
    short-lived child can still export at its exit."""
    device = _device.active()
    gpu: str | None = None
    if device is not None:
        try:
            gpu = device.get_device_name()
        except Exception:
            gpu = None
    key = (config.service_name, gpu, os.environ.get("OTEL_RESOURCE_ATTRIBUTES"),
           os.environ.get("OTEL_SERVICE_NAME"))
    known = _BUILT.get(key)
    if known is not None:
        if known.attributes.get("process.pid") != os.getpid():
            known = _BUILT[key] = _hashed(known.merge(Resource({"process.pid": os.getpid()})))
        return known
    built = _BUILT[key] = _detect(config, gpu)
    return built


def _detect(config: Config, gpu: str | None) -> Resource:
    attrs: dict[str, Any] = {
        "service.name": config.service_name,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "process.runtime.name": platform.python_implementation().lower(),
        "process.runtime.version": platform.python_version(),
        "perfsdk.version": __version__,
        "perfsdk.torch.version": torch.__version__,
    }
    if gpu is not None:
        attrs["perfsdk.gpu.name"] = gpu
    return _hashed(Resource.create(attrs))


def region_attributes(rec: Record, ranks: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Declared, per-call and set-while-running attributes plus the measured times.

    ``ranks``: :func:`perfsdk.distributed.rank_attributes` read once for a whole batch (it
    costs about 1 us, as much as the rest of a span); read here when not given."""
    if ranks is None:
        attrs = _record.attributes(rec)
    else:  # what record.attributes() does, with the batch's ranks
        attrs = SPECS[rec[SPEC]].attributes.copy()
        extra = rec[ATTRS]
        if extra:
            attrs.update(extra)
        if ranks:
            attrs.update(ranks)
    attrs["perfsdk.host_ms"] = (rec[T1] - rec[T0]) / 1e6
    device_ms = rec[DEVICE_MS]
    if device_ms is not None:
        attrs["perfsdk.device_ms"] = device_ms
    attrs["thread.id"] = rec[THREAD]
    memory = rec[MEMORY]
    if memory is not None:
        attrs.update(memory_attributes(memory))
    window = _gpu.TELEMETRY.window
    if window is not None:
        attrs.update(window(rec[T0], rec[T1]))
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
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NO_EVENTS: tuple[Event, ...] = ()


def status_of(error: BaseException | None) -> Status:
    if error is None:
        return _UNSET
    return Status(StatusCode.ERROR, f"{type(error).__qualname__}: {error}")


def region_span(rec: Record, resource: Resource,
                ranks: Mapping[str, Any] | None = None) -> ReadableSpan:
    """The finished span of a region, with the ids it was given at enter (``ranks``: see
    :func:`region_attributes`)."""
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
        span_context(trace_id, rec[SPAN]),  # perfsdk.context's: OpenTelemetry's tuple
        span_context(trace_id, parent_id) if parent_id else None,
        resource,
        region_attributes(rec, ranks),
        events,
        (),
        SpanKind.INTERNAL,
        None,
        status_of(error),
        clocks.epoch_ns(rec[T0]),
        clocks.epoch_ns(rec[T1]),
        SCOPE,
    )


def build_spans_python(items: Sequence[Any], resource: Resource,
                       ranks: Mapping[str, Any]) -> list[ReadableSpan]:
    """Region records (tuples) become spans; the application's own spans pass as they are."""
    return [region_span(it, resource, ranks) if type(it) is tuple else it for it in items]


class _Compiled:
    """The compiled twin of :func:`build_spans_python` (``perfsdk.export._spanbuild``), where
    it is built: the same spans in about 40% of the time (0.5 to 0.7 us a span against 1.3 to
    1.5 us), kept out of the garbage collector's lists (so a batch alive while it is built
    never sets off a full collection, which holds the GIL for tens of milliseconds with torch
    loaded). It is trusted only after it built one batch exactly as the Python twin did (every
    field, in the same order, attributes included): until then each batch is built both ways
    and the Python spans exported; a difference (another OpenTelemetry SDK, say) turns it off
    for good."""

    def __init__(self) -> None:
        self.builder: Any = None
        self.checked = False
        if not extensions_enabled():
            return
        try:
            from perfsdk.export._spanbuild import SpanBuilder
        except ImportError:  # optional: built at install where a C compiler is found
            return
        probe = span_context(1, 1)
        # ReadableSpan's fields in the order its __init__ sets them, the constant ones filled
        fields = vars(ReadableSpan("", probe, None, Resource({}), {}, _NO_EVENTS, (),
                                   SpanKind.INTERNAL, None, _UNSET, 0, 0, SCOPE))
        self.builder = SpanBuilder(ReadableSpan, type(probe), probe.trace_flags,
                                   probe.trace_state, dict(fields), SPECS, region_span)

    def __call__(self, items: Sequence[Any], resource: Resource,
                 ranks: Mapping[str, Any]) -> list[ReadableSpan] | None:
        """The spans, or None where only the Python twin builds them."""
        builder = self.builder
        if builder is None or _gpu.TELEMETRY.window is not None or type(ranks) is not dict:
            return None
        spans: list[ReadableSpan] = builder(items, resource, ranks, clocks.epoch_ns(0))
        if self.checked:
            return spans
        expected = build_spans_python(items, resource, ranks)
        if all(same_span(a, b) for a, b in zip(spans, expected, strict=True)):
            self.checked = self.checked or any(map(_plain, items))
        else:
            self.builder = None
            warn_once("spanbuild", "perfsdk: the compiled span builder disagrees with this "
                      "OpenTelemetry SDK's spans; using the pure-Python builder.")
        return expected


def _plain(item: Any) -> bool:
    """A record the compiled builder builds itself (no error, events or memory readings)."""
    return type(item) is tuple and item[ERROR] is None and item[EVENTS] is None and \
        item[MEMORY] is None


def same_span(a: Any, b: Any) -> bool:
    """Whether two spans are the same, field for field and in the same order (events and
    statuses, made afresh for each span, by what they hold)."""
    if type(a) is not type(b) or not isinstance(a, ReadableSpan):
        return a is b
    return (_fields(a) == _fields(b) and type(a.context) is type(b.context)
            and type(a.parent) is type(b.parent))


def _fields(span: ReadableSpan) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in vars(span).items():
        if key == "_events":
            value = [(e.name, list((e.attributes or {}).items()), e.timestamp) for e in value]
        elif key == "_status" and isinstance(value, Status):
            value = (value.status_code, value.description)
        elif key == "_attributes":
            value = list((value or {}).items())
        out.append((key, value))
    return out


COMPILED = _Compiled()


def build_spans(items: Sequence[Any], resource: Resource,
                ranks: Mapping[str, Any]) -> list[ReadableSpan]:
    """:func:`build_spans_python`, compiled where :data:`COMPILED` is built and checked
    (``ranks``: :func:`perfsdk.distributed.rank_attributes`, read once for the batch)."""
    spans = COMPILED(items, resource, ranks)
    return build_spans_python(items, resource, ranks) if spans is None else spans
