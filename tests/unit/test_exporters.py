"""The file exporter's span lines: OpenTelemetry's own JSON text (``ReadableSpan.to_json``),
made without serializing the resource for every span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from perfsdk.export import exporters
from perfsdk.export.exporters import span_line


def _sdk_spans(resource: Resource) -> list[ReadableSpan]:
    """Spans of the SDK's own: a root, a child with events, an error and a link."""
    tracer = TracerProvider(resource=resource).get_tracer("test")
    with tracer.start_as_current_span("root", attributes={
            "i": 1, "f": 2.5, "s": "text \"quoted\" é", "b": True, "l": [1, 2]}) as root:
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.add_event("marker", {"k": "v"})
            child.record_exception(KeyError("boom"))
            child.set_status(Status(StatusCode.ERROR, "KeyError: 'boom'"))
        linked = tracer.start_span("linked", links=[Link(root.get_span_context(), {"a": 1})])
        linked.end()
    return [root, child, linked]  # type: ignore[list-item]


def _region_like(resource: Resource) -> ReadableSpan:
    """A span built as perfsdk.export.spans.region_span builds one: dict attributes, a tuple
    of events, a parent context, status unset."""
    context = trace.SpanContext(0x1234, 0x5678, is_remote=False,
                                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    parent = trace.SpanContext(0x1234, 0x9ABC, is_remote=False)
    return ReadableSpan("step", context, parent, resource,
                        {"perfsdk.step": 3, "perfsdk.host_ms": 4.25, "thread.id": 77},
                        (Event("e", {"x": 1}, 1_700_000_000_123_456_789),), (),
                        SpanKind.INTERNAL, None, Status(StatusCode.UNSET),
                        1_700_000_000_000_000_001, 1_700_000_000_004_250_001, None)


def test_span_lines_are_the_sdks_own_json_text() -> None:
    first = Resource.create({"service.name": "svc", "n": 1})
    second = Resource.create({"service.name": "other"})
    spans = [*_sdk_spans(first), _region_like(first), *_sdk_spans(second), _region_like(second)]
    for span in spans * 2:  # the second round reads the resource text made in the first
        assert span_line(span) == span.to_json(indent=None) + "\n"
    assert '"service.name": "other"' in span_line(spans[-1])


def test_span_times_are_the_sdks_own_text_to_the_rounding() -> None:
    """iso_time remembers the date and time of a second; its text is ns_to_iso_str's, at the
    edges of microseconds and seconds too (a float divided and rounded half to even), and with
    the seconds visited in any order."""
    import random

    from opentelemetry.sdk.util import ns_to_iso_str

    from perfsdk.export.exporters import iso_time

    rng = random.Random(7)
    base = 1_764_470_000_000_000_000  # 2025
    values = [0, 1, 499, 500, 501, 999, 1_000, 999_999_999, 1_000_000_000, base,
              base + 999_999_500, base + 999_999_499, base + 999_999_999, base - 1]
    values += [base + rng.randrange(10**12) for _ in range(20_000)]  # about 17 minutes
    values += [rng.randrange(4 * 10**18) for _ in range(2_000)]  # any second up to 2096
    values += [base + s * 1_000_000_000 + 500 * k for s in range(3) for k in range(-3, 4)]
    rng.shuffle(values)
    assert [iso_time(v) for v in values] == [ns_to_iso_str(v) for v in values]


def test_a_span_of_another_shape_falls_back_to_its_to_json(tmp_path: Path) -> None:
    class Other:
        resource = Resource.create({})

        def to_json(self, indent: Any = 4) -> str:
            return '{"name": "other"}'

    exporter = exporters._JsonLinesFile(tmp_path)
    exporter.export([Other()])  # type: ignore[list-item]
    exporter.export(_sdk_spans(Resource.create({})))  # to_json from now on: the same text
    exporter.shutdown()
    lines = exporter.path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == '{"name": "other"}'
    assert [line.startswith('{"name": ') for line in lines] == [True] * 4


def test_otlp_encoding_hashes_perfsdks_resource_once(monkeypatch: Any) -> None:
    """OpenTelemetry's OTLP encoder groups a batch's spans by resource in a dict, hashing each
    span's resource, and ``Resource.__hash__`` serializes the attributes to JSON each time.
    perfsdk's resource (``build_resource``) computes its hash once, when it is made: encoding
    serializes nothing, and the bytes are those a plain ``Resource`` gives."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk import resources

    import perfsdk
    from perfsdk.export.spans import HashedResource, build_resource, build_spans
    from perfsdk.testing import capture

    @perfsdk.profiled("encoded")
    def work() -> int:
        return 1

    with capture() as cap:
        for _ in range(20):
            work()
        perfsdk.flush()
    ours = build_resource(perfsdk.get_config())
    plain = Resource(ours.attributes, ours.schema_url)
    assert isinstance(ours, HashedResource)
    assert ours == plain
    assert hash(ours) == hash(plain)
    real, serialized = resources.dumps, []
    monkeypatch.setattr(resources, "dumps",
                        lambda *a, **k: serialized.append(1) or real(*a, **k))
    encoded = {}
    for name, resource in (("ours", ours), ("plain", plain)):
        serialized.clear()
        spans = build_spans(cap.records, resource, {})
        encoded[name] = encode_spans(spans).SerializeToString()
        assert len(spans) == 20
        if name == "ours":
            assert serialized == []
        else:
            assert len(serialized) >= 20  # a hash a span (and one more for the batch)
    assert encoded["ours"] == encoded["plain"]
