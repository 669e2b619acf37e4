"""``perfsdk demo``: the course lab's training loop, measured before and after its fixes.

First the loop as the lab's unoptimized script has it (a small batch, ``num_workers=0``, a
``loss.item()`` sync on every step), instrumented with perfsdk's steps, data-wait and module
regions and a counting ``no_sync_guard``; then the summary and the advisor's findings. Then the
same training with the fixes the findings name (DataLoader workers and a larger batch,
``TrainStep`` with autocast and no per-step sync, channels-last), measured the same way, and a
before/after table. Both runs go to the Perfetto trace and the spans file; each is saved for
``perfsdk report`` in ``<output_dir>/demo-before`` and ``demo-after``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils.data import DataLoader

import perfsdk
from perfsdk import _device
from perfsdk import sync as _sync
from perfsdk._cli_run import output_files
from perfsdk._progress import Progress
from perfsdk._runfile import RunRecorder, save_run
from perfsdk.advisor import Advice, advise
from perfsdk.export.summary import Summary, percentile, render
from perfsdk.optimize import TrainStep, apply_channels_last
from perfsdk.optimize._models import SimpleNet, SyntheticImages

__all__ = ["DemoResult", "Phase", "run_demo"]

FIXED_BATCH = 4
"""The fixed run's batch is this many times the lab's."""
FIXED_WORKERS = 2


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one run of the loop measured."""

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

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class DemoResult:
    before: Phase
    after: Phase
    files: dict[str, str]


def _check(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"run_demo: {name}={value!r}; accepted values are integers >= {minimum}")


def run_demo(steps: int = 60, batch_size: int = 8, image_size: int = 32,
             output_dir: str | os.PathLike[str] | None = None,
             exporters: tuple[str, ...] = ("file",), out: TextIO | None = None,
             progress: bool | None = None) -> DemoResult:
    """Run the lab's loop for ``steps`` steps of ``batch_size`` images, then the fixed loop on
    the same number of images; print what perfsdk saw and the before/after table.

    Raises:
        ValueError: ``steps``, ``batch_size`` or ``image_size`` out of range (named).
    """
    _check("steps", steps, 2)
    _check("batch_size", batch_size, 1)
    _check("image_size", image_size, 4)
    if image_size % 4:
        raise ValueError(f"run_demo: image_size={image_size!r}; accepted values are positive "
                         "multiples of 4")
    stream = sys.stdout if out is None else out
    names = (*(e for e in exporters if e not in ("none", "trace")), "trace")
    config = perfsdk.configure(exporter=names, output_dir=output_dir if output_dir is not None
                               else perfsdk.get_config().output_dir)
    directory = Path(config.output_dir)
    device = "cuda" if _device.initialized() or torch.cuda.is_available() else "cpu"
    stream.write(f"perfsdk demo: the course lab's SimpleNet on synthetic {image_size}x"
                 f"{image_size} images, {steps * batch_size} images, on {device.upper()}\n\n")
    data = SyntheticImages(steps * batch_size, image_size)
    bar = None if progress is None else progress

    stream.write(f"1/2 before: the lab's loop (batch {batch_size}, num_workers=0, loss.item() "
                 "on every step)\n")
    before = _phase("before", lambda: _lab_loop(data, batch_size, image_size, device),
                    steps, bar, directory, stream)
    fixed_batch = batch_size * FIXED_BATCH
    fixes = [f"DataLoader(num_workers={FIXED_WORKERS}, persistent_workers=True, "
             f"batch_size={fixed_batch})" + (", pin_memory=True" if device == "cuda" else ""),
             "TrainStep(amp=...): autocast, and the losses stay on the device (no sync per "
             "step)", "apply_channels_last(model)"]
    stream.write("2/2 after: the fixes\n" + "".join(f"  - {f}\n" for f in fixes))
    after_steps = -(-len(data) // fixed_batch)
    after = _phase("after", lambda: _fixed_loop(data, fixed_batch, image_size, device),
                   after_steps, bar, directory, stream)
    stream.write(_table(before, after) + "\n")
    perfsdk.flush()
    files = _files(directory)
    width = max(map(len, files), default=0)
    stream.write("\nfiles:\n" + "".join(f"  {k:<{width}}  {v}\n" for k, v in files.items()))
    return DemoResult(before, after, files)


Loop = Callable[[], Iterable[int]]


def _phase(name: str, loop: Loop, steps: int, progress: bool | None, directory: Path,
           stream: TextIO) -> Phase:
    """Run ``loop`` (it yields each step's samples) measured; print its summary and advice."""
    from perfsdk.lifecycle import SUMMARY

    perfsdk.flush()
    SUMMARY.reset()
    _sync.reset()
    samples = 0
    started = time.perf_counter()
    with RunRecorder() as recorder, perfsdk.timed_region(f"demo.{name}", category="demo"), \
            perfsdk.no_sync_guard("count", assume_device=True), \
            Progress(steps, label=f"  {name}", force=progress) as bar:
        for n in loop():
            samples += n
            bar.advance()
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
                  advice)
    save_run(_phase_dir(directory, name), command=["perfsdk", "demo", name], exit_code=0,
             wall_s=wall_s, files={}, summary=summary, regions=recorder.regions,
             dropped=recorder.dropped)
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


def _lab_loop(data: SyntheticImages, batch: int, image_size: int, device: str
              ) -> Iterable[int]:
    """The lab's training loop as its unoptimized script writes it."""
    model = _model(image_size, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
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


def _fixed_loop(data: SyntheticImages, batch: int, image_size: int, device: str
                ) -> Iterable[int]:
    """The same training with the fixes."""
    model = apply_channels_last(_model(image_size, device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * FIXED_BATCH, momentum=0.9)
    train = TrainStep(model, optimizer, nn.CrossEntropyLoss(),
                      amp="bf16" if device == "cpu" else "fp16")
    loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=FIXED_WORKERS,
                        persistent_workers=True, pin_memory=device == "cuda")
    with perfsdk.instrument_module(model, depth=1):
        for x, y in perfsdk.instrument_dataloader(loader):
            with perfsdk.step(samples=len(x)):
                train(x.to(device, non_blocking=True), target=y.to(device, non_blocking=True))
            yield len(x)
    train.loss_history()  # the losses, read once at the end (one sync)


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
