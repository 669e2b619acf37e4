"""perfsdk.export.provider: region spans through the application's TracerProvider.

The records come from real regions (taken from the pipeline); each test gives them to a
:class:`ProviderExporter` on a private SDK ``TracerProvider`` (nothing global changes here; the
global-provider scenario runs in a subprocess at the end). The direct path must give the
provider's processors what its own tracer would: the two paths are compared field by field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
    sampling,
)
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.span import TraceState

import perfsdk
from perfsdk.export.provider import ProviderExporter, direct_path, user_tracer
from perfsdk.pipeline import PIPELINE
from perfsdk.record import PARENT
from tests.integration._scripts.harness import clean_env


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
    PIPELINE.drain(wait=True)
    grab = _Grab()
    PIPELINE.sinks.append(grab)
    try:
        work()
        PIPELINE.drain(wait=True)
    finally:
        PIPELINE.sinks.remove(grab)
    return grab.records


def _nested() -> None:
    """A root region with two nested ones (six attributes and more on each)."""
    with perfsdk.timed_region("p.outer", epoch=1, tag="a" * 40):
        for i in range(2):
            with perfsdk.timed_region("p.inner", i=i):
                pass


@pytest.fixture(scope="module")
def nested() -> list[tuple[Any, ...]]:
    return records_of(_nested)


class Provider:
    """A private SDK provider whose spans land in memory, and perfsdk's exporter on it."""

    def __init__(self, *, sampler: sampling.Sampler | None = None,
                 limits: SpanLimits | None = None,
                 processors: Sequence[SpanProcessor] = ()) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(sampler=sampler, span_limits=limits,
                                       resource=Resource.create({"service.name": "app"}),
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.exporter = ProviderExporter(user_tracer(self.provider))

    def direct(self, records: list[tuple[Any, ...]]) -> list[ReadableSpan]:
        self.exporter.export(records)
        return list(self.memory.get_finished_spans())

    def through_tracer(self, records: list[tuple[Any, ...]]) -> list[ReadableSpan]:
        for rec in records:
            self.exporter.through_tracer(rec)
        return list(self.memory.get_finished_spans())


def _fields(span: ReadableSpan) -> dict[str, Any]:
    return {
        "name": span.name, "trace_id": span.context.trace_id, "span_id": span.context.span_id,
        "flags": int(span.context.trace_flags), "trace_state": span.context.trace_state,
        "remote": span.context.is_remote,
        "parent": None if span.parent is None else (span.parent.trace_id, span.parent.span_id,
                                                    int(span.parent.trace_flags)),
        "attributes": dict(span.attributes), "dropped_attributes": span.dropped_attributes,
        "events": [(e.name, dict(e.attributes)) for e in span.events],
        "kind": span.kind, "status": (span.status.status_code, span.status.description),
        "start": span.start_time, "end": span.end_time, "resource": span.resource,
        "scope": span.instrumentation_scope,
    }


def _same_as_the_tracer(records: list[tuple[Any, ...]], **provider: Any) -> list[ReadableSpan]:
    """The spans of the direct path, after checking them against the tracer's own."""
    direct = Provider(**provider)
    spans = direct.direct(records)
    assert direct.exporter.counts()["through_tracer"] == 0
    tracer = Provider(**provider).through_tracer(records)
    assert [_fields(s) for s in spans] == [_fields(s) for s in tracer]
    return spans


def test_direct_spans_equal_the_tracers(nested: list[tuple[Any, ...]]) -> None:
    spans = _same_as_the_tracer(nested)
    assert [s.name for s in spans] == ["p.inner", "p.inner", "p.outer"]
    inner, _, outer = spans
    assert outer.parent is None
    assert inner.parent is not None
    assert inner.parent.span_id == outer.context.span_id
    assert outer.attributes["epoch"] == 1
    assert "perfsdk.host_ms" in outer.attributes
    assert outer.resource.attributes["service.name"] == "app"  # the application's resource
    assert outer.instrumentation_scope is not None
    assert outer.instrumentation_scope.name == "perfsdk"
    assert all(s.context.trace_flags.sampled for s in spans)


class _Counting(SpanProcessor):
    """Overrides on_end only: needs no live span."""

    def __init__(self) -> None:
        self.ended: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


class _Stamping(_Counting):
    """Acts in on_start (as a baggage processor does): the span must be a live one."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        self.started += 1
        span.set_attribute("stamped", True)


def test_a_processor_that_only_ends_gets_every_span_directly(nested):
    counting = _Counting()
    p = Provider(processors=[counting, BatchSpanProcessor(InMemorySpanExporter())])
    spans = p.direct(nested)
    assert len(counting.ended) == len(spans) == len(nested) == 3
    assert p.exporter.counts() == {"direct": 3, "through_tracer": 0, "sampled_out": 0}


def test_a_processor_with_on_start_gets_live_spans_through_the_tracer(nested):
    stamping = _Stamping()
    p = Provider(processors=[stamping])
    spans = p.direct(nested)
    assert stamping.started == len(stamping.ended) == len(spans) == 3
    assert all(s.attributes["stamped"] is True for s in spans)
    assert p.exporter.counts() == {"direct": 0, "through_tracer": 3, "sampled_out": 0}


def test_a_processor_added_later_is_seen_at_the_next_batch(nested):
    p = Provider()
    p.direct(nested)
    stamping = _Stamping()
    p.provider.add_span_processor(stamping)
    p.exporter.export(nested)
    assert stamping.started == 3
    assert p.exporter.counts() == {"direct": 3, "through_tracer": 3, "sampled_out": 0}


@pytest.mark.parametrize("sampler", [sampling.TraceIdRatioBased(0.0), sampling.ALWAYS_OFF,
                                     sampling.ParentBased(sampling.TraceIdRatioBased(0.0),
                                                          local_parent_sampled=sampling.ALWAYS_OFF)],
                         ids=["ratio-0", "always-off", "parent-based-off"])
def test_a_sampler_that_drops_everything_exports_nothing(nested, sampler):
    p = Provider(sampler=sampler)
    assert p.direct(nested) == []
    assert p.exporter.counts() == {"direct": 0, "through_tracer": 0, "sampled_out": 3}


def test_parent_based_sampler_follows_the_region_tree(nested):
    """ParentBased(ALWAYS_OFF): a root region is dropped; a nested region's parent is taken as
    sampled (a record does not carry its parent's flags), so the default local_parent_sampled
    (ALWAYS_ON) keeps it, as the tracer path does (docs/reference.md says so)."""
    spans = _same_as_the_tracer(nested, sampler=sampling.DEFAULT_OFF)
    assert [s.name for s in spans] == ["p.inner", "p.inner"]
    on = _same_as_the_tracer(nested, sampler=sampling.ParentBasedTraceIdRatio(1.0))
    assert len(on) == 3


def test_a_ratio_sampler_decides_by_trace_id():
    records = records_of(lambda: [_nested() for _ in range(40)])
    sampler = sampling.TraceIdRatioBased(0.5)
    spans = _same_as_the_tracer(records, sampler=sampler)
    kept = [r[2] for r in records
            if sampler.should_sample(None, r[1], "x").decision.is_sampled()]
    assert 0 < len(kept) < len(records)
    assert [s.context.span_id for s in spans] == kept


class _Tagging(sampling.Sampler):
    """Adds an attribute and a trace state; records but does not sample 'p.inner'."""

    def should_sample(self, parent_context: Any, trace_id: int, name: str,
                      kind: SpanKind | None = None, attributes: Any = None, links: Any = None,
                      trace_state: Any = None) -> sampling.SamplingResult:
        decision = (sampling.Decision.RECORD_ONLY if name == "p.inner"
                    else sampling.Decision.RECORD_AND_SAMPLE)
        return sampling.SamplingResult(decision, {**(attributes or {}), "sampler.tag": name},
                                       TraceState([("vendor", "x")]))

    def get_description(self) -> str:
        return "Tagging"


def test_sampler_attributes_trace_state_and_record_only(nested):
    ended = []
    for make in (Provider.direct, Provider.through_tracer):
        batch, counting = InMemorySpanExporter(), _Counting()
        p = Provider(sampler=_Tagging(), processors=[BatchSpanProcessor(batch), counting])
        make(p, nested)
        p.provider.force_flush()
        assert [s.name for s in batch.get_finished_spans()] == ["p.outer"]  # sampled only
        ended.append([_fields(s) for s in counting.ended])  # recorded, sampled or not
    direct, tracer = ended
    assert direct == tracer
    assert [(s["name"], s["flags"] & 1) for s in direct] == [("p.inner", 0), ("p.inner", 0),
                                                             ("p.outer", 1)]
    for span in direct:
        assert span["attributes"]["sampler.tag"] == span["name"]
        assert span["trace_state"].get("vendor") == "x"


def test_span_limits_apply_as_on_the_sdks_own_spans(nested):
    limits = SpanLimits(max_span_attributes=3)
    spans = _same_as_the_tracer(nested, limits=limits)
    for span in spans:
        assert len(span.attributes) == 3
        assert span.dropped_attributes > 0
    outer = spans[-1]
    assert "epoch" not in outer.attributes  # the oldest are dropped first, as the SDK does
    assert "perfsdk.host_ms" in outer.attributes
    short = _same_as_the_tracer(nested, limits=SpanLimits(max_span_attribute_length=5))
    assert short[-1].attributes["tag"] == "aaaaa"


def test_values_the_sdk_cleans_are_cleaned_the_same(tmp_path: Path):
    def work() -> None:
        with perfsdk.timed_region("p.odd") as r:
            r.set_attribute("list", [1, 2])
            r.set_attribute("mixed", [1, "a"])
            r.set_attribute("none", None)
            r.set_attribute("path", tmp_path)

    spans = _same_as_the_tracer(records_of(work))
    attrs = spans[0].attributes
    assert attrs["list"] == (1, 2)


def test_errors_and_events_go_through_the_tracer():
    def work() -> None:
        with perfsdk.timed_region("p.events") as r:
            r.add_event("checkpoint", {"n": 1})
        with pytest.raises(ValueError, match="boom"), perfsdk.timed_region("p.error"):
            raise ValueError("boom")
        with perfsdk.timed_region("p.plain"):
            pass

    p = Provider()
    spans = {s.name: s for s in p.direct(records_of(work))}
    assert p.exporter.counts() == {"direct": 1, "through_tracer": 2, "sampled_out": 0}
    assert [e.name for e in spans["p.events"].events] == ["checkpoint"]
    error = spans["p.error"]
    assert error.status.status_code is StatusCode.ERROR
    assert [e.name for e in error.events] == ["exception"]
    assert error.events[0].attributes["exception.type"] == "ValueError"


def test_direct_path_steps_aside(monkeypatch: pytest.MonkeyPatch, nested):
    p = Provider()
    assert direct_path(p.exporter.tracer) is not None
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    assert direct_path(p.exporter.tracer) is None  # the SDK's own span metrics need its tracer
    monkeypatch.delenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED")
    multi = p.exporter.tracer.span_processor  # an SDK that changed: the tracer path
    monkeypatch.setattr(multi, "_span_processors", list(multi._span_processors))
    assert direct_path(p.exporter.tracer) is None
    p.exporter.export(nested)
    assert p.exporter.counts()["through_tracer"] == 3
    assert direct_path(object()) is None


def test_ids_are_the_regions(nested):
    spans = Provider().direct(nested)
    assert [(s.context.trace_id, s.context.span_id) for s in spans] == \
        [(r[1], r[2]) for r in nested]
    assert [s.parent.span_id if s.parent else 0 for s in spans] == [r[PARENT] for r in nested]


# -- the global provider, in a fresh interpreter ---------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider, sampling
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class Ends(SpanProcessor):
        def __init__(self):
            self.ended = 0
        def on_end(self, span):
            self.ended += 1

    memory, ends = InMemorySpanExporter(), Ends()
    provider = TracerProvider(sampler=sampling.ParentBased(sampling.ALWAYS_OFF),
                              span_limits=SpanLimits(max_span_attributes=2))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(ends)
    trace.set_tracer_provider(provider)
    import perfsdk

    tracer = trace.get_tracer("app")
    with perfsdk.timed_region("dropped-root"):  # the root sampler says no
        pass
    remote = trace.SpanContext(7, 8, is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    with trace.use_span(trace.NonRecordingSpan(remote)):  # a sampled upstream caller
        with tracer.start_as_current_span("request"):
            with perfsdk.timed_region("kept", k=1):
                pass
    perfsdk.flush()
    spans = {s.name: s for s in memory.get_finished_spans()}
    info = perfsdk.diagnostics()
    json.dump({"names": sorted(spans), "ended": ends.ended,
               "kept_parent": spans["kept"].parent.span_id == spans["request"].context.span_id,
               "kept_attributes": len(spans["kept"].attributes),
               "kept_dropped": spans["kept"].dropped_attributes,
               "mode": info["span_mode"], "paths": info["exporters"]["provider"]},
              open(sys.argv[1], "w"))
""")


def test_the_global_provider_decides(tmp_path: Path):
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(result)], env=clean_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(result.read_text())
    assert got["mode"] == "user"
    assert got["names"] == ["kept", "request"]
    assert got["ended"] == 2
    assert got["kept_parent"] is True
    assert (got["kept_attributes"], got["kept_dropped"] > 0) == (2, True)
    paths = got["paths"]
    assert (paths["direct"], paths["sampled_out"], paths["through_tracer"]) == (1, 1, 0)
    assert paths["exported"] == paths["produced"] == 2
