"""What :func:`perfsdk.optimize.optimize` tried and what each candidate bought: one
:class:`StepResult` per candidate, gathered in an :class:`OptimizationReport` that prints as an
aligned table, converts to plain data and draws a PNG bar chart of the speedups."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from perfsdk.errors import MissingDependencyError

__all__ = ["OptimizationReport", "StepResult"]

_COLUMNS = ("step", "median ms", "p95 ms", "samples/s", "speedup", "peak mem", "max err",
            "setup s", "result")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One candidate of the search (or the baseline, or the combination that was asked for).

    Attributes:
        name: The candidate, e.g. ``"eager fp32 (baseline)"``, ``"amp(bf16)"``,
            ``"compile + channels_last + amp(bf16) + freezing"``.
        applied: True for the row whose transforms the returned model carries.
        reason: Why it was or was not kept: ``"chosen"``, ``"reference"``,
            ``"out of tolerance: max error 0.12 > 0.05"``, ``"slower than baseline"``,
            ``"no Conv2d"``, ``"compile failed: ..."``, ``"budget"``, ...
        median_ms: Median latency of one call (inference) or one training step, in ms; None
            when the candidate was not timed.
        p95_ms: 95th percentile latency in ms; None when not timed.
        samples_per_s: Batch size divided by the median; None when not timed.
        speedup: Baseline median divided by this median, both timed interleaved in one
            comparison; None when not timed.
        peak_memory_bytes: CUDA peak memory during the timed loop; None on the CPU.
        max_error: Largest error against the eager fp32 reference: for outputs
            ``max|out - ref| / max|ref|``, for gradients (training) ``||g - ref|| / ||ref||``;
            None when not checked.
        setup_s: Seconds spent building the candidate and running it the first time
            (compilation happens here).
    """

    name: str
    applied: bool
    reason: str
    median_ms: float | None
    p95_ms: float | None
    samples_per_s: float | None
    speedup: float | None
    peak_memory_bytes: int | None
    max_error: float | None
    setup_s: float


@dataclasses.dataclass(frozen=True)
class OptimizationReport:
    """The outcome of :func:`perfsdk.optimize.optimize`.

    Attributes:
        mode: ``"inference"`` or ``"train"``.
        steps: One row per candidate, the baseline first.
        chosen: The name of the row the returned model corresponds to.
        budget_s: The search's time budget in seconds, or None for no budget.
        search_s: Wall-clock seconds the whole call took (building, checking, timing).
        unchanged: Transforms asked for that could not act on this model or device, each as
            ``"transform: why"`` (e.g. ``"channels_last: no Conv2d"``): "no change", never
            chosen.
    """

    mode: str
    steps: tuple[StepResult, ...]
    chosen: str
    budget_s: float | None
    search_s: float
    unchanged: tuple[str, ...] = ()

    @property
    def best(self) -> StepResult:
        """The chosen row."""
        for step in self.steps:
            if step.name == self.chosen:
                return step
        raise LookupError(f"OptimizationReport: no step named {self.chosen!r}")

    @property
    def speedup(self) -> float:
        """The chosen row's speedup over eager fp32 (1.0 when the baseline was kept)."""
        return self.best.speedup or 1.0

    def headline(self) -> str:
        """One sentence: what was chosen (or "no change", and why), how much faster, and what
        the search cost."""
        budget = "" if self.budget_s is None else f" (budget {self.budget_s:g} s)"
        cost = f"search took {self.search_s:.1f} s{budget}"
        if not self.steps or self.chosen == self.steps[0].name:  # the baseline was kept
            why = "; ".join(self.unchanged) or "no candidate beat eager fp32"
            return f"optimize ({self.mode}): no change ({why}); {cost}"
        speedup = f"{self.speedup:.2f}x the speed of eager fp32"
        extra = "".join(f"; no change from {note}" for note in self.unchanged)
        return f"optimize ({self.mode}): chose {self.chosen}, {speedup}{extra}; {cost}"

    def table(self) -> str:
        """An aligned text table, one row per step; ``*`` marks the chosen row."""
        rows = [_COLUMNS] + [_cells(step) for step in self.steps]
        widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
        lines = [self.headline(), ""]
        for index, row in enumerate(rows):
            mark = "*" if index and self.steps[index - 1].name == self.chosen else " "
            cells = [row[0].ljust(widths[0])]
            cells += [c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)]
            cells.append(row[-1])
            lines.append(f"{mark} " + "  ".join(cells))
            if index == 0:
                lines.append("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
        return "\n".join(lines)

    __str__ = table

    def as_dicts(self) -> list[dict[str, Any]]:
        """Each step as a plain dict (the :class:`StepResult` fields plus ``chosen``)."""
        return [{**dataclasses.asdict(step), "chosen": step.name == self.chosen}
                for step in self.steps]

    def plot(self, path: str | Path) -> Path:
        """Write a PNG bar chart of each step's speedup over eager fp32 and return its path.

        Steps that were not timed (skipped, failed, out of tolerance before timing) get no bar
        but are labelled with the reason; the chosen step is highlighted. Needs matplotlib
        (``pip install 'perfsdk[plot]'``); it is drawn with the non-interactive Agg backend.

        Raises:
            MissingDependencyError: matplotlib is not installed.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise MissingDependencyError("matplotlib", "plot", "OptimizationReport.plot") from exc
        path = Path(path)
        names = [step.name for step in self.steps]
        speedups = [step.speedup or 0.0 for step in self.steps]
        colors = ["#E15759" if step.name == self.chosen
                  else "#4E79A7" if step.reason in ("reference", "chosen")
                  or step.speedup is not None else "#BAB0AC" for step in self.steps]
        fig = Figure(figsize=(9.0, 1.2 + 0.45 * len(names)), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        positions = list(range(len(names)))[::-1]
        ax.barh(positions, speedups, color=colors, height=0.6)
        ax.set_yticks(positions, names, fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        top = max([1.0, *speedups])
        ax.set_xlim(0.0, top * 1.35)
        for pos, step, value in zip(positions, self.steps, speedups, strict=True):
            label = f"{value:.2f}x" if step.speedup is not None else step.reason
            if step.name == self.chosen:
                label += "  (chosen)"
            ax.text(value + top * 0.01, pos, _short(label, 48), va="center", fontsize=7)
        ax.set_xlabel("speedup over eager fp32 (median latency; higher is better)")
        ax.set_title(f"optimize ({self.mode}): {self.chosen}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, format="png")
        return path


def _cells(step: StepResult) -> tuple[str, ...]:
    return (step.name, _num(step.median_ms, ".2f"), _num(step.p95_ms, ".2f"),
            _num(step.samples_per_s, ",.1f"),
            "-" if step.speedup is None else f"{step.speedup:.2f}x",
            _bytes(step.peak_memory_bytes), _num(step.max_error, ".1e"),
            f"{step.setup_s:.1f}", step.reason)


def _num(value: float | None, spec: str) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop always returns


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
