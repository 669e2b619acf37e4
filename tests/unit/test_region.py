"""The gate (RegionSpec.open): one enabled/sampled decision, one counter per spec, and the
shared null region for entries that record nothing."""

from __future__ import annotations

import math

import pytest

import perfsdk
from perfsdk.config import configure
from perfsdk.region import NULL_REGION, NullRegion, Region, RegionSpec
from perfsdk.testing import capture


def test_disabled_and_sampled_out_entries_get_the_one_shared_null_region():
    spec = RegionSpec.create("gate.null", every=2)
    first, second = spec.open(), spec.open()
    assert type(first) is Region
    assert first.recorded
    first.exit(None)
    assert second is NULL_REGION  # sampled out: nothing allocated
    second.exit(None)
    configure(enabled=False)
    assert spec.open() is NULL_REGION
    assert not NULL_REGION.recorded
    assert math.isnan(NULL_REGION.host_ms)
    NULL_REGION.set_attribute("k", 1)  # what shells call on an entry: all ignored
    with NULL_REGION as entry:
        assert entry is NULL_REGION


def test_disabled_entries_do_not_advance_the_counter():
    spec = RegionSpec.create("gate.count", every=2)
    configure(enabled=False)
    assert [spec.sampled() for _ in range(3)] == [False] * 3
    configure(enabled=True)
    assert [spec.sampled() for _ in range(4)] == [True, False, True, False]


def test_nvtx_only_push_pop_entries_share_one_object_per_spec():
    spec = RegionSpec.create("gate.nvtx")
    configure(timing=False)
    entry = spec.open()
    assert isinstance(entry, NullRegion)
    assert not entry.recorded
    entry.exit(None)
    if spec.nvtx.domain is not None:  # the nvtx package is installed
        assert entry is spec.nvtx_range
        again = spec.open()
        assert again is entry
        again.exit(None)
    configure(nvtx=False)
    assert spec.open() is NULL_REGION


def test_open_handle_always_gives_a_region_of_its_own():
    spec = RegionSpec.create("gate.handle", every=2)
    with capture() as cap:
        handles = [spec.open_handle({"i": i}) for i in range(2)]
        for handle in handles:
            if handle.entered:
                handle.exit(None)
    assert [h.recorded for h in handles] == [True, False]
    assert handles[1].attributes["i"] == 1
    assert not handles[1].result().recorded
    assert [r.attributes["i"] for r in cap.named("gate.handle")] == [0]


def test_every_counts_per_function_and_sample_every_per_block():
    @perfsdk.profiled("gate.f", every=3)
    def f() -> None:
        pass

    @perfsdk.profiled("gate.g", every=3)
    def g() -> None:
        pass

    configure(sample_every=2)
    with capture() as cap:
        for _ in range(6):
            f()
            g()
            with perfsdk.timed_region("gate.a"):
                pass
            with perfsdk.timed_region("gate.b"):
                pass
    counts = {name: len(cap.named(name)) for name in ("gate.f", "gate.g", "gate.a", "gate.b")}
    assert counts == {"gate.f": 2, "gate.g": 2, "gate.a": 3, "gate.b": 3}


def test_every_is_validated_on_the_spec():
    with pytest.raises(ValueError, match=r"every=0; accepted values are None or an integer"):
        RegionSpec.create("gate.bad", every=0, where="gate")


# -- the current context, read and set directly (perfsdk.context.CURRENT) -------------------
def _slow_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The region as under a runtime context other than OpenTelemetry's ContextVar one
    (OTEL_PYTHON_CONTEXT): through the context functions only."""
    from perfsdk import context as ctx
    from perfsdk import region

    monkeypatch.setattr(region, "_SPAN_KEY", None)
    monkeypatch.setattr(region, "_cur_get", None)
    monkeypatch.setattr(region, "_cur_set", None)
    monkeypatch.setattr(region, "_cur_reset", ctx.detach)


@pytest.mark.parametrize("path", ["direct", "functions"])
def test_a_region_is_the_current_span_and_nests(path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    if path == "functions":
        _slow_context(monkeypatch)
    tracer = TracerProvider().get_tracer("user")  # a private provider: nothing global changes
    outer_spec, inner_spec = RegionSpec.create("ctx.outer"), RegionSpec.create("ctx.inner")
    before = trace.get_current_span()
    with tracer.start_as_current_span("user.root") as root:
        outer = outer_spec.open()
        assert trace.get_current_span() is outer
        inner = inner_spec.open()
        assert trace.get_current_span() is inner
        with tracer.start_as_current_span("user.leaf") as leaf:
            assert leaf.parent is not None
            assert leaf.parent.span_id == inner.span_id
        inner.exit(None)
        assert trace.get_current_span() is outer
        outer.exit(None)
        assert trace.get_current_span() is root
    assert trace.get_current_span() is before
    root_ctx = root.get_span_context()
    assert outer.trace_id == inner.trace_id == root_ctx.trace_id
    assert outer.parent_id == root_ctx.span_id
    assert inner.parent_id == outer.span_id
    assert len({root_ctx.span_id, outer.span_id, inner.span_id}) == 3


def test_a_region_without_a_parent_starts_a_trace_of_its_own() -> None:
    spec = RegionSpec.create("ctx.root")
    first = spec.open()
    first.exit(None)
    second = spec.open()
    second.exit(None)
    assert first.parent_id == second.parent_id == 0
    assert first.trace_id != second.trace_id
    assert all((first.trace_id, first.span_id, second.trace_id, second.span_id))


def test_exit_in_another_context_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    import contextvars

    from opentelemetry import trace

    spec = RegionSpec.create("ctx.elsewhere")
    entered = contextvars.copy_context()
    region = entered.run(spec.open)
    contextvars.copy_context().run(region.exit, None)  # the token is not of that context
    assert entered.run(trace.get_current_span) is region  # left as OpenTelemetry leaves it
    assert "Failed to detach context" in caplog.text


def test_a_thread_that_ended_is_noted_again_under_a_reused_ident() -> None:
    import threading

    from perfsdk import record

    spec = RegionSpec.create("ctx.thread")
    idents: list[int] = []

    def body() -> None:
        spec.open().exit(None)
        idents.append(threading.get_ident())

    for i in range(2):
        thread = threading.Thread(target=body, name=f"noted-{i}")
        thread.start()
        thread.join()
        assert idents[-1] not in record.NOTED  # the thread ended: its ident left the set
        assert record.THREAD_NAMES[idents[-1]][0] == f"noted-{i}"


def test_span_contexts_built_as_a_tuple_are_opentelemetrys_own() -> None:
    """perfsdk.context.span_context (a region's get_span_context, its exported spans) builds
    SpanContexts without OpenTelemetry's __new__ (the tuple it would build); on this
    OpenTelemetry that shortcut is in use and equal in every field, validity included, to what
    the constructor gives, also for ids out of range."""
    from opentelemetry.trace import SpanContext, TraceFlags

    from perfsdk import context

    assert context.span_context is context._span_context_tuple
    for trace_id, span_id in [(1, 1), (2**128 - 1, 2**64 - 1), (123, 456), (0, 1), (1, 0),
                              (2**128, 1), (1, 2**64)]:
        fast = context.span_context(trace_id, span_id)
        slow = SpanContext(trace_id, span_id, False, TraceFlags(TraceFlags.SAMPLED))
        assert type(fast) is SpanContext
        assert fast == slow
        assert (fast.trace_id, fast.span_id, fast.is_remote, fast.trace_flags, fast.is_valid,
                fast.trace_state) == (slow.trace_id, slow.span_id, slow.is_remote,
                                      slow.trace_flags, slow.is_valid, slow.trace_state)
        assert fast.trace_flags.sampled
