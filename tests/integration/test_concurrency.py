"""Parents stay right under concurrency: threads, copied contexts, asyncio, and the user's own
OpenTelemetry spans opened inside regions.

Regions are checked through ``perfsdk.testing.capture()`` (the resolved records: ids, parents,
thread), the user's spans through a real OpenTelemetry SDK ``TracerProvider`` with an
``InMemorySpanExporter`` that is deliberately *not* installed globally.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from perfsdk import RegionResult, profiled, timed_region
from perfsdk.testing import capture

THREADS = 8
ROUNDS = 40


def _tag(key: str, value: Any) -> None:
    """Tag the current region (it is OpenTelemetry's current span) so the test can find it."""
    trace.get_current_span().set_attribute(key, value)


@profiled("cc.l1")
def level1(t: int, n: int, barrier: threading.Barrier | None) -> None:
    _tag("t", t)
    _tag("n", n)
    with timed_region("cc.l2", t=t, n=n):
        level3(t, n, barrier)


@profiled("cc.l3")
def level3(t: int, n: int, barrier: threading.Barrier | None) -> None:
    _tag("t", t)
    _tag("n", n)
    if barrier is not None and n == 0:
        barrier.wait()  # every thread is three regions deep at this moment


def _by_key(regions: list[RegionResult]) -> dict[tuple[str, int, int], RegionResult]:
    out: dict[tuple[str, int, int], RegionResult] = {}
    for r in regions:
        key = (r.name, r.attributes["t"], r.attributes["n"])
        assert key not in out, f"duplicate region {key}"
        out[key] = r
    return out


def test_threads_with_nested_regions_keep_their_parents() -> None:
    barrier = threading.Barrier(THREADS)
    start = threading.Barrier(THREADS)
    idents: dict[int, int] = {}

    def work(t: int) -> None:
        idents[t] = threading.get_ident()
        start.wait()
        for n in range(ROUNDS):
            level1(t, n, barrier)

    with capture() as cap:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    regions = [r for r in cap.regions if r.name.startswith("cc.l")]
    assert Counter(r.name for r in regions) == {
        "cc.l1": THREADS * ROUNDS, "cc.l2": THREADS * ROUNDS, "cc.l3": THREADS * ROUNDS}
    by_key = _by_key(regions)
    assert len({r.span_id for r in regions}) == len(regions)  # span ids are unique
    roots = [r for r in regions if r.name == "cc.l1"]
    assert len({r.trace_id for r in roots}) == len(roots)  # each top-level call is a trace
    for t in range(THREADS):
        for n in range(ROUNDS):
            l1, l2, l3 = (by_key[(name, t, n)] for name in ("cc.l1", "cc.l2", "cc.l3"))
            assert l1.parent_span_id == 0
            assert l2.parent_span_id == l1.span_id
            assert l3.parent_span_id == l2.span_id
            assert l1.trace_id == l2.trace_id == l3.trace_id != 0
            assert l1.thread_id == l2.thread_id == l3.thread_id == idents[t]
            assert l1.start_ns <= l2.start_ns <= l3.start_ns
            assert l3.end_ns <= l2.end_ns <= l1.end_ns


def test_copied_context_carries_the_region_into_a_thread() -> None:
    @profiled("cc.child")
    def child() -> None:
        pass

    with capture() as cap, timed_region("cc.parent") as parent:
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=ctx.run, args=(child,))
        plain = threading.Thread(target=child)
        copied.start()
        copied.join()
        plain.start()
        plain.join()

    parent_rec = cap.named("cc.parent")[0]
    assert parent_rec.span_id == parent.span_id
    children = cap.named("cc.child")
    assert len(children) == 2
    with_ctx = [c for c in children if c.parent_span_id == parent_rec.span_id]
    without = [c for c in children if c.parent_span_id != parent_rec.span_id]
    assert len(with_ctx) == 1
    assert len(without) == 1
    assert with_ctx[0].trace_id == parent_rec.trace_id
    assert with_ctx[0].thread_id != parent_rec.thread_id
    # the plain thread starts a trace of its own
    assert without[0].parent_span_id == 0
    assert without[0].trace_id != parent_rec.trace_id


@profiled("cc.task")
async def task(i: int) -> None:
    _tag("i", i)
    await asyncio.sleep(0)
    await middle(i)
    await asyncio.sleep(0)


@profiled("cc.middle")
async def middle(i: int) -> None:
    _tag("i", i)
    await asyncio.sleep(0)
    await leaf(i)


@profiled("cc.leaf")
async def leaf(i: int) -> None:
    _tag("i", i)
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_thousand_asyncio_tasks_keep_their_parents() -> None:
    tasks = 1000
    with capture() as cap:
        async with timed_region("cc.root") as root:
            await asyncio.gather(*(task(i) for i in range(tasks)))
        await asyncio.gather(*(task(tasks + i) for i in range(10)))  # outside any region

    root_rec = cap.named("cc.root")[0]
    assert root_rec.span_id == root.span_id
    found: dict[tuple[str, int], RegionResult] = {}
    for r in cap.regions:
        if r.name in ("cc.task", "cc.middle", "cc.leaf"):
            key = (r.name, r.attributes["i"])
            assert key not in found, key
            found[key] = r
    assert len(found) == 3 * (tasks + 10)
    for i in range(tasks + 10):
        t, m, lf = found[("cc.task", i)], found[("cc.middle", i)], found[("cc.leaf", i)]
        assert m.parent_span_id == t.span_id, i
        assert lf.parent_span_id == m.span_id, i
        assert t.trace_id == m.trace_id == lf.trace_id, i
        if i < tasks:
            assert t.parent_span_id == root_rec.span_id, i
            assert t.trace_id == root_rec.trace_id, i
        else:
            assert t.parent_span_id == 0, i
            assert t.trace_id != root_rec.trace_id, i
    # the tasks really ran interleaved: the first task finished after the last one started
    first, last = found[("cc.task", 0)], found[("cc.task", tasks - 1)]
    assert last.start_ns < first.end_ns


@pytest.fixture
def user_tracer() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("user.app"), exporter
    provider.shutdown()


def test_user_spans_inside_regions_are_children(
    user_tracer: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = user_tracer

    @profiled("cc.inner_region")
    def inner_region() -> None:
        pass

    with capture() as cap, timed_region("cc.outer_region") as region:
        with tracer.start_as_current_span("user.span") as span:
            assert span.is_recording()
            inner_region()
        with tracer.start_as_current_span("user.sibling"):
            pass

    outer = cap.named("cc.outer_region")[0]
    inner = cap.named("cc.inner_region")[0]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"user.span", "user.sibling"}
    for name in ("user.span", "user.sibling"):
        user = spans[name]
        assert user.parent is not None, name
        assert user.parent.span_id == outer.span_id == region.span_id
        assert user.context.trace_id == outer.trace_id
    # and a region opened inside the user's span is that span's child, in the same trace
    assert inner.parent_span_id == spans["user.span"].context.span_id
    assert inner.trace_id == outer.trace_id


def test_user_spans_in_threads_and_tasks(
    user_tracer: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = user_tracer

    def work(t: int) -> None:
        with timed_region("cc.thread_region", t=t), tracer.start_as_current_span(f"user.t{t}"):
            pass

    async def atask(i: int) -> None:
        async with timed_region("cc.task_region", t=100 + i):
            await asyncio.sleep(0)
            with tracer.start_as_current_span(f"user.t{100 + i}"):
                await asyncio.sleep(0)

    async def amain() -> None:
        await asyncio.gather(*(atask(i) for i in range(20)))

    with capture() as cap:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        asyncio.run(amain())

    regions = {r.attributes["t"]: r for r in cap.regions
               if r.name in ("cc.thread_region", "cc.task_region")}
    spans = {int(s.name[len("user.t"):]): s for s in exporter.get_finished_spans()}
    assert set(spans) == set(regions) == set(range(THREADS)) | set(range(100, 120))
    for t, span in spans.items():
        assert span.parent is not None
        assert span.parent.span_id == regions[t].span_id, t
        assert span.context.trace_id == regions[t].trace_id, t
