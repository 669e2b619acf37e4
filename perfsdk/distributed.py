"""Which process of a multi-process (``torchrun``, DDP) job this is, for every region; one
trace per training step across the ranks; and which rank held each step up.

:func:`rank_attributes` gives ``perfsdk.rank``, ``perfsdk.local_rank`` and
``perfsdk.world_size``: from ``torch.distributed`` once the application has initialized its
process group, else from the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``); nothing for a single process. Every region's span, its ``RegionResult`` and its
trace-file slice carry them, so Jaeger, Tempo and the summary tell the ranks apart. They are read
on perfsdk's pipeline thread when records are exported, never on the training thread, and never
with a collective.

One trace per step: the ranks agree on a *run id* (:func:`run_id`: ``TORCHELASTIC_RUN_ID``,
which ``torchrun`` gives every rank of a job; when that is ``none``, one id the ranks agree on
once through the job's c10d store; or one :func:`share_run_id` broadcasts from rank 0), and each
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
import datetime
import hashlib
import os
import statistics
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from perfsdk.errors import warn_once

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

_STORE_KEY = "perfsdk/run_id"
"""The key under which the ranks of a ``torchrun`` job agree on a run id in the job's store
(with the attempt appended: ``perfsdk/run_id/<TORCHELASTIC_RESTART_COUNT>``)."""

_STORE_TIMEOUT_S = 5.0
"""How long one agreement through the job's store may take (connect and one
``compare_set``); past it the process takes a run id of its own."""

_agreed: dict[tuple[str, str], str] = {}  # (TORCHELASTIC_RUN_ID, restart count) -> run id
_agree_lock = threading.Lock()


def _unset(value: str | None) -> bool:
    """``torchrun``'s placeholder for "no ``--rdzv-id``" (its default is the string ``none``)."""
    return value is None or value.strip().lower() in ("", "none")


def run_id() -> str | None:
    """The id the ranks of this job agree on, the same on every rank and different for every
    job: the one :func:`share_run_id` set; else ``TORCHELASTIC_RUN_ID``, which ``torchrun``
    sets on every rank (``--rdzv-id``; ``--standalone`` and a single-node launch make a fresh
    one); else, under ``torchrun`` without a run id of its own (``TORCHELASTIC_RUN_ID`` is
    ``none``: ``--master-port``, ``--master-addr``, several nodes), a fresh id that the first
    rank to ask puts in the job's store and every other rank reads from it; else None (not a
    ``torchrun`` job). From a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0), the id
    names the attempt too, so a restart never merges with the attempt before it.

    The store is asked once per process, at the first call (the first ``perfsdk.step()``):
    one connection to the ``torchrun`` agent's store at ``MASTER_ADDR:MASTER_PORT`` (the one
    ``init_process_group`` uses; the connection is closed again) and one ``compare_set``, no
    collective, 6 s at most. When the store cannot be reached, the process
    takes a random id of its own and warns once (the ranks' steps are then separate traces).
    """
    if _run_id:
        return _run_id
    env = os.environ
    given = env.get("TORCHELASTIC_RUN_ID")
    if given is None:
        return None
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    key = (given, restart)
    found = _agreed.get(key)
    if found is None:
        with _agree_lock:
            found = _agreed.get(key)
            if found is None:
                found = _agreed[key] = _resolve(given, restart, env)
    return found


def _resolve(given: str, restart: str, env: Mapping[str, str]) -> str:
    if not _unset(given):
        return given if restart == "0" else f"{given}:restart-{restart}"
    agreed, why = _agree(env, restart)
    if agreed is not None:
        return agreed
    own = uuid.uuid4().hex
    if _int(env, "WORLD_SIZE") not in (None, 1):
        warn_once("run-id", f"perfsdk: torchrun gave this job no run id (TORCHELASTIC_RUN_ID "
                  f"is {given!r}) and the job's store could not be asked for one ({why}); "
                  "this rank uses a run id of its own, so the ranks' steps are separate traces. "
                  "Pass --rdzv-id=<job id> to torchrun, or call "
                  "perfsdk.distributed.share_run_id() on every rank after "
                  "init_process_group().")
    return own


def _agree(env: Mapping[str, str], restart: str,
           timeout: float | None = None) -> tuple[str | None, str]:
    """(the run id agreed in the ``torchrun`` agent's store, "") or (None, why not)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None, "TORCHELASTIC_USE_AGENT_STORE is not True"
    host, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT")
    if not host or port is None or not 0 < port < 65536:
        return None, "MASTER_ADDR / MASTER_PORT are not set"
    return _agree_in_store(host, port, f"{_STORE_KEY}/{restart}",
                          _STORE_TIMEOUT_S if timeout is None else timeout)


def _agree_in_store(host: str, port: int, key: str, timeout: float = _STORE_TIMEOUT_S
                   ) -> tuple[str | None, str]:
    """Agree on one fresh id with every other process that asks the c10d ``TCPStore`` at
    ``host:port`` under ``key``: the first one's id wins (one ``compare_set``, no collective;
    the processes may ask at any time). Returns ``(id, "")``, or ``(None, why)`` when the
    store did not answer in time: the call returns after ``timeout + 1`` seconds at most,
    whatever the network does (torch's client, which may retry a connect past its timeout,
    is then left to finish on its daemon thread, its answer unused)."""
    box: list[tuple[str | None, str]] = []

    def ask() -> None:
        try:
            limit = datetime.timedelta(seconds=timeout)
            store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
                host, port, is_master=False, timeout=limit)
            try:
                got = store.compare_set(key, "", uuid.uuid4().hex)
            finally:
                del store  # closes the connection
            value = got.decode() if isinstance(got, bytes) else str(got)
            box.append((value, "") if value else (None, "the store answered an empty id"))
        except Exception as exc:
            box.append((None, f"{host}:{port}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}"))

    if not torch.distributed.is_available():
        return None, "torch.distributed is not available"
    # On a thread of its own, so that the caller's wait is bounded even if a connect attempt
    # outlives torch's own timeout.
    worker = threading.Thread(target=ask, name="perfsdk-run-id", daemon=True)
    worker.start()
    worker.join(timeout + 1.0)
    return box[0] if box else (None, f"{host}:{port}: no answer in {timeout:g} s")


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
