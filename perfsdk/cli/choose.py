"""The fix chooser of ``perfsdk demo``: each candidate fix tried against the set-up chosen so far
and kept only where it measures faster on this machine.

The candidates, in order: DataLoader workers (:data:`WORKERS`), a :data:`LARGER_BATCH` times
larger batch, autocast, channels-last and ``torch.compile``. Each is measured with an
interleaved A/B (the ``measure`` the demo passes in, :func:`perfsdk.cli.demo.measure_fix`) and
kept only when the set-up with it runs at least :data:`KEEP_ABOVE` times faster. Autocast is
first checked by :func:`perfsdk.optimize.probe.autocast_speedup`: where the probe says it cannot
win (a CPU that emulates bfloat16), it is rejected without the A/B. No A/B starts once the
budget is spent, and ``torch.compile`` is tried only when compiling fits the time left. One row
per candidate is printed as it goes: what it was measured on, the ratio, kept or rejected, and
why.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

import perfsdk
from perfsdk import _device
from perfsdk.advisor import Advice
from perfsdk.optimize.probe import PRUNE_BELOW, autocast_speedup

__all__ = ["BUDGET_S", "COMPILE_S", "KEEP_ABOVE", "LAB_LR", "LARGER_BATCH", "WORKERS", "Measure",
           "Setup", "Trial", "choose", "measured_note"]

LAB_LR = 0.01
"""The lab's SGD learning rate."""
KEEP_ABOVE = 1.05
"""A fix is kept when the set-up with it runs at least this many times faster than without."""
BUDGET_S = 45.0
"""Seconds the demo spends choosing fixes; a candidate that would not fit is not tried."""
COMPILE_S = {"cpu": 60.0, "cuda": 30.0}
"""Rough seconds to compile SimpleNet's training step (forward and backward) with inductor:
on a CPU it builds C++ (15-30 s measured on a quiet 2-core machine, more under load)."""
LARGER_BATCH = 4
"""The larger-batch candidate is this many times the lab's batch."""
WORKERS = (2, 4)
"""DataLoader worker counts tried, each against the set-up chosen so far (those up to the CPUs
this process may use: torch warns about more, and the loader's decoding needs a core)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a training loop runs: its batch, its DataLoader workers and the fixes on its step.

    ``amp`` is the autocast dtype's name (``"bf16"``, ``"fp16"``) or None for float32."""

    batch_size: int
    workers: int = 0
    amp: str | None = None
    channels_last: bool = False
    compiled: bool = False
    lr: float = LAB_LR
    """SGD's learning rate (scaled with the batch, the linear rule)."""

    def describe(self) -> str:
        parts = [f"batch {self.batch_size}", f"num_workers={self.workers}",
                 f"autocast {self.amp}" if self.amp else "float32"]
        parts += ["channels-last"] * self.channels_last + ["torch.compile"] * self.compiled
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate fix: what was measured, and whether the "after" loop keeps it.

    Attributes:
        field, value: The :class:`Setup` field the fix sets, and to what (``"workers"``, 2).
        label: The fix as the output names it.
        measured_on: What the ratio was measured on: the loop over some images, the training
            step at a batch size, or autocast's probe; ``""`` when not measured.
        ratio: Time without the fix over time with it (above 1: faster with it); None when it
            was not measured.
        status: ``"kept"``, ``"rejected"`` (measured, not faster by :data:`KEEP_ABOVE`) or
            ``"not tried"`` (the budget, or nothing to measure).
        reason: Why, in words.
    """

    field: str
    value: Any
    label: str
    measured_on: str
    ratio: float | None
    status: str
    reason: str

    @property
    def kept(self) -> bool:
        return self.status == "kept"


Measure = Callable[[Setup, Setup, str], float]
"""``measure(without, with_fix, on)``: time without the fix over time with it, from an
interleaved A/B; ``on`` is ``"loop"`` (an epoch through the set-up's DataLoader) or ``"step"``
(one training step on a fixed batch)."""


def choose(lab: Setup, measure: Measure, *, images: int, device: str, budget_s: float,
           stream: TextIO) -> tuple[Setup, list[Trial]]:
    """Try each candidate fix on top of ``lab`` and keep those measured faster.

    Args:
        lab: The set-up to start from (the lab's loop).
        measure: The A/B of two set-ups (see :data:`Measure`).
        images: How many images a loop A/B trains on (for the table).
        device: ``"cpu"`` or ``"cuda"``: where the step runs (autocast's dtype, its probe and
            the compile estimate depend on it).
        budget_s: Seconds for the choice; no A/B starts once they are spent.
        stream: Where the table of candidates goes, one row each as it is decided.

    Returns:
        The set-up chosen, and every candidate in the order tried.
    """
    return _Chooser(lab, measure, images, device, budget_s, stream).run()


_FIX, _ON = 28, 24  # the widths of the choice table's first two columns


class _Chooser:
    """Tries each candidate fix against the set-up chosen so far, interleaved, and keeps it only
    when it measures faster; prints one row per candidate as it goes."""

    def __init__(self, lab: Setup, measure: Measure, images: int, device: str,
                 budget_s: float, stream: TextIO) -> None:
        self.setup = self.lab = lab
        self.measure, self.images, self.device = measure, images, device
        self.stream = stream
        self.deadline = time.perf_counter() + budget_s
        self.budget_s = budget_s
        self.trials: list[Trial] = []

    def run(self) -> tuple[Setup, list[Trial]]:
        self.stream.write(f"  {'fix':<{_FIX}}{'measured on':<{_ON}}{'ratio':>6}  result\n")
        lab = self.lab
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        for workers in [w for w in WORKERS if w <= cores] or [cores]:
            pinned = ", pinned" if self.device == "cuda" else ""
            self._try("workers", workers, f"num_workers={workers} (persistent{pinned})", "loop")
        self._try("batch_size", lab.batch_size * LARGER_BATCH,
                  f"batch_size={lab.batch_size * LARGER_BATCH} (lr {LARGER_BATCH}x)", "loop",
                  lr=lab.lr * LARGER_BATCH)
        amp = self._amp()
        probe = autocast_speedup(torch.bfloat16 if amp == "bf16" else torch.float16, self.device)
        self._try("amp", amp, f"TrainStep(amp={amp!r})", "step",
                  note=f"the probe said {probe:.2f}x, then ",
                  pruned=None if probe >= PRUNE_BELOW else
                  (probe, f"{'fails' if probe == 0 else 'slower than float32'} here "
                   f"(below {PRUNE_BELOW}x: no A/B)"))
        self._try("channels_last", True, "apply_channels_last(model)", "step")
        needed = COMPILE_S.get(self.device, COMPILE_S["cpu"])
        left = self.deadline - time.perf_counter()
        self._try("compiled", True, "apply_compile(model)", "step",
                  pruned=None if left >= needed else
                  (None, f"~{needed:.0f} s to compile on {self.device.upper()}, "
                   f"{max(left, 0):.0f} s of the budget left"))
        return self.setup, self.trials

    def _amp(self) -> str:
        if self.device == "cuda" and _device.get_backend().is_bf16_supported():
            return "bf16"  # no GradScaler, so no sync per step for its overflow check
        return "bf16" if self.device == "cpu" else "fp16"

    def _try(self, field: str, value: Any, label: str, how: str, *,
             pruned: tuple[float | None, str] | None = None, note: str = "",
             **also: Any) -> None:
        """Measure the set-up so far with ``field=value`` against without; keep it if faster.
        ``pruned``: (a ratio or None, why) to reject or skip it without the A/B."""
        base = self.setup
        if pruned is None and time.perf_counter() >= self.deadline:
            pruned = (None, f"the {self.budget_s:.0f} s budget ran out")
        if pruned is not None:
            ratio, why = pruned
            trial = Trial(field, value, label, "" if ratio is None else "the autocast probe",
                          ratio, "not tried" if ratio is None else "rejected", why)
            self.stream.write(f"  {label:<{_FIX}}{trial.measured_on or '-':<{_ON}}")
        else:
            on = (f"the loop, {self.images} images" if how == "loop"
                  else f"the step, batch {base.batch_size}")
            self.stream.write(f"  {label:<{_FIX}}{on:<{_ON}}")  # the rest when measured
            self.stream.flush()
            candidate = dataclasses.replace(base, **{field: value}, **also)
            with perfsdk.timed_region("demo.try", category="demo") as region:
                region.set_attribute("demo.fix", label)
                measured = self.measure(base, candidate, how)
                region.set_attribute("demo.ratio", measured)
            kept = measured >= KEEP_ABOVE
            trial = Trial(field, value, label, on, measured, "kept" if kept else "rejected",
                          note + ("faster here" if kept else "not faster here"))
            if kept:
                self.setup = candidate
        shown = "-" if trial.ratio is None else f"{trial.ratio:.2f}x"
        self.stream.write(f"{shown:>6}  {trial.status}: {trial.reason}\n")
        self.stream.flush()
        self.trials.append(trial)


_MENTIONS = {"amp": ("apply_amp", "amp="), "channels_last": ("channels_last",),
             "compiled": ("compile",), "workers": ("tune_dataloader", "num_workers")}
"""The words by which an advisor's fix names each candidate."""


def measured_note(advice: Advice, trials: list[Trial] | tuple[Trial, ...]) -> str:
    """What the choice measured about the fixes ``advice`` names (``""`` when it names none of
    the candidates), so that advice given after the choice reads with what was measured."""
    text = " ".join(f"{f.fix} {' '.join(f.details)}" for f in advice.findings)
    said = []
    for trial in trials:
        if any(word in text for word in _MENTIONS.get(trial.field, ())):
            ratio = "" if trial.ratio is None else f" at {trial.ratio:.2f}x"
            state = {"kept": "already on in this run", "rejected": "measured and rejected",
                     "not tried": "not tried"}[trial.status]
            said.append(f"{trial.label}: {state}{ratio}")
    if not said:
        return ""
    return ("the demo's own measurements of the fixes named above:\n"
            + "".join(f"  - {line}\n" for line in dict.fromkeys(said)) + "\n")
