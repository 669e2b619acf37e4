"""The local trace file: every resolved region as a Chrome Trace Event Format JSON file that opens
in ui.perfetto.dev, chrome://tracing and the Chrome DevTools Performance panel.

With ``PERFSDK_EXPORTER=trace`` (or ``configure(exporter="trace")``) :class:`TraceSink` renders
each region once, on a writer thread of its own (never the caller's or the pipeline's): at most
``max_events`` of them (the rest are counted, never silently lost), held as the file's text. It
writes ``<output_dir>/trace-<pid>.json`` at each :func:`perfsdk.flush`, at shutdown and every
:data:`WRITE_EVERY_S` seconds while regions arrive (so a process killed without its exit still
leaves its trace), through a temporary file and ``os.replace``: whoever opens the file sees the
previous or the new trace, never half of one. A write renders only the regions that arrived
since the last one and writes out the rest as text, so what a flush costs does not grow with the
regions already in the file (the whole file was rendered again at every flush, about 10 us a
region: 1.5 s for 160,000). :func:`write_trace` writes the same file from ``RegionResult`` s.

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
  own. A child always lies inside its parent (same clock, exact integers). Within one write,
  slices follow their start, a parent before a child that starts at the same nanosecond; a
  region that ended after a write follows the slices that write held (viewers order slices by
  their start themselves). Regions of one thread that overlap without
  nesting (asyncio tasks interleaving) go to an extra lane, ``<thread> (overlap N)``, because
  trace viewers require the slices of one lane to nest;
* device time is an argument, ``perfsdk.device_ms``, not a lane: a CUDA event pair gives a
  duration, not a position on the GPU's timeline, so a bar placed at the host start would draw GPU
  work where it did not run and, overlapping its neighbours, break the nesting viewers rely on.
  For the GPU's own timeline use Nsight Systems or ``torch.profiler``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import sys
import threading
import time
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
"""Regions a :class:`TraceSink` writes by default (held as the file's text, about 200 bytes
each); the ``PERFSDK_TRACE_MAX_REGIONS`` setting."""

WRITE_EVERY_S = 30.0
"""Seconds between the writer thread's own writes of the file while regions arrive (besides
:func:`perfsdk.flush` and shutdown): a process killed without its exit leaves its trace as of
then."""

RENDER_EVERY_S = 1.0
"""Seconds between the writer thread's renderings of the regions that arrived, so that a flush
or the exit has at most about this long's regions left to render."""
RENDER_CHUNK = 32
"""Regions the writer renders between rests outside a flush (about 0.3 ms of work)."""
RENDER_REST_S = 0.0002
"""The writer's rest between chunks: it gives the GIL back to the training thread at once."""
_rest = time.sleep

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
    out = _TraceFile()
    failed = out.render(events, _threads({e[4] for e in events}, {}))
    out.write(target, dropped=failed)
    return target


class TraceSink:
    """A pipeline sink that writes the trace file when the ``trace`` exporter is on.

    The pipeline hands it records (:meth:`consume`: at most ``max_events``, default
    ``PERFSDK_TRACE_MAX_REGIONS``, are kept; the rest counted); a writer thread of its own, never
    the caller's or the pipeline's, renders them every :data:`RENDER_EVERY_S` seconds and writes
    the file when :meth:`flush` or :meth:`shutdown` asks (each waits at most its timeout) and
    every :data:`WRITE_EVERY_S` seconds while regions arrive.
    """

    def __init__(self, config: Config, *, max_events: int | None = None) -> None:
        if max_events is not None and (isinstance(max_events, bool) or
                                       not isinstance(max_events, int) or max_events < 1):
            raise ValueError(f"TraceSink(max_events={max_events!r}): accepted values are "
                             "integers >= 1")
        self._fixed_max = max_events
        self.max_events = max_events or config.trace_max_regions
        self.render_every_s = RENDER_EVERY_S
        self.write_every_s = WRITE_EVERY_S
        self._write_lock = threading.Lock()
        self._writer_state()
        self._reset()
        self.output_dir: Path | None = None
        self.configure(config)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._file = _TraceFile()

    def _writer_state(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._requested = 0
        self._done = 0
        self._jobs: list[tuple[Path, _TraceFile]] = []
        self._writer: threading.Thread | None = None

    @property
    def path(self) -> Path | None:
        """This process's trace file, or None while the ``trace`` exporter is off."""
        out = self.output_dir
        return None if out is None else out / f"trace-{os.getpid()}.json"

    @property
    def dropped(self) -> int:
        """Regions of the current file that are counted but not written."""
        return self._file.dropped

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
            if path is not None and self._file.dirty:
                ticket = self._request((path, self._file))
            self._file = _TraceFile()
            self.output_dir = new_dir
        if ticket is not None:
            self._wait(ticket, config.export_timeout_s if timeout is None else timeout)

    def consume(self, records: list[Any]) -> None:
        if self.output_dir is None:
            return
        window = _gpu.TELEMETRY.window
        ranks = rank_attributes() or None  # this process's rank: once per batch, as spans do
        with self._lock:
            out = self._file
            room = self.max_events - out.count
            keep = records if room >= len(records) else records[:max(room, 0)]
            if keep:
                lane = self._see_threads(out, {rec[THREAD] for rec in keep})
                pending = out.pending
                for rec in keep:
                    pending.append(_from_record(rec, window, lane[rec[THREAD]], ranks))
                out.count += len(keep)
                out.dirty = True
            lost = len(records) - len(keep)
            if lost:
                out.dropped += lost
                out.dirty = True
        if self._writer is None:
            self._start_writer()
        if lost:
            warn_once("trace-cap", f"perfsdk: the trace file holds at most {self.max_events:,} "
                      f"regions (PERFSDK_TRACE_MAX_REGIONS); later ones are counted (otherData "
                      f"'perfsdk.dropped_regions' in {self.path}) but not written.")

    def tally(self, overflow: dict[int, list[int]]) -> None:
        """Regions the pipeline could not queue (``{spec index: [calls, host ns, errors]}``):
        not in the trace, but counted in its ``perfsdk.dropped_regions``."""
        if self.output_dir is None:
            return
        with self._lock:
            self._file.dropped += sum(calls for calls, _, _ in overflow.values())
            self._file.dirty = True

    @staticmethod
    def _see_threads(out: _TraceFile, idents: set[int]) -> dict[int, int]:
        """Thread ident -> lane key for one batch of records: the ident itself, or, for a later
        thread that reuses the ident of a thread already in the trace (its entry in
        ``THREAD_NAMES`` was replaced), a key of its own, so each thread keeps its own lane and
        name. A thread's records exported only after a later one took its ident are named
        after the later one (Python gives no cheaper way to tell them apart)."""
        result: dict[int, int] = {}
        new: dict[int, int] = {}
        lane_of = out.lane_of
        for ident in idents:
            entry = THREAD_NAMES.get(ident)
            seen = lane_of.get(ident)
            if seen is not None and (entry is None or seen[1] is entry):
                result[ident] = seen[0]
                continue
            key = ident if seen is None else ident + ((len(out.threads) + 1) << 64)
            lane_of[ident] = (key, entry)
            result[ident] = new[ident] = key
        if new:
            named = _threads(new, out.threads)
            for ident, key in new.items():
                out.threads[key] = named[ident]
        return result

    def flush(self, timeout: float) -> None:
        self._finish(timeout, "flush")

    def shutdown(self, timeout: float) -> None:
        self._finish(timeout, "exit")

    def _finish(self, timeout: float, what: str) -> None:
        """Ask for a write and wait for it at most ``timeout`` seconds; warn once when the file
        is not written by then (it keeps what its last write held; the writer goes on)."""
        path = self.path
        if not self._wait(self._request(), timeout) and path is not None:
            warn_once(f"trace-{what}-timeout", f"perfsdk: the trace file {path} was not written "
                      f"within {timeout:g} s at {what} (PERFSDK_EXPORT_TIMEOUT); it holds the "
                      "regions of its last write (a slow disk, or a very large file).")

    def after_fork(self) -> None:
        """A forked child writes its own file (its own pid) with its own regions only."""
        self._write_lock = threading.Lock()
        self._writer_state()
        self._reset()

    def stats(self) -> dict[str, int]:
        return {"trace_regions": self._file.count, "trace_regions_dropped": self._file.dropped}

    # -- the writer thread -------------------------------------------------------------------
    def _start_writer(self) -> None:
        with self._cond:
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="perfsdk-trace-writer",
                                                daemon=True)
                self._writer.start()

    def _request(self, job: tuple[Path, _TraceFile] | None = None) -> int:
        """Ask the writer thread for a write (of ``job``, else of the current file)."""
        self._start_writer()
        with self._cond:
            if job is not None:
                self._jobs.append(job)
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def _wait(self, ticket: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= ticket, max(timeout, 0.0))

    def _run(self) -> None:
        pid = os.getpid()
        written = time.monotonic()
        while True:
            with self._cond:
                asked = self._cond.wait_for(lambda: self._requested > self._done,
                                            self.render_every_s)
                target, jobs, self._jobs = self._requested, self._jobs, []
            if os.getpid() != pid:
                return
            for path, out in jobs:
                self._write_file(path, out)
            now = time.monotonic()
            if asked or now - written >= self.write_every_s:
                self._write()
                written = now
            else:  # between writes: render what arrived, so a write has little left to do
                try:
                    self._render_paced(self._file)
                except Exception as exc:  # never end the writer: the next write says why
                    warn_once("trace-render", f"perfsdk: the trace writer failed ({exc!r})")
            if asked:
                with self._cond:
                    self._done = target
                    self._cond.notify_all()

    def _take(self, out: _TraceFile) -> tuple[list[_Event], dict[int, tuple[int, str]]]:
        """The regions ``out`` holds pending, taken from it, and the thread names they need."""
        with self._lock:
            events, out.pending = out.pending, []
            return events, dict(out.threads)

    def _render(self, out: _TraceFile) -> int:
        """Render the regions ``out`` holds pending (the writer's work, under its lock);
        returns the regions dropped so far, for the file's ``otherData``."""
        return self._render_events(out, *self._take(out))

    def _render_events(self, out: _TraceFile, events: list[_Event],
                       names: Mapping[int, tuple[int, str]]) -> int:
        failed = out.render(events, names)
        with self._lock:
            out.dropped += failed
            out.count -= failed
            return out.dropped

    def _render_paced(self, out: _TraceFile) -> None:
        """Render the pending regions :data:`RENDER_CHUNK` at a time, resting
        :data:`RENDER_REST_S` between chunks: the training thread waits at most a chunk's work
        for the GIL (a second's regions at once held it up to Python's 5 ms switch interval).
        A write asked for meanwhile (a flush) gets the rest rendered at once."""
        events, names = self._take(out)
        for i in range(0, len(events), RENDER_CHUNK):
            if self._requested > self._done:  # someone waits: no more rests
                with self._write_lock:
                    self._render_events(out, events[i:], names)
                return
            with self._write_lock:
                self._render_events(out, events[i:i + RENDER_CHUNK], names)
            _rest(RENDER_REST_S)

    def _write(self) -> None:
        with self._lock:
            path, out = self.path, self._file
            if path is None or not out.dirty:
                return
            out.dirty = False
        if not self._write_file(path, out):
            with self._lock:
                out.dirty = True

    def _write_file(self, path: Path, out: _TraceFile) -> bool:
        with self._write_lock:
            try:
                out.write(path, self._render(out))
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
        return _ENCODE(value)
    except ValueError:  # NaN or infinity: not JSON; written as strings
        return json.dumps(_finite(value), separators=(",", ":"), default=str)


_ENCODE = json.JSONEncoder(allow_nan=False, separators=(",", ":"), default=str).encode
"""``json.dumps(value, allow_nan=False, separators=(",", ":"), default=str)``, without making
an encoder at each call."""
_NAMES: dict[Any, str] = {}
"""Region names and categories as JSON strings (a few hundred at most: region specs')."""


def _name(value: Any) -> str:
    """``_json(value)`` for a region's name or category, remembered (at most 4,096)."""
    text = _NAMES.get(value)
    if text is None:
        if len(_NAMES) >= 4096:
            _NAMES.clear()
        text = _NAMES[value] = _json(value)
    return text


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


class _Lanes:
    """One thread's lanes, so that the slices of each nest: where each region goes as regions
    arrive, in any order, without the regions already placed (a region goes to the first lane
    where it provably nests, else to a new one).

    A lane keeps its outermost regions (disjoint, in start order, as two lists); what they hold
    nests in them and is forgotten. A region fits a lane when it holds or misses each of them:
    a thread's regions arrive in the order they ended, children first, so the new region holds
    those it overlaps. One that lies inside a kept region (it ended earlier than one already
    placed: held back for its GPU work) cannot be checked against the forgotten ones, and goes
    to another lane. Each lane keeps at most :data:`_KEEP` outermost regions; of the ones it
    forgets past that it notes the span, and a region that reaches into that span fits only if
    it holds all of it (an epoch's region around its steps)."""

    __slots__ = ("gone", "lanes")

    def __init__(self) -> None:
        self.lanes: list[tuple[list[int], list[int]]] = []
        self.gone: list[tuple[int, int] | None] = []  # (first start, last end) forgotten

    def place(self, t0: int, t1: int) -> int:
        """The lane of a region from ``t0`` to ``t1`` (0 = the thread's own), noted there."""
        for k, (starts, ends) in enumerate(self.lanes):
            gone = self.gone[k]
            if gone is not None and t0 < gone[1]:
                if t0 > gone[0] or t1 < gone[1] or not _fit(starts, ends, t0, t1):
                    continue  # it may cross a forgotten region
                self.gone[k] = None  # it holds them all
                return k
            if _fit(starts, ends, t0, t1):
                if len(starts) > _KEEP:
                    cut = _KEEP // 4
                    self.gone[k] = (starts[0] if gone is None else gone[0], ends[cut - 1])
                    del starts[:cut], ends[:cut]
                return k
        if len(self.lanes) < _MAX_LANES:
            self.lanes.append(([t0], [t1]))
            self.gone.append(None)
        return len(self.lanes) - 1  # past the limit: improperly nested, still written


_KEEP = 4096
"""Outermost regions a lane keeps (see :class:`_Lanes`)."""


def _fit(starts: list[int], ends: list[int], t0: int, t1: int) -> bool:
    """Whether a region from ``t0`` to ``t1`` nests with a lane's outermost regions ``starts``
    / ``ends``; if so it replaces those it holds."""
    i = bisect.bisect_right(starts, t0)  # the kept regions that start at or before t0: [0, i)
    j = i
    if i and ends[i - 1] > t0:  # t0 lies in region i - 1
        if starts[i - 1] != t0 or ends[i - 1] > t1:
            return False  # inside it (its own children are forgotten) or crossing it
        j = i - 1  # the same start: the new region holds it
    k = bisect.bisect_left(starts, t1, j)  # the kept regions that start before t1: [j, k)
    if k > j and ends[k - 1] > t1:
        return False  # the last of them crosses t1
    starts[j:k] = [t0]
    ends[j:k] = [t1]
    return True


class _TraceFile:
    """One trace file: its regions rendered once each, as they arrive, and kept as text.

    The sink's side (under its lock): ``pending`` regions, their ``count`` with the rendered
    ones, ``dropped``, ``dirty``, and the thread names and lane keys (``threads``,
    ``lane_of``). The writer's side (under its write lock): the rendered text (``chunks``), each
    thread's :class:`_Lanes`, the order threads arrived in, and the lanes already named."""

    def __init__(self) -> None:
        self.pending: list[_Event] = []
        self.count = 0
        self.dropped = 0
        self.dirty = False
        self.threads: dict[int, tuple[int, str]] = {}
        self.lane_of: dict[int, tuple[int, Any]] = {}
        self.chunks: list[bytes] = []
        self.rendered = 0
        self.lanes: dict[int, _Lanes] = {}
        self.order: dict[int, int] = {}
        self.named: set[int] = set()

    def render(self, events: list[_Event], threads: Mapping[int, tuple[int, str]]) -> int:
        """Add ``events`` (regions from :func:`_from_record` or :func:`_from_result`) to the
        text: a lane's metadata lines when a region opens it, then the slices in start order
        (a parent before a child that starts at the same nanosecond). Returns how many could
        not be written (an attribute whose ``str()`` raises): warned once, not in the text."""
        if not events:
            return 0
        failed = 0
        pid = os.getpid()
        depth = _depths(events)
        by_thread: dict[int, list[_Event]] = {}
        for e in events:
            by_thread.setdefault(e[4], []).append(e)
        lines: list[str] = []
        for ident, group in sorted(by_thread.items(), key=lambda kv: min(e[2] for e in kv[1])):
            order = self.order.setdefault(ident, len(self.order))
            tid, name = threads.get(ident) or (_UNKNOWN_TID - 1 - order, f"thread {ident}")
            lanes = self.lanes.get(ident)
            if lanes is None:
                lanes = self.lanes[ident] = _Lanes()
            lane_of: dict[int, int] = {}
            # In the order they ended, a child before the parent ending with it: each region
            # then holds the ones of its lane that it overlaps.
            for i in sorted(range(len(group)), key=lambda i: (group[i][3], -group[i][2])):
                k = lane_of[i] = lanes.place(group[i][2], group[i][3])
                lane_tid = tid + k * _LANE_STRIDE
                if lane_tid not in self.named:
                    self.named.add(lane_tid)
                    label = name if k == 0 else f"{name} (overlap {k})"
                    lines.append(_json({"ph": "M", "name": "thread_name", "pid": pid,
                                        "tid": lane_tid, "args": {"name": label}}))
                    lines.append(_json({"ph": "M", "name": "thread_sort_index", "pid": pid,
                                        "tid": lane_tid,
                                        "args": {"sort_index": order * 256 + k}}))
            for i in sorted(range(len(group)), key=lambda i: (
                    group[i][2], group[i][2] - group[i][3], depth.get(group[i][5], 0))):
                e = group[i]
                try:
                    lines.append(
                        f'{{"ph":"X","name":{_name(e[0])},"cat":{_name(e[1] or "perfsdk")},'
                        f'"pid":{pid},"tid":{tid + lane_of[i] * _LANE_STRIDE},'
                        f'"ts":{_us(e[2])},"dur":{_us(e[3] - e[2])},"args":{_json(_args(e))}}}')
                except Exception as exc:  # an attribute that cannot be written: this one only
                    failed += 1
                    warn_once("trace-render", f"perfsdk: a region could not be written to the "
                              f"trace file ({exc!r}); it is counted in otherData "
                              "'perfsdk.dropped_regions'.")
        self.chunks.append("".join(",\n" + line for line in lines).encode())
        self.rendered += len(events) - failed
        return failed

    def write(self, path: Path, dropped: int) -> None:
        """Write the file: what is rendered, with the process's name and ``otherData``."""
        process = Path(sys.argv[0]).name if sys.argv and sys.argv[0][:1] not in ("", "-") \
            else "python"
        head = '{"traceEvents":[\n' + _json({"ph": "M", "name": "process_name",
                                              "pid": os.getpid(), "tid": 0,
                                              "args": {"name": process}})
        other = {"perfsdk.version": __version__, "perfsdk.regions": self.rendered,
                 "perfsdk.dropped_regions": dropped,
                 "perfsdk.clock": "host perf_counter (CLOCK_MONOTONIC on Linux), microseconds",
                 "perfsdk.ts_origin_epoch_ns": clocks.epoch_ns(0)}
        tail = f'\n],"displayTimeUnit":"ms","otherData":{_json(other)}}}\n'
        _atomic_write(path, [head.encode(), *self.chunks, tail.encode()])


def _atomic_write(path: Path, parts: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0),
                     0o666)  # O_BINARY: Windows, where os.open is text mode otherwise
        try:
            _write_all(fd, parts)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


_IOV = 512
"""Buffers per ``os.writev`` call (below every platform's IOV_MAX, 1024 on Linux)."""


def _write_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` to ``fd`` in few system calls, each with the GIL released: ``os.writev``
    of :data:`_IOV` buffers at a time (a short write's rest is written after). Writing each
    part on its own (``writelines``) took the GIL back after every buffer's flush: beside a
    training thread that held it, each of those waited up to Python's 5 ms switch interval,
    and 43 MB took 32 s instead of 0.12 s."""
    writev = getattr(os, "writev", None)
    if writev is None:  # no writev (Windows): one write of the whole text
        parts = [b"".join(parts)]
    for i in range(0, len(parts), _IOV):
        batch = parts[i:i + _IOV]
        done = writev(fd, batch) if writev is not None else 0
        if done < sum(len(b) for b in batch):  # a short write (or no writev): the rest
            rest = memoryview(b"".join(batch))[done:]
            while rest:
                rest = rest[os.write(fd, rest):]
