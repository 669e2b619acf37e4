"""The advisor: each rule on a run that has its bottleneck and on one that does not, produced
for real with regions whose host times come from a fake clock the test advances where a sleep
would stand for the work (so every share is exact on any machine; device times and memory
through the fake GPU; NVML readings, which only a real GPU gives, on constructed records), plus
ordering, text, JSON, missing data and a real training loop with a slow dataset."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import warnings
from collections.abc import Iterator, Sequence
from types import MappingProxyType

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import perfsdk
import perfsdk.optimize
from perfsdk import advisor, timed_region
from perfsdk.advisor import Advice, Finding, advise
from perfsdk.record import RegionResult
from perfsdk.sync.ops import OPS
from perfsdk.testing import FakeClock, capture, use_fake_clock

MiB = 2**20
_ids = itertools.count(1)


def kinds(advice: Advice) -> list[str]:
    return [f.kind for f in advice.findings]


def finding(advice: Advice, kind: str) -> Finding:
    (found,) = [f for f in advice.findings if f.kind == kind]
    return found


def record(name: str, host_ms: float, *, category: str | None = None, parent: int = 0,
           device_ms: float | None = None, start_ms: float = 0.0, **attrs: object
           ) -> RegionResult:
    """A RegionResult built by hand, for fields only a real GPU fills (NVML readings)."""
    attributes = dict(attrs)
    if category:
        attributes["perfsdk.category"] = category
    start = int(1e15 + start_ms * 1e6)
    return RegionResult(name=name, host_ms=host_ms, device_ms=device_ms,
                        attributes=MappingProxyType(attributes), error=None, start_ns=start,
                        end_ns=start + int(host_ms * 1e6), trace_id=1, span_id=next(_ids),
                        parent_span_id=parent, thread_id=1)


@pytest.fixture(autouse=True)
def clock() -> Iterator[FakeClock]:
    """Every region's host time comes from this clock: it moves only where a test advances it."""
    with use_fake_clock() as fake:
        yield fake


def loop(clock: FakeClock, steps: int = 4, *, data_ms: float = 0.0, step_ms: float = 1.0,
         compute_ms: float = 0.0, body=None) -> list[RegionResult]:
    """A loop of data_wait + step regions (data wait outside the step, as a for loop over a
    DataLoader has it), the fake clock advanced where the work would take its time (each step
    takes ``step_ms`` besides its forward)."""
    with capture() as cap:
        for i in range(steps):
            with timed_region("data_wait", category="data", attributes={"perfsdk.batch": i}):
                clock.advance(data_ms)
            with timed_region("step", category="step", attributes={"perfsdk.step": i}):
                with timed_region("forward", category="compute"):
                    clock.advance(compute_ms)
                clock.advance(step_ms)
                if body is not None:
                    body(i)
    return cap.regions


# -- data loading ---------------------------------------------------------------------------
def test_data_bound_run_names_data_loading_with_its_numbers(clock):
    advice = advise(loop(clock, 5, data_ms=20, step_ms=2))
    top = advice.findings[0]
    assert top.kind == "data"
    assert top.data["batches"] == 4  # the first step is warm-up
    assert top.data["data_wait_ms_mean"] == 20.0
    assert top.data["basis_ms"] == 4 * 2.0 + 4 * 20.0  # the steps and the waits outside them
    assert top.data["share"] == pytest.approx(80 / 88)
    assert top.impact == pytest.approx(top.data["share"], abs=1e-4)
    assert top.severity == "high"
    assert top.fix == ("tuning = perfsdk.optimize.tune_dataloader(loader.dataset, "
                       "loader.batch_size)")
    assert ("loader = torch.utils.data.DataLoader(loader.dataset, tuning.batch_size, "
            "**tuning.best)") in top.details
    assert f"{100 * top.data['share']:.0f}%" in top.evidence


def test_fast_data_is_not_a_finding(clock):
    advice = advise(loop(clock, 5, data_ms=0, step_ms=50))
    assert "data" not in kinds(advice)


@pytest.mark.parametrize(("data_ms", "found"), [(25.0, True), (15.0, False)])
def test_data_threshold_is_share_of_loop_time(data_ms, found):
    regions = []
    for i in range(4):
        regions.append(record("data_wait", data_ms, category="data", start_ms=100 * i))
        regions.append(record("step", 100.0 - data_ms, category="step",
                              start_ms=100 * i + data_ms))
    advice = advise(regions)
    assert ("data" in kinds(advice)) is found
    if found:
        assert finding(advice, "data").data["share"] == pytest.approx(data_ms / 100)


def test_data_wait_inside_the_step_is_not_counted_twice():
    regions = []
    for i in range(2):
        step = record("step", 100.0, category="step", start_ms=100 * i)
        regions += [step, record("data_wait", 30.0, category="data", parent=step.span_id)]
    data = finding(advise(regions), "data")
    assert data.data["basis_ms"] == pytest.approx(200.0)
    assert data.data["share"] == pytest.approx(0.3)


# -- host-device syncs ------------------------------------------------------------------------
def _item(i):
    torch.ones(4).sum().item()  # a host-device sync on a GPU


def test_syncs_every_step_are_named_with_site_and_fix(clock):
    with perfsdk.no_sync_guard("count", assume_device=True):
        regions = loop(clock, 4, body=_item)
    advice = advise(regions, summary=perfsdk.summary(show=False))
    sync = finding(advice, "sync")
    assert sync.data["syncs"] == 3  # after the warm-up step
    assert sync.data["syncs_per_step"] == 1.0
    assert sync.data["outside_steps"] == 0
    ((site),) = sync.data["sites"]
    assert site["where"].endswith("test_advisor.py:" + str(_item.__code__.co_firstlineno + 1))
    assert site["op"] == "item"
    assert (site["count"], site["in_steps"]) == (4, 3)  # this run, warm-up step included
    assert sync.fix == 'perfsdk.configure(sync_guard="error")'
    assert sync.sites == (f"{site['where']} item (4x in all): {OPS['item']}",)
    assert sync.evidence == "1.0 per step (3 in 3 steps) at 1 call site"


def test_sites_come_from_the_regions_without_a_summary(clock):
    with perfsdk.no_sync_guard("count", assume_device=True):
        regions = loop(clock, 2, body=_item)
    sync = finding(advise(regions), "sync")
    assert [(s["op"], s["count"]) for s in sync.data["sites"]] == [("item", 2)]


def test_no_syncs_no_finding_and_a_note(clock):
    with perfsdk.no_sync_guard("count", assume_device=True):
        regions = loop(clock, 4)
    advice = advise(regions)
    assert "sync" not in kinds(advice)
    assert any("syncs: none recorded" in n for n in advice.notes)


@pytest.mark.parametrize(("every", "found"), [(4, False), (2, True)])
def test_an_occasional_sync_for_logging_is_below_the_threshold(clock, every, found):
    with perfsdk.no_sync_guard("count", assume_device=True):
        regions = loop(clock, 5, body=lambda i: _item(i) if i % every == 1 else None)
    assert sum(r.attributes.get("perfsdk.syncs", 0) for r in regions) == 4 // every
    # after the warm-up step: 1 sync in 4 steps (< SYNCS_PER_STEP), or 2 in 4 (reported)
    assert ("sync" in kinds(advise(regions))) is found


def test_syncs_in_regions_nested_in_a_step_count_for_that_step(clock):
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for _ in range(4):
            with timed_region("step", category="step"), timed_region("forward",
                                                                     category="compute"):
                clock.advance(1)
                _item(0)
                _item(0)
    regions = cap.regions
    assert {r.name for r in regions if r.attributes.get("perfsdk.syncs")} == {"forward"}
    sync = finding(advise(regions), "sync")
    assert (sync.data["syncs"], sync.data["syncs_per_step"]) == (6, 2.0)
    assert sync.data["sites"][0]["count"] == 8


def test_syncs_outside_the_steps_are_not_divided_by_the_steps(clock):
    """Six sync-free steps, then an evaluation region with three syncs: no per-step finding
    (it used to say "0.6 per step (3 in 5 steps)"); a note names them as outside the steps."""
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for i in range(6):
            with timed_region("step", category="step", attributes={"perfsdk.step": i}):
                clock.advance(5)
        with timed_region("eval"):
            for _ in range(3):
                _item(0)
    advice = advise(cap.regions)
    assert "sync" not in kinds(advice)
    assert "Host-device syncs" not in str(advice)
    [note] = [n for n in advice.notes if "syncs outside the steps" in n]
    assert note.startswith("host-device syncs outside the steps: 3 at ")
    assert f"test_advisor.py:{_item.__code__.co_firstlineno + 1} item" in note


def test_a_step_finding_also_names_the_syncs_outside_the_steps(clock):
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for i in range(4):
            with timed_region("step", category="step"):
                clock.advance(5)
                _item(i)
            with timed_region("log"):
                _log(i)
    sync = finding(advise(cap.regions), "sync")
    # the first log ran after the warm-up step ended: it is in the run that is analysed
    assert sync.evidence == "1.0 per step (3 in 3 steps) at 1 call site; 4 more outside the steps"
    assert (sync.data["syncs"], sync.data["outside_steps"]) == (3, 4)
    assert [(s["op"], s["in_steps"], s["outside_steps"]) for s in sync.data["sites"]] == [
        ("item", 3, 0), ("print", 0, 4)]
    assert sync.sites[1].endswith(f"print (4x in all) (outside the steps): {OPS['print']}")


def _log(i):
    return f"{torch.ones(2).sum():.1f}"  # formatting a device value: a sync


def test_a_summary_adds_only_the_syncs_outside_regions_of_this_run(clock):
    """Syncs outside any region are only in the summary's sites, with their times: those of an
    earlier run in the process are not this run's (they used to make a sync-free loop's top
    finding "sync")."""
    with perfsdk.no_sync_guard("count", assume_device=True):
        loop(clock, 4, body=_item)  # an earlier run: a sync in every step
        for _ in range(5):
            _item(0)  # ... and outside any region
        clock.advance(10)
        with capture() as cap:  # this run: no sync in its steps, two between them
            for i in range(4):
                with timed_region("step", category="step"):
                    clock.advance(5)
                if i in (1, 2):
                    _log(i)
    summary = perfsdk.summary(show=False)
    assert sum(s.count for s in summary.sync_sites) == 4 + 5 + 2  # process-wide
    advice = advise(cap.regions, summary=summary)
    assert "sync" not in kinds(advice)
    [note] = [n for n in advice.notes if "syncs outside the steps" in n]
    assert note.startswith("host-device syncs outside the steps: 2 at ")
    assert "print" in note
    assert " item" not in note
    quiet = advise(loop(clock, 4), summary=perfsdk.summary(show=False))
    assert "sync" not in kinds(quiet)
    assert any(n.startswith("host-device syncs: none recorded in this run") for n in quiet.notes)


def test_without_steps_every_sync_of_the_run_counts(clock):
    with perfsdk.no_sync_guard("count", assume_device=True):
        _item(0)  # before the run: not counted
        clock.advance(1)
        with capture() as cap:
            with timed_region("work"):
                clock.advance(2)
                _item(0)
            _log(0)  # between the run's regions: counted from the summary
            with timed_region("work"):
                clock.advance(2)
    sync = finding(advise(cap.regions, summary=perfsdk.summary(show=False)), "sync")
    assert sync.evidence == "2 in the run at 2 call sites"
    assert sync.data["syncs_per_step"] is None
    assert finding(advise(cap.regions), "sync").evidence == "1 in the run at 1 call site"


# -- launch overhead --------------------------------------------------------------------------
def test_host_much_longer_than_device_is_launch_overhead(fake_cuda, clock):
    with capture() as cap:
        for i in range(4):
            with timed_region("step", category="step", attributes={"perfsdk.step": i}):
                for _ in range(20):
                    fake_cuda.launch(0.01)  # tiny kernels
                clock.advance(5)  # the host launching them
            fake_cuda.complete_all()
    advice = advise(cap.regions)
    launch = finding(advice, "launch")
    assert launch.data["device_ms"] == pytest.approx(3 * 20 * 0.01)  # after the warm-up
    assert launch.data["host_ms"] == 3 * 5.0
    assert launch.data["host_device_ratio"] == pytest.approx(15 / 0.6)
    assert launch.data["host_device_ratio"] >= advisor.LAUNCH_HOST_DEVICE_RATIO
    assert launch.impact == pytest.approx(1 - 0.6 / 15)  # the GPU's idle share
    assert launch.fix == "model, report = perfsdk.optimize.optimize(model, inputs, compile=True)"
    assert "model = perfsdk.optimize.apply_cuda_graphs(model)" in launch.details


def test_busy_gpu_is_not_launch_overhead(fake_cuda):
    with capture() as cap:
        for _ in range(4):
            with timed_region("step", category="step"):
                fake_cuda.launch(50.0)  # long kernels, the host runs ahead
            fake_cuda.complete_all()
    advice = advise(cap.regions)
    assert "launch" not in kinds(advice)
    assert not any("launch overhead not checked" in n for n in advice.notes)


def test_cpu_only_run_says_launch_overhead_was_not_checked(clock):
    advice = advise(loop(clock, 3, step_ms=5))
    assert "launch" not in kinds(advice)
    assert any(n.startswith("launch overhead not checked: no device times") for n in advice.notes)


@pytest.mark.parametrize(("utilization", "step_ms", "found"),
                         [(0.2, 5.0, True), (0.95, 5.0, False), (0.2, 100.0, False)])
def test_low_gpu_utilization_with_short_steps(utilization, step_ms, found):
    # NVML readings exist only on a real GPU: records built by hand. Device time equals host
    # time here (the events see the idle gaps), so only the utilization can tell.
    regions = [record("step", step_ms, category="step", device_ms=step_ms, start_ms=i * step_ms,
                      **{"hw.gpu.utilization": utilization}) for i in range(10)]
    advice = advise(regions)
    assert ("launch" in kinds(advice)) is found
    if found:
        launch = finding(advice, "launch")
        assert launch.data["gpu_utilization"] == pytest.approx(utilization)
        assert launch.impact == pytest.approx(1 - utilization)


def test_idle_gpu_explained_by_data_wait_is_not_launch_overhead():
    regions = []
    for i in range(4):
        step = record("step", 10.0, category="step", device_ms=1.0, start_ms=10 * i)
        regions += [step, record("data_wait", 9.0, category="data", parent=step.span_id,
                                 start_ms=10 * i)]
    assert kinds(advise(regions)) == ["data"]


# -- memory pressure --------------------------------------------------------------------------
def _memory_run(fake_cuda, peak):
    with capture() as cap:
        for _ in range(2):
            with timed_region("step", category="step", memory=True):
                fake_cuda.alloc(peak)
                fake_cuda.free(peak)
    return cap.regions


def test_peak_near_capacity_is_memory_pressure(fake_cuda):
    advice = advise(_memory_run(fake_cuda, 950 * MiB), device_memory_bytes=1000 * MiB)
    memory = finding(advice, "memory")
    assert memory.data["peak_bytes"] >= 950 * MiB
    assert memory.data["fraction"] > advisor.MEMORY_PRESSURE
    assert memory.fix == "model = perfsdk.optimize.apply_checkpointing(model, segments=2)"
    assert "model = perfsdk.optimize.apply_amp(model)" in memory.details
    assert any("accumulate=2" in d for d in memory.details)
    assert "950 MiB of 1,000 MiB (95%" in memory.evidence


def test_peak_well_below_capacity_is_no_finding(fake_cuda):
    advice = advise(_memory_run(fake_cuda, 950 * MiB), device_memory_bytes=4000 * MiB)
    assert "memory" not in kinds(advice)


def test_memory_without_capacity_says_so(fake_cuda):
    advice = advise(_memory_run(fake_cuda, 950 * MiB))
    assert "memory" not in kinds(advice)
    assert any("device capacity unknown" in n for n in advice.notes)


def test_no_memory_records_says_so(clock):
    advice = advise(loop(clock, 2), device_memory_bytes=1000 * MiB)
    assert any(n.startswith("memory pressure not checked: no memory records")
               for n in advice.notes)


# -- memory creep -----------------------------------------------------------------------------
def _gpu_steps(fake_cuda, clock, steps, body, *, steps_api=None):
    """``steps`` steps of 1 ms on the fake GPU and the fake clock, memory on for every region:
    a forward that allocates 256 MiB of activations and a backward that frees them, then
    ``body(i)``."""
    perfsdk.configure(memory=True)
    step = perfsdk.step if steps_api is None else steps_api.step
    with capture() as cap:
        fake_cuda.alloc(512 * MiB)  # the model and its optimizer state
        for i in range(steps):
            with step():
                with timed_region("model"):
                    fake_cuda.alloc(256 * MiB)
                with timed_region("grad"):
                    fake_cuda.free(256 * MiB)
                body(i)
                fake_cuda.launch(1.0)  # the GPU busy as long as the host: no launch overhead
                clock.advance(1)
                fake_cuda.advance(1.0)
            fake_cuda.complete_all()
    return cap.regions


def creep(advice: Advice) -> Finding:
    return finding(advice, "memory_creep")


def test_trend_slope_is_robust_and_parts_show_a_jump():
    from perfsdk.advisor.trend import MAX_POINTS, segment_medians, theil_sen

    xs = list(range(30))
    ys = [100 + 3 * x for x in xs]
    assert theil_sen(xs, ys) == 3.0
    ys[5], ys[17], ys[23] = 10_000, -500, 7  # outliers leave the slope exact
    assert theil_sen(xs, ys) == 3.0
    long = list(range(10 * MAX_POINTS))
    assert theil_sen(long, [2 * x for x in long]) == 2.0  # evenly spaced subset
    assert theil_sen([1, 1], [0, 5]) == 0.0  # no pair with different x
    assert segment_medians([1, 1, 1, 1, 1, 9, 9, 9, 9, 9], 4) == [1.0, 1.0, 9.0, 9.0]
    assert segment_medians(list(range(8)), 4) == [0.5, 2.5, 4.5, 6.5]
    with pytest.raises(ValueError, match="xs and ys"):
        theil_sen([1, 2], [1])
    with pytest.raises(ValueError, match="3 values cannot make 4 parts"):
        segment_medians([1, 2, 3], 4)
    import doctest

    from perfsdk.advisor import trend

    assert doctest.testmod(trend).failed == 0  # its examples, as printed


def test_a_leak_in_a_region_is_named_with_its_slope(fake_cuda, clock):
    def keep(i):
        with timed_region("metrics"):
            fake_cuda.alloc(8 * MiB)

    advice = advise(_gpu_steps(fake_cuda, clock, 25, keep))
    found = creep(advice)
    assert kinds(advice) == ["memory_creep"]
    assert found.data["slope_bytes_per_step"] == 8 * MiB
    assert found.data["region"] == "metrics"  # not `model`: its 256 MiB are freed by `grad`
    assert found.fix == "perfsdk.configure(memory_snapshots=True)"
    assert found.impact == advisor.MEMORY_WEIGHT
    assert found.severity == "medium"
    line = next(x for x in str(advice).splitlines() if x.startswith("1. "))
    assert line == "1. Memory creep: GPU memory grows every step  [medium]"  # no time share
    assert json.loads(json.dumps(advice.as_dicts()))[0]["data"]["region"] == "metrics"


def test_the_deepest_region_that_accounts_for_the_growth_is_named(fake_cuda, clock):
    def keep(i):
        with timed_region("evaluate"), timed_region("cache"):
            fake_cuda.alloc(4 * MiB)

    found = creep(advise(_gpu_steps(fake_cuda, clock, 25, keep)))
    assert (found.data["region"], found.data["region_slope_bytes_per_step"]) == \
        ("cache", 4 * MiB)


def test_a_leak_outside_any_region_names_the_step(fake_cuda, clock):
    advice = advise(_gpu_steps(fake_cuda, clock, 25, lambda i: fake_cuda.alloc(8 * MiB)))
    found = creep(advice)
    assert (found.data["region"], found.data["region_slope_bytes_per_step"]) == ("step", None)
    assert "grows in `step` itself (no region inside it" in found.evidence
    assert found.fix == "perfsdk.configure(memory=True, memory_snapshots=True)"


def test_a_leak_between_the_steps_is_placed_there(fake_cuda, clock):
    perfsdk.configure(memory=True)
    with capture() as cap:
        for _ in range(25):
            with perfsdk.step():
                fake_cuda.alloc(64 * MiB)
                fake_cuda.free(64 * MiB)
                clock.advance(1)
            fake_cuda.alloc(8 * MiB)  # between the steps: a list of batches on the GPU
    found = creep(advise(cap.regions))
    assert found.data["slope_bytes_per_step"] == 8 * MiB
    assert found.data["region"] is None
    assert found.data["region_slope_bytes_per_step"] == 0
    assert "grows between the steps, outside the step regions" in found.evidence


def test_spikes_do_not_move_the_slope(fake_cuda, clock):
    def body(i):
        fake_cuda.alloc(8 * MiB)
        if i % 7 == 3:  # a long batch now and then: a transient peak
            fake_cuda.alloc(300 * MiB)
            fake_cuda.free(300 * MiB)

    found = creep(advise(_gpu_steps(fake_cuda, clock, 40, body)))
    assert found.data["slope_bytes_per_step"] == 8 * MiB


def test_steps_on_a_schedule_count_every_step(fake_cuda, clock):
    from perfsdk.auto import Steps, schedule

    steps = Steps(schedule(wait=1, warmup=0, active=1))  # every other step recorded
    found = creep(advise(_gpu_steps(fake_cuda, clock, 60, lambda i: fake_cuda.alloc(8 * MiB),
                                    steps_api=steps)))
    assert found.data["slope_bytes_per_step"] == 8 * MiB  # per step, recorded or not
    assert (found.data["first_step"], found.data["last_step"], found.data["steps"]) == (3, 59, 29)


def test_the_device_fills_in_a_number_of_steps(fake_cuda, clock):
    regions = _gpu_steps(fake_cuda, clock, 25, lambda i: fake_cuda.alloc(8 * MiB))
    found = creep(advise(regions, device_memory_bytes=2048 * MiB))
    end = 512 * MiB + 24 * 8 * MiB + 256 * MiB  # step 24's peak, in the model region
    assert found.data["end_bytes"] == end
    assert found.data["steps_to_capacity"] == (2048 * MiB - end) // (8 * MiB)
    assert f"the device's 2,048 MiB are full in ~{(2048 * MiB - end) // (8 * MiB)} steps" \
        in found.evidence


@pytest.mark.parametrize(("what", "body"), [
    ("flat", lambda fake, i: None),
    ("one jump", lambda fake, i: fake.alloc(2048 * MiB) if i == 15 else None),
    ("two jumps", lambda fake, i: fake.alloc(512 * MiB) if i in (8, 20) else None),
    ("a jump and drift", lambda fake, i: fake.alloc(2048 * MiB if i == 15 else 1024)),
    ("a small leak", lambda fake, i: fake.alloc(1 * MiB)),  # 24 MiB in 24 steps
])
def test_no_creep_without_steady_material_growth(fake_cuda, what, body, clock):
    advice = advise(_gpu_steps(fake_cuda, clock, 25, lambda i: body(fake_cuda, i)))
    assert "memory_creep" not in kinds(advice), what
    assert not any(n.startswith("memory creep") for n in advice.notes)


@pytest.mark.parametrize(("in_use", "found"), [(0, True), (20 * 1024 * MiB, False)])
def test_growth_small_against_the_memory_in_use_is_no_finding(fake_cuda, in_use, found, clock):
    fake_cuda.alloc(in_use)  # 20 GiB in use: 48 MiB more in 24 steps is under 5%
    advice = advise(_gpu_steps(fake_cuda, clock, 25, lambda i: fake_cuda.alloc(2 * MiB)))
    assert ("memory_creep" in kinds(advice)) is found


def test_too_few_steps_or_no_memory_says_so(fake_cuda, clock):
    advice = advise(_gpu_steps(fake_cuda, clock, 12, lambda i: fake_cuda.alloc(64 * MiB)))
    assert "memory_creep" not in kinds(advice)
    assert (f"memory creep not checked: 11 steps with memory readings after warm-up, "
            f"{advisor.CREEP_MIN_STEPS} needed") in advice.notes
    perfsdk.configure(memory=False)
    assert ("memory creep not checked: the steps record no memory (perfsdk.configure("
            "memory=True) or PERFSDK_MEMORY=1)") in advise(loop(clock, 25)).notes
    assert not any("creep" in n for n in advise([record("work", 1.0)]).notes)  # no steps


def _host_steps(key: str, level) -> list[RegionResult]:
    """Steps recorded on a CPU: one host-memory reading each."""
    regions = []
    for i in range(30):
        step = record("step", 10.0, category="step", start_ms=10 * i, **{"perfsdk.step": i})
        regions.append(dataclasses.replace(step, memory={
            "perfsdk.memory.rss_delta_bytes": 0, "perfsdk.memory.rss_peak_bytes": level(i)}))
        if key == "perfsdk.memory.rss_bytes":
            regions[-1] = dataclasses.replace(regions[-1], attributes=MappingProxyType(
                {**step.attributes, key: level(i)}))
    return regions


def test_the_rss_at_each_steps_end_shows_a_host_leak():
    found = creep(advise(_host_steps("perfsdk.memory.rss_bytes",
                                     lambda i: 900 * MiB + i * 5 * MiB)))
    assert found.data["source"] == "rss"
    assert found.data["slope_bytes_per_step"] == 5 * MiB
    assert found.data["region"] == "step"
    assert found.title == "Memory creep: the process memory grows every step"
    assert found.fix.startswith("# keep numbers, not tensors that hold their autograd graph")
    assert all(line.startswith("#") for line in found.details)
    assert "nothing new to apply" not in str(found)


def test_the_peak_rss_is_read_when_the_steps_have_no_current_rss():
    grows = creep(advise(_host_steps("", lambda i: 900 * MiB + i * 5 * MiB)))
    assert grows.data["source"] == "rss_peak"
    assert "the peak shows growth only past the earlier high-water mark" in grows.evidence
    flat = advise(_host_steps("", lambda i: 900 * MiB))
    assert "memory_creep" not in kinds(flat)
    assert any(n.startswith("memory creep on the CPU read from the peak RSS") for n in flat.notes)


# -- compute ----------------------------------------------------------------------------------
def test_forward_dominating_is_compute_bound(clock):
    advice = advise(loop(clock, 5, compute_ms=50))
    assert kinds(advice) == ["compute"]
    compute = advice.findings[0]
    assert compute.data["share"] == pytest.approx(50 / 51)  # 50 ms forward in a 51 ms step
    assert compute.data["share"] >= advisor.COMPUTE_SHARE
    assert compute.fix == "model, report = perfsdk.optimize.optimize(model, inputs, auto=True)"
    assert "model = perfsdk.optimize.apply_amp(model)" in compute.details
    assert "forward" in compute.data["heaviest"]


def test_compute_waits_until_the_other_bottlenecks_are_fixed(clock):
    advice = advise(loop(clock, 4, data_ms=30, compute_ms=20))
    assert kinds(advice) == ["data"]


def test_small_compute_share_is_no_finding(clock):
    advice = advise(loop(clock, 5, step_ms=50))  # the step's time is outside forward/backward
    assert advice.findings == ()
    assert any(n.startswith("no bottleneck found") for n in advice.notes)
    assert "No bottleneck found by the rules." in str(advice)


def test_per_module_regions_count_once():
    regions = []
    for i in range(2):
        step = record("step", 10.0, category="step", start_ms=10 * i)
        root = record("Net", 8.0, category="module", parent=step.span_id)
        regions += [step, root, record("Net.fc", 6.0, category="module", parent=root.span_id)]
    compute = finding(advise(regions), "compute")
    assert compute.data["compute_ms"] == pytest.approx(16.0)
    assert list(compute.data["heaviest"]) == ["Net", "Net.fc"]


# -- a fix already on is not recommended again --------------------------------------------------
def _compute_bound_train_step(clock, model, **options):
    """A compute-bound loop of TrainStep calls: 50 ms of forward a step, on the fake clock."""
    def loss_fn(out, target):
        clock.advance(50)  # the forward's work
        return torch.nn.functional.mse_loss(out.float(), target)

    step = perfsdk.optimize.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      loss_fn, **options)
    with capture() as cap:
        for _ in range(5):
            with perfsdk.step():
                step(torch.randn(4, 8), target=torch.zeros(4, 2))
                clock.advance(1)
    return cap.regions


def test_autocast_already_on_is_not_recommended_again(clock):
    """TrainStep(amp="bf16") records its autocast on its regions: the compute finding says it is
    on and recommends what is not (it used to recommend apply_amp on the demo's fixed run)."""
    regions = _compute_bound_train_step(clock, torch.nn.Linear(8, 2), amp="bf16")
    assert {r.attributes.get("perfsdk.amp") for r in regions if r.name.startswith("train.")} \
        == {"bfloat16"}
    compute = finding(advise(regions), "compute")
    assert compute.already_on == ("autocast (bfloat16)",)
    assert compute.data["already_on"] == ["amp"]
    assert compute.fix == "model, report = perfsdk.optimize.optimize(model, inputs, auto=True)"
    code = [compute.fix, *compute.details]
    assert not any("apply_amp" in line or "amp=" in line for line in code)
    assert "model = perfsdk.optimize.apply_compile(model)" in code
    assert "measures torch.compile and channels-last on this machine" in compute.details[0]
    text = str(advise(regions))
    assert ("   already   on in this run, so not recommended again: autocast (bfloat16)"
            in text.splitlines())
    plain = finding(advise(_compute_bound_train_step(clock, torch.nn.Linear(8, 2))), "compute")
    assert plain.already_on == ()
    assert "model = perfsdk.optimize.apply_amp(model)" in plain.details


def test_autocast_at_a_steps_entry_counts_as_on(clock):
    with capture() as cap:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16), perfsdk.step(), \
                    timed_region("forward", category="compute"):
                clock.advance(10)
    assert [r.attributes.get("perfsdk.amp") for r in cap.named("step")] == ["bfloat16"] * 2
    compute = finding(advise(cap.regions), "compute")
    assert compute.data["already_on"] == ["amp"]
    assert with_plain_steps(clock).data["already_on"] == []


def with_plain_steps(clock):
    with capture() as cap:
        for _ in range(2):
            with perfsdk.step(), timed_region("forward", category="compute"):
                clock.advance(10)
    assert all("perfsdk.amp" not in r.attributes for r in cap.regions)
    return finding(advise(cap.regions), "compute")


def test_an_instrumented_model_records_what_perfsdk_optimize_applied(clock):
    import perfsdk.optimize

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3))
    model = perfsdk.optimize.apply_amp(perfsdk.optimize.apply_channels_last(model))
    with capture() as cap, perfsdk.instrument_module(model, backward=False):
        for _ in range(2):
            with perfsdk.step(), timed_region("forward", category="compute"):
                model(torch.randn(2, 3, 8, 8))
                clock.advance(10)
    root = cap.named("Sequential")
    assert [r.attributes["perfsdk.transforms"] for r in root] == [("amp", "channels_last")] * 2
    assert {r.attributes["perfsdk.amp"] for r in root} == {"bfloat16"}
    assert all("perfsdk.transforms" not in r.attributes for r in cap.named("Sequential.0"))
    compute = finding(advise(cap.regions), "compute")
    assert compute.data["already_on"] == ["amp", "channels_last"]
    assert "measures torch.compile on this machine" in compute.details[0]


def test_compile_already_on_leaves_cuda_graphs_for_launch_overhead():
    regions = [record("step", 10.0, category="step", device_ms=1.0, start_ms=10 * i,
                      **{"perfsdk.transforms": ("compile",)}) for i in range(3)]
    launch = finding(advise(regions), "launch")
    assert launch.fix == "model = perfsdk.optimize.apply_cuda_graphs(model)"
    assert launch.already_on == ("torch.compile",)
    assert not any("compile" in line for line in launch.details)


def test_every_fix_already_on_leaves_a_comment_instead():
    state = {"perfsdk.amp": "bfloat16", "perfsdk.transforms": ("channels_last", "compile")}
    regions = []
    for i in range(3):
        step = record("step", 10.0, category="step", start_ms=10 * i, **state)
        regions += [step, record("forward", 9.0, category="compute", parent=step.span_id,
                                 start_ms=10 * i)]
    compute = finding(advise(regions), "compute")
    assert compute.fix.startswith("# nothing new to apply")
    assert compute.details == ()
    assert compute.data["already_on"] == ["amp", "compile", "channels_last"]


# -- warm-up ----------------------------------------------------------------------------------
def test_a_slow_first_step_is_left_out_as_warm_up(clock):
    with capture() as cap:
        for i in range(5):
            with timed_region("data_wait", category="data"):
                clock.advance(10)
            with timed_region("step", category="step"):
                clock.advance(500 if i == 0 else 1)  # compilation, first-call costs
    advice = advise(cap.regions)
    assert (advice.steps, advice.warmup_steps) == (4, 1)
    assert advice.basis_ms == 4 * 1.0 + 4 * 10.0  # without the first step and its wait
    assert kinds(advice) == ["data"]
    assert str(advice).startswith("perfsdk advice: 4 steps after 1 warm-up, ")
    three = advise(cap.regions[:6])  # three steps: no warm-up left out
    assert three.basis_ms == 500 + 2 * 1.0 + 3 * 10.0
    assert kinds(three) == []  # 30 of 532 ms: below DATA_SHARE
    assert "warm-up" not in str(advise(cap.regions[:6]))


# -- every printed fix runs as printed --------------------------------------------------------
def _all_fixes() -> list[Advice]:
    """Runs that make every rule fire, plain and with each fix already on, so that every line
    the advisor can print under "fix" and "also" is printed at least once."""
    def run(state: dict[str, object]) -> list[RegionResult]:
        out = []
        for i in range(3):
            data = record("data_wait", 30.0, category="data", start_ms=100 * i)
            step = record("step", 60.0, category="step", device_ms=1.0, start_ms=100 * i + 30,
                          **state, **{"perfsdk.syncs": 2, "perfsdk.sync_sites": ("t.py:1 item",),
                                      "perfsdk.sync_counts": (2,)})
            out += [data, step]
        return out

    def compute(state: dict[str, object]) -> list[RegionResult]:
        out = []
        for i in range(3):
            step = record("step", 10.0, category="step", start_ms=10 * i, **state)
            out += [step, record("forward", 9.0, category="compute", parent=step.span_id,
                                 start_ms=10 * i)]
        return out

    def memory(state: dict[str, object]) -> list[RegionResult]:
        return [dataclasses.replace(r, memory={"perfsdk.memory.peak_bytes": 990 * MiB})
                for r in compute(state)]

    def creep(state: dict[str, object], key: str, inside: bool = False) -> list[RegionResult]:
        out = []
        for i in range(25):
            step = dataclasses.replace(
                record("step", 10.0, category="step", start_ms=10 * i, **state),
                memory={key: (100 + 8 * i) * MiB, "perfsdk.memory.allocated_delta_bytes": 8 * MiB})
            out.append(step)
            if inside:  # the region that keeps the 8 MiB
                out.append(dataclasses.replace(
                    record("metrics", 1.0, parent=step.span_id, start_ms=10 * i),
                    memory={"perfsdk.memory.allocated_delta_bytes": 8 * MiB}))
        return out

    states: list[dict[str, object]] = [
        {}, {"perfsdk.amp": "bfloat16"}, {"perfsdk.transforms": ("compile",)},
        {"perfsdk.transforms": ("checkpointing", "cuda_graphs")},
        {"perfsdk.amp": "float16", "perfsdk.transforms": ("channels_last", "compile")}]
    advices = []
    for state in states:
        advices += [advise(run(state), device_memory_bytes=1000 * MiB),
                    advise(compute(state)), advise(memory(state), device_memory_bytes=1000 * MiB),
                    advise(creep(state, "perfsdk.memory.peak_bytes")),
                    advise(creep(state, "perfsdk.memory.peak_bytes", inside=True)),
                    advise(creep(state, "perfsdk.memory.rss_peak_bytes"))]
    assert {f.kind for a in advices for f in a} == set(advisor.KINDS)
    return advices


def printed_code(advice: Advice) -> list[list[str]]:
    """The lines of each finding printed under "fix" and "also", as printed (the label column
    cut off)."""
    blocks: list[list[str]] = []
    label = ""
    for line in str(advice).splitlines():
        if line[:1].isdigit():
            blocks.append([])
            label = ""
        elif line.startswith("   ") and blocks:
            label = line[3:12].strip() or label
            if label in ("fix", "also"):
                blocks[-1].append(line[13:])
    return blocks


def user_names() -> dict[str, object]:
    """What a user of the advice has: perfsdk, torch and advisor.NAMES."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 3, padding=1),
                          nn.Flatten(), nn.Linear(2 * 8 * 8, 2))
    inputs = torch.randn(4, 3, 8, 8)
    # an epoch longer than tune_dataloader's trial: no worker restarts, a quick tuning
    data = torch.utils.data.TensorDataset(torch.randn(128, 3, 8, 8), torch.randn(128, 2))
    names = {"perfsdk": perfsdk, "torch": torch, "model": model, "inputs": inputs,
             "loader": torch.utils.data.DataLoader(data, batch_size=4),
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
             "loss_fn": torch.nn.functional.mse_loss}
    assert set(names) == {"perfsdk", "torch", *advisor.NAMES}
    return names


def free_names(code: str) -> set[str]:
    """Names a block reads before assigning them."""
    import ast

    assigned: set[str] = set()
    free: set[str] = set()
    for stmt in ast.parse(code).body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and node.id not in assigned:
                free.add(node.id)
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                assigned.add(node.id)
    return free


def run_printed(blocks: Sequence[Sequence[str]]) -> int:
    """Execute each finding's printed lines in order, each finding with fresh user names;
    the number of statements run."""
    from perfsdk import NoEffectWarning, PerfSDKWarning

    ran = 0
    for lines in blocks:
        code = "\n".join(lines)
        assert free_names(code) <= {"perfsdk", "torch", *advisor.NAMES}, code
        names = user_names()
        for line in lines:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                exec(compile(line, "<printed by the advisor>", "exec"), names)
            # perfsdk warns only that apply_cuda_graphs has nothing to do on a CPU (torch's own
            # deprecation warnings on first importing its compiler are not perfsdk's)
            ours = [w for w in caught if issubclass(w.category, PerfSDKWarning)]
            assert all(issubclass(w.category, NoEffectWarning) for w in ours), \
                [str(w.message) for w in ours]
            ran += not line.startswith("#")
        assert isinstance(names["model"], torch.nn.Module)
        assert isinstance(names["loader"], torch.utils.data.DataLoader)
    return ran


@pytest.mark.initializes_cuda
def test_every_printed_fix_runs_as_printed(monkeypatch):
    """Each line printed under "fix" and "also" is a statement that runs, given perfsdk, torch
    and the user's model, inputs, loader, optimizer and loss_fn, or a comment. optimize() with
    compile or auto measures for minutes: here its arguments are bound to its real signature
    (test_optimize_lines_run_for_real runs it)."""
    real = perfsdk.optimize.optimize

    def optimize(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)
        return args[0], "report"

    monkeypatch.setattr(perfsdk.optimize, "optimize", optimize)
    blocks = list(dict.fromkeys(tuple(b) for a in _all_fixes() for b in printed_code(a)))
    printed = {line for block in blocks for line in block if not line.startswith("#")}
    findings = [f for advice in _all_fixes() for f in advice]
    assert printed == {line for f in findings for line in (f.fix, *f.details)
                       if not line.startswith("#")}  # the text prints every one, unwrapped
    assert len(printed) >= 10
    assert {"perfsdk.configure(memory_snapshots=True)",  # memory creep, with and without a
            "perfsdk.configure(memory=True, memory_snapshots=True)"} <= printed  # region named
    assert run_printed(blocks) >= len(printed)


@pytest.mark.slow
def test_optimize_lines_run_for_real():
    blocks = [b for advice in _all_fixes() for b in printed_code(advice)
              if any("optimize.optimize(" in line for line in b)]
    assert run_printed(blocks) > 0


def test_a_statement_that_does_not_run_fails_the_check():
    with pytest.raises(TypeError):
        run_printed([["perfsdk.optimize.tune_dataloader(dataset=loader.dataset)"]])
    with pytest.raises(AssertionError):
        run_printed([["model = apply_amp(model)"]])  # a name the user does not have


# -- ordering, text, JSON, missing data, arguments --------------------------------------------
def test_findings_are_ordered_by_impact(fake_cuda, clock):
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for i in range(5):  # the first step (the guard's first sync is slow) is warm-up
            with timed_region("data_wait", category="data"):
                clock.advance(20)
            with timed_region("step", category="step", memory=True):
                fake_cuda.alloc(990 * MiB)
                fake_cuda.free(990 * MiB)
                _item(i)
                clock.advance(1)
    advice = advise(cap.regions, device_memory_bytes=1000 * MiB)
    assert kinds(advice) == ["data", "memory", "sync"]
    impacts = [f.impact for f in advice.findings]
    expected = [80 / 84, advisor.MEMORY_WEIGHT * 0.99, advisor.SYNC_MIN_IMPACT]
    assert impacts == pytest.approx(expected, abs=1e-4)  # impacts are rounded to 4 places
    assert impacts == sorted(impacts, reverse=True)
    assert advice.top is advice.findings[0]


def test_text_is_aligned_and_names_evidence_and_fix(clock):
    with perfsdk.no_sync_guard("count", assume_device=True):
        advice = advise(loop(clock, 5, data_ms=20, body=_item))
    text = str(advice)
    lines = text.splitlines()
    assert lines[0].startswith("perfsdk advice: 4 steps after 1 warm-up, ")
    assert lines[2].startswith("1. Data loading: the loop waits for batches  [high, ~")
    assert any(line.startswith("2. Host-device syncs") for line in lines)
    for label in ("evidence", "fix", "also", "sites"):
        assert any(line.startswith(f"   {label:<9} ") for line in lines), label
    column = {line.index("tuning = perfsdk.optimize.tune_dataloader") for line in lines
              if "tune_dataloader(" in line}
    assert column == {len("   evidence  ")}
    assert "Not checked / notes:" in text
    assert all(len(line) <= 102 for line in lines)


def test_as_dicts_is_json(clock):
    advice = advise(loop(clock, 3, data_ms=20))
    (first, *_) = json.loads(json.dumps(advice.as_dicts()))
    assert first["kind"] == "data"
    assert set(first) == {f.name for f in dataclasses.fields(Finding)}
    whole = json.loads(json.dumps(advice.as_dict()))
    assert whole["steps"] == 3
    assert whole["notes"] == list(advice.notes)


def test_no_regions_says_so():
    advice = advise([])
    assert advice.findings == ()
    assert advice.steps == 0
    assert advice.notes[0].startswith("no regions recorded")
    assert "no steps" in str(advice)


def test_no_steps_uses_the_whole_run(clock):
    with capture() as cap:
        for _ in range(3):
            with timed_region("data_wait", category="data"):
                clock.advance(20)
            with timed_region("work"):
                clock.advance(2)
    advice = advise(cap.regions)
    assert advice.steps == 0
    assert advice.basis_ms == 66.0  # first start to last end
    assert finding(advice, "data").data["share"] == pytest.approx(60 / 66)
    assert any(n.startswith("no `step` regions") for n in advice.notes)
    assert kinds(advice) == ["data"]
    assert "of recorded time" in finding(advice, "data").evidence


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"regions": 3}, "regions"),
    ({"regions": ["step"]}, "regions"),
    ({"regions": [], "device_memory_bytes": 0}, "device_memory_bytes"),
    ({"regions": [], "device_memory_bytes": 1.5}, "device_memory_bytes"),
    ({"regions": [], "summary": {}}, "summary"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    regions = kwargs.pop("regions")
    with pytest.raises(ValueError, match=name):
        advise(regions, **kwargs)


# -- end to end: a real training loop with a slow dataset -------------------------------------
class SlowDataset(Dataset):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def __len__(self):
        return 32

    def __getitem__(self, i):
        self.clock.advance(4)  # decoding a file, augmenting an image (num_workers=0: this thread)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randint(0, 4, (), generator=g)


def test_real_training_loop_with_slow_data_names_data_loading_first(clock):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDataset(clock), batch_size=8, num_workers=0)
    with capture() as cap:
        batches = iter(loader)
        for i in itertools.count():
            with timed_region("data_wait", category="data", attributes={"perfsdk.batch": i}):
                batch = next(batches, None)
            if batch is None:
                break
            x, y = batch
            with timed_region("step", category="step",
                              attributes={"perfsdk.step": i, "perfsdk.samples": len(x)}):
                with timed_region("forward", category="compute"):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    clock.advance(4)  # what the model's work costs, on the fake clock
                with timed_region("backward", category="compute"):
                    loss.backward()
                with timed_region("optimizer", category="update"):
                    opt.step()
                    opt.zero_grad()
    advice = advise(cap.regions)
    assert advice.steps == 3
    assert advice.warmup_steps == 1
    top = advice.top
    assert top is not None
    assert top.kind == "data"
    assert top.data["batches"] == 4  # three batches and the end of the loader
    assert top.data["data_wait_ms_mean"] == (3 * 8 * 4.0 + 0.0) / 4  # 8 samples a batch
    assert top.data["share"] == pytest.approx(96 / (96 + 3 * 4.0))
    assert str(advice).splitlines()[2].startswith("1. Data loading")
