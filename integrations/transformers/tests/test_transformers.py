"""perfsdk-transformers with a real ``transformers.Trainer`` on the CPU: a tiny BERT built from
a config (random weights, nothing downloaded; conftest.py sets ``HF_HUB_OFFLINE=1`` and
``TRANSFORMERS_OFFLINE=1``), an in-memory dataset, a few steps, regions captured in memory, and
the summary and advice the callback prints when training ends."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
import torch
import transformers
from opentelemetry import trace
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

import perfsdk
import perfsdk_transformers
from perfsdk.cli.runfile import RunRecorder
from perfsdk.pipeline import PIPELINE
from perfsdk.region import Region
from perfsdk.testing import Capture, capture
from perfsdk_transformers import PerfsdkCallback
from perfsdk_transformers import callback as callback_module


def _dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 50, (6,), generator=g), "labels": torch.tensor(i % 2)}
            for i in range(n)]


def _model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16))


def _trainer(tmp_path, *, n: int = 4, callbacks=None, model=None, eval_n: int = 0,
             optimizer=None, **overrides) -> Trainer:
    kwargs = {"output_dir": str(tmp_path), "max_steps": 4, "per_device_train_batch_size": 2,
              "report_to": [], "save_strategy": "no", "logging_strategy": "no",
              "use_cpu": True, "disable_tqdm": True, "dataloader_num_workers": 0, "seed": 0}
    kwargs.update(overrides)
    model = model or _model()
    optimizers = (None, None) if optimizer is None else (optimizer(model), None)
    return Trainer(model=model, args=TrainingArguments(**kwargs),
                   train_dataset=_dataset(n), eval_dataset=_dataset(eval_n) if eval_n else None,
                   callbacks=callbacks, optimizers=optimizers)


def _counts(cap: Capture) -> dict[str, int]:
    names = [r.name for r in cap.regions]
    return {name: names.count(name) for name in sorted(set(names))}


def _by_span(cap: Capture) -> dict[int, object]:
    return {r.span_id: r for r in cap.regions}


def _inside(inner, outer) -> bool:
    return outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns


def test_steps_optimizer_and_epochs(tmp_path):
    # 4 samples, batch 2: 2 steps per epoch, so max_steps=4 is 2 epochs.
    trainer = _trainer(tmp_path, callbacks=[PerfsdkCallback()])
    with capture() as cap:
        trainer.train()
    assert trainer.state.global_step == 4
    assert _counts(cap) == {"epoch": 2, "microbatch": 4, "optimizer": 4, "step": 4}

    spans = _by_span(cap)
    epochs = sorted(cap.named("epoch"), key=lambda r: r.start_ns)
    assert [e.attributes["perfsdk.epoch"] for e in epochs] == [0, 1]
    assert all(e.attributes["perfsdk.category"] == "epoch" for e in epochs)
    steps = sorted(cap.named("step"), key=lambda r: r.start_ns)
    first = steps[0].attributes["perfsdk.step"]
    assert [s.attributes["perfsdk.step"] for s in steps] == list(range(first, first + 4))
    for step, epoch in zip(steps, [epochs[0]] * 2 + [epochs[1]] * 2, strict=True):
        assert step.parent_span_id == epoch.span_id
        assert _inside(step, epoch)
        assert step.attributes["perfsdk.category"] == "step"
        assert step.attributes["perfsdk.samples"] == 2  # per-device batch 2 x accumulation 1
        assert step.attributes["perfsdk.samples_per_s"] > 0
    for name, category in (("optimizer", "update"), ("microbatch", "compute")):
        for region in cap.named(name):
            parent = spans[region.parent_span_id]
            assert parent.name == "step"
            assert _inside(region, parent)
            assert region.attributes["perfsdk.category"] == category
    # each step: its micro-batch, then its optimizer step
    for step in steps:
        (micro,) = [r for r in cap.named("microbatch") if r.parent_span_id == step.span_id]
        (opt,) = [r for r in cap.named("optimizer") if r.parent_span_id == step.span_id]
        assert micro.end_ns <= opt.start_ns
    # balanced: nothing of ours is left as the current span
    assert not isinstance(trace.get_current_span(), Region)
    assert sorted({s.name for s in cap.spans}) == ["epoch", "microbatch", "optimizer", "step"]


def test_gradient_accumulation(tmp_path):
    # 8 samples, batch 2, accumulation 2: 2 optimizer steps per epoch, max_steps=4 is 2 epochs.
    trainer = _trainer(tmp_path, n=8, callbacks=[PerfsdkCallback()],
                       gradient_accumulation_steps=2)
    with capture() as cap:
        trainer.train()
    assert _counts(cap) == {"epoch": 2, "microbatch": 8, "optimizer": 4, "step": 4}
    spans = _by_span(cap)
    for step in cap.named("step"):
        assert step.attributes["perfsdk.samples"] == 4  # 2 per device x 2 micro-batches
        micro = sorted((r for r in cap.named("microbatch") if r.parent_span_id == step.span_id),
                       key=lambda r: r.start_ns)
        assert [m.attributes["perfsdk.microbatch"] for m in micro] == [0, 1]
        assert micro[0].end_ns <= micro[1].start_ns
        (opt,) = [r for r in cap.named("optimizer") if r.parent_span_id == step.span_id]
        assert micro[1].end_ns <= opt.start_ns
        assert _inside(opt, step)
    assert all(spans[r.parent_span_id].name == "epoch" for r in cap.named("step"))


class _RecordingSGD(torch.optim.SGD):
    """SGD that notes the region current while its ``step()`` runs."""

    seen: ClassVar[list[str]] = []

    def step(self, closure=None):
        _RecordingSGD.seen.append(getattr(trace.get_current_span(), "name", "none"))
        return super().step(closure)


def _recording_sgd(model):
    # A plain SGD made first: torch wraps each class's step() with the step hooks once an
    # instance of it is made, so _RecordingSGD's super().step() fires them a second time,
    # inside the first (the callback's optimizer region is the outermost call alone).
    torch.optim.SGD(model.parameters(), lr=0.01)
    _RecordingSGD.seen = []
    return _RecordingSGD(model.parameters(), lr=0.01)


def _without_optimizer_events(monkeypatch) -> None:
    """Make the callback see an older transformers' TrainerCallback, one without
    on_pre_optimizer_step / on_optimizer_step (transformers < 4.45)."""
    older = type("TrainerCallback", (), {k: v for k, v in vars(TrainerCallback).items()
                                         if k not in callback_module.OPTIMIZER_EVENTS})
    monkeypatch.setattr(callback_module, "TrainerCallback", older)
    assert not callback_module.has_optimizer_events()


@pytest.mark.parametrize("events", [True, False], ids=["events", "step-hooks"])
def test_optimizer_region_bounds_optimizer_step_once_per_update(tmp_path, monkeypatch, events):
    """With gradient accumulation, one optimizer region per update (not per micro-batch), and
    optimizer.step() runs inside it: through the Trainer's events where transformers has them,
    through torch's optimizer step hooks where it does not."""
    if events and not callback_module.has_optimizer_events():
        pytest.skip(f"transformers {transformers.__version__} has no on_pre_optimizer_step")
    if not events:
        _without_optimizer_events(monkeypatch)
    callback = PerfsdkCallback()
    trainer = _trainer(tmp_path, n=8, callbacks=[callback], gradient_accumulation_steps=2,
                       optimizer=_recording_sgd)
    with capture() as cap:
        trainer.train()
    assert trainer.state.global_step == 4
    assert _RecordingSGD.seen == ["optimizer"] * 4  # each update inside its region
    assert _counts(cap) == {"epoch": 2, "microbatch": 8, "optimizer": 4, "step": 4}
    spans = _by_span(cap)
    for opt in cap.named("optimizer"):
        step = spans[opt.parent_span_id]
        assert step.name == "step"
        assert _inside(opt, step)
        micro = [r for r in cap.named("microbatch") if r.parent_span_id == step.span_id]
        assert len(micro) == 2
        assert all(m.end_ns <= opt.start_ns for m in micro)
    assert not any(r.attributes.get("perfsdk.unfinished") for r in cap.regions)
    assert not isinstance(trace.get_current_span(), Region)
    sgd = trainer.optimizer.optimizer  # accelerate's wrapper, then the SGD
    assert not sgd._optimizer_step_pre_hooks
    assert not sgd._optimizer_step_post_hooks


def test_without_optimizer_events_or_an_optimizer(tmp_path, monkeypatch):
    """No events, and no optimizer handed to the callbacks (a Trainer subclass that keeps it
    to itself): the step's last micro-batch holds the update and ends at on_step_end."""
    _without_optimizer_events(monkeypatch)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback = PerfsdkCallback(report=False)
    with capture() as cap:
        callback.on_train_begin(args, state, control, optimizer=None)
        callback.on_epoch_begin(args, state, control)
        for _ in range(2):
            callback.on_step_begin(args, state, control)
            callback.on_substep_end(args, state, control)
            callback.on_pre_optimizer_step(args, state, control)  # not sent: ignored
            callback.on_optimizer_step(args, state, control)
            callback.on_step_end(args, state, control)
        callback.on_epoch_end(args, state, control)
        callback.on_train_end(args, state, control)
    assert _counts(cap) == {"epoch": 1, "microbatch": 4, "step": 2}
    spans = _by_span(cap)
    assert all(spans[r.parent_span_id].name == "step" for r in cap.named("microbatch"))
    assert not any(r.attributes.get("perfsdk.unfinished") for r in cap.regions)
    assert not isinstance(trace.get_current_span(), Region)


def test_validation(tmp_path):
    # evaluation every 2 steps, on 6 samples in batches of 4: 2 prediction batches each
    trainer = _trainer(tmp_path, callbacks=[PerfsdkCallback()], eval_n=6,
                       eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    with capture() as cap:
        trainer.train()
    assert _counts(cap) == {"epoch": 2, "microbatch": 4, "optimizer": 4, "step": 4,
                            "validation": 2}
    spans = _by_span(cap)
    steps = cap.named("step")
    for val in cap.named("validation"):
        assert val.attributes["perfsdk.category"] == "eval"
        assert val.attributes["perfsdk.batches"] == 2
        assert spans[val.parent_span_id].name == "epoch"  # after its step, not inside it
        assert not any(s.start_ns < val.end_ns and val.start_ns < s.end_ns for s in steps)
        # it follows steps 2 and 4 of the run
        before = [s for s in steps if s.end_ns <= val.start_ns]
        assert len(before) in (2, 4)


def test_training_that_raises_leaves_regions_balanced(tmp_path):
    model = _model()
    calls = {"n": 0}
    forward = model.forward

    @functools.wraps(forward)  # the Trainer keeps the dataset columns forward's signature names
    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    callback = PerfsdkCallback()
    trainer = _trainer(tmp_path, model=model, callbacks=[callback])
    with capture() as cap:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
        assert isinstance(trace.get_current_span(), Region)  # the failed step is still open
        model.forward = forward
        # the next run closes what the failed one left open, before anything of its own (here
        # the evaluation it starts with)
        again = _trainer(tmp_path, model=model, callbacks=[callback], eval_n=4,
                         eval_on_start=True)
        again.train()
    assert not isinstance(trace.get_current_span(), Region)
    unfinished = sorted(r.name for r in cap.regions if r.attributes.get("perfsdk.unfinished"))
    assert unfinished == ["epoch", "microbatch", "step"]
    assert len(cap.named("optimizer")) == 2 + 4
    (val,) = cap.named("validation")
    assert val.parent_span_id == 0  # a root region, not a child of the failed run's epoch
    assert val.attributes["perfsdk.batches"] == 1


def test_close_after_a_failed_run(tmp_path):
    model = _model()
    forward = model.forward

    @functools.wraps(forward)
    def failing_forward(*args, **kwargs):
        raise RuntimeError("boom")

    model.forward = failing_forward
    callback = PerfsdkCallback()
    with capture() as cap:
        with pytest.raises(RuntimeError, match="boom"):
            _trainer(tmp_path, model=model, callbacks=[callback]).train()
        callback.close()
    assert not isinstance(trace.get_current_span(), Region)
    assert sorted(r.name for r in cap.regions) == ["epoch", "microbatch", "step"]


def test_perfsdk_failure_never_breaks_training(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("perfsdk bookkeeping failed")

    monkeypatch.setattr(perfsdk, "timed_region", broken)
    trainer = _trainer(tmp_path, callbacks=[PerfsdkCallback()])
    with pytest.warns(perfsdk.PerfSDKWarning) as warned:
        trainer.train()
    assert trainer.state.global_step == 4
    # warned once, naming the first event that failed; every failure is counted
    assert [str(w.message) for w in warned] == [
        "perfsdk-transformers: on_epoch_begin failed (ValueError('perfsdk bookkeeping failed'));"
        " training goes on without some regions"]
    assert perfsdk.diagnostics()["warnings"]["perfsdk-transformers:ValueError"] > 4


def test_instrument_adds_one_callback(tmp_path):
    perfsdk_transformers.instrument()
    perfsdk_transformers.instrument()  # idempotent
    try:
        assert perfsdk_transformers.is_instrumented()
        trainer = _trainer(tmp_path)
        ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, PerfsdkCallback)]
        assert len(ours) == 1
        given = _trainer(tmp_path, callbacks=[PerfsdkCallback()])
        assert sum(isinstance(c, PerfsdkCallback) for c in given.callback_handler.callbacks) == 1
        with capture() as cap:
            trainer.train()
        assert _counts(cap)["step"] == 4
    finally:
        perfsdk_transformers.uninstrument()
    assert not perfsdk_transformers.is_instrumented()
    plain = _trainer(tmp_path)
    assert not any(isinstance(c, PerfsdkCallback) for c in plain.callback_handler.callbacks)


def test_import_without_transformers():
    script = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None  # as if not installed
        import perfsdk_transformers
        try:
            perfsdk_transformers.instrument()
        except ImportError as exc:
            assert "pip install 'perfsdk-transformers[instruments]'" in str(exc), exc
        else:
            raise AssertionError("instrument() without transformers did not raise")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_next_step_closes_stale_regions(tmp_path, monkeypatch):
    """A Trainer subclass that skips events (here: no on_optimizer_step / on_step_end) must not
    leave regions open: the next on_step_begin closes them, marked unfinished."""
    monkeypatch.setattr(callback_module, "has_optimizer_events", lambda: True)  # they are sent
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback = PerfsdkCallback()
    with capture() as cap:
        callback.on_epoch_begin(args, state, control)
        callback.on_step_begin(args, state, control)
        callback.on_pre_optimizer_step(args, state, control)  # its end never comes
        callback.on_step_begin(args, state, control)
        assert isinstance(trace.get_current_span(), Region)
        assert trace.get_current_span().name == "microbatch"
        callback.on_pre_optimizer_step(args, state, control)
        callback.on_optimizer_step(args, state, control)
        callback.on_step_end(args, state, control)
        callback.on_epoch_end(args, state, control)
    assert not isinstance(trace.get_current_span(), Region)
    assert _counts(cap) == {"epoch": 1, "microbatch": 2, "optimizer": 2, "step": 2}
    unfinished = sorted(r.name for r in cap.regions if r.attributes.get("perfsdk.unfinished"))
    assert unfinished == ["optimizer", "step"]  # the first step: its on_step_end never came
    assert [s.attributes["perfsdk.samples"] for s in cap.named("step")] == [6, 6]
    spans = _by_span(cap)
    assert all(spans[r.parent_span_id].name == "step" for r in cap.named("optimizer"))


def _report_rows(text: str) -> dict[str, int]:
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


def _no_report(text: str) -> bool:
    """No perfsdk report in ``text`` (the Trainer prints its own metrics at the end)."""
    return "perfsdk" not in text and "region " not in text and "train_runtime" in text


def test_training_ends_with_the_summary_and_the_advice(tmp_path, capsys):
    trainer = _trainer(tmp_path, callbacks=[PerfsdkCallback()], eval_n=6, eval_strategy="steps",
                       eval_steps=2, per_device_eval_batch_size=4)
    trainer.train()
    out = capsys.readouterr().out
    assert "perfsdk: Hugging Face training ended after " in out
    assert ": 4 optimizer steps, 4 recorded, 2 evaluations" in out
    assert _report_rows(out) == {"epoch": 2, "step": 4, "microbatch": 4, "optimizer": 4,
                                 "validation": 2}
    assert "perfsdk advice" in out
    assert out.index("region ") < out.index("perfsdk advice")
    trainer = _trainer(tmp_path, callbacks=[PerfsdkCallback()], max_steps=2)
    trainer.train()
    assert _report_rows(capsys.readouterr().out)["step"] == 2  # this run's regions alone


def test_report_false_prints_nothing(tmp_path, capsys):
    with capture() as cap:
        _trainer(tmp_path, callbacks=[PerfsdkCallback(report=False)]).train()
    assert _counts(cap)["step"] == 4  # still recorded
    assert _no_report(capsys.readouterr().out)
    perfsdk_transformers.instrument(report=False)
    try:
        _trainer(tmp_path).train()
    finally:
        perfsdk_transformers.uninstrument()
    assert _no_report(capsys.readouterr().out)
    with pytest.raises(ValueError, match="report='yes'"):
        PerfsdkCallback(report="yes")


def test_no_report_when_training_raises_or_perfsdk_is_disabled(tmp_path, capsys):
    model = _model()
    forward = model.forward

    @functools.wraps(forward)
    def failing_forward(*args, **kwargs):
        raise RuntimeError("boom")

    model.forward = failing_forward
    callback = PerfsdkCallback()
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, model=model, callbacks=[callback]).train()
    callback.close()
    assert capsys.readouterr().out == ""
    assert not any(isinstance(sink, RunRecorder) for sink in PIPELINE.sinks)  # none left
    perfsdk.configure(enabled=False)
    try:
        _trainer(tmp_path, callbacks=[callback]).train()
    finally:
        perfsdk.configure(enabled=True)
    assert _no_report(capsys.readouterr().out)
