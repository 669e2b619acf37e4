"""A real ``lightning.Trainer`` on the CPU with ``profiler=PerfsdkProfiler()``: the regions it
records from Lightning's profiler calls (the callback's, plus ``data_wait``), their nesting and
attributes, exceptions that leave no region open, the summary Lightning logs at the end, the
profiler with a PerfsdkCallback on the same Trainer, and ``perfsdk run`` on a script that uses
it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_lightning import BATCHES, TinyModule, children, loader, report_rows
from torch.utils.data import DataLoader, Dataset

import perfsdk
import perfsdk_lightning
from perfsdk.auto import STEPS
from perfsdk.cli.runfile import RunRecorder, load_run
from perfsdk.context import current_span
from perfsdk.instrumentor import FRAMEWORK_STEPS
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult
from perfsdk.region import Region
from perfsdk.testing import Capture, capture
from perfsdk_lightning import PerfsdkCallback, PerfsdkProfiler
from perfsdk_lightning import profiler as profiler_module

PHASES = ["forward", "backward", "optimizer"]


def trainer(max_steps: int, profiler: PerfsdkProfiler | None = None,
            callbacks: list[Any] | None = None, **kwargs: Any) -> L.Trainer:
    kwargs.setdefault("limit_val_batches", 2)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     profiler=PerfsdkProfiler() if profiler is None else profiler,
                     callbacks=callbacks or [], **kwargs)


def fit(module: Any, max_steps: int, **kwargs: Any) -> Capture:
    with capture() as cap:
        trainer(max_steps, **kwargs).fit(module, loader(), loader())
    return cap


def parent(cap: Capture, region: RegionResult) -> RegionResult | None:
    return next((r for r in cap.regions if r.span_id == region.parent_span_id), None)


def assert_balanced() -> None:
    assert not isinstance(current_span(), Region)  # every region closed
    assert STEPS.current is None
    assert not FRAMEWORK_STEPS.active  # `perfsdk run`'s patches are back
    assert not any(isinstance(sink, RunRecorder) for sink in PIPELINE.sinks)  # no report left


def test_regions_counts_nesting_and_attributes() -> None:
    module = TinyModule()
    cap = fit(module, max_steps=6)  # epoch 0: 4 batches, then validation; epoch 1: 2 batches
    steps = cap.named("step")
    assert len(steps) == 6
    for name in PHASES:
        assert len(cap.named(name)) == 6, name
    for step in steps:  # one of each phase per step, nested in it, in order, in its time
        assert children(cap, step) == PHASES
        phases = {r.name: r for r in cap.regions if r.parent_span_id == step.span_id}
        fwd, bwd, opt = (phases[name] for name in PHASES)
        assert step.start_ns <= fwd.start_ns <= fwd.end_ns <= bwd.start_ns <= bwd.end_ns
        assert bwd.end_ns <= opt.start_ns <= opt.end_ns <= step.end_ns
    # the callback's attributes: samples from the DataLoader (the last batch is short)
    assert [s.attributes["perfsdk.samples"] for s in steps] == [*BATCHES, 8, 8]
    assert all(s.attributes["perfsdk.samples_per_s"] > 0 for s in steps)
    assert [s.attributes["perfsdk.batch"] for s in steps] == [0, 1, 2, 3, 0, 1]
    indices = [s.attributes["perfsdk.step"] for s in steps]
    assert indices == list(range(indices[0], indices[0] + 6))

    epochs = cap.named("epoch")
    assert [e.attributes["perfsdk.epoch"] for e in epochs] == [0, 1]
    assert [s.parent_span_id for s in steps] == [epochs[0].span_id] * 4 + [epochs[1].span_id] * 2

    # a data_wait per batch fetched, in the epoch, before its step and outside every step
    waits = cap.named("data_wait")
    assert len(waits) == 6
    assert [w.parent_span_id for w in waits] == [epochs[0].span_id] * 4 + [epochs[1].span_id] * 2
    for wait, step in zip(waits, steps, strict=True):
        assert wait.end_ns <= step.start_ns
        assert not any(s.start_ns < wait.end_ns and wait.start_ns < s.end_ns for s in steps)

    assert module.validation_runs == 2  # Lightning's sanity check, and the run after epoch 0
    [sanity] = cap.named("sanity_check")
    assert sanity.end_ns <= epochs[0].start_ns
    assert sanity.parent_span_id == 0
    [validation] = cap.named("validation")
    assert validation.parent_span_id == epochs[0].span_id
    assert validation.start_ns >= steps[3].end_ns
    assert validation.attributes["perfsdk.epoch"] == 0

    categories = {r.name: r.attributes["perfsdk.category"] for r in cap.regions}
    assert categories == {"step": "step", "forward": "compute", "backward": "compute",
                          "optimizer": "update", "validation": "eval", "sanity_check": "eval",
                          "epoch": "epoch", "data_wait": "data"}
    assert all(r.error is None for r in cap.regions)
    assert len(cap.regions) == 6 * 5 + 2 + 2  # nothing else recorded
    assert_balanced()


def test_the_same_regions_as_the_callback() -> None:
    """Each region the callback records, with the same parent, count and attributes."""
    def shape(cap: Capture) -> list[tuple[str, str, list[tuple[str, Any]]]]:
        keys = ("perfsdk.samples", "perfsdk.batch", "perfsdk.epoch", "perfsdk.category")
        return sorted((r.name, getattr(parent(cap, r), "name", ""),
                       [(k, r.attributes[k]) for k in keys if k in r.attributes])
                      for r in cap.regions if r.name != "data_wait")

    by_profiler = fit(TinyModule(), max_steps=6)
    with capture() as by_callback:
        L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=2,
                  callbacks=[PerfsdkCallback(report=False)]).fit(TinyModule(), loader(), loader())
    assert shape(by_profiler) == shape(by_callback)


def test_framework_steps_held_while_lightning_draws_the_steps() -> None:
    seen: list[bool] = []

    class Watching(TinyModule):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            seen.append(FRAMEWORK_STEPS.active)
            return super().training_step(batch, batch_idx)

    assert not FRAMEWORK_STEPS.active
    fit(Watching(), max_steps=3)
    assert seen == [True] * 3
    assert_balanced()


def test_training_step_that_raises_leaves_no_region_open() -> None:
    module = TinyModule(fail_at=2)
    profiler = PerfsdkProfiler()
    with capture() as cap, pytest.raises(RuntimeError, match="boom") as info:
        trainer(6, profiler).fit(module, loader(), loader())
    assert info.value is module.error  # the user's exception, unchanged
    assert_balanced()
    steps, forwards = cap.named("step"), cap.named("forward")
    assert (len(steps), len(forwards)) == (3, 3)
    assert (len(cap.named("backward")), len(cap.named("optimizer"))) == (2, 2)
    assert [s.error for s in steps] == [None, None, module.error]
    assert [f.error for f in forwards] == [None, None, module.error]
    assert forwards[2].parent_span_id == steps[2].span_id
    [epoch] = cap.named("epoch")
    assert epoch.error is module.error
    assert profiler.summary() == ""  # the traceback is what matters then


class FailingValidation(TinyModule):
    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise ValueError("bad validation")


def test_a_sanity_check_that_raises_leaves_no_region_open() -> None:
    with capture() as cap, pytest.raises(ValueError, match="bad validation"):
        trainer(4, PerfsdkProfiler()).fit(FailingValidation(), loader(), loader())
    assert_balanced()
    [sanity] = cap.named("sanity_check")
    assert isinstance(sanity.error, ValueError)
    assert [r.name for r in cap.regions] == ["sanity_check"]


class FailingData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index >= 8:
            raise OSError("the disk is gone")
        return torch.ones(4), torch.ones(2)


def test_a_data_loader_that_raises_leaves_no_region_open() -> None:
    with capture() as cap, pytest.raises(OSError, match="disk"):
        trainer(4, PerfsdkProfiler(), num_sanity_val_steps=0).fit(
            TinyModule(), DataLoader(FailingData(), batch_size=8), loader())
    assert_balanced()
    waits = cap.named("data_wait")
    assert isinstance(waits[-1].error, OSError)  # Lightning fetches one batch ahead
    assert isinstance(cap.named("epoch")[0].error, OSError)


def test_gradient_accumulation_one_step_per_batch() -> None:
    cap = fit(TinyModule(), max_steps=2, accumulate_grad_batches=2)  # 2 updates: 4 batches
    steps = cap.named("step")
    assert len(steps) == len(cap.named("forward")) == len(cap.named("backward")) == 4
    assert len(cap.named("optimizer")) == 2
    assert [children(cap, s) for s in steps] == [["forward", "backward"], PHASES] * 2


class Manual(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization() -> None:
    """training_step holds the user's backward and optimizer.step(): forward holds the
    optimizer region (Lightning does not profile manual_backward)."""
    cap = fit(Manual(), max_steps=3)
    steps = cap.named("step")
    assert len(steps) == len(cap.named("forward")) == len(cap.named("optimizer")) == 3
    assert cap.named("backward") == []
    for step in steps:
        [forward] = [r for r in cap.named("forward") if r.parent_span_id == step.span_id]
        assert children(cap, forward) == ["optimizer"]


def test_bf16_mixed_and_a_compiled_module() -> None:
    module = TinyModule()
    cap = fit(module, max_steps=2, precision="bf16-mixed")
    assert module.output_dtypes == [torch.bfloat16] * 2
    assert [children(cap, s) for s in cap.named("step")] == [PHASES] * 2
    torch._dynamo.reset()
    module = TinyModule()
    cap = fit(torch.compile(module), max_steps=2)
    assert len(module.output_dtypes) == 2
    assert [children(cap, s) for s in cap.named("step")] == [PHASES] * 2


def test_step_schedule_skips_phases_of_unrecorded_steps() -> None:
    perfsdk.auto.set_schedule(perfsdk.auto.schedule(wait=1, warmup=0, active=1, repeat=1))
    cap = fit(TinyModule(), max_steps=3)  # steps 0 (wait), 1 (active), 2 (done)
    [step] = cap.named("step")
    assert step.attributes["perfsdk.step"] == 1
    assert children(cap, step) == PHASES
    assert len(cap.named("forward")) == 1


def test_options() -> None:
    cap = fit(TinyModule(), max_steps=2, profiler=PerfsdkProfiler(batch_size=3, memory=True))
    assert [s.attributes["perfsdk.samples"] for s in cap.named("step")] == [3, 3]
    assert all(r.memory is not None for r in cap.named("forward"))
    cap = fit(TinyModule(), max_steps=2)
    assert all(r.memory is None for r in cap.named("forward"))


def test_no_samples_without_a_batch_size() -> None:
    sampler = torch.utils.data.BatchSampler(range(16), batch_size=8, drop_last=False)
    data = loader().dataset
    with capture() as cap:
        trainer(2).fit(TinyModule(), DataLoader(data, batch_sampler=sampler), loader())
    assert [("perfsdk.samples" in s.attributes) for s in cap.named("step")] == [False] * 2


def test_all_actions() -> None:
    cap = fit(TinyModule(), max_steps=2, profiler=PerfsdkProfiler(all_actions=True))
    module = "[LightningModule]TinyModule"
    for step in cap.named("step"):  # the hooks nest where Lightning runs them
        assert children(cap, step) == ["forward", f"{module}.on_before_zero_grad",
                                       f"{module}.optimizer_zero_grad", "backward", "optimizer"]
    for backward in cap.named("backward"):
        assert children(cap, backward) == [f"{module}.on_before_backward",
                                           f"{module}.on_after_backward"]
    for optimizer in cap.named("optimizer"):
        assert children(cap, optimizer) == [f"{module}.on_before_optimizer_step",
                                            f"{module}.configure_gradient_clipping"]
    hooks = {r.name for r in cap.regions if r.attributes["perfsdk.category"] == "lightning"}
    assert {f"{module}.on_train_batch_start", f"{module}.configure_optimizers",
            "[Strategy]SingleDeviceStrategy.validation_step",
            "[_EvaluationLoop].val_next"} <= hooks
    for name in ("step", *PHASES, "data_wait"):  # the mapped actions are not recorded twice
        assert len(cap.named(name)) == 2, name
    assert not any(name.endswith((".training_step", ".backward", ".optimizer_step",
                                  "train_dataloader_next")) for name in hooks)
    assert_balanced()


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": True},
                                    {"batch_size": len}, {"memory": "yes"},
                                    {"report": None}, {"all_actions": 1}])
def test_bad_argument_is_named(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"PerfsdkProfiler: {next(iter(kwargs))}="):
        PerfsdkProfiler(**kwargs)


def test_summary_is_perfsdks_report(caplog: pytest.LogCaptureFixture) -> None:
    profiler = PerfsdkProfiler()
    with caplog.at_level("INFO", logger="lightning.pytorch.profilers"):
        fit(TinyModule(), max_steps=6, profiler=profiler)
    text = profiler.summary()
    assert text.startswith("perfsdk: Lightning fit ended after ")
    assert ": 6 optimizer steps, 6 batches recorded, 1 validation run (and the sanity check)" \
        in text
    assert report_rows(text) == {"epoch": 2, "step": 6, "data_wait": 6, "forward": 6,
                                 "backward": 6, "optimizer": 6, "validation": 1,
                                 "sanity_check": 1}
    assert "perfsdk advice" in text
    assert text in caplog.text  # what Lightning logged when fit ended
    assert profiler.summary() == text  # later calls: the same
    assert_balanced()


def test_validate_alone() -> None:
    profiler = PerfsdkProfiler()
    with capture() as cap:
        trainer(2, profiler).validate(TinyModule(), loader(), verbose=False)
    assert [r.name for r in cap.regions] == ["validation"]
    assert profiler.summary().startswith("perfsdk: Lightning validate ended after ")
    assert ": 0 batches recorded, 1 validation run\n" in profiler.summary()
    assert_balanced()


def test_summary_written_to_a_file(tmp_path: Path) -> None:
    fit(TinyModule(), max_steps=2, profiler=PerfsdkProfiler(dirpath=tmp_path, filename="perf"))
    [written] = tmp_path.glob("*perf*.txt")
    assert report_rows(written.read_text())["step"] == 2


def test_each_fit_summarizes_its_own_regions() -> None:
    profiler = PerfsdkProfiler()
    fit(TinyModule(), max_steps=4, profiler=profiler)
    first = profiler.summary()
    fit(TinyModule(), max_steps=2, profiler=profiler)
    assert report_rows(first)["step"] == 4
    assert report_rows(profiler.summary())["step"] == 2


def test_no_summary_with_report_false_or_perfsdk_disabled() -> None:
    profiler = PerfsdkProfiler(report=False)
    cap = fit(TinyModule(), max_steps=2, profiler=profiler)
    assert len(cap.named("step")) == 2  # still recorded
    assert profiler.summary() == ""
    perfsdk.configure(enabled=False)
    profiler = PerfsdkProfiler()
    cap = fit(TinyModule(), max_steps=2, profiler=profiler)
    assert cap.regions == []
    assert profiler.summary() == ""
    assert_balanced()


def test_with_a_callback_the_profiler_steps_aside() -> None:
    profiler, callback = PerfsdkProfiler(), PerfsdkCallback(report=False)
    with pytest.warns(perfsdk.PerfSDKWarning, match="both a PerfsdkProfiler and a "
                                                    "PerfsdkCallback.*the profiler steps aside"):
        cap = fit(TinyModule(), max_steps=6, profiler=profiler, callbacks=[callback])
    counts = {name: len(cap.named(name)) for name in {r.name for r in cap.regions}}
    assert counts == {"epoch": 2, "step": 6, "forward": 6, "backward": 6, "optimizer": 6,
                      "validation": 1, "sanity_check": 1}  # once each: the callback's
    assert [children(cap, s) for s in cap.named("step")] == [PHASES] * 6
    assert profiler.summary() == ""
    assert_balanced()


def test_instrument_gives_no_callback_to_a_trainer_with_the_profiler() -> None:
    perfsdk_lightning.instrument(report=False)
    try:
        t = trainer(3)
        assert not any(isinstance(cb, PerfsdkCallback) for cb in t.callbacks)
        with capture() as cap:
            t.fit(TinyModule(), loader(), loader())
        plain = L.Trainer(logger=False)
        assert any(isinstance(cb, PerfsdkCallback) for cb in plain.callbacks)
    finally:
        perfsdk_lightning.uninstrument()
    assert [children(cap, s) for s in cap.named("step")] == [PHASES] * 3


# -- start and stop by hand: what Lightning may call out of order ----------------------------
def test_action_kinds() -> None:
    kind = profiler_module.action_kind
    assert kind("run_training_epoch") == profiler_module.EPOCH
    assert kind("run_training_batch") == profiler_module.STEP
    assert kind("[Strategy]DDPStrategy.training_step") == profiler_module.FORWARD
    assert kind("[Strategy]FSDPStrategy.backward") == profiler_module.BACKWARD
    assert kind("[LightningModule]Net.optimizer_step") == profiler_module.CLOSURE
    assert kind("optimizer_step") == profiler_module.OPTIMIZER
    assert kind("[_TrainingEpochLoop].train_dataloader_next") == profiler_module.DATA
    assert kind("[Strategy]X.on_validation_start") == profiler_module.VALIDATION_START
    assert kind("[Strategy]X.on_validation_end") == profiler_module.VALIDATION_END
    for other in ("[LightningModule]Net.training_step", "[Callback]X{'a': 1.5}.on_fit_start",
                  "[_EvaluationLoop].val_next", "save_checkpoint", "[Strategy]X.test_step",
                  "my block"):
        assert kind(other) == profiler_module.OTHER, other


def test_by_hand_without_a_trainer() -> None:
    """A stop that never came (manual optimization's optimizer.step() raised), a stop without
    a start, an end of validation that never started: the regions still close in order."""
    profiler = PerfsdkProfiler(all_actions=True)
    with capture() as cap, profiler.profile("run_training_epoch"):
        profiler.stop("[Strategy]S.on_validation_end")  # no validation open: nothing
        with profiler.profile("run_training_batch"):
            with profiler.profile("[Strategy]S.training_step"):
                profiler.start("optimizer_step")  # its stop never comes
            profiler.stop("[Strategy]S.backward")  # never started: nothing
        with profiler.profile("my block"):
            pass
    assert not isinstance(current_span(), Region)
    assert STEPS.current is None
    names = sorted(r.name for r in cap.regions)
    assert names == ["epoch", "forward", "my block", "optimizer", "step"]
    [forward], [optimizer] = cap.named("forward"), cap.named("optimizer")
    assert optimizer.parent_span_id == forward.span_id
    assert optimizer.end_ns <= forward.end_ns
    assert cap.named("epoch")[0].attributes["perfsdk.epoch"] == 0


def test_an_exception_in_an_unrecorded_action_ends_validation() -> None:
    profiler = PerfsdkProfiler()
    def validation_step() -> None:
        with profiler.profile("[Strategy]S.validation_step"):
            raise KeyError("x")

    with capture() as cap:
        profiler.start("[Strategy]S.on_validation_start")
        profiler.stop("[Strategy]S.on_validation_start")
        with pytest.raises(KeyError):
            validation_step()
    assert not isinstance(current_span(), Region)
    [validation] = cap.regions
    assert validation.name == "validation"
    assert isinstance(validation.error, KeyError)


def test_a_failure_inside_the_profiler_warns_and_training_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, index: int) -> int:
        raise ZeroDivisionError("bad batch size")

    monkeypatch.setattr(PerfsdkProfiler, "_samples", broken)
    t = trainer(2)
    with capture() as cap, pytest.warns(perfsdk.PerfSDKWarning, match="ZeroDivisionError"):
        t.fit(TinyModule(), loader(), loader())
    assert t.global_step == 2
    assert cap.named("step") == []
    assert len(cap.named("forward")) == 2
    assert not isinstance(current_span(), Region)


# -- perfsdk run ------------------------------------------------------------------------------
SCRIPT = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from perfsdk_lightning import PerfsdkProfiler


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(28, 4, generator=g), torch.randn(28, 2, generator=g))
    return DataLoader(data, batch_size=8)


trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=2,
                    profiler=PerfsdkProfiler(report=False))
trainer.fit(Tiny(), loader(), loader())
print("callbacks:", sorted(type(cb).__name__ for cb in trainer.callbacks))
print("optimizer steps:", trainer.global_step)
"""


def test_perfsdk_run_counts_each_phase_once(tmp_path: Path) -> None:
    """Under ``perfsdk run`` the Trainer with the profiler gets no callback, and the run's
    patches step aside while the profiler draws the steps: each phase once, in its step."""
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    proc = subprocess.run([sys.executable, "-m", "perfsdk.cli", "run", "--output-dir",
                           str(tmp_path / "out"), str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "optimizer steps: 6" in proc.stdout
    assert "PerfsdkCallback" not in proc.stdout.split("callbacks:")[1].splitlines()[0]
    run = load_run(tmp_path / "out")
    names = [r.name for r in run.regions]
    counts = {name: names.count(name) for name in set(names)}
    waits = counts.pop("data_wait")
    assert counts == {"epoch": 2, "step": 6, "forward": 6, "backward": 6, "optimizer": 6,
                      "validation": 1, "sanity_check": 1, "Tiny.forward": 10}
    assert waits >= 6
    by_id = {r.span_id: r for r in run.regions}
    for region in run.regions:
        if region.name in PHASES:
            assert by_id[region.parent_span_id].name == "step", region.name
