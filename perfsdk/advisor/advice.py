""":func:`advise` and the :class:`Advice` it returns: runs the rules of
:mod:`perfsdk.advisor.rules` over a run's regions and renders what they found (see
:mod:`perfsdk.advisor`)."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

from perfsdk.advisor.rules import RULES, Finding, Run, compute_rule
from perfsdk.export.summary import Summary
from perfsdk.record import RegionResult

__all__ = ["KINDS", "Advice", "advise"]

KINDS = ("data", "sync", "launch", "memory", "memory_creep", "compute")
"""Finding kinds, in the order that breaks ties of impact."""

_WIDTH = 100


@dataclasses.dataclass(frozen=True)
class Advice:
    """What :func:`advise` found: ``str()`` is the terminal text, ``as_dicts()`` the JSON."""

    findings: tuple[Finding, ...]
    """Most impact first; empty when no rule fired."""
    notes: tuple[str, ...]
    """What could not be checked, and why (also: no steps, no regions)."""
    steps: int
    """``step`` regions in the run (0: shares are of the whole recorded time)."""
    basis_ms: float
    """The time shares are of: the steps plus data wait outside them, else the whole run."""
    warmup_steps: int = 0
    """Steps left out at the start as warm-up (not counted in ``steps``)."""

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    @property
    def top(self) -> Finding | None:
        """The finding to act on first, or None."""
        return self.findings[0] if self.findings else None

    def as_dicts(self) -> list[dict[str, Any]]:
        """The findings as plain dicts (JSON-ready)."""
        out = []
        for f in self.findings:
            d = dataclasses.asdict(f)
            d["data"], d["details"] = dict(f.data), list(f.details)
            d["sites"], d["already_on"] = list(f.sites), list(f.already_on)
            out.append(d)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready: ``steps``, ``warmup_steps``, ``basis_ms``, ``findings`` and
        ``notes``."""
        return {"steps": self.steps, "warmup_steps": self.warmup_steps,
                "basis_ms": self.basis_ms, "findings": self.as_dicts(), "notes": list(self.notes)}

    def __str__(self) -> str:
        return render(self)


def _block(label: str, lines: Iterable[str], *, code: bool = False) -> list[str]:
    """Lines under a label. Prose wraps. With ``code``, a statement is never wrapped, so that it
    runs as printed, and a ``#`` comment wraps into more comment lines."""
    out = []
    for i, line in enumerate(lines):
        head = f"   {label if i == 0 else '':<9} "
        comment = line.startswith("#")
        if code and not comment:
            out.append(head + line)
            continue
        comment = code and comment
        body = line[1:].strip() if comment else line
        width = _WIDTH - len(head) - (2 if comment else 0)
        wrapped = textwrap.wrap(body, width, break_on_hyphens=False,
                                break_long_words=False) or [""]
        if comment:
            out += [(head if j == 0 else " " * len(head)) + "# " + w
                    for j, w in enumerate(wrapped)]
        else:
            out.append(head + wrapped[0])
            out += [" " * len(head) + "  " + w for w in wrapped[1:]]
    return out


def render(advice: Advice) -> str:
    """The advice as aligned terminal text. The ``fix`` and ``also`` lines are Python: each
    statement runs as printed (given :data:`NAMES`), the rest are ``#`` comments."""
    if advice.steps:
        warm = f" after {advice.warmup_steps} warm-up" if advice.warmup_steps else ""
        head = (f"perfsdk advice: {advice.steps} steps{warm}, "
                f"{advice.basis_ms / advice.steps:,.2f} ms per step "
                f"({advice.basis_ms:,.1f} ms in all)")
    else:
        head = f"perfsdk advice: no steps, {advice.basis_ms:,.1f} ms recorded"
    lines = [head]
    if not advice.findings:
        lines += ["", "No bottleneck found by the rules."]
    of = "step time" if advice.steps else "recorded time"
    for n, f in enumerate(advice.findings, 1):
        at_stake = "" if f.kind.startswith("memory") else f", ~{100 * f.impact:.0f}% of {of}"
        lines += ["", f"{n}. {f.title}  [{f.severity}{at_stake}]"]
        lines += _block("evidence", [f.evidence])
        lead = 0  # the comments right after the fix explain it: under "fix"
        while lead < len(f.details) and f.details[lead].startswith("#"):
            lead += 1
        lines += _block("fix", [f.fix, *f.details[:lead]], code=True)
        if f.details[lead:]:
            lines += _block("also", f.details[lead:], code=True)
        if f.already_on:
            lines += _block("already", ["on in this run, so not recommended again: "
                                        + ", ".join(f.already_on)])
        if f.sites:
            lines += _block("sites", f.sites)
    if advice.notes:
        lines += ["", "Not checked / notes:"]
        for note in advice.notes:
            wrapped = textwrap.wrap(note, _WIDTH - 4, break_on_hyphens=False)
            lines += ["  - " + wrapped[0], *("    " + w for w in wrapped[1:])]
    return "\n".join(lines)


def advise(regions: Iterable[RegionResult], *, device_memory_bytes: int | None = None,
           summary: Summary | None = None) -> Advice:
    """Name a run's bottlenecks, with the evidence and the perfsdk call that fixes each.

    Args:
        regions: the run's resolved regions (``perfsdk.testing.capture().regions``, or
            ``Region.result()`` of each). Steps are regions named ``step`` (or category
            ``step``); data wait ``data_wait`` (or category ``data``).
        device_memory_bytes: the device's total memory, for the memory-pressure rule
            (``torch.cuda.get_device_properties(0).total_memory``); without it that rule only
            reports out-of-memory errors.
        summary: ``perfsdk.summary(show=False)``: adds the syncs that happened outside any
            region while this run's regions ran (its sites keep when they synced; syncs of
            earlier or later runs in the process are not counted). Syncs inside regions come
            from the regions themselves.

    Returns:
        An :class:`Advice`: findings ordered by estimated impact, and notes on what was not
        checked. Never raises on missing data: an empty run gives no findings and a note.

    Raises:
        ValueError: an argument has the wrong type or range (the message names it).
    """
    try:
        records = tuple(regions)
    except TypeError:
        raise ValueError(f"advise: regions must be an iterable of perfsdk.RegionResult, got "
                         f"{type(regions).__name__}") from None
    bad = next((r for r in records if not isinstance(r, RegionResult)), None)
    if bad is not None:
        raise ValueError(f"advise: regions must hold perfsdk.RegionResult records, got "
                         f"{type(bad).__name__}")
    if device_memory_bytes is not None and (
            isinstance(device_memory_bytes, bool) or not isinstance(device_memory_bytes, int)
            or device_memory_bytes <= 0):
        raise ValueError(f"advise: device_memory_bytes must be a positive int (bytes) or None, "
                         f"got {device_memory_bytes!r}")
    if summary is not None and not isinstance(summary, Summary):
        raise ValueError(f"advise: summary must be a perfsdk.Summary or None, got "
                         f"{type(summary).__name__}")
    run = Run(records, summary, device_memory_bytes)
    if not records:
        run.notes.append("no regions recorded: nothing to check (run the loop inside "
                         "perfsdk.testing.capture(), with step and data_wait regions)")
        return Advice((), tuple(run.notes), 0, 0.0)
    found = [f for f in (rule(run) for rule in RULES) if f is not None]
    compute = compute_rule(run, found)
    if compute is not None:
        found.append(compute)
    found.sort(key=lambda f: (-f.impact, KINDS.index(f.kind)))
    return Advice(tuple(found), tuple(run.notes), run.n_steps, run.basis_ms, run.warmup)
