"""Which process of a multi-process (``torchrun``, DDP) job this is, for every region; one
trace per training step across the ranks; and which rank held each step up.

:func:`rank_attributes` gives ``perfsdk.rank``, ``perfsdk.local_rank`` and
``perfsdk.world_size``: from ``torch.distributed`` once the application has initialized its
process group, else from the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``); nothing for a single process. Every region's span, its ``RegionResult`` and its
trace-file slice carry them, so Jaeger, Tempo and the summary tell the ranks apart. They are read
on perfsdk's pipeline thread when records are exported, never on the training thread, and never
with a collective.

One trace per step: the ranks agree on a *run id* (``TORCHELASTIC_RUN_ID``, which ``torchrun``
gives every rank of a job, or one :func:`share_run_id` broadcasts once from rank 0), and each
``perfsdk.step()`` region at the root of its context takes its trace id from the run id and the
step index (:func:`step_trace_id`). So the ranks' spans of step N land in one trace, a lane per
rank, without any collective per step. :func:`stragglers` reads the steps of all ranks (e.g.
from their span files or a collector) and says, per step, which rank was slowest and by how much.

Example:
    >>> rank_attributes({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    {'perfsdk.rank': 1, 'perfsdk.local_rank': 1, 'perfsdk.world_size': 2}
    >>> rank_attributes({})
    {}
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["COLLECTIVES", "RANK_ATTRIBUTES", "StepSpread", "rank_attributes", "run_id",
           "share_run_id", "step_trace_id", "stragglers"]

RANK_ATTRIBUTES = ("perfsdk.rank", "perfsdk.local_rank", "perfsdk.world_size")
"""The attribute names, in order."""

_from_group: dict[str, int] | None = None  # fixed once the process group exists
_from_env: dict[str, int] | None = None  # torchrun's variables, read once


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _read_env(env: Mapping[str, str]) -> dict[str, int]:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or world is None:
        return {}
    out = {"perfsdk.rank": rank, "perfsdk.local_rank": _int(env, "LOCAL_RANK"),
           "perfsdk.world_size": world}
    return {k: v for k, v in out.items() if v is not None}


def rank_attributes(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """This process's rank, local rank and world size as span attributes; ``{}`` when it is not
    part of a multi-process job. ``env`` (for tests) replaces ``os.environ`` and the process
    group."""
    global _from_group, _from_env
    if env is not None:
        return _read_env(env)
    if _from_group is not None:
        return dict(_from_group)
    if _from_env is None:
        _from_env = _read_env(os.environ)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        found = {"perfsdk.rank": dist.get_rank(), "perfsdk.world_size": dist.get_world_size()}
        if "perfsdk.local_rank" in _from_env:
            found["perfsdk.local_rank"] = _from_env["perfsdk.local_rank"]
        _from_group = {k: found[k] for k in RANK_ATTRIBUTES if k in found}
        return dict(_from_group)
    return dict(_from_env)




_run_id: str | None = None  # set by share_run_id()
_env_run_id: tuple[str | None] | None = None  # (TORCHELASTIC_RUN_ID,) once read


def run_id() -> str | None:
    """The id the ranks of this job agree on: the one :func:`share_run_id` set, else
    ``TORCHELASTIC_RUN_ID`` (set by ``torchrun`` for every rank; read once per process, like
    torchrun's other variables), else None."""
    global _env_run_id
    if _run_id:
        return _run_id
    env = _env_run_id
    if env is None:  # every step asks: an environment lookup that misses costs about 1 us
        env = _env_run_id = (os.environ.get("TORCHELASTIC_RUN_ID") or None,)
    return env[0]


def share_run_id() -> str:
    """Agree on a run id across the ranks with one broadcast from rank 0 (call it once, on every
    rank, after ``init_process_group``; not needed under ``torchrun``). A single process just
    makes one.

    Raises:
        RuntimeError: ``torch.distributed`` is available but its process group is not
            initialized (the broadcast needs it).
    """
    global _run_id
    fresh = uuid.uuid4().hex
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        box: list[Any] = [fresh if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        fresh = str(box[0])
    elif _int(os.environ, "WORLD_SIZE") not in (None, 1):
        raise RuntimeError("share_run_id: WORLD_SIZE > 1 but torch.distributed's process group "
                           "is not initialized; call torch.distributed.init_process_group() "
                           "first")
    _run_id = fresh
    return fresh


def step_trace_id(step: int, run: str | None = None) -> int | None:
    """The 128-bit trace id of step ``step`` for every rank of the run (None without a run id).

    Example:
        >>> step_trace_id(3, "job-7") == step_trace_id(3, "job-7") != step_trace_id(4, "job-7")
        True
    """
    run = run if run is not None else run_id()
    if not run:
        return None
    digest = hashlib.blake2b(f"{run}:{step}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
               "all_to_all", "reduce", "gather", "scatter")
"""Region names :func:`stragglers` counts as waiting for the other ranks (also any region of
category ``collective``)."""


@dataclasses.dataclass(frozen=True)
class StepSpread:
    """One step across the ranks: each rank's busy time (its step less the time it spent in
    collectives, waiting for the others), the slowest rank, and the spread."""

    step: int
    busy_ms_by_rank: dict[int, float]
    step_ms_by_rank: dict[int, float]
    slowest_rank: int
    spread_ms: float
    """Busiest minus least busy rank."""
    spread: float
    """``spread_ms`` over the median rank's busy time."""


def _waits(regions: list[Any], steps: dict[Any, Any]) -> dict[Any, float]:
    """Milliseconds spent in collectives inside each step (by the step's span id)."""
    parent = {r.span_id: r.parent_span_id for r in regions}
    out: dict[Any, float] = {}
    for r in regions:
        if r.name not in COLLECTIVES and r.attributes.get("perfsdk.category") != "collective":
            continue
        up = r.parent_span_id
        for _ in range(64):  # the step above it, if any
            if up in steps:
                out[up] = out.get(up, 0.0) + float(r.host_ms)
                break
            if up not in parent:
                break
            up = parent[up]
    return out


def stragglers(regions: Iterable[Any]) -> list[StepSpread]:
    """Per step, which rank held the others up, and by how much.

    Ranks that meet in a collective finish the step together, so step times alone hide the
    straggler: the others *wait* for it inside the collective. Each rank's busy time is its step
    less the collectives inside it (regions named as in :data:`COLLECTIVES`, or of category
    ``collective``); the busiest rank is the straggler. Without such regions the busy time is
    the step time.

    Args:
        regions: ``RegionResult``-like records of every rank (``name``, ``host_ms``,
            ``span_id``, ``parent_span_id`` and ``attributes`` with ``perfsdk.step`` and
            ``perfsdk.rank`` on the steps), e.g. collected from each rank's spans; steps seen on
            fewer than two ranks are left out.

    Returns:
        One :class:`StepSpread` per step, in step order.

    Example:
        >>> from types import SimpleNamespace as R
        >>> def step(rank, ms):
        ...     return R(name="step", host_ms=ms, span_id=f"s{rank}", parent_span_id="",
        ...              attributes={"perfsdk.step": 0, "perfsdk.rank": rank})
        >>> wait = R(name="all_reduce", host_ms=9.0, span_id="w0", parent_span_id="s0",
        ...          attributes={})
        >>> s = stragglers([step(0, 20.0), wait, step(1, 20.0)])[0]
        >>> s.slowest_rank, s.busy_ms_by_rank, s.spread_ms
        (1, {0: 11.0, 1: 20.0}, 9.0)
    """
    records = list(regions)
    steps = {r.span_id: r for r in records if r.name == "step"
             and "perfsdk.step" in r.attributes and "perfsdk.rank" in r.attributes}
    waits = _waits(records, steps)
    by_step: dict[int, dict[int, tuple[float, float]]] = {}
    for span_id, r in steps.items():
        total = float(r.host_ms)
        by_step.setdefault(int(r.attributes["perfsdk.step"]), {})[
            int(r.attributes["perfsdk.rank"])] = (total - waits.get(span_id, 0.0), total)
    out = []
    for index in sorted(by_step):
        ranks = dict(sorted(by_step[index].items()))
        if len(ranks) < 2:
            continue
        busy = {rank: b for rank, (b, _) in ranks.items()}
        slowest = max(busy, key=busy.__getitem__)
        spread = max(busy.values()) - min(busy.values())
        median = statistics.median(busy.values())
        out.append(StepSpread(index, busy, {rank: t for rank, (_, t) in ranks.items()}, slowest,
                              spread, spread / median if median else 0.0))
    return out
