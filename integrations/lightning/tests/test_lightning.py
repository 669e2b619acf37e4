"""A real ``lightning.Trainer`` on the CPU (a tiny LightningModule, a few steps) with
:class:`PerfsdkCallback`: the regions it produces, their nesting and attributes, what happens when
``training_step`` raises, runs under ``bf16-mixed`` and with a ``torch.compile``d module, and the
summary and advice it prints when ``fit`` ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import perfsdk
import perfsdk_lightning
from perfsdk.auto import STEPS
from perfsdk.cli.runfile import RunRecorder
from perfsdk.context import current_span
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult
from perfsdk.region import Region
from perfsdk.testing import Capture, capture
from perfsdk_lightning import PerfsdkCallback

BATCHES = [8, 8, 8, 4]  # 28 samples in batches of 8: the last batch is short


class TinyModule(L.LightningModule):
    """A Linear layer on random tensors; ``fail_at`` makes that batch's training_step raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fail_at = fail_at
        self.error: RuntimeError | None = None
        self.output_dtypes: list[torch.dtype] = []
        self.validation_runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            self.error = RuntimeError("boom in training_step")
            raise self.error
        x, y = batch
        out = self(x)
        self.output_dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).float(), y)

    def on_validation_start(self) -> None:
        self.validation_runs += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    n = sum(BATCHES)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))
    return DataLoader(data, batch_size=BATCHES[0])


def trainer(max_steps: int, callbacks: list[Any] | None = None, **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=2,
                     callbacks=[PerfsdkCallback()] if callbacks is None else callbacks, **kwargs)


def fit(module: Any, max_steps: int, **kwargs: Any) -> Capture:
    with capture() as cap:
        trainer(max_steps, **kwargs).fit(module, loader(), loader())
    return cap


def children(cap: Capture, parent: RegionResult) -> list[str]:
    """Names of ``parent``'s child regions, in the order they started."""
    found = [r for r in cap.regions if r.parent_span_id == parent.span_id and r is not parent]
    return [r.name for r in sorted(found, key=lambda r: r.start_ns)]


def assert_steps_have_phases(cap: Capture, n: int) -> None:
    steps = cap.named("step")
    assert len(steps) == n
    for name in ("forward", "backward", "optimizer"):
        assert len(cap.named(name)) == n, name
    for step in steps:  # one of each phase per step, nested in it, in order
        assert children(cap, step) == ["forward", "backward", "optimizer"]


def test_regions_counts_nesting_and_attributes() -> None:
    module = TinyModule()
    cap = fit(module, max_steps=6)  # epoch 0: 4 batches, then validation; epoch 1: 2 batches
    assert_steps_have_phases(cap, 6)
    steps = cap.named("step")
    assert [s.attributes["perfsdk.samples"] for s in steps] == [*BATCHES, 8, 8]
    assert all(s.attributes["perfsdk.samples_per_s"] > 0 for s in steps)
    assert [s.attributes["perfsdk.batch"] for s in steps] == [0, 1, 2, 3, 0, 1]
    indices = [s.attributes["perfsdk.step"] for s in steps]
    assert indices == list(range(indices[0], indices[0] + 6))

    for step in steps:  # phases in order, inside their step's time
        phases = {r.name: r for r in cap.regions if r.parent_span_id == step.span_id}
        fwd, bwd, opt = phases["forward"], phases["backward"], phases["optimizer"]
        assert step.start_ns <= fwd.start_ns <= fwd.end_ns <= bwd.start_ns <= bwd.end_ns
        assert bwd.end_ns <= opt.start_ns <= opt.end_ns <= step.end_ns

    epochs = cap.named("epoch")
    assert [e.attributes["perfsdk.epoch"] for e in epochs] == [0, 1]
    assert [s.parent_span_id for s in steps] == [epochs[0].span_id] * 4 + [epochs[1].span_id] * 2

    assert module.validation_runs == 2  # Lightning's sanity check, and the run after epoch 0
    [sanity] = cap.named("sanity_check")  # a region of its own, before training ...
    assert sanity.end_ns <= epochs[0].start_ns
    [validation] = cap.named("validation")  # ... so that validation counts the real run alone
    assert validation.parent_span_id == epochs[0].span_id
    assert validation.attributes["perfsdk.epoch"] == 0

    categories = {r.name: r.attributes["perfsdk.category"] for r in cap.regions}
    assert categories == {"step": "step", "forward": "compute", "backward": "compute",
                          "optimizer": "update", "validation": "eval", "sanity_check": "eval",
                          "epoch": "epoch"}
    assert all(r.error is None for r in cap.regions)
    assert len(cap.regions) == 6 * 4 + 2 + 2  # nothing else recorded
    assert not isinstance(current_span(), Region)
    assert STEPS.current is None


class Traced(TinyModule):
    """A training_step with a region of the user's own inside."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        with perfsdk.timed_region("user"):
            return super().training_step(batch, batch_idx)


def test_a_region_inside_training_step_nests_in_the_forward_phase() -> None:
    """The phases ride on their step's region (perfsdk.phase): what the user's code records
    inside one is still that phase's child."""
    cap = fit(Traced(), max_steps=3)
    assert_steps_have_phases(cap, 3)
    users, forwards = cap.named("user"), cap.named("forward")
    assert len(users) == 3
    assert [u.parent_span_id for u in users] == [f.span_id for f in forwards]
    assert all(f.start_ns <= u.start_ns <= u.end_ns <= f.end_ns
               for u, f in zip(users, forwards, strict=True))


def test_training_step_that_raises_leaves_regions_balanced() -> None:
    module = TinyModule(fail_at=2)
    with capture() as cap, pytest.raises(RuntimeError, match="boom") as info:
        trainer(max_steps=6).fit(module, loader(), loader())
    assert info.value is module.error  # the user's exception, unchanged
    assert not isinstance(current_span(), Region)  # every region closed
    assert STEPS.current is None

    steps, forwards = cap.named("step"), cap.named("forward")
    assert (len(steps), len(forwards)) == (3, 3)
    assert (len(cap.named("backward")), len(cap.named("optimizer"))) == (2, 2)
    assert [s.error for s in steps] == [None, None, module.error]
    assert [f.error for f in forwards] == [None, None, module.error]
    assert forwards[2].parent_span_id == steps[2].span_id
    [epoch] = cap.named("epoch")
    assert epoch.error is module.error
    assert steps[2].parent_span_id == epoch.span_id


def test_bf16_mixed() -> None:
    module = TinyModule()
    cap = fit(module, max_steps=3, precision="bf16-mixed")
    assert module.output_dtypes == [torch.bfloat16] * 3  # Lightning's autocast was on
    assert_steps_have_phases(cap, 3)


def test_compiled_module() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    module = TinyModule()
    cap = fit(torch.compile(module), max_steps=3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert len(module.output_dtypes) == 3
    assert_steps_have_phases(cap, 3)
    assert len(cap.named("epoch")) == 1


def test_gradient_accumulation_one_step_per_batch() -> None:
    cap = fit(TinyModule(), max_steps=2, accumulate_grad_batches=2)  # 2 updates: 4 batches
    steps = cap.named("step")
    assert len(steps) == len(cap.named("forward")) == len(cap.named("backward")) == 4
    assert [children(cap, s) for s in steps] == [["forward", "backward"],
                                                 ["forward", "backward", "optimizer"]] * 2


def test_step_schedule_skips_phases_of_unrecorded_steps() -> None:
    perfsdk.auto.set_schedule(perfsdk.auto.schedule(wait=1, warmup=0, active=1, repeat=1))
    cap = fit(TinyModule(), max_steps=3)  # steps 0 (wait), 1 (active), 2 (done)
    [step] = cap.named("step")
    assert step.attributes["perfsdk.step"] == 1
    assert_steps_have_phases(cap, 1)


def test_memory_option() -> None:
    cap = fit(TinyModule(), max_steps=2, callbacks=[PerfsdkCallback(memory=True)])
    assert all(r.memory is not None for r in cap.named("forward"))
    cap = fit(TinyModule(), max_steps=2)  # default: perfsdk's configured memory (off)
    assert all(r.memory is None for r in cap.named("forward"))


@pytest.mark.parametrize(("batch_size", "samples"), [
    (3, [3, 3]), (lambda batch: 2 * len(batch[0]), [16, 16]),
])
def test_batch_size_option(batch_size: int | Callable[[Any], int], samples: list[int]) -> None:
    cap = fit(TinyModule(), max_steps=2, callbacks=[PerfsdkCallback(batch_size=batch_size)])
    assert [s.attributes["perfsdk.samples"] for s in cap.named("step")] == samples


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": True},
                                    {"batch_size": "8"}, {"memory": "yes"}, {"report": "yes"},
                                    {"report": None}])
def test_bad_argument_is_named(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}="):
        PerfsdkCallback(**kwargs)


def test_a_failure_inside_the_callback_warns_and_training_goes_on() -> None:
    def broken(batch: Any) -> int:
        raise ZeroDivisionError("bad batch size")

    t = trainer(max_steps=2, callbacks=[PerfsdkCallback(batch_size=broken)])
    with capture() as cap, pytest.warns(perfsdk.PerfSDKWarning, match="ZeroDivisionError"):
        t.fit(TinyModule(), loader(), loader())
    assert t.global_step == 2
    assert cap.named("step") == []
    assert len(cap.named("epoch")) == 1


def test_disabled_records_nothing_and_trains() -> None:
    perfsdk.configure(enabled=False)
    module = TinyModule()
    with capture() as cap:
        t = trainer(max_steps=3)
        t.fit(module, loader(), loader())
    assert t.global_step == 3
    assert cap.regions == []


def test_instrument_adds_one_callback_per_trainer() -> None:
    perfsdk_lightning.instrument()
    try:
        perfsdk_lightning.instrument()  # idempotent
        with capture() as cap:
            t = trainer(max_steps=2, callbacks=[])
            t.fit(TinyModule(), loader(), loader())
        assert sum(isinstance(cb, PerfsdkCallback) for cb in t.callbacks) == 1
        assert_steps_have_phases(cap, 2)
        own = PerfsdkCallback(memory=True)
        t = trainer(max_steps=2, callbacks=[own])  # keeps its own
        assert [cb for cb in t.callbacks if isinstance(cb, PerfsdkCallback)] == [own]
    finally:
        perfsdk_lightning.uninstrument()
    perfsdk_lightning.uninstrument()  # idempotent
    t = trainer(max_steps=2, callbacks=[])
    assert not any(isinstance(cb, PerfsdkCallback) for cb in t.callbacks)


def test_span_ids_unique_across_sanity_check() -> None:
    cap = fit(TinyModule(), max_steps=2)
    ids = [r.span_id for r in cap.regions]
    assert len(set(ids)) == len(ids)


def report_rows(text: str) -> dict[str, int]:
    """Region name -> calls, from the summary table printed in ``text``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("region "))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        name, calls = line.split()[:2]
        rows[name] = int(calls)
    return rows


def test_fit_ends_with_the_summary_and_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    fit(TinyModule(), max_steps=6)
    out = capsys.readouterr().out
    assert "perfsdk: Lightning fit ended after " in out
    assert ": 6 optimizer steps, 6 batches recorded, 1 validation run (and the sanity check)" in out
    assert report_rows(out) == {"epoch": 2, "step": 6, "forward": 6, "backward": 6,
                                "optimizer": 6, "validation": 1, "sanity_check": 1}
    assert "perfsdk advice" in out
    assert out.index("region ") < out.index("perfsdk advice")


def test_each_fit_reports_its_own_regions(capsys: pytest.CaptureFixture[str]) -> None:
    callback = PerfsdkCallback()
    fit(TinyModule(), max_steps=4, callbacks=[callback])
    first = capsys.readouterr().out
    fit(TinyModule(), max_steps=2, callbacks=[callback])
    second = capsys.readouterr().out
    assert report_rows(first)["step"] == 4
    assert report_rows(second)["step"] == 2  # not 6: the summary is of this fit alone


def test_report_false_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    cap = fit(TinyModule(), max_steps=3, callbacks=[PerfsdkCallback(report=False)])
    assert_steps_have_phases(cap, 3)  # still recorded
    assert capsys.readouterr().out == ""
    perfsdk_lightning.instrument(report=False)
    try:
        fit(TinyModule(), max_steps=2, callbacks=[])
    finally:
        perfsdk_lightning.uninstrument()
    assert capsys.readouterr().out == ""


def test_no_report_when_fit_raises_or_perfsdk_is_disabled(
        capsys: pytest.CaptureFixture[str]) -> None:
    callback = PerfsdkCallback()
    with pytest.raises(RuntimeError, match="boom"):
        trainer(max_steps=6, callbacks=[callback]).fit(TinyModule(fail_at=2), loader(), loader())
    assert capsys.readouterr().out == ""  # the user's traceback is what matters then
    assert not any(isinstance(sink, RunRecorder) for sink in PIPELINE.sinks)  # none left
    perfsdk.configure(enabled=False)
    fit(TinyModule(), max_steps=2, callbacks=[callback])
    assert capsys.readouterr().out == ""
    perfsdk.configure(enabled=True)
    fit(TinyModule(), max_steps=2, callbacks=[callback])  # the same callback reports again
    assert report_rows(capsys.readouterr().out)["step"] == 2
