"""perfsdk._fastpath, the optional compiled hot path, and the switch that ignores it.

What the compiled NVTX range records is checked through the NVTX injection library in
tests/integration/test_nvtx_fastpath.py (against the pure-Python path), and instrument_module
with the compiled inner entries and node hook in tests/unit/test_auto_module.py (every test
twice, against the Python twins); here: calling conventions, exceptions, references, records
equal to the Python twin's, and that perfsdk imports and works without the module.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import perfsdk
import perfsdk.auto
from perfsdk import markers, region
from perfsdk.config import extensions_enabled
from perfsdk.region import RegionSpec
from perfsdk.testing import FakeClock, capture, use_fake_clock

try:
    from perfsdk import _fastpath
except ImportError:
    _fastpath = None  # type: ignore[assignment]

# The compiled paths stand aside while CUDA is initialized (regions then record device events,
# in Python): these tests are of the CPU paths, whatever an earlier test in the worker did.
pytestmark = pytest.mark.usefixtures("no_cuda")

needs_nvtx_call = pytest.mark.skipif(
    _fastpath is None or not _fastpath.HAVE_NVTX, reason="perfsdk._fastpath not built with NVTX")


@pytest.fixture
def nvtx_call() -> Any:
    # No tool is attached in this process: the range calls are NVTX's no-ops, the rest is real.
    return _fastpath.NvtxCall("perfsdk.test", "unit", 0xFF00FF00, 0, 7)


@needs_nvtx_call
def test_call_passes_arguments_and_result(nvtx_call: Any) -> None:
    assert nvtx_call(max, (1, 5, 2), {}) == 5
    assert nvtx_call(max, (1, 5, 2), None) == 5
    assert nvtx_call(sorted, ([3, 1, 2],), {"reverse": True}) == [3, 2, 1]
    assert nvtx_call(dict, (), {"a": 1}) == {"a": 1}
    assert repr(nvtx_call) == "<perfsdk._fastpath.NvtxCall 'perfsdk.test/unit'>"


@needs_nvtx_call
def test_call_raises_the_same_exception(nvtx_call: Any) -> None:
    error = KeyError("k")

    def boom() -> None:
        raise error

    with pytest.raises(KeyError) as info:
        nvtx_call(boom, (), {})
    assert info.value is error
    with pytest.raises(SystemExit):
        nvtx_call(sys.exit, (3,), {})


@needs_nvtx_call
def test_call_keeps_no_references(nvtx_call: Any) -> None:
    arg, result = object(), object()

    def fn(x: object) -> object:
        return result

    before = sys.getrefcount(arg), sys.getrefcount(result), sys.getrefcount(fn)
    for _ in range(100):
        nvtx_call(fn, (arg,), {})
    assert (sys.getrefcount(arg), sys.getrefcount(result), sys.getrefcount(fn)) == before


@needs_nvtx_call
@pytest.mark.parametrize(("args", "kwargs"), [
    ((), {}), ((len,), {}), ((len, [1]), {}), ((len, ([1],), {}, None), {}),
    ((len, ([1],), {}), {"extra": 1}),
])
def test_call_needs_fn_args_kwargs(nvtx_call: Any, args: tuple[Any, ...],
                                   kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=r"fn, args, kwargs|tuple|dict"):
        nvtx_call(*args, **kwargs)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        nvtx_call(len, ([1],), [("a", 1)])


@needs_nvtx_call
@pytest.mark.parametrize("bad", [
    {"color": -1}, {"color": 2**32}, {"payload": 2**63}, {"payload": "x"}, {"category": -1},
])
def test_constructor_rejects_bad_values(bad: dict[str, Any]) -> None:
    options: dict[str, Any] = {"domain": "d", "message": "m", "color": 0xFF000000, **bad}
    with pytest.raises((OverflowError, TypeError, ValueError)):
        _fastpath.NvtxCall(**options)


@pytest.mark.skipif(_fastpath is None, reason="perfsdk._fastpath is not built")
def test_maxrss_is_a_byte_count() -> None:
    assert _fastpath.maxrss() > 1024 * 1024


def test_no_tool_no_compiled_range() -> None:
    """Without a tool the nvtx package hands out a dummy domain: no compiled range either, and
    NVTX-only mode takes the inline path (whose push and pop are the dummy's no-ops)."""
    marker = markers.NvtxMarker("perfsdk", "no.tool", 0xFF000000, None, None)
    assert marker.call is None
    perfsdk.configure(timing=False)

    @perfsdk.profiled("no.tool")
    def double(x: int, *, k: int = 2) -> int:
        return x * k

    assert double(3) == 6
    assert double(3, k=3) == 9


@pytest.mark.parametrize(("raw", "enabled"), [
    (None, True), ("", True), ("0", True), ("off", True), ("1", False), (" TRUE ", False),
])
def test_extensions_enabled(raw: str | None, enabled: bool) -> None:
    env = {} if raw is None else {"PERFSDK_DISABLE_EXTENSIONS": raw}
    assert extensions_enabled(env) is enabled


def test_a_bad_value_warns_and_keeps_the_extension() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extensions_enabled({"PERFSDK_DISABLE_EXTENSIONS": "maybe"}) is True
    assert any("PERFSDK_DISABLE_EXTENSIONS" in str(w.message) for w in caught)


@pytest.mark.parametrize("how", ["disabled", "missing"])
def test_perfsdk_works_without_the_extension(how: str) -> None:
    """PERFSDK_DISABLE_EXTENSIONS=1, or no compiled module at all (import blocked): the
    pure-Python paths, the same results."""
    script = textwrap.dedent("""
        import sys
        if sys.argv[1] == "missing":
            class Block:
                def find_spec(self, name, path=None, target=None):
                    if name == "perfsdk._fastpath":
                        raise ImportError("blocked")
                    return None
            sys.meta_path.insert(0, Block())
        import perfsdk
        from perfsdk import markers, memory
        assert not markers.compiled_nvtx()
        assert memory.peak_rss is memory._peak_rss_python
        perfsdk.configure(timing=False, exporter="none")

        @perfsdk.profiled
        def f(x):
            return x + 1

        assert f(1) == 2
        perfsdk.configure(timing=True)
        with perfsdk.timed_region("r", memory=True) as r:
            pass
        assert r.result().memory["perfsdk.memory.rss_peak_bytes"] > 0
        print("ok")
    """)
    env = {"PERFSDK_DISABLE_EXTENSIONS": "1"} if how == "disabled" else {}
    import os

    proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- inner entries and the backward node hook (instrument_module's hot path) ------------------
needs_inner = pytest.mark.skipif(
    _fastpath is None or not hasattr(_fastpath, "InnerGate")
    or region.inner_gate is not _fastpath.InnerGate,
    reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")


def _twin_modes(monkeypatch: pytest.MonkeyPatch, seed: int,
                *twins: tuple[Any, str, Any]) -> Iterator[bool]:
    """True (the compiled paths, as perfsdk chose at import), then False (``twins``, the
    ``(owner, name, pure-Python twin)`` triples of the ``python_twins()`` functions, swapped
    in); before each, the id generator seeded with ``seed``, so both runs draw the same ids."""
    for compiled in (True, False):
        if not compiled:
            for owner, name, twin in twins:
                monkeypatch.setattr(owner, name, twin)
        monkeypatch.setattr(region, "_getrandbits", random.Random(seed).getrandbits)
        yield compiled


def _entries(gate: Any, clock: FakeClock) -> None:
    """A model region holding nested and sibling inner entries, one raising."""
    with perfsdk.timed_region("model"):
        a = gate("a")()
        clock.advance(1)
        b = gate("b")()
        clock.advance(2)
        b.exit(None)
        a.exit(None, 0)
        clock.advance(3)
        c = gate("c")()
        with perfsdk.timed_region("inside.c"):
            clock.advance(4)
        c.exit(error=KeyError("k"))
        d = gate("d")()
        d.exit(t1=clock() + 5_000_000)


@needs_inner
def test_compiled_inner_entries_record_what_the_python_twin_records(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same ids (a seeded generator swapped in), parents, times, errors and names, compiled
    and in Python."""
    specs = {name: RegionSpec.create(f"fast.{name}") for name in "abcd"}
    runs = []
    for compiled in _twin_modes(monkeypatch, 1234,
                                (region.InnerRegion, "exit", region.exit_inner_python)):
        make = _fastpath.InnerGate if compiled else region._inner_gate_python
        with use_fake_clock() as clock, capture() as cap:
            _entries(lambda name: make(specs[name]), clock)  # noqa: B023
        t0 = cap.named("model")[0].start_ns  # each fake clock starts at the real time
        runs.append([(r.name, r.span_id, r.parent_span_id, r.start_ns - t0, r.end_ns - t0,
                      type(r.error).__name__) for r in cap.regions])
    compiled_run, python_run = runs
    assert compiled_run == python_run
    by_name = {row[0]: row for row in compiled_run}
    assert by_name["fast.b"][2] == by_name["fast.a"][1]  # nested: a is b's parent
    assert by_name["fast.a"][2] == by_name["model"][1]
    assert by_name["inside.c"][2] == by_name["fast.c"][1]  # the owner stood for c
    assert by_name["fast.c"][5] == "KeyError"
    assert by_name["fast.d"][4] - by_name["fast.d"][3] == 5_000_000


@needs_inner
def test_compiled_gate_hands_what_is_off_its_fast_path_to_python() -> None:
    spec = RegionSpec.create("fast.off")
    gate = _fastpath.InnerGate(spec)
    entry = gate()  # no current region: a Region of its own
    assert type(entry) is region.Region
    entry.exit(None)
    with perfsdk.timed_region("model"):
        entry = gate()
        assert type(entry) is region.InnerRegion
        entry.exit(None)
        perfsdk.configure(memory=True)  # a memory reading: a Region of its own
        try:
            entry = gate()
            assert type(entry) is region.Region
            entry.exit(None)
        finally:
            perfsdk.configure(memory=False)
    perfsdk.configure(enabled=False)
    try:
        assert gate() is region.NULL_REGION
    finally:
        perfsdk.configure(enabled=True)
    sampled = _fastpath.InnerGate(RegionSpec.create("fast.sampled", every=2))
    with capture() as cap, perfsdk.timed_region("model"):
        kinds = []
        for _ in range(4):
            entry = sampled()
            kinds.append(type(entry).__name__)
            entry.exit(None)
    assert kinds == ["InnerRegion", "NullRegion"] * 2
    assert len(cap.named("fast.sampled")) == 2


@needs_inner
def test_compiled_gate_sees_a_global_swapped_after_it_was_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled code caches the module globals it reads while their dict is unchanged:
    a global swapped later (a test's clock, torch's profiler flag) is read again."""
    import torch

    gate = _fastpath.InnerGate(RegionSpec.create("fast.swapped"))
    ticks = iter(range(1_000, 2_000, 5))
    with capture() as cap, perfsdk.timed_region("model"):
        for _ in range(3):  # the clock and the flag are read, and cached
            entry = gate()
            assert type(entry) is region.InnerRegion
            entry.exit(None)
        monkeypatch.setattr(region, "_perf_ns", lambda: next(ticks))
        entry = gate()
        assert entry[7] == 1_000  # t0: from the swapped clock
        entry.exit(None)
        monkeypatch.undo()
        monkeypatch.setattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        entry = gate()  # under a torch profiler: a Region of its own (record_function)
        assert type(entry) is region.Region
        assert entry._rf is not None
        entry.exit(None)
        monkeypatch.undo()
        entry = gate()
        assert type(entry) is region.InnerRegion
        entry.exit(None)
    found = cap.named("fast.swapped")
    assert len(found) == 6
    assert [r.end_ns - r.start_ns for r in found].count(5) == 1  # 1,000 to 1,005 on the swap


@needs_inner
def test_compiled_inner_entries_keep_no_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of entries leave the owner as they found it and no objects behind."""
    monkeypatch.setattr(region, "_enqueue", lambda record: None)  # records dropped here
    gate = _fastpath.InnerGate(RegionSpec.create("fast.refs"))
    with perfsdk.timed_region("model") as owner:
        before = sys.getrefcount(owner), owner.inner_id
        for _ in range(100):  # warm: caches, free lists
            gate().exit(None)
        around = gate()  # the entries below nest in it: its span id is each one's parent
        held = owner.inner_id
        refs = sys.getrefcount(held)
        blocks = sys.getallocatedblocks()
        for _ in range(5000):
            entry = gate()
            entry.exit(None)
            del entry
        grown = sys.getallocatedblocks() - blocks
        assert sys.getrefcount(held) == refs
        around.exit(None)
        del around
        assert (sys.getrefcount(owner), owner.inner_id) == before
    assert grown < 500  # one leaked int per entry would be 5000


@needs_inner
def test_compiled_exit_checks_its_arguments() -> None:
    gate = _fastpath.InnerGate(RegionSpec.create("fast.args"))
    with perfsdk.timed_region("model"):
        entry = gate()
        with pytest.raises(TypeError, match="at most 2"):
            entry.exit(None, 0, 1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'when'"):
            entry.exit(when=1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'error'"):
            entry.exit(None, error=None)
        entry.exit(None)
    with pytest.raises(TypeError, match="no arguments"):
        gate(1)
    with pytest.raises(TypeError):
        _fastpath.InnerGate()
    assert "fast.args" in repr(gate)


@needs_inner
def test_compiled_node_hook_warns_instead_of_breaking_backward() -> None:
    """Its bookkeeping failing (here: a malformed entry) warns once; backward goes on."""
    from perfsdk.auto import backward

    hook = _fastpath.NodeHook(5, [["not", "an", "entry"]])
    assert backward._make_hook is _fastpath.NodeHook
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hook(None) is None
    assert any("backward region of instrument_module failed" in str(w.message) for w in caught)
    with pytest.raises(TypeError):
        _fastpath.NodeHook(5, (), 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="one argument"):
        hook()
    assert repr(hook) == "<perfsdk._fastpath.NodeHook seq=5, 1 entries>"


@needs_inner
def test_compiled_track_hands_other_outputs_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain tensor is tracked in C; a tuple, or a tensor subclass, by the Python twin."""
    import torch

    from perfsdk.auto import backward

    seen: list[Any] = []

    def python(*args: Any) -> bool:
        seen.append(args[3])
        return True

    monkeypatch.setattr(backward, "track_python", python)
    x = torch.ones(2, requires_grad=True)
    plain, pair = x * 2, (x * 3, x * 4)
    sub = (x * 5).as_subclass(type("Sub", (torch.Tensor,), {}))
    try:
        assert _fastpath.track(lambda: None, 0, None, plain) is True
        assert _fastpath.track(lambda: None, 0, None, pair) is True
        assert _fastpath.track(lambda: None, 0, None, sub) is True
        assert seen == [pair, sub]
        # a node older than the call: not the call's
        assert _fastpath.track(lambda: None, plain.grad_fn._sequence_nr() + 1, None,
                               plain) is False
        with pytest.raises(TypeError, match="track"):
            _fastpath.track(lambda: None, 0, None)  # type: ignore[call-arg]
    finally:
        backward.forward_done()


@needs_inner
def test_bind_inner_refuses_types_without_plain_slots() -> None:
    """What region.py's import guard catches (then the Python twins run): a Region class whose
    fields are not plain slots cannot be read by offset."""
    class NoSlots:
        pass

    with pytest.raises(TypeError, match=r"NoSlots\._timed is not a __slots__ member"):
        _fastpath.bind_inner({}, region.InnerRegion, NoSlots, region.NULL_REGION,
                             perfsdk.config.state, region._FORK, None)
    with pytest.raises(TypeError, match="tuple subclass"):
        _fastpath.bind_inner({}, NoSlots, region.Region, region.NULL_REGION,
                             perfsdk.config.state, region._FORK, None)
    gate = _fastpath.InnerGate(RegionSpec.create("fast.still"))  # the binding is unchanged
    with perfsdk.timed_region("model"):
        entry = gate()
        assert type(entry) is region.InnerRegion
        entry.exit(None)


@pytest.mark.skipif(_fastpath is None or not hasattr(_fastpath, "new_id"),
                    reason="perfsdk._fastpath is not built")
def test_compiled_ids_are_distinct_nonzero_and_of_their_size() -> None:
    spans = [_fastpath.new_id(64) for _ in range(20_000)]
    traces = [_fastpath.new_id(128) for _ in range(1_000)]
    assert len(set(spans)) == len(spans)
    assert all(0 < i < 1 << 64 for i in spans)
    assert len(set(traces)) == len(traces)
    assert all(0 < i < 1 << 128 for i in traces)
    assert any(i >= 1 << 64 for i in traces)  # both halves drawn
    for bad in (0, 32, 65, "64"):
        with pytest.raises((ValueError, TypeError), match=r"bits|integer"):
            _fastpath.new_id(bad)


@needs_inner
def test_compiled_entries_ids_do_not_follow_the_programs_random_seed() -> None:
    """random.seed() in the program must not repeat a phase's span id (compiled generator)."""
    forward = perfsdk.phase("seeded.phase")
    with capture() as cap:
        for _ in range(2):
            random.seed(1234)
            with perfsdk.step(), forward:
                pass
        perfsdk.flush()
    first, second = cap.named("seeded.phase")
    assert first.span_id != second.span_id
    assert first.parent_span_id != second.parent_span_id  # the steps' own ids differ too


@pytest.mark.skipif(_fastpath is None or not hasattr(_fastpath, "new_id"),
                    reason="perfsdk._fastpath is not built")
def test_a_forked_child_draws_other_compiled_ids() -> None:
    """A forked child (a DataLoader worker) does not repeat its parent's next ids: the compiled
    generator is reseeded in the child."""
    import os

    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+: fork() of a process with threads warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave at once
        os.close(read)
        os.write(write, f"{_fastpath.new_id(64)} {_fastpath.new_id(64)}".encode())
        os._exit(0)
    os.close(write)
    child = [int(x) for x in os.read(read, 128).split()]
    os.close(read)
    os.waitpid(pid, 0)
    parent = [_fastpath.new_id(64), _fastpath.new_id(64)]
    assert len(child) == 2
    assert not set(child) & set(parent)


# -- a step's region (RegionStart, region_exit) ------------------------------------------------
needs_region = pytest.mark.skipif(
    _fastpath is None or not hasattr(_fastpath, "RegionStart")
    or region.region_starter is not _fastpath.RegionStart,
    reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")


def _count_python_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the regions that the compiled start handed to the Python code."""
    handed: list[str] = []
    python_start = region._start_python

    def counting(spec: RegionSpec, attributes: Any) -> Any:
        handed.append(spec.name)
        return python_start(spec, attributes)

    monkeypatch.setattr(region, "_start_python", counting)
    return handed


def _recorded(cap: Any) -> list[tuple[Any, ...]]:
    """What a twin comparison compares, per captured region, sorted: name, ids, parent, times
    from the first start, attributes, the error's repr and the memory readings' keys (RSS
    itself moves between runs)."""
    t0 = min(r.start_ns for r in cap.regions)
    return sorted((r.name, r.trace_id, r.span_id, r.parent_span_id, r.start_ns - t0,
                   r.end_ns - t0, sorted(r.attributes.items()), repr(r.error),
                   sorted(r.memory or ())) for r in cap.regions)


def _steps_run(clock: FakeClock) -> None:
    with perfsdk.step(samples=4):
        clock.advance(1)
        with perfsdk.timed_region("inside"):
            clock.advance(2)
        with perfsdk.phase("fast.phase"):
            clock.advance(1)
    with perfsdk.timed_region("outer"), perfsdk.step(samples=2):  # a Region as the parent
        clock.advance(3)
    with perfsdk.step(), perfsdk.phase("fast.phase"):
        clock.advance(1)
    perfsdk.auto.end_step()


@needs_region
def test_compiled_step_regions_record_what_the_python_twin_records(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same ids (a seeded generator swapped in), parents, times, attributes, compiled and in
    Python; the compiled runs take no Python start."""
    from perfsdk.auto import steps

    with perfsdk.step():  # the pipeline started, this thread noted
        pass
    perfsdk.auto.end_step()
    handed = _count_python_starts(monkeypatch)
    runs = []
    for compiled in _twin_modes(monkeypatch, 99, *region.python_twins(),
                                *steps.python_twins()):
        monkeypatch.setattr(steps, "_STEP_START", None)
        perfsdk.auto.set_schedule(None)  # step indices from 0
        with use_fake_clock() as clock, capture() as cap:
            _steps_run(clock)
            perfsdk.flush()
        runs.append(_recorded(cap))
        if compiled:
            assert handed == []
    compiled_run, python_run = runs
    assert compiled_run == python_run
    assert [r[0] for r in compiled_run].count("step") == 3


@needs_region
@pytest.mark.initializes_cuda
def test_compiled_step_region_hands_what_is_off_its_fast_path_to_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's span as the parent, the torch profiler, an error at exit: the Python code, the
    same records as ever; memory readings on the host are compiled (RssPeak)."""
    from opentelemetry.sdk.trace import TracerProvider

    with perfsdk.step():
        pass
    perfsdk.auto.end_step()
    handed = _count_python_starts(monkeypatch)
    tracer = TracerProvider().get_tracer("user")  # a private provider: nothing global changes
    with capture() as cap:
        with tracer.start_as_current_span("user") as user, perfsdk.step():
            pass
        perfsdk.configure(memory=True)
        try:
            with perfsdk.step():
                pass
        finally:
            perfsdk.configure(memory=False)
        with torch.profiler.profile() as prof, perfsdk.step():
            pass
        with pytest.raises(KeyError), perfsdk.step():
            raise KeyError("k")
        perfsdk.auto.end_step()
        perfsdk.flush()
    assert handed == ["step", "step"]  # memory=True compiled; the error is the exit's
    steps = cap.named("step")
    assert steps[0].parent_span_id == user.get_span_context().span_id
    assert steps[1].memory is not None
    assert "perfsdk.memory.rss_peak_bytes" in steps[1].memory
    assert "step" in {e.name for e in prof.events()}
    assert type(steps[3].error) is KeyError
    assert [s.attributes["perfsdk.step"] for s in steps] == sorted(
        s.attributes["perfsdk.step"] for s in steps)


# -- the steps (step_start, step_end, Step's with) --------------------------------------------
needs_steps = pytest.mark.skipif(
    _fastpath is None or not hasattr(_fastpath, "step_start")
    or perfsdk.auto.steps.step_start is not getattr(_fastpath, "step_start", None),
    reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")


def _count_python_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the compiled steps handed to the Python code: ``start`` per step start, ``end`` per
    step end."""
    from perfsdk.auto import steps

    handed: list[str] = []
    start, end = steps._step_python, steps.Steps._end

    def counting_start(*args: Any) -> Any:
        handed.append("start")
        return start(*args)

    def counting_end(*args: Any) -> Any:
        handed.append("end")
        return end(*args)

    monkeypatch.setattr(steps, "_step_python", counting_start)
    monkeypatch.setattr(steps.Steps, "_end", counting_end)
    return handed


@needs_steps
def test_compiled_steps_leave_no_python_frame_in_the_common_case(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``with step(...)``, plain ``step()`` calls (each ending the one before), ``STEPS.step``,
    ``Step.end`` and ``end_step``: compiled, recorded as in Python (indices, samples, the rate
    at the end, nesting, autocast's dtype)."""
    perfsdk.auto.set_schedule(None)  # step indices from 0
    with perfsdk.step():  # the step's start is made at the first step, in Python
        pass
    handed = _count_python_steps(monkeypatch)
    with use_fake_clock() as clock, capture() as cap:
        with perfsdk.step(samples=4) as first:
            clock.advance(2)
            with perfsdk.timed_region("inside"):
                clock.advance(1)
        perfsdk.step(samples=8)  # the plain-call style: the next call ends it
        clock.advance(4)
        second = perfsdk.auto.STEPS.step()
        clock.advance(1)
        second.end()
        second.end()  # idempotent
        with torch.autocast("cpu", dtype=torch.bfloat16), perfsdk.step(samples=1):
            clock.advance(1)
        perfsdk.step(samples=2)
        perfsdk.auto.end_step()
        perfsdk.flush()
    assert handed == []
    assert first.region is None
    assert perfsdk.auto.STEPS.current is None
    steps = cap.named("step")
    assert [s.attributes["perfsdk.step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s.attributes.get("perfsdk.samples") for s in steps] == [4, 8, None, 1, 2]
    assert steps[0].attributes["perfsdk.samples_per_s"] == pytest.approx(4 / 3e-3)  # ms: 3
    assert steps[1].attributes["perfsdk.samples_per_s"] == pytest.approx(8 / 4e-3)
    assert "perfsdk.samples_per_s" not in steps[2].attributes
    assert steps[3].attributes["perfsdk.amp"] == "bfloat16"
    assert "perfsdk.amp" not in steps[0].attributes
    assert cap.named("inside")[0].parent_span_id == steps[0].span_id
    assert len({s.trace_id for s in steps}) == 5  # each a root: a trace of its own


@needs_steps
def test_compiled_exits_honour_the_pipelines_bound_read_at_its_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled exits read ``PIPELINE.max_pending`` (and ``started``) at their slots, with
    no Python frame: past the bound a record goes to ``spill``, as ``Pipeline.submit`` does;
    a bound changed at run time is seen at the next exit."""
    from perfsdk.pipeline import PIPELINE

    forward = perfsdk.phase("forward")
    with perfsdk.step(), forward:  # the step's start is made at the first step, in Python
        pass
    perfsdk.auto.end_step()
    perfsdk.flush()
    handed = _count_python_steps(monkeypatch)
    spilled: list[Any] = []
    monkeypatch.setattr(PIPELINE, "spill", spilled.append)  # the instance's dict
    with PIPELINE._drain_lock:  # the pipeline thread drains nothing meanwhile
        queued = len(PIPELINE.queue)
        monkeypatch.setattr(PIPELINE, "max_pending", queued + 2)  # the slot
        for _ in range(3):
            with perfsdk.step(), forward:
                pass
        assert len(PIPELINE.queue) == queued + 2
        assert len(spilled) == 4  # two records a step (the phase's, the step's), six in all
        PIPELINE.max_pending = queued + 4
        with perfsdk.step():
            pass
        assert len(PIPELINE.queue) == queued + 3
        assert len(spilled) == 4
    assert handed == []


@pytest.mark.skipif(_fastpath is None or not hasattr(_fastpath, "TwinMethod"),
                    reason="perfsdk._fastpath is not built")
def test_a_twin_method_calls_the_compiled_and_shows_the_python() -> None:
    """An instance's lookup calls the compiled callable with the instance first (positional,
    keyword and many arguments alike); its ``__func__`` and the class's lookup are the Python
    twin, which is what torch.compile inlines."""
    def python(self: Any, *args: Any, **kwargs: Any) -> Any:
        return ("python", args, kwargs)

    def compiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (self, args, kwargs)

    class Owner:
        method = _fastpath.TwinMethod(compiled, python)

    owner = Owner()
    assert owner.method(1, 2) == (owner, (1, 2), {})
    assert owner.method(1, k=3) == (owner, (1,), {"k": 3})
    bound = owner.method
    assert bound(*range(12), k=1) == (owner, tuple(range(12)), {"k": 1})
    assert bound() == (owner, (), {})
    assert bound.__func__ is python
    assert bound.__self__ is owner
    assert Owner.method is python
    with pytest.raises(TypeError, match="callable"):
        _fastpath.TwinMethod(compiled, 3)


@needs_steps
def test_a_steps_with_block_takes_no_python_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """``with perfsdk.step():`` in eager code: Step's ``__enter__`` and ``__exit__`` are
    compiled (TwinMethod), so no frame of perfsdk.auto.steps runs; their Python twins are what
    torch.compile sees (tests/integration/test_compile.py)."""
    from perfsdk.auto import steps

    with perfsdk.step():  # the step's start is made at the first step, in Python
        pass
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == steps.__file__:
            frames.append(frame.f_code.co_name)

    with capture() as cap:
        sys.setprofile(profile)
        try:
            with perfsdk.step(samples=2) as handle:
                pass
        finally:
            sys.setprofile(None)
        perfsdk.flush()
    assert frames == []
    assert type(handle) is steps.Step
    assert handle.__exit__.__func__ is steps.python_twins()[3][2]
    assert [r.attributes["perfsdk.samples"] for r in cap.named("step")] == [2]


@needs_region
def test_a_compiled_region_extends_the_current_opentelemetry_context() -> None:
    """The compiled start makes the region the current span in a new OpenTelemetry Context
    that keeps the outer context's values, and its exit restores the outer context."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    token = otel_context.attach(otel_context.set_value("user.key", "kept"))
    try:
        outer = otel_context.get_current()
        with perfsdk.timed_region("ctx.block") as block:
            current = otel_context.get_current()
            assert type(current) is type(outer)  # OpenTelemetry's Context, immutable
            assert otel_context.get_value("user.key") == "kept"
            assert trace.get_current_span() is block
        assert otel_context.get_current() is outer
        assert otel_context.get_value("user.key") == "kept"
    finally:
        otel_context.detach(token)


@needs_steps
def test_without_a_tool_region_exits_stay_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NVTX tool in this process: the nvtx package's dummy domain counts as no domain
    (nothing pushed), so a step's and a ``timed_region``'s exit take the compiled path, not
    the Python ``Region.exit`` (which a dummy domain used to send them to)."""
    if hasattr(markers._domain("perfsdk"), "handle"):
        pytest.skip("an NVTX tool is attached to this process")
    marker = markers.NvtxMarker("perfsdk", "no.tool.exit", 0xFF000000, None, None)
    assert marker.domain is None
    assert marker.call is None
    with perfsdk.step():  # the step's start is made at the first step, in Python
        pass
    exits: list[str] = []
    python_exit = region.Region.exit

    def counting(self: region.Region, *args: Any) -> Any:
        exits.append(self.spec.name)
        return python_exit(self, *args)

    monkeypatch.setattr(region.Region, "exit", counting)
    with capture() as cap:
        with perfsdk.step(samples=2), perfsdk.timed_region("no.tool.block"):
            pass
        perfsdk.flush()
    assert exits == []
    assert sorted(r.name for r in cap.regions) == ["no.tool.block", "step"]
    assert cap.named("no.tool.block")[0].parent_span_id == cap.named("step")[0].span_id


@needs_steps
def test_compiled_steps_hand_what_is_off_their_fast_path_to_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """flops, a schedule, a listener, a torchrun run id, memory readings, bad samples: the
    Python code, recorded as ever; the compiled steps around them stay compiled."""
    from perfsdk import distributed
    from perfsdk.auto import schedule

    perfsdk.auto.set_schedule(None)
    with perfsdk.step():
        pass
    handed = _count_python_steps(monkeypatch)
    with capture() as cap:
        with perfsdk.step(flops=1e6):
            pass
        assert handed == ["start", "end"]
        with pytest.raises(ValueError, match="samples=0"):
            perfsdk.step(samples=0)
        with pytest.raises(ValueError, match="samples=True"):
            perfsdk.step(samples=True)
        monkeypatch.setattr(distributed, "_run_id", "job-7")
        with perfsdk.step() as shared:
            pass
        monkeypatch.setattr(distributed, "_run_id", None)
        perfsdk.configure(memory=True)
        try:
            with perfsdk.step():  # a compiled start, an end with an RSS reading: Python
                pass
        finally:
            perfsdk.configure(memory=False)
        seen: list[int] = []

        class Listener:
            def on_step_start(self, index: int) -> None:
                seen.append(index)

            def on_step_end(self, index: int) -> None:
                seen.append(-index)

        listener = Listener()
        perfsdk.auto.STEPS.listeners.append(listener)
        try:
            with perfsdk.step():
                pass
        finally:
            perfsdk.auto.STEPS.listeners.remove(listener)
        handed.clear()
        with perfsdk.step():  # compiled again
            pass
        assert handed == []
        perfsdk.auto.set_schedule(schedule(wait=1, warmup=0, active=1))
        for _ in range(2):
            with perfsdk.step():
                pass
        perfsdk.auto.set_schedule(None)
        perfsdk.flush()
    assert handed == ["start", "end", "start"]  # a scheduled step's start; a paused step's end
    steps = cap.named("step")
    assert [s.attributes["perfsdk.step"] for s in steps] == [1, 2, 3, 4, 5, 1]
    assert steps[0].attributes["perfsdk.flops"] == 1e6
    assert steps[1].trace_id == distributed.step_trace_id(2, "job-7")
    assert shared.index == 2
    assert "perfsdk.memory.rss_bytes" in steps[2].attributes
    assert seen == [4, -4]


# -- @profiled's gate (RegionStart(spec, gate=True), region_exit) -----------------------------
def _profiled_run(clock: FakeClock) -> None:
    @perfsdk.profiled("gate.fn", attributes={"k": 1})
    def fn(n: int) -> int:
        clock.advance(n)
        with perfsdk.timed_region("gate.inside"):
            clock.advance(1)
        return n

    @perfsdk.profiled("gate.raises")
    def raises() -> None:
        clock.advance(2)
        raise KeyError("k")

    @perfsdk.profiled("gate.sampled", every=2)
    def sampled() -> None:
        clock.advance(1)

    @perfsdk.profiled("gate.memory", memory=True)
    def memory() -> bytes:
        return bytes(1 << 20)

    assert fn(3) == 3
    with perfsdk.timed_region("gate.outer"):  # a Region as the parent
        fn(1)
    with pytest.raises(KeyError):
        raises()
    for _ in range(4):
        sampled()
    memory()
    perfsdk.configure(enabled=False)
    try:
        fn(5)  # disabled at run time: nothing recorded
    finally:
        perfsdk.configure(enabled=True)


@needs_region
def test_compiled_profiled_gate_records_what_spec_open_records(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``@profiled`` through the compiled gate and exit records what ``spec.open`` and
    ``region.exit`` record (ids from a seeded generator, times on a fake clock, parents,
    attributes, errors, sampling, disabled), and its common case takes no Python start."""
    perfsdk.profiled("gate.warm")(lambda: None)()  # the pipeline started, this thread noted
    handed = _count_python_starts(monkeypatch)
    runs = []
    for compiled in _twin_modes(monkeypatch, 7, *region.python_twins()):
        handed.clear()
        with use_fake_clock() as clock, capture() as cap:
            _profiled_run(clock)  # decorated inside: each run takes the gate of its mode
            perfsdk.flush()
        runs.append(_recorded(cap))
        if compiled:
            assert handed == []
    compiled_run, python_run = runs
    assert compiled_run == python_run
    names = [r[0] for r in compiled_run]
    assert names.count("gate.fn") == 2
    assert names.count("gate.sampled") == 2  # every=2: sampled in the gate of each mode
    assert [r[7] for r in compiled_run if r[0] == "gate.raises"] == ["KeyError('k')"]
    assert "perfsdk.memory.rss_peak_bytes" in next(r[8] for r in compiled_run
                                                   if r[0] == "gate.memory")


def _sampled_run(clock: FakeClock) -> tuple[list[str], list[str]]:
    """Sampled entries of ``@profiled`` and of phases (PERFSDK_SAMPLE_EVERY=3 and every=2),
    nested in a region and with none around; returns the entry types of the two bare gates."""
    @perfsdk.profiled("sampled.fn")
    def fn() -> None:
        clock.advance(1)

    @perfsdk.profiled("sampled.every", every=2)
    def every() -> None:
        clock.advance(1)

    ph = perfsdk.phase("sampled.phase")
    bare = region.inner_gate(RegionSpec.create("sampled.bare", every=2))
    kinds_in, kinds_out = [], []
    with perfsdk.timed_region("sampled.model"):  # entered unsampled: every run records it
        perfsdk.configure(sample_every=3)
        try:
            for _ in range(6):
                fn()
                every()
                with ph:
                    clock.advance(2)
                entry = bare()  # inside a region: an inner entry when sampled in
                kinds_in.append(type(entry).__name__)
                entry.exit(None)
        finally:
            perfsdk.configure(sample_every=1)
    for _ in range(2):
        entry = bare()  # no region around: a Region of its own when sampled in
        kinds_out.append(type(entry).__name__)
        entry.exit(None)
    return kinds_in, kinds_out


@needs_region
def test_compiled_gates_sample_as_the_python_gates_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling is decided in the compiled gates (``@profiled``'s and a phase's), on the spec's
    own counter: the same entries recorded as by the Python gates, and neither ``spec.open``
    nor ``spec.open_inner`` called (they were, for every sampled entry, before)."""
    perfsdk.profiled("sampled.warm")(lambda: None)()  # the pipeline started, this thread noted
    python_gates: list[str] = []
    for name in ("open", "open_inner"):
        original = getattr(RegionSpec, name)

        def counting(spec: RegionSpec, *args: Any, _name: str = name,
                     _original: Any = original) -> Any:
            python_gates.append(_name)
            return _original(spec, *args)

        monkeypatch.setattr(RegionSpec, name, counting)
    runs, gates, kinds = [], [], []
    for _compiled in _twin_modes(monkeypatch, 11, *region.python_twins()):
        python_gates.clear()
        with use_fake_clock() as clock, capture() as cap:
            kinds.append(_sampled_run(clock))  # built inside: each run, its mode's gates
            perfsdk.flush()
        runs.append(_recorded(cap))
        gates.append(len(python_gates))
    compiled_run, python_run = runs
    assert compiled_run == python_run
    assert kinds[0] == kinds[1] == (["InnerRegion", "NullRegion"] * 3, ["Region", "NullRegion"])
    names = [r[0] for r in compiled_run]
    assert names.count("sampled.fn") == 2  # calls 0 and 3 of 6
    assert names.count("sampled.every") == 3  # its own every=2 over the configured rate
    assert names.count("sampled.phase") == 2
    assert names.count("sampled.bare") == 4
    assert gates[0] == 0
    assert gates[1] > 0  # the Python twins do take the Python gates: the count sees them


# -- timed_region's entry (the spec's starter) and exit (region_exit) -------------------------
def _timed_run(clock: FakeClock) -> None:
    with perfsdk.timed_region("timed.block", attributes={"k": 2}) as block:
        clock.advance(2)
        with perfsdk.timed_region("timed.inner"):
            clock.advance(1)
    assert block.host_ms == pytest.approx(3.0)  # the handle has its result at exit

    def raises() -> None:
        with perfsdk.timed_region("timed.raises"):
            clock.advance(1)
            raise ValueError("v")

    with pytest.raises(ValueError, match="v"):
        raises()
    with perfsdk.timed_region("timed.memory", memory=True):
        clock.advance(1)
    perfsdk.configure(sample_every=2)
    try:
        for _ in range(4):
            with perfsdk.timed_region("timed.sampled"):
                clock.advance(1)
    finally:
        perfsdk.configure(sample_every=1)


@needs_region
def test_compiled_timed_region_records_what_the_python_twin_records(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``timed_region`` entered by its spec's compiled starter and left by ``region_exit``
    records what ``Region._start`` and ``Region.exit`` record (ids, parents, times, attributes,
    errors, memory readings, sampling), and its common case takes no Python start."""
    from perfsdk.record import SPECS

    with perfsdk.timed_region("timed.warm"):  # the pipeline started, this thread noted
        pass
    handed = _count_python_starts(monkeypatch)
    runs = []
    for compiled in _twin_modes(monkeypatch, 5, *region.python_twins()):
        for spec in list(SPECS):  # the starters made in the other mode go
            object.__setattr__(spec, "starter", None)
        handed.clear()
        with use_fake_clock() as clock, capture() as cap:
            _timed_run(clock)
            perfsdk.flush()
        runs.append(_recorded(cap))
        if compiled:
            assert handed == []
        else:
            assert "timed.block" in handed  # the twin: every entry through _start_python
    compiled_run, python_run = runs
    assert compiled_run == python_run
    names = [r[0] for r in compiled_run]
    assert names.count("timed.sampled") == 2
    assert [r[7] for r in compiled_run if r[0] == "timed.raises"] == ["ValueError('v')"]
    assert "perfsdk.memory.rss_peak_bytes" in next(r[8] for r in compiled_run
                                                   if r[0] == "timed.memory")
