"""The current region, as OpenTelemetry's current span.

A :class:`~perfsdk.region.Region` *is* an OpenTelemetry ``Span`` (a light, non-SDK one), made
current for the region's body. So perfsdk's own nesting, the user's OpenTelemetry spans opened
inside a region, ``trace.get_current_span().set_attribute(...)`` and context propagation all see
the same thing, across threads that copy the context and across ``await``. Without the
``opentelemetry-api`` package, a plain ``ContextVar`` stands in.
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["CONTEXT", "CURRENT", "HAVE_OTEL", "SPAN_KEY", "SpanBase", "attach", "current_span",
           "detach", "parent_ids", "span_context"]

try:
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _otel_trace
    from opentelemetry.trace import SpanContext, TraceFlags

    HAVE_OTEL = True
except ImportError:  # optional: pip install opentelemetry-api
    HAVE_OTEL = False

SpanBase: Any
current_span: Any
detach: Any
span_context: Any
"""``span_context(trace_id, span_id)``: a sampled, local ``SpanContext`` (None without
OpenTelemetry)."""

CURRENT: contextvars.ContextVar[Any] | None = None
"""The variable that holds the current context, for the region hot path to read and set
directly (a C call each, where OpenTelemetry's functions take four Python frames); None when
OpenTelemetry runs on a runtime context of another kind (``OTEL_PYTHON_CONTEXT``): then use the
functions. With OpenTelemetry it holds OpenTelemetry's ``Context`` (a dict), the current span
is its :data:`SPAN_KEY` entry (what ``get_current_span()`` reads), and a span is made current
with ``CURRENT.set(CONTEXT({**CURRENT.get(), SPAN_KEY: span}))`` (what ``attach(
set_span_in_context(span))`` does). Without OpenTelemetry it holds the current span itself,
and :data:`SPAN_KEY` and :data:`CONTEXT` are None."""

SPAN_KEY: str | None = None
CONTEXT: Any = None

if HAVE_OTEL:
    SpanBase = _otel_trace.Span
    current_span = _otel_trace.get_current_span
    _set_span_in_context = _otel_trace.set_span_in_context
    _attach = _otel_context.attach
    detach = _otel_context.detach
    _SAMPLED = TraceFlags(TraceFlags.SAMPLED)

    def attach(span: Any) -> Any:
        return _attach(_set_span_in_context(span))

    try:  # the fast path: exactly what the functions above do, without their frames
        from opentelemetry.context import _RUNTIME_CONTEXT
        from opentelemetry.context.context import Context as _Context
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
        from opentelemetry.trace.propagation import _SPAN_KEY

        _var = getattr(_RUNTIME_CONTEXT, "_current_context", None)
        if (type(_RUNTIME_CONTEXT) is ContextVarsRuntimeContext and isinstance(_SPAN_KEY, str)
                and isinstance(_var, contextvars.ContextVar)):
            CURRENT, SPAN_KEY, CONTEXT = _var, _SPAN_KEY, _Context
    except ImportError:  # another opentelemetry-api layout: the functions only
        pass

    _TRACE_END, _SPAN_END = 1 << 128, 1 << 64
    _new_tuple = tuple.__new__

    def _span_context_constructor(trace_id: int, span_id: int) -> Any:
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)

    _DEFAULT_STATE = _span_context_constructor(1, 1).trace_state

    def _span_context_tuple(trace_id: int, span_id: int) -> Any:
        """What the constructor builds, without its ``__new__`` (half its cost; about 2,900
        instructions a span with a parent on the background thread): the tuple itself,
        validity computed the same way. Used only where :func:`_same_contexts` says equal."""
        return _new_tuple(SpanContext, (
            trace_id, span_id, False, _SAMPLED, _DEFAULT_STATE,
            0 < trace_id < _TRACE_END and 0 < span_id < _SPAN_END))

    def _same_contexts() -> bool:
        """Whether the tuple is what this OpenTelemetry's constructor builds (its layout is
        OpenTelemetry's own; a version that changes it gets the constructor)."""
        cases = [(1, 1), (2**128 - 1, 2**64 - 1), (0, 5), (5, 0), (2**128, 1), (1, 2**64)]
        try:
            for trace_id, span_id in cases:
                fast = _span_context_tuple(trace_id, span_id)
                slow = _span_context_constructor(trace_id, span_id)
                if (fast, fast.is_valid, type(fast)) != (slow, slow.is_valid, type(slow)):
                    return False
        except Exception:
            return False
        return True

    span_context = _span_context_tuple if _same_contexts() else _span_context_constructor

    def parent_ids(span: Any) -> tuple[int, int]:
        """(trace_id, span_id) of a foreign current span, (0, 0) when there is none."""
        if not isinstance(span, SpanBase):  # what get_current_span() reads as no span
            return 0, 0
        ctx = span.get_span_context()
        if ctx.is_valid:
            return ctx.trace_id, ctx.span_id
        return 0, 0

else:
    SpanBase = object
    _current: contextvars.ContextVar[Any] = contextvars.ContextVar("perfsdk_region", default=None)

    current_span = _current.get
    CURRENT = _current

    def attach(span: Any) -> Any:
        return _current.set(span)

    def _detach(token: Any) -> None:
        try:
            _current.reset(token)
        except ValueError:  # token from another context: leave it
            pass

    detach = _detach

    def _no_span_context(trace_id: int, span_id: int) -> Any:
        return None

    span_context = _no_span_context

    def parent_ids(span: Any) -> tuple[int, int]:
        return 0, 0
