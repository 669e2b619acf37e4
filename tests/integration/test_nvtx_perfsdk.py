"""perfsdk's live NVTX markers, checked through a real NVTX injection library.

Every scenario runs in a fresh subprocess with ``tests/nvtx_injection/librecorder.so`` injected
(``NVTX_INJECTION64_PATH``), so what is asserted here is exactly what Nsight Systems would
receive: range names, nesting, domains, colors, categories, payloads, and balance under
exceptions, threads, generators and asyncio. Most checks share one scenario process (a
module-scoped fixture) to keep the file fast; each test looks at its own region names.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from perfsdk.markers import color_for
from tests.nvtx_injection.recorder import (
    Event,
    Range,
    ranges,
    run_with_recorder,
    start_end_ranges,
)

pytestmark = pytest.mark.skipif(find_spec("nvtx") is None, reason="nvtx package not installed")

GREEN = 0xFF008000

MAIN_SCENARIO = r"""
import asyncio
import threading

import perfsdk
from perfsdk import profiled, timed_region

# -- nesting, colors, categories, payloads (default domain) ---------------------------------
@profiled("nest.outer", category="phase", payload=42)
def outer():
    with timed_region("nest.middle", category="phase"):
        inner()
        inner()
    with timed_region("nest.other_cat", category="io", payload=-7):
        pass


@profiled("nest.inner", color="green")
def inner():
    pass


outer()

# -- a custom domain -------------------------------------------------------------------------
@profiled("dom.func", domain="perfsdk.test", category="phase", color="#80112233")
def in_domain():
    with timed_region("dom.block", domain="perfsdk.test", color=0x123456):
        pass


in_domain()

# -- exceptions ------------------------------------------------------------------------------
@profiled("exc.outer")
def exc_outer():
    with timed_region("exc.middle"):
        exc_inner()


@profiled("exc.inner")
def exc_inner():
    raise ValueError("boom")


try:
    exc_outer()
except ValueError as exc:
    assert str(exc) == "boom", exc
else:
    raise SystemExit("the exception was swallowed")
try:
    with timed_region("exc.block"):
        raise KeyError("k")
except KeyError:
    pass
else:
    raise SystemExit("the exception was swallowed")


@profiled("exc.after")
def exc_after():
    pass


exc_after()

# -- threads ---------------------------------------------------------------------------------
@profiled("thr.outer")
def thr_outer(n):
    with timed_region("thr.middle"):
        thr_leaf(n)


@profiled("thr.leaf")
def thr_leaf(n):
    if n == 0:
        inside.wait()  # all four threads hold three open ranges at once here


start = threading.Barrier(4)
inside = threading.Barrier(4)


def thr_work(i):
    start.wait()
    for n in range(25):
        thr_outer(n)


threads = [threading.Thread(target=thr_work, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()

# -- generators ------------------------------------------------------------------------------
def _items(n):
    for i in range(n):
        with timed_region("gen.body"):
            pass
        yield i


gen_full = profiled("gen.full")(_items)
gen_closed = profiled("gen.closed")(_items)
gen_dropped = profiled("gen.dropped")(_items)
seen = []
for v in gen_full(3):
    with timed_region("gen.consumer"):
        seen.append(v)
assert seen == [0, 1, 2], seen
g = gen_closed(10)
assert next(g) == 0 and next(g) == 1
g.close()
g = gen_dropped(10)
assert next(g) == 0
del g  # garbage-collected while suspended

# -- async functions and async with ----------------------------------------------------------
@profiled("async.task")
async def task(i):
    for _ in range(3):
        await asyncio.sleep(0)
    await leaf(i)


@profiled("async.leaf")
async def leaf(i):
    await asyncio.sleep(0)


async def block(i):
    async with timed_region("async.inner_block"):
        await asyncio.sleep(0)


async def main():
    await asyncio.gather(*(task(i) for i in range(4)))
    async with timed_region("async.block"):
        await asyncio.gather(*(block(i) for i in range(3)))


asyncio.run(main())

# -- a step's phases (perfsdk.phase: riding on the step's region) ----------------------------
ph_forward = perfsdk.phase("phase.forward", category="compute")
ph_backward = perfsdk.phase("phase.backward")
for i in range(2):
    with perfsdk.step():
        with ph_forward, timed_region("phase.inside"):
            pass
        try:
            with ph_backward:
                if i == 1:
                    raise RuntimeError("backward failed")
        except RuntimeError:
            pass
with ph_forward:  # outside a step: a region of its own
    pass

# -- run-time switches -----------------------------------------------------------------------
@profiled("toggle.func")
def toggled():
    with timed_region("toggle.block"):
        pass


perfsdk.configure(nvtx=False)
toggled()
perfsdk.configure(nvtx=True, enabled=False)
toggled()
perfsdk.configure(enabled=True)

with timed_region("end.marker"):
    pass
"""


def _run(lib: Path, tmp_path: Path, code: str, env: dict[str, str | None] | None = None
         ) -> list[Event]:
    return run_with_recorder(textwrap.dedent(code), lib, tmp_path, env)


@pytest.fixture(scope="module")
def main_events(nvtx_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    events = _run(nvtx_lib, tmp_path_factory.mktemp("nvtx_main"), MAIN_SCENARIO)
    assert any(e["kind"] == "init" for e in events), "the injection library was not loaded"
    return events


@pytest.fixture(scope="module")
def main_ranges(main_events: list[Event]) -> list[Range]:
    return ranges(main_events)  # raises on any unbalanced push/pop anywhere in the scenario


def _named(rs: list[Range], prefix: str) -> list[Range]:
    return [r for r in rs if str(r["message"]).startswith(prefix)]


def _category_ids(events: list[Event]) -> dict[tuple[str, str], int]:
    return {(e["domain"], e["name"]): e["category"] for e in events if e["kind"] == "category"}


# ---------------------------------------------------------------------------- names, nesting


def test_exact_names_and_nesting(main_ranges: list[Range]) -> None:
    rs = _named(main_ranges, "nest.")
    assert [(r["path"], r["depth"]) for r in rs] == [
        (("nest.outer",), 0),
        (("nest.outer", "nest.middle"), 1),
        (("nest.outer", "nest.middle", "nest.inner"), 2),
        (("nest.outer", "nest.middle", "nest.inner"), 2),
        (("nest.outer", "nest.other_cat"), 1),
    ]
    assert {r["domain"] for r in rs} == {"perfsdk"}
    assert len({r["thread"] for r in rs}) == 1
    outer, middle, inner1, inner2, other = rs
    assert outer["push_seq"] < middle["push_seq"] < inner1["push_seq"] < inner1["pop_seq"]
    assert inner1["pop_seq"] < inner2["push_seq"] < inner2["pop_seq"] < middle["pop_seq"]
    assert middle["pop_seq"] < other["push_seq"] < other["pop_seq"] < outer["pop_seq"]


def test_phases_nest_in_their_step_and_stay_balanced(main_ranges: list[Range],
                                                     main_events: list[Event]) -> None:
    rs = [r for r in main_ranges
          if r["message"] == "step" or str(r["message"]).startswith("phase.")]
    one_step = [("step",), ("step", "phase.forward"), ("step", "phase.forward", "phase.inside"),
                ("step", "phase.backward")]
    assert [r["path"] for r in rs] == [*one_step, *one_step, ("phase.forward",)]
    compute = _category_ids(main_events)[("perfsdk", "compute")]
    assert {r["category"] for r in rs if r["message"] == "phase.forward"} == {compute}
    assert len({r["thread"] for r in rs}) == 1


def test_sync_regions_use_push_pop_not_start_end(main_events: list[Event]) -> None:
    started = {e["message"] for e in main_events if e["kind"] == "start"}
    assert not {m for m in started if not m.startswith("async.")}, started


# ---------------------------------------------------------------------------------- domains


def test_default_and_custom_domains(main_events: list[Event], main_ranges: list[Range]) -> None:
    created = [e["domain"] for e in main_events if e["kind"] == "domain_create"]
    # one domain handle, made once by each NVTX client in the process: the nvtx package, and
    # perfsdk's compiled module where it is built (tests/integration/test_nvtx_fastpath.py)
    assert created.count("perfsdk") in (1, 2)
    assert created.count("perfsdk.test") == created.count("perfsdk")
    dom = _named(main_ranges, "dom.")
    assert [(r["path"], r["domain"]) for r in dom] == [
        (("dom.func",), "perfsdk.test"),
        (("dom.func", "dom.block"), "perfsdk.test"),
    ]
    # a range in another domain is on its own stack: nothing of "perfsdk" encloses it
    assert all(r["depth"] == 0 for r in _named(main_ranges, "end.marker"))


# ----------------------------------------------------------------------------------- colors


def test_explicit_colors(main_ranges: list[Range]) -> None:
    by_name = {r["message"]: r["color"] for r in main_ranges}
    assert by_name["nest.inner"] == GREEN == 0xFF008000
    assert by_name["dom.func"] == 0x80112233  # '#AARRGGBB' keeps its alpha
    assert by_name["dom.block"] == 0xFF123456  # 0xRRGGBB gets an opaque alpha


def test_default_color_is_the_stable_per_name_color(main_ranges: list[Range]) -> None:
    for name in ("nest.outer", "nest.middle", "exc.inner", "thr.leaf", "gen.full"):
        colors = {r["color"] for r in main_ranges if r["message"] == name}
        assert colors == {color_for(name)}, name
    # different names do not all collapse onto one color
    assert len({color_for(n) for n in ("nest.outer", "nest.middle", "exc.inner", "thr.leaf",
                                        "gen.full", "exc.outer")}) > 1


# ------------------------------------------------------------------------------- categories


def test_categories_are_registered_in_the_domain(
    main_events: list[Event], main_ranges: list[Range]
) -> None:
    ids = _category_ids(main_events)
    assert ("perfsdk", "phase") in ids
    assert ("perfsdk", "io") in ids
    assert ("perfsdk.test", "phase") in ids  # registered separately in the custom domain
    assert ids[("perfsdk", "phase")] != ids[("perfsdk", "io")]
    assert all(i != 0 for i in ids.values())
    by_name = {r["message"]: r for r in main_ranges}
    assert by_name["nest.outer"]["category"] == ids[("perfsdk", "phase")]
    assert by_name["nest.middle"]["category"] == ids[("perfsdk", "phase")]
    assert by_name["nest.other_cat"]["category"] == ids[("perfsdk", "io")]
    assert by_name["dom.func"]["category"] == ids[("perfsdk.test", "phase")]
    assert by_name["nest.inner"]["category"] == 0  # none given


# --------------------------------------------------------------------------------- payloads


def test_integer_payloads(main_ranges: list[Range]) -> None:
    by_name = {r["message"]: r for r in main_ranges}
    assert (by_name["nest.outer"]["payload"], by_name["nest.outer"]["payload_type"]) == (
        42, "int64")
    assert (by_name["nest.other_cat"]["payload"], by_name["nest.other_cat"]["payload_type"]) == (
        -7, "int64")
    assert by_name["nest.inner"]["payload_type"] is None


# ------------------------------------------------------------------------------- exceptions


def test_balanced_when_the_body_raises(main_ranges: list[Range]) -> None:
    rs = _named(main_ranges, "exc.")
    assert [r["path"] for r in rs] == [
        ("exc.outer",),
        ("exc.outer", "exc.middle"),
        ("exc.outer", "exc.middle", "exc.inner"),
        ("exc.block",),
        ("exc.after",),  # the stack is back at the top after both exceptions
    ]


# ---------------------------------------------------------------------------------- threads


def test_balanced_per_thread(main_ranges: list[Range]) -> None:
    rs = _named(main_ranges, "thr.")
    threads = Counter(r["thread"] for r in rs)
    assert len(threads) == 4
    assert set(threads.values()) == {75}  # 25 calls x 3 levels on each thread
    main_thread = _named(main_ranges, "nest.outer")[0]["thread"]
    assert main_thread not in threads
    for thread in threads:
        paths = Counter(r["path"] for r in rs if r["thread"] == thread)
        assert paths == {
            ("thr.outer",): 25,
            ("thr.outer", "thr.middle"): 25,
            ("thr.outer", "thr.middle", "thr.leaf"): 25,
        }


def test_threads_really_overlapped(main_events: list[Event]) -> None:
    # otherwise the per-thread balance above proves little: at one point every worker thread
    # held its three ranges open at once (they meet at a barrier inside the innermost one)
    depth: Counter[Any] = Counter()
    most = 0
    for e in main_events:
        if e["kind"] == "push" and str(e["message"]).startswith("thr."):
            depth[e["thread"]] += 1
        elif e["kind"] == "pop" and depth[e["thread"]]:
            depth[e["thread"]] -= 1
        most = max(most, sum(1 for v in depth.values() if v == 3))
    assert most == 4


# ------------------------------------------------------------------------------- generators


def test_generator_one_range_per_resumption(main_ranges: list[Range]) -> None:
    full = _named(main_ranges, "gen.full")
    # three resumptions that yield plus the one that finishes the generator
    assert [r["depth"] for r in full] == [0, 0, 0, 0]
    bodies = [r["path"] for r in _named(main_ranges, "gen.body")]
    assert bodies.count(("gen.full", "gen.body")) == 3
    # the consumer runs between resumptions: no generator range is open around it
    consumers = _named(main_ranges, "gen.consumer")
    assert [r["path"] for r in consumers] == [("gen.consumer",)] * 3
    order = sorted(full + consumers, key=lambda r: r["push_seq"])
    assert [r["message"] for r in order] == ["gen.full", "gen.consumer"] * 3 + ["gen.full"]


def test_generator_closed_or_dropped_early_is_balanced(main_ranges: list[Range]) -> None:
    # ranges() already proved that nothing is left open; each resumption made exactly one range
    assert len(_named(main_ranges, "gen.closed")) == 2
    assert len(_named(main_ranges, "gen.dropped")) == 1
    closed_bodies = [r for r in _named(main_ranges, "gen.body") if r["path"][0] == "gen.closed"]
    assert len(closed_bodies) == 2


# ------------------------------------------------------------------------------------ async


def test_async_uses_balanced_start_end_ranges(main_events: list[Event]) -> None:
    pushed = {e["message"] for e in main_events if e["kind"] == "push"}
    assert not {m for m in pushed if str(m).startswith("async.")}
    se = start_end_ranges(main_events)  # raises on an unmatched start or end
    counts = Counter(r["message"] for r in se)
    assert counts == {"async.task": 4, "async.leaf": 4, "async.block": 1,
                      "async.inner_block": 3}
    for r in se:
        assert r["domain"] == "perfsdk"
        assert r["color"] == color_for(r["message"])
        assert r["start_ns"] <= r["end_ns"]


def test_async_ranges_interleave(main_events: list[Event]) -> None:
    ids = {e["range_id"]: e["message"] for e in main_events if e["kind"] == "start"}
    order = [(e["kind"], ids.get(e["range_id"])) for e in main_events
             if e["kind"] in ("start", "end")]
    tasks = [k for k, m in order if m == "async.task"]
    # all four tasks started before the first one ended: the ranges really interleaved
    assert tasks[:5] == ["start"] * 4 + ["end"], tasks
    se = start_end_ranges(main_events)
    block = next(r for r in se if r["message"] == "async.block")
    for r in se:
        if r["message"] == "async.inner_block":
            assert block["start_ns"] <= r["start_ns"] <= r["end_ns"] <= block["end_ns"]


# --------------------------------------------------------------------------------- switches


def test_runtime_switches_stop_ranges(main_events: list[Event]) -> None:
    messages = {e.get("message") for e in main_events if e["kind"] in ("push", "start")}
    assert "toggle.func" not in messages  # configure(nvtx=False), then configure(enabled=False)
    assert "toggle.block" not in messages
    assert "end.marker" in messages  # and back on afterwards


@pytest.mark.parametrize("variable", ["PERFSDK_NVTX", "PERFSDK_ENABLED"])
def test_switched_off_by_environment_emits_no_ranges(
    nvtx_lib: Path, tmp_path: Path, variable: str
) -> None:
    events = _run(nvtx_lib, tmp_path, """
        import asyncio
        import nvtx
        import perfsdk

        @perfsdk.profiled("off.func", category="c", payload=1)
        def f():
            with perfsdk.timed_region("off.block"):
                pass

        @perfsdk.profiled("off.async")
        async def a():
            async with perfsdk.timed_region("off.async_block"):
                pass

        f()
        asyncio.run(a())
        nvtx.push_range("control")  # proves the recorder is attached in this process
        nvtx.pop_range()
        """, env={variable: "0"})
    marks = [e for e in events if e["kind"] in ("push", "start", "pop", "end")]
    assert [(e["kind"], e.get("message")) for e in marks] == [("push", "control"), ("pop", None)]


# ------------------------------------------------------------- a second, independent process


SECOND_SCENARIO = r"""
import nvtx
import perfsdk

for name in ("nest.outer", "nest.middle", "exc.inner", "thr.leaf", "gen.full"):
    with perfsdk.timed_region(name):
        pass


@perfsdk.profiled("payload.max", payload=2**63 - 1)
def pmax():
    pass


@perfsdk.profiled("payload.min", payload=-(2**63))
def pmin():
    pass


pmax()
pmin()

try:
    @perfsdk.profiled("payload.big", payload=2**63)
    def pbig():
        pass
except ValueError as exc:
    if "payload" in str(exc):  # refused at decoration, naming the argument: fine
        nvtx.mark("payload.big rejected")
else:
    pbig()
"""


@pytest.fixture(scope="module")
def second_events(nvtx_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    return _run(nvtx_lib, tmp_path_factory.mktemp("nvtx_second"), SECOND_SCENARIO)


def test_default_color_is_the_same_in_another_process(
    main_ranges: list[Range], second_events: list[Event]
) -> None:
    first = {r["message"]: r["color"] for r in main_ranges}
    second = {r["message"]: r["color"] for r in ranges(second_events)}
    assert second["nest.outer"] != 0
    for name in ("nest.outer", "nest.middle", "exc.inner", "thr.leaf", "gen.full"):
        assert second[name] == first[name] == color_for(name), name
    pids = {r["pid"] for r in main_ranges} | {r["pid"] for r in ranges(second_events)}
    assert len(pids) == 2


def test_full_int64_payload_range(second_events: list[Event]) -> None:
    by_name = {r["message"]: r for r in ranges(second_events)}
    assert (by_name["payload.max"]["payload"], by_name["payload.max"]["payload_type"]) == (
        2**63 - 1, "int64")
    assert (by_name["payload.min"]["payload"], by_name["payload.min"]["payload_type"]) == (
        -(2**63), "int64")


def test_accepted_payload_reaches_nvtx(second_events: list[Event]) -> None:
    """A payload that ``@profiled`` accepts must reach NVTX (or be refused at decoration).

    perfsdk accepts payloads up to 2**64 - 1, but the nvtx package converts them to a C
    ``long``: 2**63 overflows, the event attributes are never built and the region loses its
    NVTX range (one PerfSDKWarning saying "NVTX unavailable").
    """
    rejected = [e for e in second_events
                if e["kind"] == "mark" and e["message"] == "payload.big rejected"]
    pushed = [r for r in ranges(second_events) if r["message"] == "payload.big"]
    if not rejected:
        assert [r["payload"] for r in pushed] == [2**63], (
            "payload=2**63 was accepted by @profiled but did not reach NVTX")


def test_switching_nvtx_off_or_on_inside_a_region_stays_balanced(
    nvtx_lib: Path, tmp_path: Path
) -> None:
    """``configure(nvtx=...)`` while regions are open (e.g. from a controller thread) must not
    pop a range that was never pushed, leave one open, or raise into the program."""
    events = _run(nvtx_lib, tmp_path, """
        import asyncio
        import nvtx
        import perfsdk

        with perfsdk.timed_region("sw.parent"):
            perfsdk.configure(nvtx=False)
            with perfsdk.timed_region("sw.entered_off"):
                perfsdk.configure(nvtx=True)  # on again before this region exits
            with perfsdk.timed_region("sw.sibling"):
                pass

        with perfsdk.timed_region("sw.entered_on"):
            perfsdk.configure(nvtx=False)  # off before this region exits
        perfsdk.configure(nvtx=True)

        async def main():
            perfsdk.configure(nvtx=False)
            async with perfsdk.timed_region("sw.async_off"):
                perfsdk.configure(nvtx=True)
            async with perfsdk.timed_region("sw.async_on"):
                perfsdk.configure(nvtx=False)
            perfsdk.configure(nvtx=True)

        try:
            asyncio.run(main())
        except Exception as exc:  # reported as a mark so the sync checks still run
            nvtx.mark(f"raised {exc!r}")
        with perfsdk.timed_region("sw.last"):
            pass
        """)
    raised = [e["message"] for e in events if e["kind"] == "mark"]
    rs = ranges(events)
    assert [(r["message"], r["path"]) for r in rs if r["message"] != "sw.entered_on"] == [
        ("sw.parent", ("sw.parent",)),
        ("sw.sibling", ("sw.parent", "sw.sibling")),
        ("sw.last", ("sw.last",)),
    ]
    start_end_ranges(events)
    assert not raised, raised


def test_timing_off_leaves_only_balanced_nvtx_ranges(nvtx_lib: Path, tmp_path: Path) -> None:
    """PERFSDK_TIMING=0: every kind of region still reaches NVTX, balanced, and nothing else
    is recorded (no region reaches the pipeline, so no summary row and no span)."""
    events = _run(nvtx_lib, tmp_path, """
        import asyncio
        import perfsdk
        from perfsdk.pipeline import PIPELINE

        @perfsdk.profiled("t.outer")
        def outer():
            with perfsdk.timed_region("t.block"):
                return inner()

        @perfsdk.profiled("t.inner")
        def inner():
            return 7

        @perfsdk.profiled("t.gen")
        def gen():
            yield 1
            yield 2

        @perfsdk.profiled("t.boom")
        def boom():
            raise KeyError("x")

        @perfsdk.profiled("t.co")
        async def co():
            await asyncio.sleep(0)
            return 3

        assert outer() == 7
        assert list(gen()) == [1, 2]
        try:
            boom()
        except KeyError:
            pass
        assert asyncio.run(co()) == 3
        perfsdk.flush()
        assert len(perfsdk.summary(show=False)) == 0, perfsdk.summary(show=False)
        assert not PIPELINE.started
        """, env={"PERFSDK_TIMING": "0"})
    rs = ranges(events)
    assert [(r["message"], r["path"]) for r in rs if r["message"] != "t.gen"] == [
        ("t.outer", ("t.outer",)),
        ("t.block", ("t.outer", "t.block")),
        ("t.inner", ("t.outer", "t.block", "t.inner")),
        ("t.boom", ("t.boom",)),
    ]
    assert sum(r["message"] == "t.gen" for r in rs) == 3  # one per resumption
    assert [r["message"] for r in start_end_ranges(events)] == ["t.co"]
