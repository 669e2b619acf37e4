"""phase: the span a timed_region records, riding on the region around it (compiled and
pure-Python inner entries alike); a region of its own wherever one is needed."""

from __future__ import annotations

import itertools
import pickle
import threading
from collections import Counter

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import perfsdk
import perfsdk.phases as _phases
from perfsdk import phase
from perfsdk import region as _region
from perfsdk.auto import steps as _steps
from perfsdk.region import Region
from perfsdk.testing import capture

_COMPILED = (_region._fastpath is not None
             and _region.inner_gate is getattr(_region._fastpath, "InnerGate", None))


@pytest.fixture(autouse=True, params=[
    pytest.param("compiled", marks=pytest.mark.skipif(
        not _COMPILED, reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")),
    "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Inner entries compiled (as perfsdk chose at import) or the pure-Python twins (a phase
    takes its gate when it is made: after this)."""
    monkeypatch.setattr(_steps, "_STEP_START", None)  # made again at the next step
    if request.param == "python":
        # the region paths; Steps.step, Steps._end, Step's with; a phase's with block
        for owner, name, twin in (_region.python_twins() + _steps.python_twins()
                                  + _phases.python_twins()):
            monkeypatch.setattr(owner, name, twin)
    return str(request.param)


def _inside(inner, outer) -> bool:
    return outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns


def test_a_phase_is_a_child_of_its_step_and_stands_as_the_parent_inside():
    tracer = TracerProvider().get_tracer("user")  # a private provider: nothing global changes
    forward = phase("forward", category="compute", attributes={"k": "v"})
    with capture() as cap:
        with perfsdk.step(samples=4):
            with forward:
                current = trace.get_current_span()
                seen_id = current.get_span_context().span_id
                with perfsdk.timed_region("inside"):
                    pass
                with tracer.start_as_current_span("user") as span:
                    user_parent = span.parent.span_id
            after = trace.get_current_span()
            after_id = after.get_span_context().span_id
        perfsdk.flush()
    (step,) = cap.named("step")
    (fwd,) = cap.named("forward")
    assert type(current) is Region
    assert current.span_id == step.span_id
    assert seen_id == fwd.span_id != step.span_id  # ... standing for the phase
    assert fwd.parent_span_id == step.span_id
    assert fwd.trace_id == step.trace_id
    assert fwd.thread_id == step.thread_id
    assert cap.named("inside")[0].parent_span_id == fwd.span_id
    assert user_parent == fwd.span_id
    assert after is current
    assert after_id == step.span_id
    assert fwd.attributes["perfsdk.category"] == "compute"
    assert fwd.attributes["k"] == "v"
    assert fwd.error is None
    assert _inside(fwd, step)
    span = cap.span("forward")
    assert span.parent.span_id == step.span_id


def test_the_phases_of_each_step_nest_in_that_step_in_order():
    phases = [phase(name) for name in ("forward", "backward", "optimizer")]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture() as cap:
        for _ in range(3):
            with perfsdk.step(samples=2):
                with phases[0]:
                    loss = model(torch.ones(2, 4)).sum()
                opt.zero_grad()
                with phases[1]:
                    loss.backward()
                with phases[2]:
                    opt.step()
        perfsdk.flush()
    steps = {r.span_id: r for r in cap.named("step")}
    assert len(steps) == 3
    found = [r for r in cap.regions if r.name != "step"]
    assert Counter(r.name for r in found) == {"forward": 3, "backward": 3, "optimizer": 3}
    assert len({r.span_id for r in found}) == 9
    for parent in steps.values():
        mine = sorted((r for r in found if r.parent_span_id == parent.span_id),
                      key=lambda r: r.start_ns)
        assert [r.name for r in mine] == ["forward", "backward", "optimizer"]
        assert all(_inside(r, parent) and r.trace_id == parent.trace_id for r in mine)
        assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(mine))


def test_outside_any_region_a_phase_is_a_region_of_its_own():
    alone = phase("alone")
    with capture() as cap:
        with alone:
            current = trace.get_current_span()
        perfsdk.flush()
    assert type(current) is Region
    assert current.spec.name == "alone"
    (found,) = cap.named("alone")
    assert found.parent_span_id == 0
    assert found.span_id == current.span_id


def test_where_a_region_is_needed_the_phase_gets_one():
    """Memory readings and the torch profiler's record_function ranges need a Region."""
    with capture() as cap:
        with perfsdk.step(), phase("measured", memory=True):
            current = trace.get_current_span()
        perfsdk.flush()
    assert type(current) is Region
    assert current.spec.name == "measured"
    (found,) = cap.named("measured")
    assert found.memory is not None
    assert found.parent_span_id == cap.named("step")[0].span_id

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            perfsdk.step(), phase("profiled"):
        pass
    assert Counter(e.name for e in prof.events())["profiled"] == 1


def test_inside_a_region_with_device_time_the_phase_gets_its_own(fake_cuda):
    with capture() as cap:
        with perfsdk.step(), phase("gpu"):
            fake_cuda.launch(2.0)
            current = trace.get_current_span()
        fake_cuda.advance(2.0)
        perfsdk.flush()
    assert type(current) is Region
    assert current.spec.name == "gpu"
    assert cap.named("gpu")[0].device_ms == 2.0
    assert fake_cuda.sync_calls == []


def test_an_error_is_recorded_propagates_and_the_step_stands_for_itself_again():
    error = ZeroDivisionError("no batches")
    failing = phase("failing")
    with capture() as cap:
        with perfsdk.step():
            with pytest.raises(ZeroDivisionError) as info, failing:
                raise error
            current = trace.get_current_span()
            after_id = current.get_span_context().span_id
            with perfsdk.timed_region("after"):
                pass
        perfsdk.flush()
    assert info.value is error
    (step,) = cap.named("step")
    assert cap.named("failing")[0].error is error
    assert step.error is None
    assert after_id == step.span_id
    assert current.inner_id == 0
    assert cap.named("after")[0].parent_span_id == step.span_id
    assert cap.span("failing").status.status_code == trace.StatusCode.ERROR


def test_open_returns_an_entry_a_later_hook_exits():
    forward = phase("forward")
    with capture() as cap:
        with perfsdk.step():
            entry = forward.open()  # on_train_batch_start
            seen = trace.get_current_span().get_span_context().span_id
            entry.exit()  # on_before_backward
            entry = forward.open()
            entry.exit(RuntimeError("hook"))
        perfsdk.flush()
    first, second = cap.named("forward")
    assert seen == first.span_id
    assert first.error is None
    assert isinstance(second.error, RuntimeError)
    assert first.parent_span_id == second.parent_span_id == cap.named("step")[0].span_id


def test_one_phase_object_in_many_threads_exits_each_threads_own_entry():
    shared = phase("threaded")
    barrier = threading.Barrier(8, timeout=60)
    errors: list[BaseException] = []
    seen: list[tuple[int, int]] = []  # (the thread's outer span id, the phase standing in it)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(50):
                with perfsdk.timed_region("outer") as outer:
                    with shared:
                        current = trace.get_current_span()
                        assert current is outer
                        seen.append((outer.span_id, current.get_span_context().span_id))
                    assert outer.inner_id == 0
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with capture() as cap:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        perfsdk.flush()
    assert errors == []
    assert shared._active == []
    outers = {r.span_id: r for r in cap.named("outer")}
    found = {r.span_id: r for r in cap.named("threaded")}
    assert len(outers) == len(found) == 400
    for outer_id, span_id in seen:
        assert found[span_id].parent_span_id == outer_id
        assert found[span_id].thread_id == outers[outer_id].thread_id


def test_disabled_records_nothing_and_a_later_enable_does():
    forward = phase("forward")
    with capture() as cap:
        perfsdk.configure(enabled=False)
        with perfsdk.step(), forward:
            pass
        perfsdk.configure(enabled=True)
        with perfsdk.step(), forward:
            pass
        perfsdk.flush()
    assert [r.name for r in cap.named("forward")] == ["forward"]
    assert forward._active == []


@pytest.mark.parametrize(("args", "kwargs", "argument"), [
    (("",), {}, "name"),
    ((5,), {}, "name"),
    (("x",), {"color": "nope"}, "color"),
    (("x",), {"category": ""}, "category"),
    (("x",), {"domain": ""}, "domain"),
    (("x",), {"memory": "yes"}, "memory"),
    (("x",), {"memory": 1}, "memory"),
    (("x",), {"attributes": {"a": {"nested": 1}}}, "'a'"),
])
def test_bad_arguments_raise_naming_them(args, kwargs, argument):
    phase("x", memory=True, color=0xFF0000)  # a valid spec cached first: no stand-in for a bad one
    with pytest.raises(ValueError, match="phase") as info:
        phase(*args, **kwargs)
    assert argument in str(info.value)


def test_pickle_round_trip():
    forward = phase("pickled", color="red", category="compute", attributes={"a": 1})
    copy = pickle.loads(pickle.dumps(forward))
    assert repr(copy) == "phase('pickled')"
    assert copy.spec == forward.spec
    with capture() as cap:
        with perfsdk.step(), copy:
            pass
        perfsdk.flush()
    (found,) = cap.named("pickled")
    assert found.attributes["a"] == 1


def test_an_exit_without_an_entry_is_a_no_op():
    """An exit that no entry matched (a hook's exit whose entry was skipped): nothing ends,
    nothing breaks, and the next with block records as usual."""
    forward = phase("forward")
    with capture() as cap:
        forward.__exit__(None, None, None)
        assert forward._active == []
        with perfsdk.step(), forward:
            pass
        perfsdk.flush()
    assert forward._active == []
    assert [r.name for r in cap.named("forward")] == ["forward"]


def test_a_phase_made_inside_the_loop_registers_one_spec():
    """``with perfsdk.phase("forward"):`` written in the loop: the record table of specs must
    not grow by one per step."""
    from perfsdk import record as _record

    with perfsdk.step(), phase("looped", category="compute", attributes={"k": [1, 2]}):
        pass
    before = len(_record.SPECS)
    with capture() as cap:
        for _ in range(500):
            with perfsdk.step(), phase("looped", category="compute", attributes={"k": [1, 2]}):
                pass
        perfsdk.flush()
    assert len(_record.SPECS) == before
    found = cap.named("looped")
    assert len(found) == 500
    assert found[0].attributes["k"] == (1, 2)


def test_open_here_sees_this_thread_s_open_with_blocks_of_that_name():
    backward = phase("backward")
    seen = []
    with perfsdk.timed_region("step"):
        assert not _phases.open_here("backward")
        with backward:
            assert _phases.open_here("backward")
            assert not _phases.open_here("optimizer")
            other = threading.Thread(target=lambda: seen.append(_phases.open_here("backward")))
            other.start()
            other.join(60)
        assert not _phases.open_here("backward")
    with backward:  # outside any region: a Region of its own, still seen
        assert _phases.open_here("backward")
    assert seen == [False]  # another thread's block is not this one's


def test_the_names_registry_stays_bounded_when_phases_come_and_go():
    for i in range(_phases.SPECS_CACHED + 500):
        phase(f"made-and-dropped-{i}")
    kept = phase("kept")
    assert len(_phases._NAMED) <= _phases.SPECS_CACHED + 1
    with perfsdk.timed_region("step"), kept:
        assert _phases.open_here("kept")
