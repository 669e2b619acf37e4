"""``no_sync_guard``: find host-device synchronizations and name the line of code behind each.

A guard applies to its own context only (the thread, or the asyncio task, that entered it),
nests, and restores what was there before, also on exceptions. It watches tensor operations
with two torch modes pushed on the entering thread (see :mod:`perfsdk.sync.ops`), wraps the
explicit ``synchronize`` calls while any guard is open, and, where the application runs CUDA,
turns on torch's own sync debug mode with its warnings routed to the guard of the context they
come from (and swallowed elsewhere).
"""

from __future__ import annotations

import collections
import contextvars
import fnmatch
import functools
import inspect
import linecache
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

import torch

from perfsdk import config as _config
from perfsdk import context as _ctx
from perfsdk.clocks import epoch_ns
from perfsdk.config import state as _state
from perfsdk.errors import SyncError, SyncWarning, warn_once
from perfsdk.region import Region, now_ns
from perfsdk.sync import debug as _syncdebug
from perfsdk.sync import ops as _syncops
from perfsdk.sync.report import MAX_OUTSIDE_TIMES, SyncReport, SyncSite, short_path, short_via

__all__ = ["MAX_SPAN_SITES", "MODES", "OPS", "Mode", "no_sync_guard", "reset", "sites"]

P = ParamSpec("P")
R = TypeVar("R")
Mode = Literal["warn", "error", "count", "off"]
MODES = ("warn", "error", "count", "off")
OPS = _syncops.OPS
MAX_SPAN_SITES = 16
"""Call sites listed per region (``perfsdk.sync_sites``); ``perfsdk.syncs`` counts them all."""


# -- where a sync came from ---------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the perfsdk package
# the detector itself and torch's stand-ins (the fake device), which count as torch
_OURS = frozenset({__file__, _syncops.__file__, _syncdebug.__file__, warnings.__file__,
                   functools.__file__, os.path.join(_HERE, "testing", "fake_cuda.py"),
                   os.path.join(_HERE, "testing", "fake_tensor.py")})
# perfsdk's own scripts, which stand for a user's script: their lines are the call sites
_CALLERS = frozenset({os.path.join(_HERE, "cli", "demo.py")})


# torch code that reads host-side tensors by design (seeds, step counters): with assume_device
# a CPU tensor there stands for nothing on a GPU, so it is not reported
_HOST_SIDE_DIRS = (os.path.join(_TORCH_DIR, "utils", "data") + os.sep,)
_HOST_SIDE_FUNCS = frozenset({(os.path.join(_TORCH_DIR, "optim", "optimizer.py"), "_get_value")})


def _call_site() -> tuple[str, int, bool, str]:
    """The innermost frame outside torch and perfsdk: the user's line that asked for the sync
    (directly, or through a perfsdk helper such as ``TrainStep.loss_history()``); whether
    torch's host-side bookkeeping lies between; and the innermost perfsdk line crossed on the
    way (``""`` for none). Only where no frame outside perfsdk exists (perfsdk's own threads)
    is perfsdk's line the site."""
    frame: Any = sys._getframe(2)
    host_side = False
    via: tuple[str, int] | None = None
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if name.startswith(_TORCH_DIR):
            host_side = host_side or name.startswith(_HOST_SIDE_DIRS) or (
                (name, code.co_name) in _HOST_SIDE_FUNCS)
        elif name.startswith(_HERE) and name not in _CALLERS:
            if via is None and name not in _OURS:
                via = (name, frame.f_lineno)
        elif not (name in _OURS or name.startswith("<frozen")):
            return name, frame.f_lineno, host_side, f"{via[0]}:{via[1]}" if via else ""
        frame = frame.f_back
    if via is not None:
        return via[0], via[1], host_side, ""
    return "<unknown>", 0, host_side, ""


class _Tally:
    """The syncs at one call site: how many, and when those outside any region happened."""

    __slots__ = ("code", "count", "operator", "outside", "times", "via")

    def __init__(self, operator: str, code: str, via: str) -> None:
        self.operator, self.code, self.via = operator, code, via
        self.count = self.outside = 0
        self.times: collections.deque[int] = collections.deque(maxlen=MAX_OUTSIDE_TIMES)

    def add(self, outside: bool, when: int | None) -> None:
        self.count += 1
        if outside:
            self.outside += 1
            if when is not None:
                self.times.append(when)

    def site(self, key: tuple[str, int, str]) -> SyncSite:
        file, line, op = key
        return SyncSite(file, line, op, self.operator, self.count, self.code, self.via,
                        self.outside, tuple(self.times))


def _sorted(tallies: dict[tuple[str, int, str], _Tally]) -> list[SyncSite]:
    items = [t.site(key) for key, t in tallies.items()]
    items.sort(key=lambda s: (-s.count, s.file, s.line))
    return items


# -- per-guard state ---------------------------------------------------------------------------
class _Frame:
    __slots__ = ("assume_any", "assume_device", "guard", "live", "mode", "open", "parent",
                 "token")

    def __init__(self, guard: no_sync_guard, parent: _Frame | None, mode: str, live: bool
                 ) -> None:
        self.guard = guard
        self.parent = parent
        self.mode = mode
        self.live = live
        self.open = True
        self.assume_device = guard.assume_device
        outer = _active_from(parent)
        # the detector classifies once, for the widest setting of the open guards
        self.assume_any: bool = self.assume_device or (outer is not None and outer.assume_any)
        self.token: contextvars.Token[_Frame | None] | None = None


_ACTIVE: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar(
    "perfsdk_sync_guard", default=None)


def _active_from(frame: _Frame | None) -> _Frame | None:
    while frame is not None and not (frame.live and frame.open):
        frame = frame.parent
    return frame


def _active() -> _Frame | None:
    """The innermost open, live guard of the current context."""
    return _active_from(_ACTIVE.get())


_lock = threading.Lock()
_SITES: dict[tuple[str, int, str], _Tally] = {}  # process-wide, for the summary
_WARNED: set[tuple[str, int, str]] = set()


def sites() -> tuple[SyncSite, ...]:
    """Every sync any guard in this process has recorded, most frequent first."""
    with _lock:
        return tuple(_sorted(_SITES))


def reset() -> None:
    """Forget the process-wide sites and which were warned about (for tests)."""
    with _lock:
        _SITES.clear()
        _WARNED.clear()


def _recording_region() -> Region | None:
    span = _ctx.current_span()
    return span if type(span) is Region and span.is_recording() else None


def _report(label: str, operator: str, real: bool = True) -> bool:
    """Record one sync for every open guard of this context that counts it (a guard without
    ``assume_device`` counts real ones only); the innermost of those decides: allow, warn or
    raise."""
    frame = _active()
    if frame is None:
        return True
    file, line, host_side, via = _call_site()
    if host_side and not real:
        return True  # a CPU tensor that is host-side by design (a DataLoader seed, a step count)
    key = (file, line, label)
    code = linecache.getline(file, line).strip()
    region = _recording_region()
    outside = region is None
    # a sync outside any region keeps its time, to tell which run it belongs to; none while a
    # skipped step pauses recording (that step's regions are not recorded either)
    when = epoch_ns(now_ns()) if outside and _state.enabled else None
    decider: _Frame | None = None
    counted = False
    while frame is not None:
        if frame.live and frame.open and (real or frame.assume_device):
            took = frame.guard._take(key, operator, code, via, outside, when)
            if decider is None:
                decider, counted = frame, took
        frame = frame.parent
    if decider is None or not counted:
        return True  # no guard here counts it, or the deciding guard allows it
    mode = decider.mode
    with _lock:
        tally = _SITES.get(key)
        if tally is None:
            tally = _SITES[key] = _Tally(operator, code, via)
        tally.add(outside, when)
    if region is not None:
        _annotate_region(region, f"{short_path(file)}:{line} {label}")
    if mode == "error":
        raise SyncError(_message(label, operator, file, line, code, via,
                                 "no_sync_guard('error')"),
                        op=label, operator=operator, file=file, line=line)
    if mode == "warn":
        with _lock:
            first = key not in _WARNED
            _WARNED.add(key)
        if first:
            warnings.warn_explicit(_message(label, operator, file, line, code, via, None),
                                   SyncWarning, file, line)
    return True


def _message(label: str, operator: str, file: str, line: int, code: str, via: str,
             raised_by: str | None) -> str:
    where = f"{short_path(file)}:{line}"
    text = f"host-device sync ({label}, {operator}) at {where}"
    if code:
        text += f": {code}"
    if via:
        text += f" (in perfsdk at {short_via(via)})"
    text += f". Fix: {OPS.get(label, '')}."
    if raised_by:
        text += f" Raised by {raised_by}; allow it with allow=({label!r},) or ({where!r},)."
    return text


def _annotate_region(span: Region, site: str) -> None:
    """Count the sync on the region it happened in: ``perfsdk.syncs`` in all, and per call site
    ``perfsdk.sync_sites`` with ``perfsdk.sync_counts`` (at most :data:`MAX_SPAN_SITES`)."""
    attrs = span.attributes  # a sync is rare: the merged copy is affordable here
    span.set_attribute("perfsdk.syncs", int(attrs.get("perfsdk.syncs", 0)) + 1)
    known = tuple(attrs.get("perfsdk.sync_sites", ()))
    counts = tuple(attrs.get("perfsdk.sync_counts", ()))
    if site in known:
        at = known.index(site)
        if at < len(counts):
            span.set_attribute("perfsdk.sync_counts",
                               (*counts[:at], counts[at] + 1, *counts[at + 1:]))
    elif len(known) < MAX_SPAN_SITES:
        span.set_attribute("perfsdk.sync_sites", (*known, site))
        span.set_attribute("perfsdk.sync_counts", (*counts, 1))


# -- the guard ------------------------------------------------------------------------------
class no_sync_guard:
    """Report host-device synchronizations inside a ``with`` block or a decorated function.

    Args:
        mode: ``"warn"`` (one :class:`SyncWarning` per call site, the default), ``"error"``
            (raise :class:`SyncError` at the offending line), ``"count"`` (record silently)
            or ``"off"``.
        assume_device: flag operations that *would* synchronize if their tensors were on a
            GPU, so a CPU-only run catches them. Without it only real device tensors count.
        allow: kinds of sync (keys of :data:`OPS`, such as ``"item"``) or call sites
            (``"train.py:42"``, ``"*/data.py:*"``) that are known and accepted: they are counted
            in ``report.allowed`` and never warned about or raised.

    The innermost open guard decides what happens; every open guard of the context counts.
    The guard object keeps a cumulative :attr:`report` over all its uses. ``PERFSDK_SYNC_GUARD``
    (or ``configure(sync_guard=...)``) overrides ``mode`` for every guard, so guards can stay in
    the code: ``error`` in CI, ``off`` in production. With perfsdk disabled a guard does nothing.
    """

    def __init__(self, mode: Mode = "warn", *, assume_device: bool = False,
                 allow: Iterable[str] = ()) -> None:
        if mode not in MODES:
            raise ValueError(f"no_sync_guard: mode={mode!r}; accepted values are "
                             f"{', '.join(repr(m) for m in MODES)}")
        if not isinstance(assume_device, bool):
            raise ValueError(f"no_sync_guard: assume_device={assume_device!r}; accepted values "
                             "are True or False")
        if isinstance(allow, str):
            allow = (allow,)
        self.allow = tuple(allow)
        for item in self.allow:
            if not isinstance(item, str) or not (item in OPS or ":" in item or ".py" in item):
                raise ValueError(
                    f"no_sync_guard: allow entry {item!r} is neither a kind of sync nor a call "
                    f"site; accepted values are {', '.join(repr(k) for k in OPS)}, or a "
                    "'file.py:line' pattern (wildcards allowed)")
        self.mode: Mode = mode
        self.assume_device = assume_device
        self._ops = frozenset(i for i in self.allow if i in OPS)
        self._patterns = tuple(i for i in self.allow if i not in OPS)
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str], _Tally] = {}
        self._allowed = 0

    def _take(self, key: tuple[str, int, str], operator: str, code: str, via: str = "",
              outside: bool = False, when: int | None = None) -> bool:
        """Count one sync; False (and counted as allowed) when ``allow`` accepts it."""
        file, line, label = key
        where = f"{file}:{line}"
        allowed = label in self._ops or any(
            fnmatch.fnmatch(where, p) or fnmatch.fnmatch(where, f"*{os.sep}{p}")
            for p in self._patterns)
        with self._lock:
            if allowed:
                self._allowed += 1
                return False
            tally = self._sites.get(key)
            if tally is None:
                tally = self._sites[key] = _Tally(operator, code, via)
            tally.add(outside, when)
        return True

    @property
    def report(self) -> SyncReport:
        with self._lock:
            items = _sorted(self._sites)
            allowed = self._allowed
        return SyncReport(tuple(items), allowed)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(t.count for t in self._sites.values())

    def __enter__(self) -> no_sync_guard:
        parent = _ACTIVE.get()
        mode = _config.get_config().sync_guard or self.mode  # PERFSDK_SYNC_GUARD wins
        live = mode != "off" and _state.enabled and not torch.compiler.is_compiling()
        frame = _Frame(self, parent, mode, live)
        if live:
            _syncops.push_modes(_active, _report)
            try:
                _syncdebug.SHARED.acquire()
            except BaseException:
                _syncops.pop_modes()
                raise
        frame.token = _ACTIVE.set(frame)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        frame = _ACTIVE.get()
        while frame is not None and frame.guard is not self:
            frame = frame.parent  # exited out of order (a generator kept open): still unwind
        if frame is None:
            warn_once("sync-guard-exit", "perfsdk: no_sync_guard exited in a context that did "
                      "not enter it; ignored")
            return
        frame.open = False
        try:
            assert frame.token is not None
            _ACTIVE.reset(frame.token)
        except ValueError:  # the token belongs to another context
            _ACTIVE.set(frame.parent)
        if frame.live:
            try:
                _syncdebug.SHARED.release()
            finally:
                _syncops.pop_modes()

    async def __aenter__(self) -> no_sync_guard:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Use as a decorator: each call of ``fn`` (sync or async) runs inside the guard."""
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ValueError(
                f"no_sync_guard cannot decorate the generator function {fn.__qualname__!r}: "
                "the guard would close before the first item; accepted are plain and async "
                "functions (use `with no_sync_guard(...):` inside the generator instead)")
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await fn(*args, **kwargs)
            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return fn(*args, **kwargs)
        return run

    def __repr__(self) -> str:
        return (f"no_sync_guard({self.mode!r}, assume_device={self.assume_device}, "
                f"allow={self.allow!r})")


def _after_fork() -> None:
    """A child forked inside a guard (a DataLoader worker) is not the guarded code: close the
    guards it inherited, so its CPU-side work is neither reported nor stopped."""
    frame = _ACTIVE.get()
    while frame is not None:
        frame.open = False
        frame = frame.parent
    reset()


_syncdebug.connect(_active, _report)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
