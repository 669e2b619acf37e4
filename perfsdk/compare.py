"""Two saved runs compared region by region: the regression gate behind ``perfsdk compare``.

For each region the two runs recorded, :func:`compare_runs` takes the per-call host times of
its most recent calls in each run (at most :data:`MAX_CALLS`, calls that raised left out), the
two medians and their ratio (new / base), and a confidence interval of that ratio from a seeded
bootstrap: both samples are resampled with replacement :data:`RESAMPLES` times and the ratio of
the resampled medians taken each time; the interval is the middle ``confidence`` of those
ratios. The same seed gives the same interval. The verdict follows from the interval:

- ``slower``: its lower bound is above ``1 + fail_if_slower / 100`` (above 1 without a
  threshold): slower by more than allowed, with that confidence;
- ``slower, within threshold``: above 1 but not above the threshold;
- ``faster``: its upper bound is below 1;
- ``no significant change``: otherwise;
- ``too few calls``: fewer than :data:`MIN_CALLS` calls in a run (never a regression);
- ``only in base`` / ``only in new``: listed, compared with nothing.

The gate is the ``step`` region (``perfsdk run`` starts one per DataLoader batch) or the
regions named: the comparison has :attr:`~RunComparison.regressed` when one of them is
``slower``.

Example:
    >>> base = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3]
    >>> new = [15.1, 15.0, 14.8, 15.3, 15.2, 14.9]
    >>> row = compare_samples(base, new, name="step", fail_if_slower=10)
    >>> row.verdict, round(row.ratio, 2)
    ('slower', 1.5)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from perfsdk.export.runfile import SavedRun, load_run
from perfsdk.export.summary import percentile

__all__ = ["FASTER", "MAX_CALLS", "MIN_CALLS", "ONLY_IN_BASE", "ONLY_IN_NEW", "RESAMPLES",
           "SAME", "SLOWER", "STEP", "TOO_FEW", "WITHIN", "RegionComparison", "RunComparison",
           "compare_runs", "compare_samples"]

STEP = "step"
"""The region gated by default: ``perfsdk run``'s (and ``perfsdk.step()``'s) training step."""
MAX_CALLS = 2048
"""Calls compared per region and run: the most recent ones (bounded work, steady state)."""
MIN_CALLS = 5
"""Fewer calls than this in a run: the region's verdict is ``too few calls``."""
RESAMPLES = 2000
"""Bootstrap resamples per region."""

SLOWER = "slower"
WITHIN = "slower, within threshold"
FASTER = "faster"
SAME = "no significant change"
TOO_FEW = "too few calls"
ONLY_IN_BASE = "only in base"
ONLY_IN_NEW = "only in new"

_CHUNK = 250  # resamples drawn at once (bounds the memory: _CHUNK x MAX_CALLS doubles)


@dataclasses.dataclass(frozen=True)
class RegionComparison:
    """One region of a :class:`RunComparison` (times in milliseconds).

    Attributes:
        name: The region's name.
        base_calls, new_calls: The calls compared from each run (0: not in that run).
        base_median_ms, new_median_ms: Their medians (None: not in that run).
        ratio: ``new_median_ms / base_median_ms`` (None unless in both runs).
        low, high: The confidence interval of ``ratio`` (None unless both runs have at least
            :data:`MIN_CALLS` calls).
        verdict: One of ``slower``, ``slower, within threshold``, ``faster``, ``no significant
            change``, ``too few calls``, ``only in base``, ``only in new``.
        gated: Whether this region decides :attr:`RunComparison.regressed`.
    """

    name: str
    base_calls: int
    new_calls: int
    base_median_ms: float | None
    new_median_ms: float | None
    ratio: float | None
    low: float | None
    high: float | None
    verdict: str
    gated: bool = False

    @property
    def regressed(self) -> bool:
        """Gated and ``slower``: slower by more than allowed, with the confidence asked."""
        return self.gated and self.verdict == SLOWER


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """What :func:`compare_runs` found: a row per region, the gate and its outcome.

    ``str()`` of it is the table, the notes and the outcome, as ``perfsdk compare`` prints them.
    """

    base: str
    new: str
    rows: tuple[RegionComparison, ...]
    gated: tuple[str, ...]
    fail_if_slower: float | None
    confidence: float
    resamples: int
    seed: int
    notes: tuple[str, ...] = ()

    @property
    def regressed(self) -> bool:
        """Whether a gated region is ``slower`` (``perfsdk compare`` exits 1)."""
        return any(row.regressed for row in self.rows)

    def __getitem__(self, name: str) -> RegionComparison:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(row.name == name for row in self.rows)

    def table(self) -> str:
        """An aligned text table: a row per region, the gated ones marked."""
        level = _pct(self.confidence * 100)
        header = ["region", "base calls", "base p50 ms", "new calls", "new p50 ms", "ratio",
                  f"{level} CI", "verdict"]
        rows = [[row.name, f"{row.base_calls:,}" if row.base_calls else "-",
                 _ms(row.base_median_ms), f"{row.new_calls:,}" if row.new_calls else "-",
                 _ms(row.new_median_ms), _ratio(row.ratio),
                 "-" if row.low is None or row.high is None
                 else f"{_ratio(row.low)}-{_ratio(row.high)}",
                 row.verdict + ("  <- gate" if row.gated else "")] for row in self.rows]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            middle = [c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1], strict=True)]
            return "  ".join([cells[0].ljust(widths[0]), *middle, cells[-1]]).rstrip()

        return "\n".join([line(header), "-" * len(line(header)), *(line(r) for r in rows)])

    def outcome(self) -> str:
        """One line: which gated regions regressed, or that none did."""
        allowed = (f"more than {_pct(self.fail_if_slower)} slower" if self.fail_if_slower
                   else "any slowdown")
        if not self.gated:
            return "no region gated: nothing can regress"
        failed = [row for row in self.rows if row.regressed]
        if failed:
            worst = ", ".join(f"{row.name} {_ratio(row.ratio)}x (CI from "
                              f"{_ratio(row.low)}x)" for row in failed)
            return f"REGRESSION: {worst}: {allowed} with {_pct(self.confidence * 100)} confidence"
        states = ", ".join(f"{row.name}: {row.verdict}" for row in self.rows if row.gated)
        return f"no regression ({states}; a regression is {allowed} with " \
               f"{_pct(self.confidence * 100)} confidence)"

    def __str__(self) -> str:
        lines = [f"perfsdk compare: base {self.base}, new {self.new}", "", self.table(), "",
                 "ratio: new median / base median of each region's per-call host times (each "
                 f"run's most recent {MAX_CALLS:,} calls at most)",
                 f"CI: bootstrap of the medians, {self.resamples:,} resamples, seed {self.seed}",
                 *self.notes, "", self.outcome()]
        return "\n".join(lines)


def compare_samples(base_ms: Sequence[float], new_ms: Sequence[float], *, name: str = "region",
                    fail_if_slower: float | None = None, confidence: float = 0.95, seed: int = 0,
                    resamples: int = RESAMPLES, gated: bool = False) -> RegionComparison:
    """Compare two samples of per-call times (milliseconds; only the last :data:`MAX_CALLS` of
    each are used): what :func:`compare_runs` does for each region both runs recorded, with the
    same arguments. ``name`` names the row (and picks its bootstrap seed, with ``seed``)."""
    _check(fail_if_slower, confidence, seed, resamples)
    b, n = list(base_ms)[-MAX_CALLS:], list(new_ms)[-MAX_CALLS:]
    mb, mn = _median(b), _median(n)
    ratio = None if mb is None or mn is None else _divide(mn, mb)
    if len(b) < MIN_CALLS or len(n) < MIN_CALLS:
        return RegionComparison(name, len(b), len(n), mb, mn, ratio, None, None, TOO_FEW, gated)
    low, high = _bootstrap(b, n, confidence, _region_seed(seed, name), resamples)
    limit = 1 + (fail_if_slower or 0) / 100
    if low > limit:
        verdict = SLOWER
    elif low > 1:
        verdict = WITHIN
    elif high < 1:
        verdict = FASTER
    else:
        verdict = SAME
    return RegionComparison(name, len(b), len(n), mb, mn, ratio, low, high, verdict, gated)


def compare_runs(base: str | os.PathLike[str] | SavedRun, new: str | os.PathLike[str] | SavedRun,
                 *, fail_if_slower: float | None = None, regions: Iterable[str] | None = None,
                 confidence: float = 0.95, seed: int = 0,
                 resamples: int = RESAMPLES) -> RunComparison:
    """Compare two saved runs (the directories ``perfsdk run`` and ``perfsdk demo`` write, or
    loaded runs) region by region: medians, their ratio with a bootstrap confidence interval,
    and a verdict; ``.regressed`` when a gated region is slower by more than allowed.

    Args:
        base: The run to compare against (its directory, holding ``run.json``).
        new: The run under test.
        fail_if_slower: The slowdown allowed, in percent (10: a gated region regresses when
            its ratio's confidence interval lies wholly above 1.10). None: any slowdown the
            interval shows.
        regions: The regions to gate on; each must be in both runs. None: ``("step",)``,
            ``perfsdk run``'s step; ``()``: none (the table alone).
        confidence: The interval's confidence, between 0 and 1.
        seed: The bootstrap's seed (the same seed, the same intervals).
        resamples: Bootstrap resamples per region (at least 100).

    Returns:
        The :class:`RunComparison` (``str()`` of it is what ``perfsdk compare`` prints).

    Raises:
        FileNotFoundError: A directory holds no ``run.json``.
        ValueError: A ``run.json`` perfsdk cannot read, an argument out of range, or a gated
            region not in both runs (the message names it and the regions in both).
    """
    _check(fail_if_slower, confidence, seed, resamples)
    if regions is None:
        gate: tuple[str, ...] = (STEP,)
    elif isinstance(regions, str):
        gate = (regions,)
    else:
        gate = tuple(dict.fromkeys(regions))
        if not all(isinstance(r, str) for r in gate):
            raise ValueError(f"regions must be region names (str), got {list(gate)!r}")
    runs = [r if isinstance(r, SavedRun) else load_run(r) for r in (base, new)]
    labels = [label if isinstance(r, SavedRun) else os.fspath(r)
              for label, r in (("base", base), ("new", new))]
    (base_times, base_total), (new_times, new_total) = (_times(r) for r in runs)
    both = [name for name in base_times if name in new_times]
    for name in gate:
        if name not in both:
            raise ValueError(_missing(name, base_times, new_times, both, default=regions is None))
    names = sorted(base_times, key=lambda k: -math.fsum(base_times[k]))
    names += sorted((k for k in new_times if k not in base_times),
                    key=lambda k: -math.fsum(new_times[k]))
    rows = tuple(_row(name, base_times, new_times, fail_if_slower=fail_if_slower,
                      confidence=confidence, seed=seed, resamples=resamples, gated=name in gate)
                 for name in names)
    notes = [*_run_notes("base", runs[0]), *_run_notes("new", runs[1])]
    for row in rows:
        if row.gated and row.verdict == TOO_FEW:
            notes.append(f"{row.name}: too few calls to judge ({row.base_calls} and "
                         f"{row.new_calls}; at least {MIN_CALLS} in each run), not counted "
                         "as a regression")
    for label, times, total in (("base", base_times, base_total), ("new", new_times, new_total)):
        cut = [k for k in gate if len(times.get(k, ())) < total.get(k, 0)]
        for k in cut:
            notes.append(f"{k}: the {label} run's most recent {len(times[k]):,} of "
                         f"{total[k]:,} calls compared")
    return RunComparison(labels[0], labels[1], rows, gate, fail_if_slower, confidence, resamples,
                         seed, tuple(notes))


# -- internals -----------------------------------------------------------------------------------
def _check(fail_if_slower: Any, confidence: Any, seed: Any, resamples: Any) -> None:
    number = isinstance(fail_if_slower, (int, float)) and not isinstance(fail_if_slower, bool)
    if fail_if_slower is not None and not (number and 0 <= fail_if_slower < math.inf):
        raise ValueError("fail_if_slower must be a percentage >= 0 (10 allows 10% slower) or "
                         f"None, got {fail_if_slower!r}")
    real = isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
    if not (real and 0 < confidence < 1):
        raise ValueError(f"confidence must be a number between 0 and 1 (0.95), got "
                         f"{confidence!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an int >= 100, got {resamples!r}")


def _row(name: str, base: Mapping[str, Sequence[float]], new: Mapping[str, Sequence[float]],
         **options: Any) -> RegionComparison:
    if name in base and name in new:
        return compare_samples(base[name], new[name], name=name, **options)
    b, n = base.get(name, ()), new.get(name, ())
    return RegionComparison(name, len(b), len(n), _median(b), _median(n), None, None, None,
                            ONLY_IN_BASE if name in base else ONLY_IN_NEW, options["gated"])


def _times(run: SavedRun) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per region: the host times of its most recent calls that did not raise (at most
    MAX_CALLS; none when every call raised), and how many such calls the run kept."""
    recent: dict[str, collections.deque[float]] = {}
    total: dict[str, int] = {}
    for region in run.regions:
        times = recent.get(region.name)
        if times is None:
            times = recent[region.name] = collections.deque(maxlen=MAX_CALLS)
            total[region.name] = 0
        if region.error is None and region.recorded and math.isfinite(region.host_ms):
            times.append(region.host_ms)
            total[region.name] += 1
    return {name: list(times) for name, times in recent.items()}, total


def _run_notes(label: str, run: SavedRun) -> list[str]:
    notes = []
    if run.exit_code:
        notes.append(f"the {label} run's script exited with {run.exit_code}")
    if run.dropped:
        notes.append(f"the {label} run kept its first {len(run.regions):,} regions, not "
                     f"{run.dropped:,} more: its times are the kept regions'")
    return notes


def _missing(name: str, base: Mapping[str, object], new: Mapping[str, object],
             both: Sequence[str], *, default: bool) -> str:
    where = ("is in neither run" if name not in base and name not in new
             else "is not in the new run" if name in base else "is not in the base run")
    text = f"region {name!r} {where}"
    if default:
        text += (" (the default gate: `perfsdk run` starts a step per DataLoader batch; name "
                 "the regions to gate on: --region, regions=)")
    return text + f"; the regions in both runs: {', '.join(sorted(both)) or 'none'}"


def _median(values: Sequence[float]) -> float | None:
    return percentile(sorted(values), 50) if values else None


def _divide(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 1.0 if a == 0 else math.inf


def _region_seed(seed: int, name: str) -> int:
    """A seed per region, so that a region's interval does not depend on the others."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _bootstrap(base: Sequence[float], new: Sequence[float], confidence: float, seed: int,
               resamples: int) -> tuple[float, float]:
    """The percentile bootstrap interval of median(new) / median(base)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def medians(ordered: torch.Tensor, k: int) -> torch.Tensor:
        """The medians of ``k`` resamples of the sorted ``ordered``: a resample is how often it
        picks each value, and its middle ranks are where those counts add up."""
        m = len(ordered)
        picks = torch.randint(m, (k, m), generator=generator)
        counts = torch.zeros(k, m, dtype=torch.int32).scatter_add_(
            1, picks, torch.ones(1, dtype=torch.int32).expand(k, m))
        ranks = torch.tensor([[(m - 1) // 2 + 1, m // 2 + 1]], dtype=torch.int32).expand(k, 2)
        middle = torch.searchsorted(counts.cumsum(1, dtype=torch.int32), ranks.contiguous())
        return ordered[middle].mean(dim=1)

    sorted_base = torch.tensor(sorted(base), dtype=torch.float64)
    sorted_new = torch.tensor(sorted(new), dtype=torch.float64)
    ratios = []
    for start in range(0, resamples, _CHUNK):
        k = min(_CHUNK, resamples - start)
        mb, mn = medians(sorted_base, k), medians(sorted_new, k)
        ratio = mn / mb  # x / 0 = inf, 0 / 0 = nan: both medians 0 is no change
        ratios.append(torch.where(torch.isnan(ratio), torch.ones_like(ratio), ratio))
    ordered = sorted(torch.cat(ratios).tolist())
    tail = (1 - confidence) / 2 * (len(ordered) - 1)  # outward ranks: no inf - inf
    return ordered[math.floor(tail)], ordered[math.ceil(len(ordered) - 1 - tail)]


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _pct(value: float) -> str:
    return f"{value:g}%"
