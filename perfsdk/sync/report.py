"""What a sync guard saw, as plain data: :class:`SyncSite` (one call site), :class:`SyncReport`
(a guard's sites and totals) and their text rendering. Nothing here watches or imports the
guard, so the summary and the saved-run file can use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_OUTSIDE_TIMES", "SyncReport", "SyncSite", "render", "short_path", "short_via"]

MAX_OUTSIDE_TIMES = 1024
"""Times kept per call site of the latest syncs outside any recorded region
(:attr:`SyncSite.outside_ns`); :attr:`SyncSite.outside` counts them all."""

# the folder that holds the perfsdk package: perfsdk's own lines are shown relative to it
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep


@dataclasses.dataclass(frozen=True)
class SyncSite:
    """One call site: the user's ``file:line`` (the first frame outside torch and perfsdk), the
    kind of sync (a key of :data:`OPS`), the operator that synchronized, and how often."""

    file: str
    line: int
    op: str
    operator: str
    count: int
    code: str = ""
    via: str = ""
    """``file:line`` in perfsdk through which the sync happened, when it was perfsdk's code
    that synchronized on the user's behalf (``TrainStep.loss_history()``); else empty."""
    outside: int = 0
    """How many of ``count`` happened outside any recorded region."""
    outside_ns: tuple[int, ...] = ()
    """When those happened (wall-clock ns since the epoch, the clock of region start and end
    times), the latest :data:`MAX_OUTSIDE_TIMES`, oldest first: how the advisor tells the syncs of
    the run it is given from other runs' (skipped steps, whose regions are not recorded, leave
    no time)."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def label(self) -> str:
        """``"file:line op"`` with the file relative to the working directory, as regions list
        their sites in ``perfsdk.sync_sites``."""
        return f"{short_path(self.file)}:{self.line} {self.op}"


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What a guard saw: per call site, most frequent first, and the totals."""

    sites: tuple[SyncSite, ...]
    allowed: int = 0

    @property
    def total(self) -> int:
        return sum(site.count for site in self.sites)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(site) for site in self.sites]

    def __str__(self) -> str:
        return render(self.sites, allowed=self.allowed)


def render(sites: Iterable[SyncSite], *, allowed: int = 0) -> str:
    rows = list(sites)
    total = sum(site.count for site in rows)
    head = (f"host-device syncs: {total:,} at {len(rows)} call site"
            f"{'' if len(rows) == 1 else 's'}")
    if allowed:
        head += f" ({allowed:,} more allowed)"
    if not rows:
        return head
    count_w = max(5, *(len(f"{s.count:,}") for s in rows))
    op_w = max(2, *(len(s.op) for s in rows))
    wheres = [f"{short_path(s.file)}:{s.line}" for s in rows]
    where_w = max(5, *(len(w) for w in wheres))
    lines = [head, f"{'count':>{count_w}}  {'op':<{op_w}}  where"]
    for s, where in zip(rows, wheres, strict=True):
        text = f"{s.count:>{count_w},}  {s.op:<{op_w}}  {where:<{where_w}}"
        code = s.code + (f"  (in perfsdk at {short_via(s.via)})" if s.via else "")
        lines.append(f"{text}  | {code}" if code else text.rstrip())
    return "\n".join(lines)


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def short_via(via: str) -> str:
    """``perfsdk/optimize/train_step.py:222`` for a ``file:line`` inside the package."""
    return via[len(_ROOT):] if via.startswith(_ROOT) else via
