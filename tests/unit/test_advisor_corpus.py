"""The advisor against a corpus of loops whose bottleneck is known: for each, the top finding is
that bottleneck and no other finding is claimed.

The loops are real training loops on the CPU (a dataset that sleeps far longer than its tiny
model computes; an ``.item()`` in every step; a model whose forward and backward are nearly the
whole step), memory pressure on the fake GPU (with a fake clock, so the kernels keep the GPU as
busy as the host: no launch overhead), and the advisor's two old false claims: a summary that
still holds an earlier run's syncs given with a sync-free loop, and syncs outside the steps
divided by the number of steps. The margins are wide (10x and more) so that a busy machine
cannot change the answer; nothing here asserts a duration.

Memory creep: a real CPU loop that keeps every step's output (with its autograd graph), whose
RSS really grows, and the same loop keeping nothing (flat) or filling a cache once (one jump),
neither of which is a finding; on the fake GPU, a region that keeps 8 MiB a step beside a
forward and backward that allocate and free 256 MiB (the slope is exact, and the region named),
and a workspace allocated once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import perfsdk
import perfsdk.optimize
from perfsdk.advisor import KINDS, Advice, advise
from perfsdk.record import RegionResult
from perfsdk.testing import FakeCuda, capture, use_fake_clock

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop with a known bottleneck: ``run()`` gives its regions and advise()'s keywords."""

    top: str | None
    run: Callable[[], tuple[list[RegionResult], dict[str, Any]]]
    check: Callable[[Advice], None] = lambda advice: None

    @property
    def id(self) -> str:
        return self.run.__name__.lstrip("_")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _heavy_model() -> nn.Module:
    """A model whose forward and backward take milliseconds: far more than the rest of a step."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())))


def _compute_steps(model: nn.Module, steps: int, body: Callable[[int], None] | None = None
                   ) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512)
    for i in range(steps):
        with perfsdk.step(samples=len(x)):
            with perfsdk.timed_region("forward", category="compute"):
                loss = model(x).square().mean()
            with perfsdk.timed_region("backward", category="compute"):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if body is not None:
                body(i)


# -- data-bound: a dataset that sleeps 5 ms a sample, a model that computes in microseconds -------
class SleepyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.005)  # reading and decoding a file
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randint(0, 4, (), generator=g)


def _data_bound() -> tuple[list[RegionResult], dict[str, Any]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SleepyDataset(), batch_size=4)  # 20 ms a batch, on this thread
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for x, y in perfsdk.instrument_dataloader(loader):
            with perfsdk.step(samples=len(x)):
                with perfsdk.timed_region("forward", category="compute"):
                    loss = nn.functional.cross_entropy(model(x), y)
                with perfsdk.timed_region("backward", category="compute"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
    return cap.regions, {}


def _data_checks(advice: Advice) -> None:
    assert advice.top is not None
    assert advice.top.data["share"] > 0.5
    assert advice.top.fix.startswith("tuning = perfsdk.optimize.tune_dataloader(")


# -- sync-bound: .item() in every step ------------------------------------------------------------
def _sync_bound() -> tuple[list[RegionResult], dict[str, Any]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    total = 0.0
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for x, y in batches:  # already in memory: no data wait to speak of
            with perfsdk.step(samples=len(x)):
                with perfsdk.timed_region("forward", category="compute"):
                    loss = nn.functional.cross_entropy(model(x), y)
                with perfsdk.timed_region("backward", category="compute"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
                total += loss.item()  # a host-device sync on every step
    return cap.regions, {"summary": perfsdk.summary(show=False)}


def _sync_checks(advice: Advice) -> None:
    assert advice.top is not None
    assert advice.top.data["syncs_per_step"] == 1.0
    assert advice.top.data["outside_steps"] == 0
    [site] = advice.top.data["sites"]
    assert (site["op"], site["count"]) == ("item", 6)
    assert site["where"].endswith(f"test_advisor_corpus.py:{_line('total += loss.item()')}")


def _line(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(_sync_bound)
    return next(start + i for i, line in enumerate(lines) if text in line)


# -- compute-bound: forward and backward are nearly the whole step --------------------------------
def _compute_bound() -> tuple[list[RegionResult], dict[str, Any]]:
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        _compute_steps(_heavy_model(), 5)
    return cap.regions, {}


def _compute_checks(advice: Advice) -> None:
    assert advice.top is not None
    assert advice.top.data["share"] > 0.5
    assert advice.top.already_on == ()
    assert any(n.startswith("host-device syncs: none recorded") for n in advice.notes)


# -- memory pressure on the fake GPU --------------------------------------------------------------
def _memory_pressure() -> tuple[list[RegionResult], dict[str, Any]]:
    fake = FakeCuda()
    with perfsdk.testing.use_fake_cuda(fake), use_fake_clock() as clock, capture() as cap:
        for i in range(5):
            with perfsdk.step(), perfsdk.timed_region("train", memory=True):
                fake.alloc(960 * MiB)  # activations kept for backward
                fake.launch(40.0)  # the GPU is busy as long as the host: no launch overhead
                clock.advance(40)
                fake.advance(40.0)
                fake.free(960 * MiB)
            fake.complete_all()
            assert i >= 0
    return cap.regions, {"device_memory_bytes": 1000 * MiB}


def _memory_checks(advice: Advice) -> None:
    assert advice.top is not None
    assert advice.top.data["fraction"] == pytest.approx(0.96, abs=0.01)
    assert advice.top.fix == "model = perfsdk.optimize.apply_checkpointing(model, segments=2)"


# -- memory creep ---------------------------------------------------------------------------------
def _cpu_loop(keep: Callable[[int, torch.Tensor], None]) -> tuple[list[RegionResult],
                                                                  dict[str, Any]]:
    """49 real steps of a linear layer on 3072 x 256 inputs (3 MiB, saved for backward, and a
    3 MiB output); ``keep(i, out)`` decides what each step keeps. With memory on, each step
    records the RSS at its end as ``perfsdk.memory.rss_bytes`` (the peak RSS only grows past the
    test process's earlier high-water mark)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    perfsdk.configure(memory=True)
    with capture() as cap:
        for i in range(49):
            with perfsdk.step(samples=3072):
                keep(i, model(torch.randn(3072, 256)))
    return cap.regions, {}


def _leak_on_the_cpu() -> tuple[list[RegionResult], dict[str, Any]]:
    outputs: list[torch.Tensor] = []
    run = _cpu_loop(lambda i, out: outputs.append(out))  # each output and its graph: 6 MiB
    assert len(outputs) == 49
    return run


def _cpu_leak_checks(advice: Advice) -> None:
    assert advice.top is not None
    data = advice.top.data
    assert data["source"] == "rss"
    assert data["steps"] == 48  # after the warm-up step
    assert 3 * MiB < data["slope_bytes_per_step"] < 12 * MiB  # 6 MiB kept a step
    assert data["region"] == "step"
    assert advice.top.fix.startswith("# keep numbers, not tensors")
    assert "/step over 48 steps" in advice.top.evidence
    assert "per 1,000 steps" in advice.top.evidence


def _flat_on_the_cpu() -> tuple[list[RegionResult], dict[str, Any]]:
    return _cpu_loop(lambda i, out: None)  # allocates and frees 6 MiB a step


def _one_jump_on_the_cpu() -> tuple[list[RegionResult], dict[str, Any]]:
    cache: list[torch.Tensor] = []

    def fill_once(i: int, out: torch.Tensor) -> None:
        if i == 25:
            cache.append(torch.ones(64 * MiB))  # a 256 MiB cache (float32), filled once
    return _cpu_loop(fill_once)


def _creep_checked(advice: Advice) -> None:
    assert not any(n.startswith("memory creep not checked") for n in advice.notes)


def _gpu_loop(step_body: Callable[[FakeCuda, int], None]
              ) -> tuple[list[RegionResult], dict[str, Any]]:
    fake = FakeCuda()
    perfsdk.configure(memory=True)
    with perfsdk.testing.use_fake_cuda(fake), use_fake_clock() as clock, capture() as cap:
        fake.alloc(512 * MiB)  # the model and its optimizer state
        for i in range(41):
            with perfsdk.step():
                with perfsdk.timed_region("model"):
                    fake.alloc(256 * MiB)  # activations kept for backward
                with perfsdk.timed_region("grad"):
                    fake.free(256 * MiB)
                step_body(fake, i)
                fake.launch(5.0)  # the GPU is busy as long as the host: no launch overhead
                clock.advance(5)
                fake.advance(5.0)
            fake.complete_all()
    return cap.regions, {"device_memory_bytes": 16 * 2**30}


def _leak_on_the_gpu() -> tuple[list[RegionResult], dict[str, Any]]:
    def keep(fake: FakeCuda, i: int) -> None:
        with perfsdk.timed_region("metrics"):
            fake.alloc(8 * MiB)  # logits kept for an epoch-end metric, never freed
    return _gpu_loop(keep)


def _gpu_leak_checks(advice: Advice) -> None:
    assert advice.top is not None
    data = advice.top.data
    assert data["source"] == "cuda"
    assert data["slope_bytes_per_step"] == 8 * MiB
    assert data["growth_per_1000_steps_bytes"] == 8000 * MiB
    assert (data["first_step"], data["last_step"], data["steps"]) == (1, 40, 40)
    assert data["end_bytes"] == 512 * MiB + 256 * MiB + 40 * 8 * MiB  # step 40's peak: the
    # model and its state, the activations, 40 steps' metrics
    assert data["region"] == "metrics"
    assert data["region_slope_bytes_per_step"] == 8 * MiB
    assert data["steps_to_capacity"] == (16 * 2**30 - data["end_bytes"]) // (8 * MiB)
    assert advice.top.fix == "perfsdk.configure(memory_snapshots=True)"
    assert "rises 8 MiB/step over 40 steps" in advice.top.evidence
    assert "+7.81 GiB per 1,000 steps; grows in `metrics` (8 MiB/step there)" \
        in advice.top.evidence
    assert "memory creep" not in " ".join(advice.notes)


def _workspace_once_on_the_gpu() -> tuple[list[RegionResult], dict[str, Any]]:
    def workspace(fake: FakeCuda, i: int) -> None:
        if i == 20:
            fake.alloc(1024 * MiB)  # a workspace allocated once and kept
    return _gpu_loop(workspace)


# -- an earlier run's syncs in the summary, a sync-free loop now ----------------------------------
def _earlier_syncs_in_the_summary() -> tuple[list[RegionResult], dict[str, Any]]:
    with perfsdk.no_sync_guard("count", assume_device=True):
        _sync_bound()  # syncs in its steps
        for _ in range(4):
            torch.ones(3).sum().item()  # and outside any region
        with capture() as cap:
            _compute_steps(_heavy_model(), 5)  # this run: no sync at all
    summary = perfsdk.summary(show=False)
    assert sum(s.count for s in summary.sync_sites) == 10  # the process has seen them
    return cap.regions, {"summary": summary}


def _no_sync_claimed(advice: Advice) -> None:
    assert any(n.startswith("host-device syncs: none recorded in this run") for n in advice.notes)
    assert "item" not in str(advice)


# -- six sync-free steps, then syncs outside the steps -------------------------------------------
def _syncs_outside_the_steps() -> tuple[list[RegionResult], dict[str, Any]]:
    model = _heavy_model()
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        _compute_steps(model, 6)
        with perfsdk.timed_region("evaluate"), torch.no_grad():
            for _ in range(3):
                model(torch.randn(8, 512)).mean().item()  # read once per evaluation batch
    return cap.regions, {"summary": perfsdk.summary(show=False)}


def _outside_checks(advice: Advice) -> None:
    [note] = [n for n in advice.notes if "outside the steps" in n]
    assert note.startswith("host-device syncs outside the steps: 3 at ")
    assert "per step (3 in 5 steps)" not in str(advice)


# -- autocast already on (TrainStep(amp="bf16")), compute-bound -----------------------------------
def _autocast_already_on() -> tuple[list[RegionResult], dict[str, Any]]:
    model = _heavy_model()
    step = perfsdk.optimize.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                      nn.functional.mse_loss, amp="bf16")
    x, y = torch.randn(64, 512), torch.zeros(64, 512)
    with perfsdk.no_sync_guard("count", assume_device=True), capture() as cap:
        for _ in range(5):
            with perfsdk.step(samples=len(x)):
                step(x, target=y)
    return cap.regions, {"summary": perfsdk.summary(show=False)}


def _already_on_checks(advice: Advice) -> None:
    assert advice.top is not None
    assert advice.top.already_on == ("autocast (bfloat16)",)
    assert not any("apply_amp" in line or "amp=" in line
                   for line in (advice.top.fix, *advice.top.details))
    assert "already   on in this run, so not recommended again: autocast (bfloat16)" \
        in str(advice)


CORPUS = [
    Loop("data", _data_bound, _data_checks),
    Loop("sync", _sync_bound, _sync_checks),
    Loop("compute", _compute_bound, _compute_checks),
    Loop("memory", _memory_pressure, _memory_checks),
    Loop("compute", _earlier_syncs_in_the_summary, _no_sync_claimed),
    Loop("compute", _syncs_outside_the_steps, _outside_checks),
    Loop("compute", _autocast_already_on, _already_on_checks),
    Loop("memory_creep", _leak_on_the_cpu, _cpu_leak_checks),
    Loop(None, _flat_on_the_cpu, _creep_checked),
    Loop(None, _one_jump_on_the_cpu, _creep_checked),
    Loop("memory_creep", _leak_on_the_gpu, _gpu_leak_checks),
    Loop(None, _workspace_once_on_the_gpu, _creep_checked),
]


@pytest.mark.parametrize("loop", CORPUS, ids=[c.id for c in CORPUS])
def test_the_top_finding_is_the_known_bottleneck_and_nothing_else_is_claimed(loop: Loop) -> None:
    regions, options = loop.run()
    advice = advise(regions, **options)
    assert [f.kind for f in advice.findings] == ([] if loop.top is None else [loop.top]), \
        str(advice)
    assert set(KINDS) - {loop.top} == {k for k in KINDS if k not in
                                       {f.kind for f in advice.findings}}
    loop.check(advice)
