"""Steps, schedules and capture ranges: step regions parent what runs inside them, skipped steps
record nothing, cudaProfilerStart/Stop reach the device at the chosen steps, and torch.profiler
writes a real Chrome trace holding our regions."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import perfsdk
import perfsdk.auto as auto
from perfsdk import region as _region
from perfsdk.auto import steps as _steps
from perfsdk.config import state
from perfsdk.context import current_span
from perfsdk.errors import NoEffectWarning
from perfsdk.region import Region
from perfsdk.testing import capture, use_fake_clock

_COMPILED = (_region._fastpath is not None
             and _region.region_starter is getattr(_region._fastpath, "RegionStart", None))


@pytest.fixture(autouse=True, params=[
    pytest.param("compiled", marks=pytest.mark.skipif(
        not _COMPILED, reason="perfsdk._fastpath is not built (or PERFSDK_DISABLE_EXTENSIONS)")),
    "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A step's region entered and left compiled (as perfsdk chose at import) or by the
    pure-Python twins."""
    monkeypatch.setattr(_steps, "_STEP_START", None)  # made again at the next step
    if request.param == "python":
        # the region paths; Steps.step, Steps._end, Step's with
        for owner, name, twin in _region.python_twins() + _steps.python_twins():
            monkeypatch.setattr(owner, name, twin)
    return str(request.param)


@pytest.fixture(autouse=True)
def fresh_steps() -> Iterator[None]:
    auto.set_schedule(None)
    yield
    auto.end_step()
    for listener in list(auto.STEPS.listeners):
        listener.remove()  # type: ignore[attr-defined]
    auto.set_schedule(None)


@perfsdk.profiled("work")
def work() -> None:
    with perfsdk.timed_region("inner"):
        pass


def test_step_region_attributes_and_samples_per_second():
    with use_fake_clock() as clock, capture() as cap:
        with auto.step(samples=64) as s:
            clock.advance(20)
        assert s.index == 0
        assert s.recorded
        with auto.step():
            clock.advance(5)
    first, second = cap.named("step")
    assert first.attributes["perfsdk.step"] == 0
    assert second.attributes["perfsdk.step"] == 1
    assert first.attributes["perfsdk.category"] == "step"
    assert first.attributes["perfsdk.samples"] == 64
    assert (first.host_ms, second.host_ms) == (20.0, 5.0)
    # set at the step's end, from the same clock reading that ends its region
    assert first.attributes["perfsdk.samples_per_s"] == 64 / 0.020
    assert "perfsdk.samples" not in second.attributes
    assert "perfsdk.samples_per_s" not in second.attributes


def test_samples_per_s_is_samples_over_the_steps_own_real_duration():
    with capture() as cap, auto.step(samples=8):
        torch.ones(64, 64).sum()
    (step,) = cap.named("step")
    seconds = (step.end_ns - step.start_ns) / 1e9
    assert step.attributes["perfsdk.samples_per_s"] == pytest.approx(8 / seconds, rel=1e-12)


def test_regions_inside_a_step_nest_under_it():
    model = nn.Linear(2, 2)
    with capture() as cap, auto.instrument_module(model):
        for _ in range(2):
            with auto.step(samples=1):
                work()
                model(torch.ones(1, 2)).sum().backward()
    steps = {r.span_id: r for r in cap.named("step")}
    assert len(steps) == 2
    for name in ("work", "Linear", "Linear.backward"):
        found = cap.named(name)
        assert len(found) == 2, name
        assert {r.parent_span_id for r in found} == set(steps), name
    inner = cap.named("inner")[0]
    assert inner.parent_span_id == cap.named("work")[0].span_id


def test_plain_call_api_ends_the_previous_step():
    with capture() as cap:
        for _ in range(3):
            s = auto.step(samples=2)
            assert isinstance(current_span(), Region)
            work()
        auto.end_step()
        auto.end_step()  # idempotent
        assert not isinstance(current_span(), Region)
    assert s.index == 2
    steps = cap.named("step")
    assert [r.attributes["perfsdk.step"] for r in steps] == [0, 1, 2]
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(steps))
    assert {r.parent_span_id for r in cap.named("work")} == {r.span_id for r in steps}


@pytest.mark.parametrize("args", [
    {"wait": 1, "warmup": 1, "active": 2},
    {"wait": 0, "warmup": 0, "active": 1, "repeat": 3},
    {"wait": 2, "warmup": 0, "active": 3, "repeat": 2, "skip_first": 3},
    {"wait": 1, "warmup": 2, "active": 1, "repeat": 1},
])
def test_schedule_matches_torch_profiler_schedule(args):
    ours = auto.schedule(**args)
    with warnings.catch_warnings():  # torch warns that warmup=0 may skew its profiles
        warnings.simplefilter("ignore", UserWarning)
        theirs = torch.profiler.schedule(**args)
    recorded = {torch.profiler.ProfilerAction.RECORD,
                torch.profiler.ProfilerAction.RECORD_AND_SAVE}
    for i in range(40):
        assert ours.is_active(i) == (theirs(i) in recorded), (args, i)
        if theirs(i) == torch.profiler.ProfilerAction.WARMUP:
            assert ours.phase(i) == "warmup"


@pytest.mark.parametrize(("args", "arg"), [
    ({"wait": -1, "warmup": 0, "active": 1}, "wait"),
    ({"wait": 0, "warmup": 0, "active": 0}, "active"),
    ({"wait": 0, "warmup": 1.5, "active": 1}, "warmup"),
    ({"wait": 0, "warmup": 0, "active": 1, "repeat": True}, "repeat"),
])
def test_bad_schedule_is_named(args, arg):
    with pytest.raises(ValueError, match=f"{arg}="):
        auto.schedule(**args)


@pytest.mark.parametrize("samples", [0, -3, 2.5, True, "8"])
def test_bad_samples_is_named(samples):
    with pytest.raises(ValueError, match="samples="):
        auto.step(samples=samples)
    with pytest.raises(ValueError, match="schedule="):
        auto.set_schedule("often")  # type: ignore[arg-type]


def test_steps_outside_the_active_phase_record_nothing():
    model = nn.Linear(2, 2)
    auto.set_schedule(auto.schedule(wait=1, warmup=1, active=2, repeat=1))
    phases = []
    with capture() as cap, auto.instrument_module(model):
        for _ in range(6):
            with auto.step(samples=4) as s:
                phases.append(s.phase)
                assert state.enabled is s.recorded
                work()
                model(torch.ones(1, 2)).sum().backward()
            assert state.enabled  # back to the configured value between steps
        work()  # outside any step: recorded
    assert phases == ["wait", "warmup", "active", "active", "done", "done"]
    assert [r.attributes["perfsdk.step"] for r in cap.named("step")] == [2, 3]
    steps = {r.span_id for r in cap.named("step")}
    for name in ("work", "inner", "Linear", "Linear.backward"):
        assert len(cap.named(name)) == (3 if name in ("work", "inner") else 2), name
    assert {r.parent_span_id for r in cap.named("Linear")} == steps
    assert cap.named("work")[-1].parent_span_id == 0


def test_skipped_step_keeps_a_user_disable_and_exceptions_restore():
    auto.set_schedule(auto.schedule(wait=1, warmup=0, active=1))
    perfsdk.configure(enabled=False)
    with capture() as cap:
        for _ in range(2):
            with auto.step():
                work()
        assert not state.enabled  # the user's setting, not the schedule's
        perfsdk.configure(enabled=True)
        with pytest.raises(KeyError), auto.step():  # step 2: skipped
            raise KeyError("x")
        assert state.enabled
        with pytest.raises(KeyError), auto.step():  # step 3: recorded, with the error
            raise KeyError("y")
    (step,) = cap.named("step")
    assert step.attributes["perfsdk.step"] == 3
    assert isinstance(step.error, KeyError)


def test_own_steps_instance():
    steps = auto.Steps(auto.schedule(wait=0, warmup=0, active=1))
    with capture() as cap, steps.step(samples=3):
        pass
    assert cap.named("step")[0].attributes["perfsdk.step"] == 0
    assert auto.STEPS.next_index == 0
    with pytest.raises(ValueError, match="schedule="):
        auto.Steps("x")  # type: ignore[arg-type]


# -- capture ranges ----------------------------------------------------------------------------
def test_steps_started_from_many_threads_get_distinct_indices():
    """The index counter takes no lock: two threads never get the same index."""
    steps = auto.Steps()
    seen: list[int] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for _ in range(500):
            seen.append(steps.step().index)

    state.enabled = False  # the indices alone: no regions closed across threads
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        state.enabled = perfsdk.get_config().enabled
    assert sorted(seen) == list(range(2000))
    steps.set_schedule(None)
    assert steps.step().index == 0
    assert steps.next_index == 1
    steps.end()


def test_capture_calls_profiler_start_and_stop_at_the_chosen_steps(fake_cuda, caplog):
    caplog.set_level(logging.INFO, logger="perfsdk.auto")
    rng = auto.capture(range(1, 3))
    assert "--capture-range=cudaProfilerApi" in rng.command
    assert "--capture-range-end=stop" in rng.command
    assert "-t cuda,nvtx" in rng.command
    assert rng.command in caplog.text
    seen = []
    with capture() as cap:
        for i in range(5):
            with auto.step():
                seen.append((i, list(fake_cuda.profiler_calls)))
    assert fake_cuda.profiler_calls == ["start", "stop"]
    assert seen == [(0, []), (1, ["start"]), (2, ["start"]), (3, ["start", "stop"]),
                    (4, ["start", "stop"])]
    assert rng.calls == ["start", "stop"]
    assert rng not in auto.STEPS.listeners
    assert len(cap.named("step")) == 5


def test_capture_stops_when_removed_early_and_validates(fake_cuda):
    with auto.capture(range(0, 10)):
        auto.step()
        assert fake_cuda.profiler_calls == ["start"]
    assert fake_cuda.profiler_calls == ["start", "stop"]
    for bad in (range(3, 3), range(0, 10, 2), -1, "1", 1.0):
        with pytest.raises(ValueError, match="steps="):
            auto.capture(bad)  # type: ignore[arg-type]
    auto.end_step()
    with pytest.warns(NoEffectWarning, match="already started"):
        auto.capture(0)


def test_capture_without_cuda_warns_and_carries_on():
    rng = auto.capture(0)
    with pytest.warns(NoEffectWarning, match="CUDA is not initialized"), auto.step():
        pass
    assert rng.calls == []


def test_torch_profile_writes_a_chrome_trace_with_our_regions(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    rng = auto.torch_profile(range(1, 3), output_dir=tmp_path)
    with auto.instrument_module(model):
        for _ in range(4):
            with auto.step(samples=2):
                work()
                model(torch.ones(2, 4)).sum().backward()
    assert rng.saved
    assert rng.path.parent == tmp_path
    assert rng.path.exists()
    trace = json.loads(rng.path.read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count("step") == 2  # only the chosen steps
    for name in ("work", "inner", "Sequential", "Sequential.0", "Sequential.0.backward"):
        assert names.count(name) == 2, name
    assert "aten::addmm" in names  # torch's own operators, on the same timeline


def test_torch_profile_defaults_to_the_configured_output_dir(tmp_path):
    perfsdk.configure(output_dir=tmp_path / "out")
    rng = auto.torch_profile(0)
    with auto.step():
        pass
    assert rng.path.parent == tmp_path / "out"
    assert rng.path.exists()
    with pytest.raises(ValueError, match="output_dir="):
        auto.torch_profile(5, output_dir=3)  # type: ignore[arg-type]


def test_steps_record_the_rss_at_their_end_while_memory_is_on() -> None:
    """The advisor's leak rule needs a reading that falls as well as grows: the current RSS."""
    from perfsdk.memory import current_rss

    if current_rss() is None:
        pytest.skip("no /proc/self/statm here")
    with capture() as cap:
        with perfsdk.step():
            keep = torch.ones(1 << 20)  # 4 MiB touched inside the step
        perfsdk.configure(memory=True)
        with perfsdk.step():
            keep += 1
    off, on = cap.named("step")
    assert "perfsdk.memory.rss_bytes" not in off.attributes
    rss = on.attributes["perfsdk.memory.rss_bytes"]
    assert isinstance(rss, int)
    assert rss >= keep.numel() * 4  # the tensor is resident


def test_torch_profile_starts_through_torchs_one_cycle_note(tmp_path, monkeypatch):
    """torch 2.11's profiler warns at every start without ``acc_events`` that a cycle's end
    clears its events (seen on a GPU machine, where under -W error it stopped torch_profile
    from starting): the range is one cycle, so the note is not the program's business."""
    import torch.profiler.profiler as tpp

    original = tpp.profile.__enter__

    def enter_as_2_11(self):
        warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events "
                      "from the current cycle will be reported.", UserWarning, stacklevel=2)
        return original(self)

    monkeypatch.setattr(tpp.profile, "__enter__", enter_as_2_11)
    rng = auto.torch_profile(range(1, 2), output_dir=tmp_path)
    for _ in range(2):
        with auto.step():
            torch.ones(2).sum()
    assert rng.saved  # pyproject's filterwarnings=error: the note would have stopped it
    assert rng.path.exists()
