"""timed_region: with, async with, decorator; the handle; reuse; errors; concurrency."""

from __future__ import annotations

import asyncio
import math
import pickle
import threading

import pytest
from opentelemetry import trace

import perfsdk
from perfsdk import RegionResult, context, timed_region
from perfsdk.pipeline import PIPELINE
from perfsdk.region import Region


def resolved(cap):
    PIPELINE.drain(wait=True)
    return list(cap.regions)


def by_name(cap, name):
    return [r for r in resolved(cap) if r.name == name]


# -- with ---------------------------------------------------------------------------------------
def test_with_block_handle(captured):
    with timed_region("load", batch=3, attributes={"split": "train", "domain": "not-nvtx"}) as r:
        assert isinstance(r, Region)
        assert context.current_span() is r
        assert math.isnan(r.host_ms)  # not finished yet
        assert r.recorded
        assert r.device_ms is None
        total = sum(range(10_000))
    assert total == 49_995_000
    assert r.host_ms > 0
    assert r.device_ms is None  # no GPU
    assert r.name == "load"
    assert r.attributes["batch"] == 3
    assert r.attributes["split"] == "train"
    assert r.attributes["domain"] == "not-nvtx"  # via attributes=, a span attribute
    assert r.attributes["code.function"] == "test_with_block_handle"
    assert r.attributes["code.filepath"] == __file__
    assert not isinstance(context.current_span(), Region)

    result = r.result()
    assert isinstance(result, RegionResult)
    assert result.name == "load"
    assert result.host_ms == r.host_ms
    assert result.device_ms is None
    assert result.error is None
    assert result.attributes["batch"] == 3
    assert result.end_ns - result.start_ns == pytest.approx(r.host_ms * 1e6, abs=1)

    (captured_region,) = resolved(captured)
    assert captured_region == result
    span = captured.span("load")
    assert span.attributes["batch"] == 3
    assert span.attributes["perfsdk.host_ms"] == r.host_ms
    assert "perfsdk.device_ms" not in span.attributes


def test_result_inside_the_block_is_an_error():
    with timed_region("early") as r, pytest.raises(RuntimeError, match="has not exited"):
        r.result()


def test_attributes_set_while_running(captured):
    with timed_region("annotated", fixed=1) as r:
        r.set_attribute("tokens", 512)
        trace.get_current_span().set_attribute("via.otel", "yes")
        r.set_attributes({"more": 2.5})
    expected = {"fixed": 1, "tokens": 512, "via.otel": "yes", "more": 2.5}
    assert {k: r.attributes.get(k) for k in expected} == expected
    (region,) = resolved(captured)
    assert {k: region.attributes.get(k) for k in expected} == expected
    span = captured.span("annotated")
    assert span.attributes["tokens"] == 512
    assert span.attributes["via.otel"] == "yes"


def test_per_call_attributes_on_one_line(captured):
    for i in range(3):
        with timed_region("step", index=i):
            pass
    assert [r.attributes["index"] for r in by_name(captured, "step")] == [0, 1, 2]


def test_user_otel_span_inside_becomes_a_child(captured):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("user")  # a private provider: nothing global changes
    with timed_region("parent") as r, tracer.start_as_current_span("user-span") as span:
        ctx = span.get_span_context()
        assert span.parent is not None
        assert span.parent.span_id == r.span_id
        assert ctx.trace_id == r.trace_id


# -- reuse --------------------------------------------------------------------------------------
def test_same_object_reused_sequentially_and_nested(captured):
    region = timed_region("reused", k="v")
    with region as first:
        pass
    with region as second:
        pass
    assert first is not second
    assert first.host_ms >= 0
    assert second.host_ms >= 0
    with region as outer, region as inner:
        assert context.current_span() is inner
    assert context.current_span() is not outer
    regions = by_name(captured, "reused")
    assert len(regions) == 4
    assert len({r.span_id for r in regions}) == 4
    assert regions[2].parent_span_id == regions[3].span_id  # inner resolved first
    assert all(r.attributes["k"] == "v" for r in regions)


def test_shared_object_in_threads(captured):
    shared = timed_region("threaded")
    barrier = threading.Barrier(8)
    errors = []

    def work():
        try:
            barrier.wait()
            for _ in range(50):
                with timed_region("t.outer") as outer:
                    with shared as inner:
                        assert context.current_span() is inner
                    assert context.current_span() is outer
                    assert inner.parent_id == outer.span_id
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(by_name(captured, "threaded")) == 400


# -- exceptions ---------------------------------------------------------------------------------
def test_exception_propagates_and_is_recorded(captured):
    error = ZeroDivisionError("no batches")
    with pytest.raises(ZeroDivisionError) as info, timed_region("failing") as r:
        raise error
    assert info.value is error
    assert error.__context__ is None
    assert r.host_ms >= 0
    assert r.result().error is error
    (region,) = by_name(captured, "failing")
    assert region.error is error
    span = captured.span("failing")
    assert span.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]
    assert span.events[0].attributes["exception.type"] == "ZeroDivisionError"
    assert not isinstance(context.current_span(), Region)


# -- async with ---------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_async_with(captured):
    async with timed_region("fetch", url="x") as r:
        assert context.current_span() is r
        await asyncio.sleep(0.02)
        assert context.current_span() is r
    assert r.host_ms >= 19.0
    (region,) = by_name(captured, "fetch")
    assert region.attributes["url"] == "x"


@pytest.mark.asyncio
async def test_async_with_exception(captured):
    with pytest.raises(KeyError):  # noqa: PT012 - the raise must happen inside the region
        async with timed_region("afail"):
            await asyncio.sleep(0)
            raise KeyError("k")
    (region,) = by_name(captured, "afail")
    assert isinstance(region.error, KeyError)


@pytest.mark.asyncio
async def test_async_with_in_100_concurrent_tasks_keeps_parents(captured):
    shared = timed_region("shared")

    async def task(i):
        async with timed_region("task", i=i) as outer:
            await asyncio.sleep(0.001 * (i % 4))
            async with timed_region("inner", i=i) as inner:
                await asyncio.sleep(0.001 * ((i + 1) % 3))
                assert context.current_span() is inner
            async with shared as s:
                await asyncio.sleep(0.001 * (i % 2))
                assert context.current_span() is s
            assert context.current_span() is outer
        return outer, inner, s

    async with timed_region("main") as main:
        results = await asyncio.gather(*(task(i) for i in range(100)))
    for outer, inner, s in results:
        assert outer.parent_id == main.span_id
        assert inner.parent_id == outer.span_id
        assert s.parent_id == outer.span_id
        assert outer.trace_id == inner.trace_id == main.trace_id
    regions = resolved(captured)
    tasks = {r.span_id: r for r in regions if r.name == "task"}
    inners = [r for r in regions if r.name == "inner"]
    assert len(tasks) == len(inners) == 100
    for r in inners:
        assert tasks[r.parent_span_id].attributes["i"] == r.attributes["i"]
    assert len([r for r in regions if r.name == "shared"]) == 100


# -- decorator ----------------------------------------------------------------------------------
def test_as_decorator(captured):
    @timed_region("decorated", kind="fn")
    def add(a, b):
        """Add."""
        return a + b

    @timed_region("adecorated")
    async def aadd(a, b):
        await asyncio.sleep(0)
        return a + b

    assert add(1, 2) == 3
    assert add.__doc__ == "Add."
    assert add.__wrapped__(1, 1) == 2
    assert asyncio.run(aadd(2, 3)) == 5
    regions = resolved(captured)
    assert [r.name for r in regions] == ["decorated", "adecorated"]
    assert regions[0].attributes["kind"] == "fn"


def test_disabled_records_nothing(captured):
    perfsdk.configure(enabled=False)
    with timed_region("off") as r:
        pass
    assert math.isnan(r.host_ms)
    assert not r.recorded
    assert r.device_ms is None
    assert resolved(captured) == []


def test_disabled_then_enabled_inside_a_shared_object(captured):
    shared = timed_region("toggled")
    perfsdk.configure(enabled=False)
    with shared as off:
        perfsdk.configure(enabled=True)
        with shared as on:
            pass
    assert math.isnan(off.host_ms)
    assert not off.recorded
    assert on.host_ms >= 0
    assert [r.name for r in resolved(captured)] == ["toggled"]


def test_an_inert_entry_leaving_never_takes_another_threads_live_one(captured):
    """A shared object holds a disabled-at-entry handle of this thread and a live one of another
    thread: this thread's exit takes its inert entry, so the live one closes in its own thread."""
    shared = timed_region("toggled.threads")
    entered, left = threading.Event(), threading.Event()
    handles = {}

    def other():
        with shared as on:
            handles["on"] = on
            entered.set()
            assert left.wait(10)
            assert context.current_span() is on
        handles["after"] = context.current_span()  # the live entry's exit restored it here

    perfsdk.configure(enabled=False)
    off = shared.__enter__()
    perfsdk.configure(enabled=True)
    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    shared.__exit__(None, None, None)  # two entries open: this thread's is not current
    left.set()
    thread.join(10)
    assert not off.recorded
    regions = by_name(captured, "toggled.threads")
    assert len(regions) == 1
    assert regions[0].span_id == handles["on"].span_id
    assert handles["after"] is not handles["on"]
    assert shared._active == []


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        (("",), {}, "name"),
        ((5,), {}, "name"),
        ((["unhashable"],), {}, "name"),
        (("x",), {"color": "nope"}, "color"),
        (("x",), {"color": [1, 2]}, "color"),
        (("x",), {"payload": 0.5}, "payload"),
        (("x",), {"category": ""}, "category"),
        (("x",), {"domain": ""}, "domain"),
        (("x",), {"sync": 1}, "sync"),
        (("x",), {"bad": object()}, "'bad'"),
        (("x",), {"attributes": {"a": {"nested": 1}}}, "'a'"),
    ],
)
def test_bad_arguments_raise_naming_them(args, kwargs, argument):
    with pytest.raises(ValueError, match="timed_region") as info:
        timed_region(*args, **kwargs)
    assert argument in str(info.value)


def test_pickle_round_trip(captured):
    region = timed_region("pickled", color="red", attributes={"a": 1})
    copy = pickle.loads(pickle.dumps(region))
    assert repr(copy) == "timed_region('pickled')"
    with copy as r:
        pass
    assert r.name == "pickled"
    assert r.attributes["a"] == 1
    assert r.spec.color == 0xFFFF0000


@pytest.mark.asyncio
async def test_steps_aside_while_torch_compiles(monkeypatch, captured):
    import perfsdk.timing

    shared = timed_region("compiled-shared")  # made outside, entered inside compiled code
    monkeypatch.setattr(perfsdk.timing, "_is_compiling", lambda: True)
    with timed_region("compiled", k=1) as r:
        assert not isinstance(context.current_span(), Region)
    assert r is None
    async with shared as a:
        pass
    assert a is None
    monkeypatch.setattr(perfsdk.timing, "_is_compiling", lambda: False)
    with shared:
        pass
    assert [x.name for x in resolved(captured)] == ["compiled-shared"]


def test_ids_do_not_follow_the_programs_random_seed(captured):
    """random.seed() in the program (seed_everything, isolate_rng, identically seeded DDP ranks)
    must not repeat trace or span ids."""
    import random

    for _ in range(2):
        random.seed(1234)
        with timed_region("seeded"):
            pass
    first, second = [r for r in resolved(captured) if r.name == "seeded"]
    assert first.span_id != second.span_id
    assert first.trace_id != second.trace_id


def test_forked_children_draw_other_ids(tmp_path):
    """A forked child (a DataLoader worker) does not repeat its parent's next ids."""
    import os
    import warnings

    from perfsdk import region

    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+: fork() of a process with threads warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report its next id and leave at once
        os.close(read)
        os.write(write, str(region._getrandbits(64)).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    assert child != region._getrandbits(64)
