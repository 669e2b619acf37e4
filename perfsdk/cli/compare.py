"""``perfsdk compare BASE NEW``: two saved runs compared region by region, the regression gate.

It prints :func:`perfsdk.bench.compare_runs`'s table and exits 0 when no gated region (the
``step``, or those named with ``--region``) is slower by more than ``--fail-if-slower`` percent
with the confidence asked, 1 when one is, and 2 on bad input (a directory that holds no run, an
unreadable ``run.json``, a gated region not in both runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from perfsdk.compare import compare_runs
from perfsdk.export.runfile import RUN_FILE

__all__ = ["compare", "run_dir_problem"]


def run_dir_problem(directory: str) -> str | None:
    """Why ``directory`` is not a saved run (naming the runs inside it, if any), or None."""
    path = Path(directory)
    if not path.is_dir():
        return (f"{directory}: no such directory (the output directory of `perfsdk run`, or "
                "the demo-before/ or demo-after/ that `perfsdk demo` writes there)")
    if (path / RUN_FILE).is_file():
        return None
    inside = sorted(p.parent.name for p in path.glob(f"*/{RUN_FILE}"))
    hint = (f"; the runs inside it: {', '.join(inside)}" if inside
            else "; `perfsdk run` and `perfsdk demo` write it (see their --output-dir)")
    return f"{directory}: not a saved run, no {RUN_FILE} there" + hint


def compare(base: str, new: str, *, fail_if_slower: float | None, regions: Sequence[str] | None,
            confidence: float, out: TextIO, err: TextIO) -> int:
    """Compare the runs saved in ``base`` and ``new``, print the table to ``out``; returns the
    exit code (0 no regression, 1 a regression, 2 bad input, said on ``err``)."""
    for directory in (base, new):
        problem = run_dir_problem(directory)
        if problem is not None:
            err.write(f"perfsdk compare: {problem}\n")
            return 2
    try:
        comparison = compare_runs(base, new, fail_if_slower=fail_if_slower,
                                  regions=regions or None, confidence=confidence)
    except (FileNotFoundError, ValueError) as exc:
        err.write(f"perfsdk compare: {exc}\n")
        return 2
    out.write(f"{comparison}\n")
    return 1 if comparison.regressed else 0
