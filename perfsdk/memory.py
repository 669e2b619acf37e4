"""Memory per region: allocator counters with correct nested peaks, and process RSS growth.

**Nested peaks.** ``torch.cuda.reset_peak_memory_stats`` is process-global (pytorch#16266), so
resetting it for one region would corrupt every enclosing one. perfsdk keeps the list of open
regions with their peak so far. Whenever it resets the allocator's peak (at each region's
enter), it first folds the allocator's peak since the last reset into every open region. At a
region's exit its peak is ``max(its folded peak, the allocator's peak since the last reset)``.
So nested and sibling regions each get their true peak, an outer region's peak is never lower
than an inner one's, and regions on other threads see the process-wide peak (the allocator is
shared). All of it is host-side bookkeeping in the caching allocator: no device sync.

**RSS.** perfsdk reports how much a region raised the process's peak RSS (``getrusage``'s
``ru_maxrss``: ``rss_delta_bytes``, 0 when the region stayed under an earlier high-water mark)
and the peak at its exit (``rss_peak_bytes``). The exit reading is always taken. The baseline is
read at enter, except when the last reading (any region's enter or exit, on any thread) began
at most :data:`REUSE_NS` (50 us) earlier: then that reading is the baseline. So a tight loop of
small regions costs one reading a region instead of two, and the approximation is bounded:
``rss_delta_bytes`` may also count peak growth from at most 50 us before the region began
(never less than the region's own growth: the peak only rises), and is exact for a region
entered more than 50 us after the last reading. (Touching new pages runs at a few GB/s, so
that is at most a few hundred KB, and nothing when nothing ran between the two regions.)
What makes each reading cheap:

- On Linux it asks ``getrusage(RUSAGE_THREAD)``: the kernel gives the same ``ru_maxrss`` as for
  ``RUSAGE_SELF`` (the address space's high-water mark, which every thread shares, so growth on
  other threads counts) but skips summing the CPU times of every thread in the process, which
  is most of ``RUSAGE_SELF``'s cost (0.45 us against 0.8 us a reading on our CI machine, and
  ``RUSAGE_SELF`` grows with the thread count: torch's intra-op pool, DataLoader threads).
- Where perfsdk's compiled module is built, ``_fastpath.RssPeak`` keeps the latest reading and
  makes that system call itself, without building Python's 16-field ``struct_rusage`` (another
  ~0.2 us) and without a Python frame: a region on the host calls its ``baseline()`` at enter
  and ``host_exit()`` at exit directly (about 1,000 instructions a region in all, against
  6,300 for the same in Python; ``PERFSDK_DISABLE_EXTENSIONS=1`` uses the twin,
  :class:`_RssPeakPython`).
- The current RSS would cost a ``/proc`` read (1.1-1.4 us), so it is not read.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from perfsdk import _device
from perfsdk.config import extensions_enabled
from perfsdk.errors import warn_once

__all__ = ["TRACKER", "MemoryTracker", "current_rss", "largest_free_block", "oom_attributes",
           "peak_rss", "want_snapshots"]

_getrusage = resource.getrusage
# The peak RSS is the address space's: any thread's getrusage reports it, and RUSAGE_THREAD
# does not sum every thread's CPU times first (see the module docstring).
_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


def _peak_rss_python() -> int:
    return _getrusage(_WHO).ru_maxrss * _RSS_UNIT


peak_rss: Callable[[], int] = _peak_rss_python
"""``peak_rss() -> int``: the process's peak resident set size in bytes (``ru_maxrss``); the
compiled ``_fastpath.maxrss`` where it is built."""
if extensions_enabled():
    try:  # optional: built at install where a C compiler is found
        import perfsdk._fastpath as _fastpath

        peak_rss = _fastpath.maxrss
    except ImportError:
        pass


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: list[int | None] = []  # [fd] once opened; [None] where /proc/self/statm is missing


def current_rss() -> int | None:
    """The process's resident set size now, in bytes (``/proc/self/statm``'s second field; one
    ``pread`` on a descriptor opened once, about a microsecond), or None where there is no
    ``/proc`` (macOS, Windows). Steps record it at their end while memory tracking is on
    (``perfsdk.memory.rss_bytes``), so the advisor sees RSS fall as well as grow: the peak
    RSS that regions report only ever grows."""
    if not _statm:
        try:
            _statm.append(os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            _statm.append(None)
    fd = _statm[0]
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class _Open:
    """An open region's memory state (kept in the tracker's list while the region runs)."""

    __slots__ = ("allocated0", "peak", "rss0")

    def __init__(self, rss0: int, allocated0: int) -> None:
        self.rss0 = rss0
        self.allocated0 = allocated0
        self.peak = allocated0


REUSE_NS: Final = 50_000
"""A region entered within this many ns of the last peak-RSS reading (any region's, on any
thread) takes that reading as its baseline instead of reading again (see the module
docstring)."""

_clock = time.perf_counter_ns
_NEVER: Final = (0, -(2**62))  # (reading, when): no reading yet


class _RssPeakPython:
    """The peak-RSS readings of ``memory=True`` regions (the compiled ``_fastpath.RssPeak``
    where it is built, this otherwise): :meth:`baseline` at a region's enter, :meth:`read`
    or :meth:`host_exit` at its exit. Reads :func:`peak_rss` and ``_clock`` at each call."""

    __slots__ = ("last", "reuse_ns")

    def __init__(self, reuse_ns: int) -> None:
        self.reuse_ns = reuse_ns
        self.last = _NEVER
        """The latest reading and when it began (one tuple: replaced whole, never torn)."""

    def baseline(self) -> int:
        """The latest reading if it began at most ``reuse_ns`` ago, else a new one."""
        rss0, when = self.last
        now = _clock()
        if now - when > self.reuse_ns:
            rss0 = peak_rss()
            self.last = (rss0, now)
        return rss0

    def read(self) -> int:
        """A reading now, kept as the latest."""
        now = _clock()
        rss1 = peak_rss()
        self.last = (rss1, now)
        return rss1

    def host_exit(self, rss0: int) -> tuple[None, None, None, int, int]:
        """A region on the host's exit: ``(None, None, None, rss_delta, rss_peak)``."""
        rss1 = self.read()
        return None, None, None, rss1 - rss0, rss1

    def reset(self) -> None:
        self.last = _NEVER


RssPeak: Callable[[int], Any] = _RssPeakPython
"""The class of :attr:`MemoryTracker.rss`: the compiled ``_fastpath.RssPeak`` where it is built
(one region's readings without a Python frame), else :class:`_RssPeakPython`."""
if peak_rss is not _peak_rss_python:
    RssPeak = getattr(_fastpath, "RssPeak", _RssPeakPython)  # a module built before it: twin


class MemoryTracker:
    """Each region's memory baselines and readings (see the module docstring); ``rss``: the
    peak-RSS readings (:data:`RssPeak`; tests pass :class:`_RssPeakPython` to inject a clock).
    A region on the host uses ``rss`` directly (``rss.baseline()``, ``rss.host_exit()``)."""

    def __init__(self, rss: Any = None) -> None:
        self._lock = threading.Lock()
        self._open: list[_Open] = []
        self.rss = RssPeak(REUSE_NS) if rss is None else rss

    def enter(self) -> Any:
        """Baselines for a region; call :meth:`exit` with what this returns."""
        rss0 = self.rss.baseline()
        if not _device._is_initialized():
            return rss0
        cuda = _device.get_backend()
        if _snapshots["wanted"] and not _snapshots["recording"]:
            _record_history(True)
        with self._lock:
            peak = cuda.max_memory_allocated()
            for state in self._open:
                if peak > state.peak:
                    state.peak = peak
            cuda.reset_peak_memory_stats()
            state = _Open(rss0, cuda.memory_allocated())
            self._open.append(state)
        return state

    def exit(self, token: Any) -> tuple[int | None, int | None, int | None, int, int]:
        """``(allocated_delta, peak, reserved, rss_delta, rss_peak)`` in bytes; the CUDA fields
        are None when the region did not start on an initialized CUDA device."""
        if type(token) is not _Open:
            return self.rss.host_exit(token)  # type: ignore[no-any-return]
        rss1 = self.rss.read()
        cuda = _device.get_backend()
        with self._lock:
            peak = max(token.peak, cuda.max_memory_allocated())
            allocated = cuda.memory_allocated()
            reserved = cuda.memory_reserved()
            try:
                self._open.remove(token)
            except ValueError:  # after a fork, or the backend was swapped mid-region
                pass
            for state in self._open:  # the allocator's peak is not reset here: outer regions
                if peak > state.peak:  # read it at their own exit or the next enter
                    state.peak = peak
        return allocated - token.allocated0, peak, reserved, rss1 - token.rss0, rss1

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._open = []
        self.rss.reset()


def largest_free_block(segments: Any) -> int:
    """The largest inactive (free, cached) block in a ``memory_snapshot()`` segment list."""
    sizes = [block.get("size", 0) for segment in segments or ()
             for block in segment.get("blocks", ()) if block.get("state") == "inactive"]
    return max(sizes, default=0)


TRACKER = MemoryTracker()
def _statm_after_fork() -> None:
    """A forked child's descriptor still reads its parent's ``/proc/<pid>/statm``: reopen."""
    if _statm and _statm[0] is not None:
        try:
            os.close(_statm[0])
        except OSError:
            pass
    _statm.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=TRACKER.after_fork)
    os.register_at_fork(after_in_child=_statm_after_fork)


# -- OOM forensics -----------------------------------------------------------------------------
_snapshots = {"wanted": False, "recording": False, "written": 0}


def want_snapshots(enabled: bool) -> None:
    """``configure(memory_snapshots=...)``: record allocation history from now (or from when
    the application initializes CUDA: perfsdk never initializes it)."""
    _snapshots["wanted"] = enabled
    if _device._is_initialized():
        _record_history(enabled)


def _record_history(enabled: bool) -> None:
    if _snapshots["recording"] == enabled:
        return
    try:
        _device.get_backend().record_memory_history("all" if enabled else None,
                                                    max_entries=100_000)
        _snapshots["recording"] = enabled
    except Exception as exc:  # never break the program
        warn_once("memory-history", f"perfsdk: could not record CUDA allocation history "
                  f"({exc!r}); OOM snapshots will hold segments only.")


def oom_attributes(memory: tuple[Any, ...] | None) -> dict[str, Any]:
    """The allocator's state when ``torch.OutOfMemoryError`` left a region, as span attributes;
    with snapshots wanted, also write the snapshot for pytorch.org/memory_viz."""
    if not _device._is_initialized():
        return {}
    cuda = _device.get_backend()
    attrs: dict[str, Any] = {}
    try:
        attrs["perfsdk.oom.allocated_bytes"] = cuda.memory_allocated()
        attrs["perfsdk.oom.reserved_bytes"] = cuda.memory_reserved()
        attrs["perfsdk.oom.peak_bytes"] = (memory[1] if memory and memory[1] is not None
                                           else cuda.max_memory_allocated())
        attrs["perfsdk.oom.largest_free_block_bytes"] = largest_free_block(
            cuda.memory_snapshot(include_traces=False))
        if _snapshots["wanted"]:
            from perfsdk.config import get_config

            directory = get_config().output_dir
            directory.mkdir(parents=True, exist_ok=True)
            _snapshots["written"] += 1
            path = directory / f"oom-{os.getpid()}-{_snapshots['written']}.pickle"
            cuda.dump_snapshot(str(path))
            attrs["perfsdk.memory.snapshot_path"] = str(path.resolve())
    except Exception as exc:  # forensics must never hide the user's OOM
        warn_once("oom-forensics", f"perfsdk: could not read the allocator after an "
                  f"out-of-memory error ({exc!r}).")
    return attrs


MEMORY_ATTRIBUTES = (
    "perfsdk.memory.allocated_delta_bytes",
    "perfsdk.memory.peak_bytes",
    "perfsdk.memory.reserved_bytes",
    "perfsdk.memory.rss_delta_bytes",
    "perfsdk.memory.rss_peak_bytes",
)
"""Span attribute names for the fields of a record's MEMORY tuple, in order."""


def memory_attributes(memory: tuple[Any, ...] | None) -> dict[str, int]:
    if memory is None:
        return {}
    return {k: v for k, v in zip(MEMORY_ATTRIBUTES, memory, strict=True) if v is not None}
