"""``perfsdk demo``: the course lab's training loop, measured, then each fix tried and kept only
where it pays on this machine.

The data stands in for a real loader's: synthetic images, each read with a simulated storage
latency (a sleep, as a read from network storage waits: the process is blocked and the CPU is
free) and then decoded (real CPU work). A loader stalls this way on real storage, and DataLoader
workers overlap those waits even on a 2-core machine, where they could not overlap CPU work.

1. before: the loop as the lab's unoptimized script has it (a small batch, ``num_workers=0``, a
   ``loss.item()`` sync on every step), instrumented with perfsdk's steps, data-wait and module
   regions and a counting ``no_sync_guard``; then the summary and the advisor's findings.
2. choose: each candidate fix (DataLoader workers, a larger batch, autocast, channels-last,
   ``torch.compile``) is tried with a quick interleaved A/B (:func:`measure_fix`, through
   :func:`perfsdk.bench.compare`) against the set-up chosen so far, and kept only when it
   measures at least :data:`KEEP_ABOVE` times faster (the chooser: :mod:`perfsdk.cli.choose`).
   The losses stay on the device from here on (``TrainStep``): removing a sync cannot slow a
   loop, so that one is not measured.
3. after: the same training with the kept fixes only, measured like the first, and a
   before/after table.

Both runs go to the Perfetto trace and the spans file; each is saved for ``perfsdk report`` in
``<output_dir>/demo-before`` and ``demo-after``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import perfsdk
from perfsdk import _device
from perfsdk import sync as _sync
from perfsdk._progress import Progress
from perfsdk.advisor import Advice, advise
from perfsdk.bench import compare
from perfsdk.cli.choose import (
    BUDGET_S,
    KEEP_ABOVE,
    LAB_LR,
    LARGER_BATCH,
    Setup,
    Trial,
    choose,
    measured_note,
)
from perfsdk.cli.run import output_files
from perfsdk.cli.runfile import RunRecorder, save_run
from perfsdk.export.summary import Summary, percentile, render
from perfsdk.optimize import TrainStep, applied, apply_channels_last, apply_compile, fallbacks
from perfsdk.testing.models import SimpleNet, SyntheticImages

__all__ = ["BUDGET_S", "KEEP_ABOVE", "LATENCY_MS", "DemoResult", "Phase", "Setup",
           "StoredImages", "Trial", "measure_fix", "run_demo"]

LATENCY_MS = 5.0
"""Simulated storage latency per image, in milliseconds (a read from network storage)."""
BEFORE_S = 30.0
"""The before run stops at the first step that ends this many seconds after its start (on a
machine much slower or busier than the demo expects); the after run then trains on as many
images."""
AB_BATCHES = 2
"""A loop A/B call trains on this many of the larger batches' worth of images."""
LOOP_CALLS = 3
"""Timed calls per variant in a loop A/B (one per interleaved round, after one warm-up)."""
STEP_SECONDS = 1.0
"""Seconds per variant in a training-step A/B (five interleaved rounds, after two warm-ups)."""


class StoredImages(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic images loaded the way real ones are: each ``__getitem__`` first waits
    ``latency_ms`` for storage (``time.sleep``: the process is blocked, the CPU is free, as
    during a read from network storage), then decodes the image (CPU work: smoothing and
    resizing a 96x96 image, as JPEG decoding and augmentation would). The label is
    ``index % 10``.

    Raises:
        ValueError: ``length``, ``image_size`` or ``latency_ms`` out of range (named).
    """

    def __init__(self, length: int, image_size: int, latency_ms: float = LATENCY_MS) -> None:
        _check_int("StoredImages", "length", length, 1)
        _check_int("StoredImages", "image_size", image_size, 4)
        _check_number("StoredImages", "latency_ms", latency_ms)
        self.images = SyntheticImages(length, image_size)
        self.latency_ms = float(latency_ms)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.latency_ms:
            time.sleep(self.latency_ms / 1e3)
        return self.images[index]

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``size`` images (cycling) and labels, decoded without the latency."""
        items = [self.images[i % len(self.images)] for i in range(size)]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])

    def decode_ms(self, samples: int = 5) -> float:
        """The median time of decoding one image in this process (no latency), in
        milliseconds."""
        self.images[0]  # the first call pays for torch's kernels being loaded
        times = []
        for index in range(samples):
            started = time.perf_counter()
            self.images[index % len(self.images)]
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one run of the loop measured, and the set-up it ran with (read from the loop's own
    model, ``TrainStep`` and DataLoader, not from the plan)."""

    name: str
    steps: int
    samples: int
    wall_s: float
    step_ms_p50: float
    data_wait_share: float
    """Data wait over data wait plus step time (the share the advisor reports)."""
    syncs_per_step: float
    summary: Summary
    advice: Advice
    ran: Setup

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The numbers, the top finding and the set-up, JSON-ready (no summary rows)."""
        top = self.advice.top
        return {"name": self.name, "steps": self.steps, "samples": self.samples,
                "wall_s": self.wall_s, "samples_per_s": self.samples_per_s,
                "step_ms_p50": self.step_ms_p50, "data_wait_share": self.data_wait_share,
                "syncs_per_step": self.syncs_per_step, "top_finding": top.kind if top else None,
                "ran": dataclasses.asdict(self.ran)}


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """The two runs, the fixes tried between them, and the files written.

    ``setup`` is what the choice arrived at (``after.ran`` is what the loop really ran with);
    ``trials`` lists every candidate in the order tried."""

    before: Phase
    after: Phase
    files: dict[str, str]
    trials: tuple[Trial, ...] = ()
    setup: Setup | None = None

    @property
    def kept(self) -> tuple[Trial, ...]:
        return tuple(t for t in self.trials if t.status == "kept")

    @property
    def rejected(self) -> tuple[Trial, ...]:
        return tuple(t for t in self.trials if t.status == "rejected")

    @property
    def speedup(self) -> float:
        """After over before, in images/s."""
        before = self.before.samples_per_s
        return self.after.samples_per_s / before if before else math.nan

    def as_dict(self) -> dict[str, Any]:
        """Everything but the summaries, JSON-ready."""
        return {"before": self.before.as_dict(), "after": self.after.as_dict(),
                "speedup": self.speedup, "files": dict(self.files),
                "trials": [dataclasses.asdict(t) for t in self.trials],
                "setup": None if self.setup is None else dataclasses.asdict(self.setup)}


def _check_int(where: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name}={value!r}; accepted values are integers >= {minimum}")


def _check_number(where: str, name: str, value: Any, *, positive: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {name}={value!r}; accepted values are finite numbers "
                         f"{'> 0' if positive else '>= 0'}")


def run_demo(steps: int = 60, batch_size: int = 8, image_size: int = 32,
             output_dir: str | os.PathLike[str] | None = None,
             exporters: tuple[str, ...] = ("file",), out: TextIO | None = None,
             progress: bool | None = None, *, latency_ms: float = LATENCY_MS,
             budget_s: float = BUDGET_S) -> DemoResult:
    """Run the lab's loop for ``steps`` steps of ``batch_size`` images; try each fix with an
    interleaved A/B and keep those that measure faster; run the loop with the kept fixes on the
    same number of images; print what perfsdk saw, what was tried and the before/after table.

    Args:
        steps, batch_size, image_size: The lab's loop (``image_size`` a multiple of 4).
        output_dir: Where the trace, spans and both runs go (default: perfsdk's output dir).
        exporters: perfsdk exporters besides the trace file, which is always written.
        out: Where the text goes (default ``sys.stdout``).
        progress: Progress bars on stderr: None (on a terminal), True, False.
        latency_ms: Simulated storage latency per image, in milliseconds.
        budget_s: Seconds for choosing the fixes; candidates that would not fit are not tried.

    Raises:
        ValueError: an argument out of range (named, with the accepted values).
    """
    _check_int("run_demo", "steps", steps, 2)
    _check_int("run_demo", "batch_size", batch_size, 1)
    _check_int("run_demo", "image_size", image_size, 4)
    if image_size % 4:
        raise ValueError(f"run_demo: image_size={image_size!r}; accepted values are positive "
                         "multiples of 4")
    _check_number("run_demo", "latency_ms", latency_ms)
    _check_number("run_demo", "budget_s", budget_s, positive=True)
    stream = sys.stdout if out is None else out
    names = (*(e for e in exporters if e not in ("none", "trace")), "trace")
    config = perfsdk.configure(exporter=names, output_dir=output_dir if output_dir is not None
                               else perfsdk.get_config().output_dir)
    directory = Path(config.output_dir)
    device = "cuda" if _device.initialized() or _device.get_backend().is_available() else "cpu"
    data = StoredImages(steps * batch_size, image_size, latency_ms)
    stream.write(f"perfsdk demo: the course lab's SimpleNet on {len(data)} synthetic "
                 f"{image_size}x{image_size} images, on {device.upper()}\n"
                 f"the data: each image waits {latency_ms:g} ms of simulated storage latency "
                 "(a sleep, as a read\n  from network storage: the CPU is free), then is "
                 f"decoded on the CPU ({data.decode_ms():.1f} ms, measured)\n\n")
    lab = Setup(batch_size)
    _warm_up(data, batch_size, device)

    stream.write(f"1/3 before: the lab's loop (batch {batch_size}, num_workers=0, loss.item() "
                 "on every step)\n")
    before = _phase("before", lambda: _lab_loop(data, batch_size, image_size, device), steps,
                    progress, directory, stream, ran=lambda: lab, limit_s=BEFORE_S)
    if before.samples < len(data):  # stopped early: the after run trains on as many images
        data = StoredImages(before.samples, image_size, latency_ms)

    stream.write(f"2/3 choose: each fix tried in an interleaved A/B on this machine and kept "
                 f"only if\n    at least {KEEP_ABOVE:.2f}x faster (ratio = time without / time "
                 "with). From here on the losses\n    stay on the device (TrainStep: no sync "
                 "per step); that one needs no A/B.\n")
    ab_data = StoredImages(AB_BATCHES * LARGER_BATCH * batch_size, image_size, latency_ms)
    with perfsdk.timed_region("demo.choose", category="demo"):
        setup, trials = choose(
            lab, lambda without, with_fix, on: measure_fix(without, with_fix, ab_data, on=on,
                                                           device=device),
            images=len(ab_data), device=device, budget_s=budget_s, stream=stream)
    stream.write(f"  chosen: {setup.describe()}\n\n")

    fixed = _Trainer(setup, data, device)
    after_steps = -(-len(data) // setup.batch_size)
    stream.write(f"3/3 after: the kept fixes ({setup.describe()})\n")
    try:
        after = _phase("after", lambda: _fixed_loop(fixed), after_steps, progress, directory,
                       stream, ran=fixed.ran)
    finally:
        fixed.close()
    stream.write(measured_note(after.advice, trials))
    stream.write(_table(before, after) + "\n")
    perfsdk.flush()
    files = _files(directory)
    width = max(map(len, files), default=0)
    stream.write("\nfiles:\n" + "".join(f"  {k:<{width}}  {v}\n" for k, v in files.items()))
    return DemoResult(before, after, files, tuple(trials), setup)


Loop = Callable[[], Generator[int, None, None]]


def _phase(name: str, loop: Loop, steps: int, progress: bool | None, directory: Path,
           stream: TextIO, ran: Callable[[], Setup], limit_s: float = math.inf) -> Phase:
    """Run ``loop`` (it yields each step's samples) measured; print its summary and advice.
    ``ran`` tells the set-up the loop ran with (recorded on the phase's region); the loop stops
    at the first step that ends ``limit_s`` seconds or more after the start."""
    from perfsdk.lifecycle import SUMMARY

    perfsdk.flush()
    SUMMARY.reset()
    _sync.reset()
    samples = done = 0
    started = time.perf_counter()
    with RunRecorder() as recorder, \
            perfsdk.timed_region(f"demo.{name}", category="demo") as region, \
            perfsdk.no_sync_guard("count", assume_device=True), \
            Progress(steps, label=f"  {name}", force=progress) as bar:
        with contextlib.closing(loop()) as batches:
            for n in batches:
                samples += n
                bar.advance()
                done += 1
                if time.perf_counter() - started >= limit_s and done < steps:
                    break
        setup = ran()
        region.set_attributes({f"demo.{k}": "fp32" if k == "amp" and v is None else v
                               for k, v in dataclasses.asdict(setup).items()})
    wall_s = time.perf_counter() - started
    perfsdk.flush()
    summary = perfsdk.summary(show=False)
    advice = advise(recorder.regions, summary=summary)
    step_ms = sorted(r.host_ms for r in recorder.regions if r.name == "step")
    waits = sum(r.host_ms for r in recorder.regions if r.name == "data_wait")
    syncs = sum(int(r.attributes.get("perfsdk.syncs", 0)) for r in recorder.regions
                if r.name == "step")
    loop_ms = sum(step_ms) + waits  # the waits are outside the steps here: the advisor's basis
    phase = Phase(name, len(step_ms), samples, wall_s, percentile(step_ms, 50) if step_ms else 0,
                  waits / loop_ms if loop_ms else 0.0, syncs / max(len(step_ms), 1), summary,
                  advice, setup)
    save_run(_phase_dir(directory, name), command=["perfsdk", "demo", name], exit_code=0,
             wall_s=wall_s, files={}, summary=summary, regions=recorder.regions,
             dropped=recorder.dropped)
    if done < steps:
        stream.write(f"  stopped after {limit_s:.0f} s, at step {done} of {steps}: this "
                     "machine is slower or busier than the demo\n  expects; the after run "
                     f"trains on the same number of images\n")
    stream.write(f"  {phase.steps} steps, {samples} images in {wall_s:.2f} s: "
                 f"{phase.samples_per_s:,.1f} images/s\n\n{render(summary.rows)}\n\n"
                 f"{advice}\n\n")
    return phase


def _phase_dir(directory: Path, name: str) -> Path:
    path = directory / f"demo-{name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _model(image_size: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    return SimpleNet(image_size).to(device)


def _warm_up(data: StoredImages, batch: int, device: str) -> None:
    """Two untimed training steps, so that neither phase pays for what happens once per
    process (torch loading its kernels and lazy modules, the sync guard's set-up)."""
    model = _model(data.images.image_size, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LAB_LR)
    x, y = data.batch(batch)
    with perfsdk.no_sync_guard("count", assume_device=True):
        for _ in range(2):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    _sync.reset()  # what the guard saw here is no part of the runs


def _lab_loop(data: StoredImages, batch: int, image_size: int, device: str
              ) -> Generator[int, None, None]:
    """The lab's training loop as its unoptimized script writes it."""
    model = _model(image_size, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LAB_LR, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=0)
    total = 0.0
    with perfsdk.instrument_module(model, depth=1):
        for x, y in perfsdk.instrument_dataloader(loader):
            with perfsdk.step(samples=len(x)):
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                total += loss.item()  # the lab's sync on every step
            yield len(x)


def _fixed_loop(trainer: _Trainer) -> Generator[int, None, None]:
    """The same training with the kept fixes: ``TrainStep`` (no sync per step) and the chosen
    DataLoader, batch, autocast, memory format and compilation."""
    with perfsdk.instrument_module(trainer.model, depth=1):
        for x, y in perfsdk.instrument_dataloader(trainer.loader):
            with perfsdk.step(samples=len(x)):
                trainer.step(x, y)
            yield len(x)
    trainer.train.loss_history()  # the losses, read once at the end (one sync)


class _Trainer:
    """The lab's model and optimizer trained through ``TrainStep`` under one :class:`Setup`,
    with its own DataLoader (worker processes kept between epochs)."""

    def __init__(self, setup: Setup, data: StoredImages, device: str, *,
                 regions: bool = True) -> None:
        self.setup, self.device = setup, device
        model = _model(data.images.image_size, device)
        if setup.channels_last:
            model = apply_channels_last(model)
        if setup.compiled:
            model = apply_compile(model)
        self.model = model
        optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=0.9)
        self.train = TrainStep(model, optimizer, nn.CrossEntropyLoss(), amp=setup.amp,
                               regions=regions)
        self.loader: DataLoader[tuple[torch.Tensor, int]] = DataLoader(
            data, batch_size=setup.batch_size, shuffle=True, num_workers=setup.workers,
            persistent_workers=setup.workers > 0,
            pin_memory=setup.workers > 0 and device == "cuda")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.setup.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        self.train(x.to(self.device, non_blocking=True),
                   target=y.to(self.device, non_blocking=True))

    def epoch(self) -> None:
        for x, y in self.loader:
            self.step(x, y)

    def ran(self) -> Setup:
        """The set-up read back from the objects the loop uses."""
        conv = next(m for m in self.model.modules() if isinstance(m, nn.Conv2d))
        dtype = self.train.dtype
        return Setup(
            batch_size=int(self.loader.batch_size or 0), workers=self.loader.num_workers,
            amp=None if dtype is None else {torch.bfloat16: "bf16"}.get(dtype, "fp16"),
            channels_last=conv.weight.is_contiguous(memory_format=torch.channels_last)
            and not conv.weight.is_contiguous(),
            compiled="compile" in applied(self.model) and "compile" not in fallbacks(self.model),
            lr=float(self.train.optimizer.param_groups[0]["lr"]))

    def close(self) -> None:
        """Stop the DataLoader's worker processes (they are kept between epochs)."""
        del self.loader
        gc.collect()


def measure_fix(without: Setup, with_fix: Setup, data: StoredImages, *, on: str,
                device: str = "cpu") -> float:
    """Time without the fix over time with it (above 1: the fix is faster), from one
    interleaved :func:`perfsdk.bench.compare` of two fresh trainers.

    Args:
        without, with_fix: The two set-ups.
        data: The images.
        on: ``"loop"``: each call trains one epoch of ``data`` through the set-up's DataLoader
            (the same images for both, so the times compare directly; one warm-up epoch starts
            the workers); ``"step"``: each call is one training step on a fixed batch of
            ``without.batch_size`` decoded images.
        device: ``"cpu"`` (the host clock) or ``"cuda"`` (CUDA events, one sync at the end).

    Raises:
        ValueError: ``on`` is not ``"loop"`` or ``"step"``.
    """
    if on not in ("loop", "step"):
        raise ValueError(f"measure_fix: on={on!r}; accepted values are 'loop' and 'step'")
    a = _Trainer(without, data, device, regions=False)
    b = _Trainer(with_fix, data, device, regions=False)
    try:
        if on == "loop":
            result = compare({"without": a.epoch, "with": b.epoch}, warmup=1,
                             iters=LOOP_CALLS, rounds=LOOP_CALLS, device=device)
        else:
            x, y = data.batch(without.batch_size)
            result = compare({"without": a.step, "with": b.step}, x, y, warmup=2,
                             min_time=STEP_SECONDS, rounds=5, device=device)
    finally:
        a.close()
        b.close()
    return result.speedup("with")


def _files(directory: Path) -> dict[str, str]:
    files = output_files(directory)
    if "trace" in files:
        files["trace"] += "  (open in https://ui.perfetto.dev)"
    for name in ("before", "after"):
        files[name] = f"{directory / f'demo-{name}'}  (perfsdk report {directory}/demo-{name})"
    return files


def _table(before: Phase, after: Phase) -> str:
    rows = [("images/s", f"{before.samples_per_s:,.1f}", f"{after.samples_per_s:,.1f}",
             f"{after.samples_per_s / before.samples_per_s:.2f}x"
             if before.samples_per_s else "-"),
            ("step ms (p50)", f"{before.step_ms_p50:.1f}", f"{after.step_ms_p50:.1f}", ""),
            ("images per step", f"{before.samples / max(before.steps, 1):.0f}",
             f"{after.samples / max(after.steps, 1):.0f}", ""),
            ("data wait share", f"{before.data_wait_share:.0%}", f"{after.data_wait_share:.0%}",
             ""),
            ("syncs per step", f"{before.syncs_per_step:.1f}", f"{after.syncs_per_step:.1f}",
             ""),
            ("top finding", before.advice.top.kind if before.advice.top else "none",
             after.advice.top.kind if after.advice.top else "none", "")]
    head = ("", "before", "after", "change")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = ["before / after"]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    lines.append("-" * (sum(widths) + 6))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in rows]
    return "\n".join(lines)
