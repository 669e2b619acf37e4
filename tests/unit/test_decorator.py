"""@profiled: every kind of callable, metadata, errors, nesting, sampling, disabling, pickling."""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import math
import operator
import pickle
import threading
import traceback
import typing

import pytest
import torch

import perfsdk
from perfsdk import context, profiled, timed_region
from perfsdk.decorator import Profiler
from perfsdk.pipeline import PIPELINE
from perfsdk.region import Region


def resolved(cap):
    """Every region that has finished so far, in resolution order."""
    PIPELINE.drain(wait=True)
    return list(cap.regions)


def current_name():
    span = context.current_span()
    return span.name if isinstance(span, Region) else None


# -- module-level functions (pickling and metadata need importable names) -----------------------
@profiled
def module_fn(x: int, *, scale: float = 2.0) -> float:
    """Scale x."""
    return x * scale


@profiled("named.module_fn", color="green")
def module_named(x: int) -> int:
    return x + 1


# -- forms --------------------------------------------------------------------------------------
def test_bare_decorator_records_one_region_named_by_qualname(captured):
    @profiled
    def step(x):
        assert current_name() == step.__qualname__
        return x * 3

    assert step(4) == 12
    (region,) = resolved(captured)
    assert region.name == "test_bare_decorator_records_one_region_named_by_qualname.<locals>.step"
    assert region.error is None
    assert region.host_ms >= 0
    assert region.device_ms is None  # no GPU
    assert region.attributes["code.function"] == step.__qualname__
    assert region.attributes["code.filepath"] == __file__
    assert region.attributes["code.lineno"] == step.__wrapped__.__code__.co_firstlineno + 1
    assert captured.span(step.__qualname__).attributes["perfsdk.host_ms"] == region.host_ms


def test_named_decorator_with_options(captured):
    @profiled("fwd", color="green", category="compute", payload=7, domain="train",
              attributes={"layer": 3, "tags": ["a", "b"]})
    def forward(x):
        return -x

    assert forward(2) == -2
    (region,) = resolved(captured)
    assert region.name == "fwd"
    assert region.attributes["layer"] == 3
    assert region.attributes["tags"] == ("a", "b")
    assert region.attributes["perfsdk.category"] == "compute"
    assert region.attributes["perfsdk.payload"] == 7
    spec = forward.__perfsdk_spec__
    assert (spec.domain, spec.color, spec.category, spec.payload) == (
        "train", 0xFF008000, "compute", 7)


def test_call_forms(captured):
    def plain(x):
        return x - 1

    wrapped = profiled(plain)
    assert wrapped is not plain
    assert wrapped(5) == 4
    assert profiled()(plain)(5) == 4
    assert profiled(None)(plain)(5) == 4
    assert profiled("kw-name")(plain)(5) == 4
    assert profiled(name="by-keyword")(plain)(5) == 4
    options = profiled("opts", every=1)
    assert isinstance(options, Profiler)
    assert options(plain)(5) == 4
    names = [r.name for r in resolved(captured)]
    q = plain.__qualname__
    assert names == [q, q, q, "kw-name", "by-keyword", "opts"]


def test_function_and_options_together_is_a_type_error():
    def f():
        pass

    with pytest.raises(TypeError, match="options go with a name"):
        profiled(f, every=2)  # type: ignore[call-overload]


def test_callable_object_instance(captured):
    class Doubler:
        def __init__(self):
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return 2 * x

    obj = Doubler()
    wrapped = profiled(obj)
    assert wrapped(21) == 42
    assert obj.calls == 1
    assert wrapped.__wrapped__ is obj
    (region,) = resolved(captured)
    assert region.name == Doubler.__qualname__
    assert region.attributes["code.function"] == Doubler.__qualname__


def _stacked(fn):
    return fn


def _with_args(*args, **kwargs):
    return _stacked


@_stacked
@profiled(
    "stacked",
    color="green",
    attributes={"def": "below"},
)
@_with_args(
    1,
    key="def stacked_fn():",  # a decorator line that mentions def is not the def
)
def stacked_fn():
    return 1


def test_code_lineno_is_the_def_line_under_a_multiline_decorator_stack(captured):
    assert stacked_fn() == 1
    (region,) = resolved(captured)
    lines, start = inspect.getsourcelines(stacked_fn)
    def_line = start + next(i for i, line in enumerate(lines) if line.startswith("def "))
    assert inspect.unwrap(stacked_fn).__code__.co_firstlineno == start < def_line  # first @
    assert region.attributes["code.lineno"] == def_line
    assert region.attributes["code.function"] == "stacked_fn"


def test_code_lineno_falls_back_when_the_source_is_unavailable(captured):
    namespace: dict[str, typing.Any] = {"profiled": profiled}
    exec(compile("@profiled\ndef made():\n    return 2\n", "<no source>", "exec"), namespace)
    assert namespace["made"]() == 2
    (region,) = resolved(captured)
    assert region.attributes["code.filepath"] == "<no source>"
    assert region.attributes["code.lineno"] == 1  # co_firstlineno: the best there is


def _partial_target(x, y):
    return x + y


def test_partial_is_named_after_the_function_it_wraps(captured):
    wrapped = profiled(functools.partial(functools.partial(_partial_target, 1), y=2))
    assert wrapped() == 3
    (region,) = resolved(captured)
    assert region.name == "partial(_partial_target)"
    code = _partial_target.__code__
    assert region.attributes["code.function"] == "_partial_target"
    assert region.attributes["code.filepath"] == code.co_filename == __file__
    assert region.attributes["code.lineno"] == code.co_firstlineno
    assert region.attributes["code.namespace"] == __name__


@pytest.mark.parametrize(("fn", "args", "name", "function", "namespace"), [
    (torch.relu, (torch.tensor([-1.0, 2.0]),), "torch.relu", "relu", "torch"),
    (math.sqrt, (4.0,), "math.sqrt", "sqrt", "math"),
    (operator.add, (1, 2), "operator.add", "add", "operator"),  # defined in _operator
    (len, ([1],), "len", "len", "builtins"),
    (str.upper, ("a",), "str.upper", "str.upper", None),  # a method of a builtin type
    (torch.nn.functional.silu, (torch.tensor([1.0]),), "silu", "silu",
     "torch.nn.functional"),  # a Python function: its __qualname__, like any other
])
def test_builtins_are_named_by_module_and_name(captured, fn, args, name, function, namespace):
    profiled(fn)(*args)
    (region,) = resolved(captured)
    assert region.name == name
    assert region.attributes["code.function"] == function
    assert region.attributes.get("code.namespace") == namespace


def test_partial_of_a_builtin(captured):
    assert profiled(functools.partial(torch.add, other=1))(torch.tensor([1])).tolist() == [2]
    (region,) = resolved(captured)
    assert region.name == "partial(torch.add)"
    assert region.attributes["code.namespace"] == "torch"


@pytest.mark.asyncio
async def test_async_callable_object_and_partial_cover_the_await(captured):
    import functools

    class Fetcher:
        async def __call__(self, seconds):
            await asyncio.sleep(seconds)
            return current_name()

    class Counter:
        def __call__(self, n):
            yield from range(n)

    async def nap(seconds):
        await asyncio.sleep(seconds)
        return current_name()

    fetch = profiled("fetch")(Fetcher())
    assert inspect.iscoroutinefunction(fetch)
    assert await fetch(0.02) == "fetch"
    assert await profiled("partial")(functools.partial(nap, 0.02))() == "partial"
    assert list(profiled("count")(Counter())(2)) == [0, 1]
    regions = {r.name: r for r in resolved(captured)}
    assert regions["fetch"].host_ms >= 19.0
    assert regions["partial"].host_ms >= 19.0
    assert len(captured.named("count")) == 3


# -- methods, both decorator orders -------------------------------------------------------------
class Model:
    scale = 10

    def __init__(self, bias):
        self.bias = bias

    @profiled
    def instance(self, x):
        return x * self.scale + self.bias

    @profiled
    @classmethod
    def cls_outer(cls, x):
        return (cls, x * cls.scale)

    @classmethod
    @profiled
    def cls_inner(cls, x):
        return (cls, x * cls.scale)

    @profiled
    @staticmethod
    def static_outer(x):
        return x + 100

    @staticmethod
    @profiled
    def static_inner(x):
        return x + 200

    @profiled("custom")
    @classmethod
    def cls_named(cls):
        return cls


class SubModel(Model):
    scale = 20


def test_methods_in_both_decorator_orders(captured):
    m = Model(1)
    assert m.instance(2) == 21
    assert Model.instance(m, 3) == 31
    assert Model.cls_outer(1) == (Model, 10)
    assert m.cls_outer(2) == (Model, 20)
    assert SubModel.cls_outer(1) == (SubModel, 20)
    assert Model.cls_inner(1) == (Model, 10)
    assert SubModel(0).cls_inner(1) == (SubModel, 20)
    assert Model.static_outer(1) == 101
    assert m.static_outer(2) == 102
    assert Model.static_inner(1) == 201
    assert m.static_inner(2) == 202
    assert Model.cls_named() is Model
    names = [r.name for r in resolved(captured)]
    assert names == [
        "Model.instance", "Model.instance",
        "Model.cls_outer", "Model.cls_outer", "Model.cls_outer",
        "Model.cls_inner", "Model.cls_inner",
        "Model.static_outer", "Model.static_outer",
        "Model.static_inner", "Model.static_inner",
        "custom",
    ]


def test_method_wrappers_keep_their_descriptor_kind():
    assert isinstance(Model.__dict__["cls_outer"], classmethod)
    assert isinstance(Model.__dict__["static_outer"], staticmethod)
    assert Model.__dict__["cls_outer"].__func__.__qualname__ == "Model.cls_outer"
    assert Model.__dict__["static_outer"].__func__.__wrapped__.__qualname__ == (
        "Model.static_outer")


# -- metadata -----------------------------------------------------------------------------------
def test_keeps_metadata_signature_and_type_hints():
    original = module_fn.__wrapped__
    assert module_fn.__name__ == "module_fn"
    assert module_fn.__qualname__ == "module_fn"
    assert module_fn.__doc__ == "Scale x."
    assert module_fn.__module__ == __name__
    assert not hasattr(original, "__wrapped__")
    assert inspect.signature(module_fn) == inspect.signature(original)
    assert str(inspect.signature(module_fn)) == "(x: 'int', *, scale: 'float' = 2.0) -> 'float'"
    assert typing.get_type_hints(module_fn) == {"x": int, "scale": float, "return": float}
    assert module_fn(3) == 6.0


def test_async_and_generator_wrappers_keep_their_kind():
    async def coro():
        pass

    def gen():
        yield 1

    async def agen():
        yield 1

    assert inspect.iscoroutinefunction(profiled(coro))
    assert inspect.isgeneratorfunction(profiled(gen))
    assert inspect.isasyncgenfunction(profiled(agen))
    assert profiled(coro).__wrapped__ is coro


# -- exceptions ---------------------------------------------------------------------------------
class Boom(Exception):
    pass


def test_exception_propagates_unchanged_and_is_recorded(captured):
    error = Boom("bad batch")

    @profiled
    def fails():
        raise error

    with pytest.raises(Boom) as info:
        fails()
    assert info.value is error
    assert error.__context__ is None
    assert error.__cause__ is None
    frames = traceback.extract_tb(error.__traceback__)
    assert frames[-1].name == "fails"
    assert frames[-1].line == "raise error"
    (region,) = resolved(captured)
    assert region.error is error
    span = captured.span(fails.__qualname__)
    assert span.status.status_code.name == "ERROR"
    assert context.current_span() is not None
    assert not isinstance(context.current_span(), Region)  # nothing left open


def test_base_exceptions_propagate_too(captured):
    @profiled
    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupt()
    (region,) = resolved(captured)
    assert isinstance(region.error, KeyboardInterrupt)


# -- nesting ------------------------------------------------------------------------------------
def test_nested_regions_have_correct_parents(captured):
    @profiled("inner")
    def inner():
        return current_name()

    @profiled("outer")
    def outer():
        return [inner(), inner(), current_name()]

    assert outer() == ["inner", "inner", "outer"]
    regions = {r.name: r for r in resolved(captured)}
    inners = captured.named("inner")
    out = regions["outer"]
    assert out.parent_span_id == 0
    assert len(inners) == 2
    for r in inners:
        assert r.parent_span_id == out.span_id
        assert r.trace_id == out.trace_id
    assert inners[0].span_id != inners[1].span_id
    # two top-level calls are two traces
    outer()
    resolved(captured)
    second = captured.named("outer")[1]
    assert second.trace_id != out.trace_id


def test_recursion_nests(captured):
    @profiled("fact")
    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    assert fact(5) == 120
    regions = {r.span_id: r for r in resolved(captured)}
    assert len(regions) == 5
    roots = [r for r in regions.values() if r.parent_span_id == 0]
    assert len(roots) == 1
    depth, node = 1, roots[0]
    children = {r.parent_span_id: r for r in regions.values()}
    while node.span_id in children:
        node, depth = children[node.span_id], depth + 1
    assert depth == 5


def test_threads_keep_their_own_nesting(captured):
    @profiled("t.inner")
    def inner():
        pass

    @profiled("t.outer")
    def outer():
        for _ in range(3):
            inner()

    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        for _ in range(5):
            outer()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    regions = resolved(captured)
    outers = {r.span_id: r for r in regions if r.name == "t.outer"}
    inners = [r for r in regions if r.name == "t.inner"]
    assert len(outers) == 40
    assert len(inners) == 120
    for r in inners:
        parent = outers[r.parent_span_id]
        assert parent.thread_id == r.thread_id
        assert parent.trace_id == r.trace_id
        assert parent.start_ns <= r.start_ns <= r.end_ns <= parent.end_ns
    assert all(o.parent_span_id == 0 for o in outers.values())


# -- async functions ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_async_region_covers_the_awaited_call(captured):
    @profiled("nap")
    async def nap(seconds):
        assert current_name() == "nap"
        await asyncio.sleep(seconds)
        assert current_name() == "nap"
        return "rested"

    assert await nap(0.03) == "rested"
    (region,) = resolved(captured)
    assert region.name == "nap"
    assert region.host_ms >= 29.0  # the sleep is inside the region


@pytest.mark.asyncio
async def test_async_exception_and_nesting(captured):
    error = Boom("async")

    @profiled("a.inner")
    async def inner():
        await asyncio.sleep(0)
        raise error

    @profiled("a.outer")
    async def outer():
        try:
            await inner()
        except Boom as exc:
            return exc

    assert await outer() is error
    regions = {r.name: r for r in resolved(captured)}
    assert regions["a.inner"].error is error
    assert regions["a.inner"].parent_span_id == regions["a.outer"].span_id
    assert regions["a.outer"].error is None


# -- generators ---------------------------------------------------------------------------------
def test_generator_one_region_per_resumption(captured):
    seen = []

    @profiled("gen")
    def numbers(n):
        for i in range(n):
            seen.append(current_name())
            yield i
        seen.append(current_name())
        return "done"

    with timed_region("consumer") as outer:
        assert list(numbers(3)) == [0, 1, 2]
        assert context.current_span() is outer
    assert seen == ["gen"] * 4
    regions = [r for r in resolved(captured) if r.name == "gen"]
    assert len(regions) == 4  # 3 items + the resumption that finishes it
    assert all(r.parent_span_id == outer.span_id for r in regions)
    assert all(r.error is None for r in regions)


def test_generator_send_and_return_value(captured):
    @profiled("acc")
    def accumulate():
        total = 0
        while True:
            value = yield total
            if value is None:
                return total
            total += value

    def driver():
        return (yield from accumulate())

    g = accumulate()
    assert next(g) == 0
    assert g.send(5) == 5
    assert g.send(2) == 7
    with pytest.raises(StopIteration) as info:
        g.send(None)
    assert info.value.value == 7

    d = driver()
    next(d)
    d.send(3)
    with pytest.raises(StopIteration) as info:
        d.send(None)
    assert info.value.value == 3
    assert len([r for r in resolved(captured) if r.name == "acc"]) == 7


def test_generator_closed_early_leaves_nothing_open(captured):
    cleaned = []

    @profiled("early")
    def items():
        try:
            yield 1
            yield 2
            yield 3
        finally:
            cleaned.append(True)

    with timed_region("outer") as outer:
        g = items()
        assert next(g) == 1
        assert context.current_span() is outer
        g.close()
        assert cleaned == [True]
        assert context.current_span() is outer
    assert not isinstance(context.current_span(), Region)
    regions = [r for r in resolved(captured) if r.name == "early"]
    assert len(regions) == 1
    assert regions[0].parent_span_id == outer.span_id
    assert PIPELINE.pending == 0


def test_generator_collected_early_leaves_nothing_open(captured):
    cleaned = []

    @profiled("collected")
    def items():
        try:
            while True:
                yield 1
        finally:
            cleaned.append(current_name())

    with timed_region("outer") as outer:
        g = items()
        next(g)
        next(g)
        del g
        gc.collect()
        assert cleaned == ["outer"]  # the cleanup ran outside any 'collected' region
        assert context.current_span() is outer
        for value in items():  # a for loop broken off, then dropped
            if value:
                break
        gc.collect()
        assert len(cleaned) == 2
    regions = [r for r in resolved(captured) if r.name == "collected"]
    assert len(regions) == 3
    assert all(r.parent_span_id == outer.span_id for r in regions)
    assert PIPELINE.pending == 0


def test_exception_thrown_into_generator(captured):
    @profiled("thrown")
    def items():
        try:
            yield 1
        except KeyError:
            yield "recovered"
        yield 2

    g = items()
    assert next(g) == 1
    assert g.throw(KeyError("k")) == "recovered"
    assert next(g) == 2
    error = ValueError("into the generator")
    with pytest.raises(ValueError, match="into the generator") as info:
        g.throw(error)
    assert info.value is error
    regions = [r for r in resolved(captured) if r.name == "thrown"]
    assert len(regions) == 4
    assert [r.error for r in regions] == [None, None, None, error]


def test_generator_raising_records_the_error(captured):
    @profiled("raising")
    def items():
        yield 1
        raise Boom("in generator")

    g = items()
    next(g)
    with pytest.raises(Boom, match="in generator"):
        next(g)
    regions = [r for r in resolved(captured) if r.name == "raising"]
    assert [type(r.error) for r in regions] == [type(None), Boom]


# -- async generators ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_async_generator_one_region_per_resumption(captured):
    seen = []

    @profiled("agen")
    async def ticks(n):
        for i in range(n):
            await asyncio.sleep(0)
            seen.append(current_name())
            yield i

    async with timed_region("consumer") as outer:
        assert [i async for i in ticks(3)] == [0, 1, 2]
        assert context.current_span() is outer
    assert seen == ["agen"] * 3
    regions = [r for r in resolved(captured) if r.name == "agen"]
    assert len(regions) == 4
    assert all(r.parent_span_id == outer.span_id for r in regions)


@pytest.mark.asyncio
async def test_async_generator_closed_early_and_collected(captured):
    cleaned = []

    @profiled("agen.early")
    async def ticks():
        try:
            while True:
                await asyncio.sleep(0)
                yield 1
        finally:
            cleaned.append(True)

    async with timed_region("outer") as outer:
        agen = ticks()
        assert await agen.__anext__() == 1
        await agen.aclose()
        assert cleaned == [True]
        assert context.current_span() is outer

        agen = ticks()
        await agen.__anext__()
        await agen.__anext__()
        del agen
        gc.collect()
        for _ in range(5):  # the loop's async-generator finalizer runs aclose() as a task
            await asyncio.sleep(0)
        assert cleaned == [True, True]
        assert context.current_span() is outer
    regions = [r for r in resolved(captured) if r.name == "agen.early"]
    assert len(regions) == 3
    assert all(r.parent_span_id == outer.span_id for r in regions)
    assert PIPELINE.pending == 0


def test_async_generator_abandoned_with_break_records_no_error(captured):
    cleaned = []

    @profiled("agen.break")
    async def ticks():
        try:
            while True:
                await asyncio.sleep(0)
                yield 1
        finally:
            cleaned.append(True)

    async def main():
        async for _ in ticks():
            break  # abandoned: asyncio.run closes it at shutdown (cancelling its aclose task)

    asyncio.run(main())
    assert cleaned == [True]
    regions = resolved(captured)
    assert [(r.name, r.error) for r in regions] == [("agen.break", None)]
    assert PIPELINE.pending == 0


def test_generator_abandoned_with_break_records_no_error(captured):
    cleaned = []

    @profiled("gen.break")
    def ticks():
        try:
            while True:
                yield 1
        finally:
            cleaned.append(True)

    for _ in ticks():
        break
    gc.collect()
    assert cleaned == [True]
    assert [(r.name, r.error) for r in resolved(captured)] == [("gen.break", None)]


@pytest.mark.asyncio
async def test_exception_thrown_into_async_generator(captured):
    @profiled("athrown")
    async def ticks():
        try:
            yield 1
        except KeyError:
            yield "recovered"

    agen = ticks()
    assert await agen.__anext__() == 1
    assert await agen.athrow(KeyError("k")) == "recovered"
    error = ValueError("into the async generator")
    with pytest.raises(ValueError, match="into the async generator") as info:
        await agen.athrow(error)
    assert info.value is error
    regions = [r for r in resolved(captured) if r.name == "athrown"]
    assert [r.error for r in regions] == [None, None, error]


# -- sampling -----------------------------------------------------------------------------------
def test_every_n_records_exactly_every_nth_call(captured):
    inside = []

    @profiled("sampled", every=3)
    def step(i):
        inside.append((i, current_name() == "sampled"))

    for i in range(10):
        step(i)
    assert [i for i, recorded in inside if recorded] == [0, 3, 6, 9]
    assert len([r for r in resolved(captured) if r.name == "sampled"]) == 4


def test_sample_every_from_config_and_explicit_every_wins(captured, monkeypatch):
    monkeypatch.setenv("PERFSDK_SAMPLE_EVERY", "2")
    perfsdk.config.reset_from_env()

    @profiled("from-env")
    def a():
        pass

    @profiled("explicit", every=1)
    def b():
        pass

    @profiled("gen-sampled")
    def g():
        yield 1

    for _ in range(6):
        a()
        b()
        list(g())
    regions = resolved(captured)
    assert len([r for r in regions if r.name == "from-env"]) == 3
    assert len([r for r in regions if r.name == "explicit"]) == 6
    assert len([r for r in regions if r.name == "gen-sampled"]) == 3 * 2


# -- disabled -----------------------------------------------------------------------------------
def test_disabled_at_decoration_returns_the_function_itself(monkeypatch):
    def f():
        pass

    cm = classmethod(f)
    sm = staticmethod(f)
    perfsdk.configure(enabled=False)
    assert profiled(f) is f
    assert profiled("n", every=2, color="red")(f) is f
    assert profiled(cm) is cm
    assert profiled(sm) is sm
    assert timed_region("n")(f) is f

    perfsdk.configure(enabled=True)
    monkeypatch.setenv("PERFSDK_ENABLED", "0")
    perfsdk.config.reset_from_env()
    assert profiled(f) is f


def test_disabled_at_decoration_still_validates_arguments():
    perfsdk.configure(enabled=False)
    with pytest.raises(ValueError, match="color"):
        profiled(color="nope")
    with pytest.raises(ValueError, match="category"):
        profiled(category="")


@pytest.mark.asyncio
async def test_disabled_at_run_time_records_nothing(captured):
    @profiled
    def f(x):
        return x

    @profiled
    async def coro(x):
        return x

    @profiled
    def gen():
        yield 1
        yield 2

    @profiled
    async def agen():
        yield 1

    perfsdk.configure(enabled=False)
    assert f(1) == 1
    assert await coro(2) == 2
    assert list(gen()) == [1, 2]
    assert [x async for x in agen()] == [1]
    with timed_region("off") as handle:
        pass
    assert math.isnan(handle.host_ms)
    assert not handle.recorded
    assert resolved(captured) == []
    perfsdk.configure(enabled=True)
    assert f(1) == 1
    assert [r.name for r in resolved(captured)] == [f.__qualname__]


# -- bad arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "argument", "accepted"),
    [
        ({"name": 5}, "name", "non-empty string"),
        ({"name": ""}, "name", "non-empty string"),
        ({"every": 0}, "every", "integer >= 1"),
        ({"every": -1}, "every", "integer >= 1"),
        ({"every": 2.0}, "every", "integer >= 1"),
        ({"every": True}, "every", "integer >= 1"),
        ({"color": "nope"}, "color", "#RRGGBB"),
        ({"color": -1}, "color", "#RRGGBB"),
        ({"color": 2**33}, "color", "#RRGGBB"),
        ({"payload": 1.5}, "payload", "integer"),
        ({"payload": True}, "payload", "integer"),
        ({"payload": 2**64}, "payload", "integer"),
        ({"payload": 2**63}, "payload", "-2**63 to 2**63-1"),
        ({"payload": -(2**63) - 1}, "payload", "-2**63 to 2**63-1"),
        ({"category": ""}, "category", "non-empty string"),
        ({"category": 3}, "category", "non-empty string"),
        ({"attributes": {"a": object()}}, "'a'", "str, bool, int, float"),
        ({"attributes": {"": 1}}, "attribute names", "non-empty strings"),
        ({"attributes": {"a": [1, object()]}}, "'a'", "str, bool, int, float"),
        ({"domain": ""}, "domain", "non-empty strings"),
        ({"domain": None}, "domain", "non-empty strings"),
        ({"sync": "yes"}, "sync", "True or False"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, argument, accepted):
    with pytest.raises(ValueError, match="profiled") as info:
        profiled(**kwargs)
    message = str(info.value)
    assert argument in message
    assert accepted in message


def test_bad_positional_name_raises_naming_it():
    with pytest.raises(ValueError, match="name") as info:
        profiled(5)  # type: ignore[call-overload]
    assert "non-empty string" in str(info.value)


def test_not_a_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        Profiler()(42)  # type: ignore[arg-type]


def test_good_color_forms():
    for color, argb in [("green", 0xFF008000), ("#112233", 0xFF112233),
                        ("#80112233", 0x80112233), (0x112233, 0xFF112233),
                        (0x80112233, 0x80112233)]:
        assert profiled(color=color)(module_fn.__wrapped__).__perfsdk_spec__.color == argb
    # no color: a stable one per name
    a = profiled("same-name")(lambda: None).__perfsdk_spec__.color
    b = profiled("same-name")(lambda: None).__perfsdk_spec__.color
    assert a == b


# -- pickling -----------------------------------------------------------------------------------
def test_pickle_round_trips(captured):
    assert pickle.loads(pickle.dumps(module_fn)) is module_fn
    assert pickle.loads(pickle.dumps(module_named)) is module_named
    options = profiled("x", color="red", every=2, attributes={"k": "v"})
    copy = pickle.loads(pickle.dumps(options))
    assert copy == options
    assert copy is not options

    def f():
        return 1

    assert copy(f)() == 1
    assert [r.name for r in resolved(captured)] == ["x"]
    assert resolved(captured)[0].attributes["k"] == "v"


# -- sync=True on the fake device ---------------------------------------------------------------
def test_sync_true_resolves_device_time_before_exit_returns(fake_cuda, captured):
    @profiled("synced", sync=True)
    def work():
        fake_cuda.launch(2.5)

    work()
    # resolved at exit: the test never moved the GPU clock, and draining without waiting
    # finds the device time already there
    assert fake_cuda.sync_calls == ["Event.synchronize"]
    PIPELINE.drain(wait=False)
    (region,) = captured.regions
    assert region.device_ms == 2.5
