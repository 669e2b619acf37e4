"""The advisor: each rule on a run that has its bottleneck and on one that does not, produced
for real with regions whose host times come from a fake clock the test advances where a sleep
would stand for the work (so every share is exact on any machine; device times and memory
through the fake GPU; NVML readings, which only a real GPU gives, on constructed records), plus
ordering, text, JSON, missing data and a real training loop with a slow dataset."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from types import MappingProxyType

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import perfsdk
from perfsdk import advisor, timed_region
from perfsdk._syncops import OPS
from perfsdk.advisor import Advice, Finding, advise
from perfsdk.record import RegionResult
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
    assert "1.0 per step (3 in 3 steps) at 1 call site" == sync.evidence


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
