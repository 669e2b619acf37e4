"""The local trace file: every resolved region as a Chrome Trace Event Format JSON file that opens
in ui.perfetto.dev, chrome://tracing and the Chrome DevTools Performance panel.

With ``PERFSDK_EXPORTER=trace`` (or ``configure(exporter="trace")``) :class:`TraceSink` keeps the
regions in memory (at most ``max_events``; the rest are counted, never silently lost) and writes
``<output_dir>/trace-<pid>.json`` completely at each :func:`perfsdk.flush` and at shutdown, on
a writer thread of its own (the caller only waits, at most the flush timeout), through a
temporary file and ``os.replace``: whoever opens the file sees the previous or the new
trace, never half of one. :func:`write_trace` writes the same file from ``RegionResult`` s.

The file:

* one complete event (``"ph": "X"``) per region: ``name``, ``cat`` (the region's category, else
  ``perfsdk``), ``pid``, ``tid`` (the thread's OS id), ``ts`` and ``dur`` in microseconds with
  exactly three decimals (whole nanoseconds, no float rounding), ``args`` (the region's
  attributes, ``perfsdk.rank`` / ``perfsdk.local_rank`` / ``perfsdk.world_size`` in a
  multi-process job (:func:`perfsdk.distributed.rank_attributes`), ``perfsdk.host_ms``,
  ``perfsdk.device_ms``, ``perfsdk.memory.*``, ``exception.type`` / ``exception.message``,
  ``hw.gpu.*`` while GPU sampling is on);
* ``ts`` is the host's ``perf_counter`` clock (``CLOCK_MONOTONIC`` on Linux), the clock every
  region is measured with, shared by all processes of the machine, so files from DataLoader
  workers or ranks on one node line up; ``otherData`` gives the wall-clock epoch of ``ts = 0``;
* metadata events name the process and each thread lane, also the lane of a thread that ended
  before its regions were exported (its name is noted at its first region: perfsdk.record's
  ``THREAD_NAMES``); a later thread that reuses a dead thread's ident gets a lane and name of its
  own. A child is emitted after its parent and
  always lies inside it (same clock, exact integers). Regions of one thread that overlap without
  nesting (asyncio tasks interleaving) go to an extra lane, ``<thread> (overlap N)``, because
  trace viewers require the slices of one lane to nest;
* device time is an argument, ``perfsdk.device_ms``, not a lane: a CUDA event pair gives a
  duration, not a position on the GPU's timeline, so a bar placed at the host start would draw GPU
  work where it did not run and, overlapping its neighbours, break the nesting viewers rely on.
  For the GPU's own timeline use Nsight Systems or ``torch.profiler``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from perfsdk import clocks
from perfsdk import gpu as _gpu
from perfsdk._version import __version__
from perfsdk.config import Config
from perfsdk.distributed import rank_attributes
from perfsdk.errors import warn_once
from perfsdk.memory import memory_attributes
from perfsdk.record import (
    ATTRS,
    DEVICE_MS,
    ERROR,
    MEMORY,
    PARENT,
    SPAN,
    SPEC,
    SPECS,
    T0,
    T1,
    THREAD,
    THREAD_NAMES,
    RegionResult,
)

__all__ = ["MAX_EVENTS", "TraceSink", "write_trace"]

MAX_EVENTS = 250_000
"""Regions a :class:`TraceSink` keeps by default (about 300 bytes each in memory); the
``PERFSDK_TRACE_MAX_REGIONS`` setting."""

_LANE_STRIDE = 1 << 22
"""Added to a thread's id per overlap lane (Linux thread ids stay below 2**22)."""
_UNKNOWN_TID = 1 << 30
"""First lane id for threads whose OS id is unknown or already taken by another lane."""
_MAX_LANES = 255

# A stored region: (name, cat, t0, t1, thread ident, span id, parent span id, declared attributes,
# extra attributes | None, memory | None, device_ms | None, (error type, message) | None,
# the process's rank attributes | None (shared by the events of one batch)).
_Event = tuple[Any, ...]


def write_trace(path: str | os.PathLike[str], regions: Iterable[RegionResult]) -> Path:
    """Write ``regions`` as a Chrome / Perfetto JSON trace at ``path`` (replaced atomically).

    Args:
        path: the file to write; its directory is created when missing.
        regions: ``RegionResult`` s, e.g. ``perfsdk.testing.capture().regions``.

    Returns:
        The path written.

    Raises:
        ValueError: ``path`` is not a path, or ``regions`` holds something else than
            ``RegionResult`` s.
        OSError: the file could not be written.

    Example:
        >>> import tempfile, perfsdk
        >>> from perfsdk.testing import capture
        >>> with capture() as cap, perfsdk.timed_region("work"):
        ...     pass
        >>> out = write_trace(tempfile.mkdtemp() + "/trace.json", cap.regions)
        >>> out.name
        'trace.json'
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"write_trace(path={path!r}): accepted values are a file path "
                         "(str or os.PathLike)")
    if isinstance(regions, (str, bytes, Mapping)) or not isinstance(regions, Iterable):
        raise ValueError(f"write_trace(regions={regions!r}): accepted values are an iterable "
                         "of perfsdk.RegionResult")
    events = []
    for region in regions:
        if not isinstance(region, RegionResult):
            raise ValueError(f"write_trace(regions=...): found {type(region).__name__}; "
                             "accepted values are an iterable of perfsdk.RegionResult")
        events.append(_from_result(region))
    target = Path(path)
    _atomic_write(target, render(events, _threads({e[4] for e in events}, {}), dropped=0))
    return target


class TraceSink:
    """A pipeline sink that writes the trace file when the ``trace`` exporter is on.

    Regions are kept in memory (at most ``max_events``, default ``PERFSDK_TRACE_MAX_REGIONS``;
    the rest counted); the file is rendered and written on a writer thread of its own, never on
    the caller's or the pipeline's, when :meth:`flush` or :meth:`shutdown` asks (each waits at
    most its timeout).
    """

    def __init__(self, config: Config, *, max_events: int | None = None) -> None:
        if max_events is not None and (isinstance(max_events, bool) or
                                       not isinstance(max_events, int) or max_events < 1):
            raise ValueError(f"TraceSink(max_events={max_events!r}): accepted values are "
                             "integers >= 1")
        self._fixed_max = max_events
        self.max_events = max_events or config.trace_max_regions
        self._write_lock = threading.Lock()
        self._writer_state()
        self._reset()
        self.output_dir: Path | None = None
        self.configure(config)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._events: list[_Event] = []
        self._threads: dict[int, tuple[int, str]] = {}
        self._lane_of: dict[int, tuple[int, Any]] = {}
        self.dropped = 0
        self._dirty = False

    def _writer_state(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._requested = 0
        self._done = 0
        self._jobs: list[tuple[Path, list[_Event], dict[int, tuple[int, str]], int]] = []
        self._writer: threading.Thread | None = None

    @property
    def path(self) -> Path | None:
        """This process's trace file, or None while the ``trace`` exporter is off."""
        out = self.output_dir
        return None if out is None else out / f"trace-{os.getpid()}.json"

    def configure(self, config: Config, timeout: float | None = None) -> None:
        """Turn the file on or off, or move it: what was collected goes to the old file first
        (written on the writer thread; waited for at most ``timeout`` seconds, default the new
        ``export_timeout_s``)."""
        if self._fixed_max is None:
            self.max_events = config.trace_max_regions
        new_dir = config.output_dir if "trace" in config.exporters else None
        if new_dir == self.output_dir:
            return
        ticket = None
        with self._lock:
            path = self.path
            if path is not None and self._dirty:
                ticket = self._request((path, self._events, self._threads, self.dropped))
            self._events, self._threads, self.dropped, self._dirty = [], {}, 0, False
            self._lane_of = {}
            self.output_dir = new_dir
        if ticket is not None:
            self._wait(ticket, config.export_timeout_s if timeout is None else timeout)

    def consume(self, records: list[Any]) -> None:
        if self.output_dir is None:
            return
        window = _gpu.TELEMETRY.window
        ranks = rank_attributes() or None  # this process's rank: once per batch, as spans do
        with self._lock:
            room = self.max_events - len(self._events)
            keep = records if room >= len(records) else records[:max(room, 0)]
            events = self._events
            if keep:
                lane = self._see_threads({rec[THREAD] for rec in keep})
                for rec in keep:
                    events.append(_from_record(rec, window, lane[rec[THREAD]], ranks))
                self._dirty = True
            lost = len(records) - len(keep)
        if lost:
            with self._lock:
                self.dropped += lost
                self._dirty = True
            warn_once("trace-cap", f"perfsdk: the trace file holds at most {self.max_events:,} "
                      f"regions (PERFSDK_TRACE_MAX_REGIONS); later ones are counted (otherData "
                      f"'perfsdk.dropped_regions' in {self.path}) but not written.")

    def tally(self, overflow: dict[int, list[int]]) -> None:
        """Regions the pipeline could not queue (``{spec index: [calls, host ns, errors]}``):
        not in the trace, but counted in its ``perfsdk.dropped_regions``."""
        if self.output_dir is None:
            return
        with self._lock:
            self.dropped += sum(calls for calls, _, _ in overflow.values())
            self._dirty = True

    def _see_threads(self, idents: set[int]) -> dict[int, int]:
        """Thread ident -> lane key for one batch of records: the ident itself, or, for a later
        thread that reuses the ident of a thread already in the trace (its entry in
        ``THREAD_NAMES`` was replaced), a key of its own, so each thread keeps its own lane and
        name. A thread's records exported only after a later one took its ident are named
        after the later one (Python gives no cheaper way to tell them apart)."""
        out: dict[int, int] = {}
        new: dict[int, int] = {}
        lane_of = self._lane_of
        for ident in idents:
            entry = THREAD_NAMES.get(ident)
            seen = lane_of.get(ident)
            if seen is not None and (entry is None or seen[1] is entry):
                out[ident] = seen[0]
                continue
            key = ident if seen is None else ident + ((len(self._threads) + 1) << 64)
            lane_of[ident] = (key, entry)
            out[ident] = new[ident] = key
        if new:
            named = _threads(new, self._threads)
            for ident, key in new.items():
                self._threads[key] = named[ident]
        return out

    def flush(self, timeout: float) -> None:
        self._wait(self._request(), timeout)

    def shutdown(self, timeout: float) -> None:
        self._wait(self._request(), timeout)

    def after_fork(self) -> None:
        """A forked child writes its own file (its own pid) with its own regions only."""
        self._write_lock = threading.Lock()
        self._writer_state()
        self._reset()

    def stats(self) -> dict[str, int]:
        return {"trace_regions": len(self._events), "trace_regions_dropped": self.dropped}

    # -- the writer thread -------------------------------------------------------------------
    def _request(self, job: Any = None) -> int:
        """Ask the writer thread for a write (of ``job``, else of the current file)."""
        with self._cond:
            if job is not None:
                self._jobs.append(job)
            self._requested += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="perfsdk-trace-writer",
                                                daemon=True)
                self._writer.start()
            self._cond.notify_all()
            return self._requested

    def _wait(self, ticket: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= ticket, max(timeout, 0.0))

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._requested > self._done)
                target, jobs, self._jobs = self._requested, self._jobs, []
            if os.getpid() != pid:
                return
            for path, events, threads, dropped in jobs:
                self._write_file(path, events, threads, dropped)
            self._write()
            with self._cond:
                self._done = target
                self._cond.notify_all()

    def _write(self) -> None:
        with self._lock:
            path = self.path
            if path is None or not self._dirty:
                return
            events, threads, dropped = list(self._events), dict(self._threads), self.dropped
            self._dirty = False
        if not self._write_file(path, events, threads, dropped):
            with self._lock:
                self._dirty = True

    def _write_file(self, path: Path, events: list[_Event],
                    threads: Mapping[int, tuple[int, str]], dropped: int) -> bool:
        with self._write_lock:
            try:
                _atomic_write(path, render(events, threads, dropped))
            except Exception as exc:  # never break the program: warn once, try again next flush
                warn_once("trace-write", f"perfsdk: could not write the trace file {path} "
                          f"({exc!r}); check PERFSDK_OUTPUT_DIR.")
                return False
            return True


# -- building events ---------------------------------------------------------------------------
def _error(error: BaseException | None) -> tuple[str, str] | None:
    if error is None:
        return None
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    return name, str(error)


def _from_record(rec: Any, window: Any, lane: int, ranks: Mapping[str, int] | None = None
                 ) -> _Event:
    spec = SPECS[rec[SPEC]]
    extra = rec[ATTRS]
    if window is not None:
        readings = window(rec[T0], rec[T1])
        if readings:
            extra = {**(extra or {}), **readings}
    return (spec.name, spec.category, rec[T0], rec[T1], lane, rec[SPAN], rec[PARENT],
            spec.attributes, extra, rec[MEMORY], rec[DEVICE_MS], _error(rec[ERROR]), ranks)


def _from_result(r: RegionResult) -> _Event:
    origin = clocks.epoch_ns(0)
    return (r.name, r.attributes.get("perfsdk.category"), r.start_ns - origin, r.end_ns - origin,
            r.thread_id, r.span_id, r.parent_span_id, r.attributes, None, r.memory, r.device_ms,
            _error(r.error), None)  # a RegionResult's attributes hold its rank already


def _args(e: _Event) -> dict[str, Any]:
    args = dict(e[7])
    if e[8]:
        args.update(e[8])
    if e[12]:
        args.update(e[12])
    args["perfsdk.host_ms"] = (e[3] - e[2]) / 1e6
    if e[10] is not None:
        args["perfsdk.device_ms"] = e[10]
    memory = e[9]
    if memory is not None:
        args.update(memory if isinstance(memory, Mapping) else memory_attributes(memory))
    if e[11] is not None:
        args["exception.type"], args["exception.message"] = e[11]
    return args


def _threads(idents: Iterable[int], known: Mapping[int, tuple[int, str]]
             ) -> dict[int, tuple[int, str]]:
    """Thread ident -> (OS thread id, name): a live thread's own (a rename shows), else the
    name and id noted at the thread's first region; a lane id of its own when the OS id is
    unknown or taken, and ``thread <ident>`` only for a thread never noted."""
    live = {t.ident: t for t in threading.enumerate()}
    taken = {tid for tid, _ in known.values()}
    out: dict[int, tuple[int, str]] = {}
    for ident in sorted(idents):
        thread = live.get(ident)
        noted = THREAD_NAMES.get(ident)
        native: int | None
        if thread is not None:
            name, native = thread.name, thread.native_id
        elif noted is not None:
            name, native = noted
        else:
            name, native = f"thread {ident}", None
        if isinstance(native, int) and 0 < native < _LANE_STRIDE and native not in taken:
            out[ident] = (native, name)
        else:
            out[ident] = (_UNKNOWN_TID + len(taken), name)
        taken.add(out[ident][0])
    return out


# -- writing -----------------------------------------------------------------------------------
def _us(ns: int) -> str:
    """Nanoseconds as microseconds with exactly three decimals, formatted from the integer."""
    sign = "-" if ns < 0 else ""
    whole, frac = divmod(abs(int(ns)), 1000)
    return f"{sign}{whole}.{frac:03d}"


def _json(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), default=str)
    except ValueError:  # NaN or infinity: not JSON; written as strings
        return json.dumps(_finite(value), separators=(",", ":"), default=str)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _depths(events: list[_Event]) -> dict[int, int]:
    """Span id -> nesting depth among the regions present (roots 0), for tie-breaking."""
    parent = {e[5]: e[6] for e in events}
    depth: dict[int, int] = {}
    for span in parent:
        chain: list[int] = []
        while span in parent and span not in depth and len(chain) <= len(parent):
            chain.append(span)
            span = parent[span]
        base = depth.get(span, -1)
        for s in reversed(chain):
            base += 1
            depth[s] = base
    return depth


def _lanes(events: list[_Event]) -> list[int]:
    """For events of one thread sorted parent-first: the lane each goes to so that every lane
    nests properly (0 = the thread's own lane)."""
    stacks: list[list[int]] = []
    lanes = []
    for e in events:
        t0, t1 = e[2], e[3]
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= t0:
                stack.pop()
            if not stack or t1 <= stack[-1]:
                stack.append(t1)
                lanes.append(k)
                break
        else:
            if len(stacks) < _MAX_LANES:
                stacks.append([t1])
            lanes.append(len(stacks) - 1)  # past the limit: improperly nested, still written
    return lanes


def render(events: list[_Event], threads: Mapping[int, tuple[int, str]], dropped: int) -> str:
    """The trace file's text for stored events."""
    pid = os.getpid()
    depth = _depths(events)
    by_thread: dict[int, list[_Event]] = {}
    for e in events:
        by_thread.setdefault(e[4], []).append(e)
    process = Path(sys.argv[0]).name if sys.argv and sys.argv[0][:1] not in ("", "-") else "python"
    lines = [_json({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": process}})]
    body: list[str] = []
    firsts = sorted(by_thread.items(), key=lambda kv: min(e[2] for e in kv[1]))
    for order, (ident, group) in enumerate(firsts):
        tid, name = threads.get(ident) or (_UNKNOWN_TID - 1 - order, f"thread {ident}")
        group.sort(key=lambda e: (e[2], e[2] - e[3], depth.get(e[5], 0)))
        lanes = _lanes(group)
        for k in sorted(set(lanes)):
            lane_tid = tid + k * _LANE_STRIDE
            label = name if k == 0 else f"{name} (overlap {k})"
            lines.append(_json({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_tid,
                                "args": {"name": label}}))
            lines.append(_json({"ph": "M", "name": "thread_sort_index", "pid": pid,
                                "tid": lane_tid, "args": {"sort_index": order * 256 + k}}))
        for e, k in zip(group, lanes, strict=True):
            body.append(
                f'{{"ph":"X","name":{_json(e[0])},"cat":{_json(e[1] or "perfsdk")},'
                f'"pid":{pid},"tid":{tid + k * _LANE_STRIDE},"ts":{_us(e[2])},'
                f'"dur":{_us(e[3] - e[2])},"args":{_json(_args(e))}}}')
    other = {"perfsdk.version": __version__, "perfsdk.regions": len(events),
             "perfsdk.dropped_regions": dropped,
             "perfsdk.clock": "host perf_counter (CLOCK_MONOTONIC on Linux), microseconds",
             "perfsdk.ts_origin_epoch_ns": clocks.epoch_ns(0)}
    return ('{"traceEvents":[\n' + ",\n".join(lines + body) + '\n],"displayTimeUnit":"ms",'
            f'"otherData":{_json(other)}}}\n')


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
