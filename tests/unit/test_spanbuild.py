"""Spans from region records: the compiled builder (``perfsdk.export._spanbuild``) makes the
spans the pure-Python one makes, field for field, for records of every shape; it builds the
plain ones itself; and it is trusted only after a batch of its own agreed."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

import perfsdk
from perfsdk import clocks
from perfsdk.context import span_context
from perfsdk.distributed import rank_attributes
from perfsdk.export import spans as spans_module
from perfsdk.export.exporters import span_line
from perfsdk.export.spans import build_resource, build_spans_python, region_span, same_span
from perfsdk.pipeline import PIPELINE
from perfsdk.record import ERROR, EVENTS, MEMORY, PARENT, SPAN, SPECS, TRACE
from perfsdk.testing import Capture, use_fake_cuda

spanbuild = pytest.importorskip("perfsdk.export._spanbuild")

# The compiled builder is asked only while no GPU sampler adds readings to spans: on a GPU machine
# a sampler starts once CUDA is initialized (torch.compile in an earlier test does that).
pytestmark = pytest.mark.usefixtures("no_cuda")


def _records_of_every_shape(captured: Capture) -> list[tuple[Any, ...]]:
    @perfsdk.profiled("plain")
    def plain() -> int:
        return 1

    @perfsdk.profiled("declared", attributes={"model": "mlp", "layers": 3, "ratio": 0.5})
    def declared() -> int:
        return 2

    plain()
    declared()
    with perfsdk.timed_region("outer") as outer:
        outer.set_attribute("batch", 32)  # a per-call attribute
        plain()  # a parent
        with perfsdk.timed_region("evented") as evented:
            evented.add_event("marker", {"k": "v"})
    with pytest.raises(KeyError), perfsdk.timed_region("failing"):
        raise KeyError("boom")
    with perfsdk.timed_region("memory", memory=True):
        pass
    with trace.get_tracer("test", tracer_provider=TracerProvider()).start_as_current_span("app"):
        plain()  # a foreign parent and trace
    with use_fake_cuda() as fake:
        with perfsdk.timed_region("device"):
            fake.launch(2.5)  # a device time
        fake.advance(2.5)
    PIPELINE.drain(wait=True)
    records = list(captured.records)
    names = {SPECS[r[0]].name for r in records}
    assert {"plain", "declared", "outer", "evented", "failing", "memory", "device"} <= names
    invalid = list(records[0])
    invalid[SPAN] = 0  # an invalid span id: the context says so
    other = list(records[0])
    other[TRACE], other[PARENT] = 2**128, 2**64  # out of range: invalid too
    return [*records, tuple(invalid), tuple(other)]


def _builder(slow: Any) -> Any:
    probe = span_context(1, 1)
    fields = vars(ReadableSpan("", probe, None, None, {}, (), (), trace.SpanKind.INTERNAL,
                               None, spans_module.status_of(None), 0, 0, spans_module.SCOPE))
    return spanbuild.SpanBuilder(ReadableSpan, type(probe), probe.trace_flags, probe.trace_state,
                                 dict(fields), SPECS, slow)


@pytest.mark.parametrize("ranks", [{}, {"perfsdk.rank": 1, "perfsdk.world_size": 2}])
def test_compiled_spans_are_the_python_spans(captured: Capture, ranks: dict[str, Any]) -> None:
    records = _records_of_every_shape(captured)
    resource = build_resource(perfsdk.get_config())
    app_span = object()  # the application's own span passes as it is
    items: list[Any] = [*records, app_span]
    slow_calls: list[tuple[Any, ...]] = []

    def slow(rec: tuple[Any, ...], res: Any, rk: Any) -> ReadableSpan:
        slow_calls.append(rec)
        return region_span(rec, res, rk)

    compiled = _builder(slow)(items, resource, ranks, clocks.epoch_ns(0))
    expected = build_spans_python(items, resource, ranks)
    assert compiled[-1] is app_span
    assert len(compiled) == len(expected) == len(items)
    for got, want in zip(compiled[:-1], expected[:-1], strict=True):
        assert type(got) is ReadableSpan
        assert same_span(got, want), (got.name, vars(got), vars(want))
        assert span_line(got) == span_line(want)
    # Only records with an error, events or memory readings went to region_span.
    assert [r for r in records if r[ERROR] is not None or r[EVENTS] is not None
            or r[MEMORY] is not None] == slow_calls
    assert len(slow_calls) == 3
    by_name = {s.name: s for s in compiled[:-1]}
    assert by_name["device"].attributes["perfsdk.device_ms"] == pytest.approx(2.5)
    assert by_name["outer"].attributes["batch"] == 32
    assert by_name["declared"].attributes["model"] == "mlp"
    assert [s.context.is_valid for s in compiled[-3:-1]] == [False, False]
    assert compiled[-2].parent is None or compiled[-2].parent == expected[-2].parent
    if ranks:
        assert all(s.attributes["perfsdk.world_size"] == 2 for s in compiled[:-1])
    # What it builds itself stays out of the garbage collector's lists (see untrack() in
    # _spanbuild.c); the Python-built ones are tracked as usual.
    plain = by_name["outer"]
    for obj in (plain, vars(plain), plain._attributes, plain.context, by_name["plain"].parent):
        assert obj is not None
        assert not gc.is_tracked(obj)
    assert gc.is_tracked(expected[records.index(next(
        r for r in records if SPECS[r[0]].name == "outer"))])


def compiled_builder() -> Any:
    """perfsdk's compiled span builder as the exporters get it (skips the test where
    ``PERFSDK_DISABLE_EXTENSIONS=1`` turns it off: the pure-Python runs of the suite)."""
    compiled = spans_module._Compiled()
    if compiled.builder is None:
        pytest.skip("perfsdk's compiled modules are turned off (PERFSDK_DISABLE_EXTENSIONS)")
    return compiled


def test_a_builder_is_checked_before_it_is_trusted(captured: Capture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records_of_every_shape(captured)
    resource = build_resource(perfsdk.get_config())
    compiled = compiled_builder()
    assert compiled.builder is not None
    assert not compiled.checked
    built: list[int] = []
    real = compiled.builder

    def counting(*args: Any) -> Any:
        built.append(len(args[0]))
        return real(*args)

    compiled.builder = counting
    python: list[int] = []
    monkeypatch.setattr(spans_module, "build_spans_python",
                        lambda items, *a: python.append(len(items)) or
                        [region_span(i, *a) if type(i) is tuple else i for i in items])
    failing = [r for r in records if r[ERROR] is not None]
    first = compiled(failing, resource, rank_attributes())
    assert first is not None
    assert not compiled.checked
    second = compiled(records, resource, rank_attributes())
    assert compiled.checked
    assert python == [len(failing), len(records)]
    third = compiled(records, resource, rank_attributes())  # from now on: compiled only
    assert python == [len(failing), len(records)]
    assert built == [len(failing)] + 2 * [len(records)]
    assert second is not None
    assert third is not None
    assert all(same_span(a, b) for a, b in zip(second, third, strict=True))


def test_a_builder_that_disagrees_is_turned_off(captured: Capture) -> None:
    records = _records_of_every_shape(captured)
    resource = build_resource(perfsdk.get_config())
    compiled = compiled_builder()
    real = compiled.builder

    def renaming(*args: Any) -> list[Any]:
        spans = real(*args)
        spans[0]._name = "not " + spans[0].name  # another SDK's field, say
        return spans  # type: ignore[no-any-return]

    compiled.builder = renaming
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        spans = compiled(records, resource, rank_attributes())
    assert compiled.builder is None
    assert not compiled.checked
    assert any("disagrees" in str(w.message) for w in said)
    assert spans is not None
    assert all(same_span(a, b) for a, b in zip(
        spans, build_spans_python(records, resource, rank_attributes()), strict=True))
    assert compiled(records, resource, rank_attributes()) is None  # the Python twin from now on


def test_without_the_module_the_python_twin_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFSDK_DISABLE_EXTENSIONS", "1")
    compiled = spans_module._Compiled()
    assert compiled.builder is None
    assert compiled([], build_resource(perfsdk.get_config()), {}) is None
