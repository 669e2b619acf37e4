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

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import inspect
import os
import random
import statistics
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from perfsdk import _device, clocks
from perfsdk.config import state as _state
from perfsdk.context import current_span, parent_ids
from perfsdk.errors import warn_once

__all__ = ["COLLECTIVES", "DDP_REGION", "RANK_ATTRIBUTES", "StepSpread", "instrument_ddp",
           "rank_attributes", "run_id", "share_run_id", "step_trace_id", "stragglers"]

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


# os.environ's own dict of encoded names, kept in step with every change to os.environ:
# ``os.environ.get`` is three Python calls, paid at every step otherwise.
_ENV_KEYS: Any = getattr(os.environ, "_data", None)
try:
    _RUN_ID_KEY: Any = os.environ.encodekey("TORCHELASTIC_RUN_ID")
except Exception:  # another os.environ than CPython's: always ask it
    _ENV_KEYS = None


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
    if _ENV_KEYS is not None and _RUN_ID_KEY not in _ENV_KEYS:
        return None  # not under torchrun: one dict lookup (each step asks)
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
    """Milliseconds spent in collectives inside each step (by the step's span id): the union of
    their intervals where the records carry ``start_ns`` and ``end_ns`` (DDP's bucket
    all-reduces overlap one another, and a collective region may hold another), else the sum of
    their host times."""
    parent = {r.span_id: r.parent_span_id for r in regions}
    out: dict[Any, float] = {}
    spans: dict[Any, list[tuple[int, int]]] = {}
    for r in regions:
        if r.name not in COLLECTIVES and r.attributes.get("perfsdk.category") != "collective":
            continue
        up = r.parent_span_id
        for _ in range(64):  # the step above it, if any
            if up in steps:
                start, end = getattr(r, "start_ns", None), getattr(r, "end_ns", None)
                if isinstance(start, int) and isinstance(end, int) and 0 < start <= end:
                    spans.setdefault(up, []).append((start, end))
                else:
                    out[up] = out.get(up, 0.0) + float(r.host_ms)
                break
            if up not in parent:
                break
            up = parent[up]
    for step, intervals in spans.items():
        intervals.sort()
        covered, (lo, hi) = 0, intervals[0]
        for start, end in intervals[1:]:
            if start > hi:
                covered, lo, hi = covered + hi - lo, start, end
            else:
                hi = max(hi, end)
        out[step] = out.get(step, 0.0) + (covered + hi - lo) / 1e6
    return out


def stragglers(regions: Iterable[Any]) -> list[StepSpread]:
    """Per step, which rank held the others up, and by how much.

    Ranks that meet in a collective finish the step together, so step times alone hide the
    straggler: the others *wait* for it inside the collective. Each rank's busy time is its step
    less the collectives inside it (regions named as in :data:`COLLECTIVES`, or of category
    ``collective``, such as the bucket all-reduces :func:`instrument_ddp` records): the time in
    the step during which none of them was in flight. The busiest rank is the straggler.
    Without such regions the busy time is the step time.

    Args:
        regions: ``RegionResult``-like records of every rank (``name``, ``host_ms``,
            ``span_id``, ``parent_span_id`` and ``attributes`` with ``perfsdk.step`` and
            ``perfsdk.rank`` on the steps; ``start_ns`` and ``end_ns``, where present, let
            overlapping collectives count once), e.g. collected from each rank's spans; steps
            seen on fewer than two ranks are left out.

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


# -- DDP's gradient all-reduces as regions ----------------------------------------------------

DDP_REGION = "ddp.all_reduce"
"""The region :func:`instrument_ddp` records for each gradient bucket DDP reduces (category
``collective``, so :func:`stragglers` counts it as waiting)."""

_ids = random.Random()  # span ids of our own: a program's random.seed() must not repeat them
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)


class _Entry:
    """One bucket's reduction while it is in flight. It is also what perfsdk's pipeline reads
    a GPU region's device time from (``start_event``, ``end_event``, ``resolved``,
    ``device_ms``)."""

    __slots__ = ("attributes", "device_ms", "end_event", "nvtx", "parent_id", "range_id",
                 "resolved", "span_id", "spec_index", "start_event", "t0", "thread_id",
                 "trace_id", "unwrap")

    def __init__(self, spec_index: int, nvtx: Any, range_id: Any) -> None:
        self.spec_index = spec_index
        self.nvtx = nvtx
        self.range_id = range_id
        self.t0 = 0  # 0: not timed (NVTX-only mode)
        self.trace_id = self.span_id = self.parent_id = self.thread_id = 0
        self.attributes: dict[str, Any] = {}
        self.unwrap = False  # the future's value is a list holding DDP's tensor
        self.start_event: Any = None
        self.end_event: Any = None
        self.resolved = False
        self.device_ms: float | None = None


def _allreduce(group: Any, bucket: Any) -> Any:
    """DDP's all-reduce as ``torch``'s ``allreduce_hook`` computes it (the bucket divided by the
    world size, then summed over the ranks), issued on the process group itself: one Python
    call fewer than ``dist.all_reduce``. Its future's value is the list of the reduced tensors;
    the hook hands DDP the one tensor in it. DDP's Python reducer (compiled autograd) passes
    ``(grad, param)`` instead of a bucket: reduced there as DDP does without a hook."""
    if type(bucket) is tuple:
        from torch.distributed import _functional_collectives as fcol

        grad = bucket[0]
        grad.copy_(fcol.all_reduce(grad / group.size(), "sum", group))
        return None
    buffer = bucket.buffer()
    buffer.div_(group.size())
    if buffer.is_complex():  # as dist.all_reduce does it
        return torch.distributed.all_reduce(buffer, group=group, async_op=True).get_future()
    return group.allreduce([buffer]).get_future()


def _first(fut: Any) -> Any:
    return fut.value()[0]


_HOOK_SIGNATURE = inspect.Signature([
    inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    inspect.Parameter("bucket", inspect.Parameter.POSITIONAL_OR_KEYWORD),
])


class _CommHook:
    """The communication hook :func:`instrument_ddp` registers on a DDP model: it calls the
    hook it wraps (``hook``, with ``state``) and records the bucket's reduction as a
    :data:`DDP_REGION` region, from the call to the completion of the future it returns (a
    ``then`` callback on it ends the region; DDP gets the chained future)."""

    __signature__ = _HOOK_SIGNATURE  # what DDP's check of a hook's signature reads

    def __init__(self, hook: Callable[[Any, Any], Any] | None, state: Any, user: bool) -> None:
        # The engine, imported here: perfsdk.record imports this module.
        from perfsdk.pipeline import PIPELINE
        from perfsdk.record import NOTED, note_thread
        from perfsdk.region import Region, now_ns

        self._pipeline, self._noted, self._note_thread = PIPELINE, NOTED, note_thread
        self._region_type, self._now = Region, now_ns
        self.forward_parent: Any = None  # the region current at the model's last forward
        self.user = self.unwrap = False
        self.hook: Callable[[Any, Any], Any] = _allreduce
        self.state: Any = None
        self.spec: Any = None
        self.use(hook, state, user)

    def use(self, hook: Callable[[Any, Any], Any] | None, state: Any, user: bool) -> None:
        """Wrap ``hook`` with ``state`` (None: DDP's all-reduce on the process group
        ``state``) from the next bucket on."""
        from perfsdk.region import RegionSpec

        name = "allreduce" if hook is None else (getattr(hook, "__qualname__", None)
                                                 or type(hook).__qualname__)
        self.spec = RegionSpec.create(DDP_REGION, category="collective", asynchronous=True,
                                      every=1, attributes={"perfsdk.ddp.comm_hook": name},
                                      where="instrument_ddp")
        self.hook, self.unwrap = (_allreduce, True) if hook is None else (hook, False)
        self.state, self.user = state, user
        self.__name__ = getattr(hook, "__name__", name)  # DDP's hook checks and logging
        self.__qualname__ = f"perfsdk({name})"

    def note_forward(self, module: Any, args: Any) -> None:
        """A forward pre-hook on the model: the region current at its forward is the fallback
        parent of buckets reduced on a thread that has none (CUDA's autograd threads)."""
        current = current_span()
        self.forward_parent = current if isinstance(current, self._region_type) else None

    def __call__(self, state: Any, bucket: Any) -> Any:
        hook, hook_state, unwrap = self.hook, self.state, self.unwrap
        if not _state.enabled or type(bucket) is tuple:  # perfsdk off; DDP's Python reducer
            fut = hook(hook_state, bucket)              # hands (grad, param) pairs
            return fut.then(_first) if unwrap and fut is not None else fut
        try:
            entry = self._open(bucket)
        except Exception as exc:  # our bookkeeping never breaks the reduction
            warn_once("ddp-hook", f"perfsdk: could not record a DDP bucket ({exc!r}); its "
                      "all-reduce runs unrecorded.")
            fut = hook(hook_state, bucket)
            return fut.then(_first) if unwrap else fut
        try:
            fut = hook(hook_state, bucket)
        except BaseException as exc:
            self._close(entry, exc)
            raise
        try:
            then = fut.then
        except AttributeError:  # not a torch Future: DDP says so itself
            self._close(entry, None)
            return fut
        entry.unwrap = unwrap
        return then(functools.partial(self._done, entry))

    def _open(self, bucket: Any) -> _Entry:
        spec = self.spec
        dom = spec.nvtx.domain if _state.nvtx else None
        entry = _Entry(spec.index, dom,
                       None if dom is None else dom.start_range(spec.nvtx.attributes))
        if not _state.timing:  # NVTX-only mode: the range alone
            return entry
        pipeline = self._pipeline
        if not pipeline.started:
            pipeline.start()
        parent = current_span()
        if isinstance(parent, self._region_type):  # or the InnerRegion it stands for
            trace, up = parent.trace_id, parent.inner_id or parent.span_id
        else:
            trace, up = parent_ids(parent) if parent is not None else (0, 0)
        if not trace:  # no current region on this thread: the one around the model's forward,
            before = self.forward_parent  # or, once that ended, the region around it
            if before is not None:
                trace = before.trace_id
                up = before.parent_id if before.t1 else before.span_id
        entry.trace_id = trace or _ids.getrandbits(128) or 1
        entry.parent_id = up
        entry.span_id = _ids.getrandbits(64) or 1
        entry.thread_id = threading.get_ident()
        if entry.thread_id not in self._noted:  # record.NOTED: the threads already named
            self._note_thread()
        buffer = bucket.buffer()
        entry.attributes = {"perfsdk.ddp.bucket": int(bucket.index()),
                            "perfsdk.ddp.bucket_bytes": buffer.numel() * buffer.element_size()}
        if _device.initialized():  # device time: from here on this stream to the end
            event = clocks.event_pool(_device.get_backend()).get()
            event.record()
            entry.start_event = event
        entry.t0 = self._now()
        return entry

    def _done(self, entry: _Entry, fut: Any) -> Any:
        """The hook's future completed (on whichever thread completed it): end the region, and
        hand DDP the future's value (or its error) unchanged. DDP waits for the future this
        returns, so the region is recorded before ``backward()`` returns."""
        try:
            error: BaseException | None = None
            try:
                fut.value()  # no wait: the future is complete; raises the reduction's error
            except Exception as exc:
                error = exc
            self._close(entry, error)
        except Exception as exc:  # our bookkeeping never fails the reduction
            warn_once("ddp-hook-done", f"perfsdk: could not record the end of a DDP bucket's "
                      f"all-reduce ({exc!r}).")
        return fut.value()[0] if entry.unwrap else fut.value()

    def _close(self, entry: _Entry, error: BaseException | None) -> None:
        t1 = self._now()
        if entry.nvtx is not None:
            entry.nvtx.end_range(entry.range_id)
        if not entry.t0:
            return
        start, end = entry.start_event, None
        if start is not None:
            # In a CUDA future's callback the current stream waits for the all-reduce, so this
            # event completes when the reduction has finished on the device.
            end = clocks.event_pool(_device.get_backend()).get()
            end.record()
        entry.end_event = end
        entry.resolved = end is None
        pipeline = self._pipeline
        pipeline.submit((entry.spec_index, entry.trace_id, entry.span_id, entry.parent_id,
                         entry.t0, t1, entry.thread_id, error, entry.attributes, None, None,
                         start, end, None if end is None else entry, None))
        if end is not None:
            pipeline.poke()

    def register_after(self, model: Any, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        """``model.register_comm_hook(state, hook)`` once perfsdk's hook is in: DDP takes one
        hook only, so perfsdk's wraps the user's from the next bucket on. A second user hook
        is refused as DDP refuses it."""
        if self.user:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once "
                f"(this DDP model's communication hook is already {self.hook!r}, wrapped by "
                "perfsdk.distributed.instrument_ddp)")
        check = getattr(model, "_check_comm_hook", None)
        if check is not None:
            check(hook)  # DDP's own checks of the hook
        self.use(hook, state, True)
        logger = getattr(model, "logger", None)
        if logger is not None:
            with contextlib.suppress(Exception):
                logger._set_comm_hook_name(self.__qualname__)


def _hook_of(model: Any) -> _CommHook | None:
    for hook, _ in getattr(model, "_comm_hooks", ()):
        if isinstance(hook, _CommHook):
            return hook
    return None


def _describe(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def instrument_ddp(model: torch.nn.parallel.DistributedDataParallel, *,
                   hook: Callable[[Any, Any], Any] | None = None, state: Any = None
                   ) -> torch.nn.parallel.DistributedDataParallel:
    """Record the gradient all-reduces of a ``DistributedDataParallel`` model as regions.

    DDP reduces the gradients in buckets during ``backward()``, and a rank that finished its
    backward early waits there for the slowest one, inside ``backward()``, where no region
    shows it. This registers a communication hook that wraps DDP's default all-reduce (or
    ``hook``), and records each bucket as a :data:`DDP_REGION` region of category
    ``collective`` (attributes ``perfsdk.ddp.bucket``, ``perfsdk.ddp.bucket_bytes`` and
    ``perfsdk.ddp.comm_hook``), nested in the region current at ``backward()`` (the step).
    :func:`stragglers` then tells the slow rank: the others' time in these regions is their
    wait for it. ``perfsdk run`` calls it on the first DDP model it sees called.

    What a region measures: from the hook's call (the bucket's gradients are ready, and the
    all-reduce is issued) to the completion of the future it returns. On gloo that is when the
    all-reduce has finished, so the host time is the wait. On NCCL the future completes on the
    host as soon as the all-reduce is queued on its stream, so the host time is short; the
    region's device time (on a GPU) runs from the bucket being ready on the stream to the
    all-reduce's end. Nothing waits for anything: the region ends in a callback chained on the
    future (``then``), on whichever thread completes it, and DDP's own wait for that chained
    future at the end of ``backward()`` is the only one (so every bucket's region is recorded
    by the time ``backward()`` returns).

    DDP accepts one communication hook per model. To use one of your own with perfsdk's,
    pass it here (``hook``, ``state``: what you would give ``model.register_comm_hook``), or
    call ``model.register_comm_hook(state, hook)`` after this: perfsdk's hook then wraps
    yours. A hook registered *before* this cannot be wrapped (DDP offers no way to replace
    it), and this raises, saying so.

    Args:
        model: the ``torch.nn.parallel.DistributedDataParallel`` model.
        hook: a communication hook ``hook(state, bucket) -> torch.futures.Future`` to wrap;
            default: DDP's all-reduce on the model's process group (what ``torch``'s
            ``allreduce_hook`` does: the bucket divided by the world size, summed over the
            ranks; DDP without a hook computes the same).
        state: the ``state`` argument for ``hook``.

    Returns:
        ``model``, with the hook registered (calling this again changes nothing, except that
        a ``hook`` given then is wrapped as ``model.register_comm_hook`` would).

    Raises:
        ValueError: ``model`` is not a ``DistributedDataParallel`` model, or ``hook`` is not
            callable.
        RuntimeError: the model already has a communication hook (one of yours, a built-in
            one, DDP's mixed-precision hook); register yours through ``hook=`` instead.
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp):
        raise ValueError(f"instrument_ddp: model is a {type(model).__name__}; accepted values "
                         "are torch.nn.parallel.DistributedDataParallel models (wrap it first: "
                         "DistributedDataParallel(model))")
    if hook is not None and not callable(hook):
        raise ValueError(f"instrument_ddp: hook={hook!r}; accepted values are None or a "
                         "callable hook(state, bucket) -> torch.futures.Future")
    ours = _hook_of(model)
    if ours is not None:
        if hook is not None:
            ours.register_after(model, state, hook)
        return model
    registered = getattr(model, "_comm_hooks", None) or []
    if registered:
        theirs = _describe(registered[0][0])
        raise RuntimeError(
            f"instrument_ddp: this DDP model already has a communication hook ({theirs}), and "
            "DDP takes one only, so perfsdk cannot wrap it. Register it through perfsdk "
            f"instead: perfsdk.distributed.instrument_ddp(model, hook={theirs}, state=...) in "
            "place of model.register_comm_hook(state, hook), or call instrument_ddp(model) "
            "first and register your hook after it.")
    if hook is None:
        wrapper = _CommHook(None, model.process_group, user=False)
    else:
        check = getattr(model, "_check_comm_hook", None)
        if check is not None:
            check(hook)
        wrapper = _CommHook(hook, state, user=True)
    try:
        ddp.register_comm_hook(model, None, wrapper)
    except RuntimeError as exc:
        raise RuntimeError(
            "instrument_ddp: DDP refused perfsdk's communication hook: this model already has "
            "one (a built-in hook, DDP's mixed precision or a fused optimizer), and DDP takes "
            "one only. Pass a hook of your own through instrument_ddp(model, hook=..., "
            f"state=...) instead. DDP said: {exc}") from exc
    model.register_forward_pre_hook(wrapper.note_forward)
    # A hook the program registers from now on is wrapped, not refused (DDP takes one only).
    model.register_comm_hook = functools.partial(  # type: ignore[method-assign]
        wrapper.register_after, model)
    return model
