"""Region: the one code path behind ``@profiled``, ``timed_region``, module hooks and steps.

A :class:`RegionSpec` is built once where a region is declared (names, NVTX attributes, code
location, ``every``). Each recorded entry creates a fresh :class:`Region`, so regions nest,
recurse and run on many threads. Enter and exit do only the live work on the calling thread
(NVTX, record-function, current context, clocks); the finished region goes to the pipeline,
which resolves device time and builds spans in the background.

The gate. :meth:`RegionSpec.open` is the one enabled/sampled decision every shell calls
(``@profiled``'s wrappers, ``timed_region``, steps, ``data_wait``, module and backward
regions); it enters the region and returns what the shell exits, whatever happened:

- perfsdk disabled, or the entry sampled out: :data:`NULL_REGION`, one shared inert object
  (its ``exit`` does nothing), so a skipped entry allocates nothing;
- NVTX-only mode (``PERFSDK_TIMING=0``) for a push/pop region: the NVTX range is pushed and
  the spec's own shared :class:`NullRegion` pops it at exit, again with nothing allocated;
- otherwise a fresh, entered :class:`Region`.

Sampling keeps one counter per spec (``spec.calls``), advanced only by the gate: ``every=N``
of ``@profiled`` counts the calls of that function, ``PERFSDK_SAMPLE_EVERY`` the entries of each
region where it is declared (a ``timed_region`` block counts per block, where it is written).
A spec declared with ``every=1`` (steps, backward regions) is never sampled on its own.
:meth:`RegionSpec.sampled` is the decision alone and :meth:`RegionSpec.enter` the entry alone,
for the shells that work between the two (a module's root region closes stale backward
regions first) or enter again without deciding again (a generator's later resumptions).

A shell may test ``state.enabled`` (and ``torch.compiler.is_dynamo_compiling()``) itself
before calling the gate, to keep a disabled call at one flag test and no call; it steps aside
inside compiled code so that nothing breaks the graph.

Handles. ``timed_region`` and steps hand their entry to the user (``as r``, ``Step.region``),
and a skipped block's handle still tells its name, its attributes (``r.attributes["k"]``) and
``result()`` with ``recorded`` False. So they call :meth:`RegionSpec.open_handle`, the same
gate, which returns a Region of their own in every case (unentered when skipped). A ``with``
block is not a per-call hot path the way a decorated function or a module hook is; the shared
null region is for those.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Final

import torch

from perfsdk import _device, clocks, markers
from perfsdk import context as _ctx
from perfsdk import memory as _memory
from perfsdk import record as _record
from perfsdk.config import extensions_enabled
from perfsdk.config import state as _state
from perfsdk.errors import warn_once
from perfsdk.pipeline import FORK as _FORK
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult

__all__ = ["NULL_REGION", "InnerRegion", "NullRegion", "Region", "RegionResult", "RegionSpec",
           "now_ns", "set_host_clock", "validate_attributes"]

_perf_ns = time.perf_counter_ns  # the host clock regions read (perfsdk.testing can swap it)
_ids = random.Random()  # a generator of our own, seeded from os.urandom: a program's
# random.seed() (Lightning's seed_everything and isolate_rng, identically seeded DDP ranks)
# must not make trace and span ids repeat; reseeded in forked children (DataLoader workers)
_getrandbits = _ids.getrandbits
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)
_torch_profiler = torch.autograd.profiler
"""Whose ``_is_profiler_enabled`` says a torch profiler is on: the flag torch's own Python code
reads (dynamo, inductor) before adding ``record_function`` ranges, set by
``torch.profiler.profile``, ``torch.autograd.profiler.profile``, ``emit_nvtx`` and
``emit_itt``. A module global, where ``torch._C._autograd._profiler_enabled()`` is a pybind11
call (hundreds of instructions, at every region's entry)."""
_get_ident = threading.get_ident
_noted = _record.NOTED
_note_thread = _record.note_thread
_parent_ids = _ctx.parent_ids
_record_function = markers.record_function
_current_span = _ctx.current_span
_attach = _ctx.attach
_detach = _ctx.detach
_event_pool = clocks.event_pool
_queue = PIPELINE.queue  # PIPELINE.submit, written out in Region.exit
_enqueue = _queue.append
# The current context, read and set directly (see perfsdk.context.CURRENT): with OpenTelemetry
# the variable holds a Context whose _SPAN_KEY entry is the current span; without, the span.
_SPAN_KEY = _ctx.SPAN_KEY
_Context = _ctx.CONTEXT
_cur_get = None if _ctx.CURRENT is None else _ctx.CURRENT.get
_cur_set = None if _ctx.CURRENT is None else _ctx.CURRENT.set
_cur_reset = _detach if _ctx.CURRENT is None else _ctx.CURRENT.reset
_alloc = object.__new__  # a Region without its __init__ (the gate sets every field at entry)
_new_tuple = tuple.__new__  # an InnerRegion without a Python-level __new__

AttributeValue = str | bool | int | float | tuple[Any, ...] | list[Any]


def now_ns() -> int:
    """The host clock that regions read (``perf_counter_ns`` unless a test swapped it)."""
    return _perf_ns()


def set_host_clock(clock: Callable[[], int]) -> Callable[[], int]:
    """Make regions read ``clock`` (ns) instead of ``time.perf_counter_ns``; return the previous
    clock. For :func:`perfsdk.testing.use_fake_clock`, which restores it."""
    global _perf_ns
    previous, _perf_ns = _perf_ns, clock
    return previous


def validate_attributes(attributes: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """Span attributes must be str/bool/int/float or sequences of them; raise naming the key."""
    out: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{where}: attribute names must be non-empty strings, got {key!r}")
        if isinstance(value, (str, bool, int, float)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, bool, int, float)) for v in value
        ):
            out[key] = tuple(value)
        else:
            raise ValueError(
                f"{where}: attribute {key!r}={value!r} has type {type(value).__name__}; accepted "
                "values are str, bool, int, float, or a list/tuple of those"
            )
    return out


@dataclasses.dataclass(frozen=True)
class RegionSpec:
    """What is fixed where a region is declared. Build with :meth:`create`."""

    name: str
    domain: str
    color: int
    category: str | None
    payload: int | None
    attributes: Mapping[str, Any]
    sync: bool
    asynchronous: bool
    nvtx: markers.NvtxMarker = dataclasses.field(compare=False, repr=False)
    index: int = dataclasses.field(default=-1, compare=False, repr=False)
    calls: itertools.count[int] = dataclasses.field(
        default_factory=itertools.count, compare=False, repr=False)
    memory: bool | None = None
    every: int | None = None
    """Record every N-th entry (None: ``PERFSDK_SAMPLE_EVERY``; 1: every entry)."""
    nvtx_range: NullRegion | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False)
    """The shared entry of NVTX-only mode: pops the range at exit (push/pop regions only)."""
    starter: Callable[[dict[str, Any] | None], Region] | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False)
    """``region_starter(self)``, kept once made (:func:`spec_starter`): a ``timed_region``'s
    entry, compiled where built."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", _record.register(self))
        if self.nvtx.domain is not None and not self.asynchronous:
            object.__setattr__(self, "nvtx_range", _NvtxRange(self.nvtx.domain))

    # -- the gate -------------------------------------------------------------------------
    def sampled(self) -> bool:
        """The enabled/sampled decision for one entry (advances the spec's counter)."""
        if not _state.enabled:
            return False
        n = self.every or _state.sample_every
        return n == 1 or not next(self.calls) % n

    def enter(self, attributes: dict[str, Any] | None = None) -> Region | NullRegion:
        """Enter one entry now, without a sampling decision (the caller made it)."""
        if not _state.timing:  # NVTX-only mode (PERFSDK_TIMING=0)
            shared = self.nvtx_range  # push/pop ranges: one shared object per spec
            if shared is not None and _state.nvtx:
                self.nvtx.domain.push_range(self.nvtx.attributes)
                return shared
            if not _state.nvtx or self.nvtx.domain is None:
                return NULL_REGION  # no NVTX range to emit: nothing at all
            # start/end ranges (async) keep an id per entry: the Region's NVTX-only path
        return _alloc(Region)._start(self, attributes)

    def open(self, attributes: dict[str, Any] | None = None) -> Region | NullRegion:
        """The gate: :data:`NULL_REGION` for a disabled or sampled-out entry, else the entered
        region (see the module docstring). Always ``exit`` what it returns.

        The body is :meth:`sampled` then :meth:`enter`, written out: it runs on every call of
        every decorated function, and each Python call saved is ~50 ns of NVTX-only mode's
        ~200 (measured with benchmarks/overhead.py).
        """
        if not _state.enabled:
            return NULL_REGION
        n = self.every or _state.sample_every
        if n != 1 and next(self.calls) % n:
            return NULL_REGION
        if _state.timing:
            return _alloc(Region)._start(self, attributes)
        shared = self.nvtx_range  # NVTX-only: as in enter()
        if shared is not None and _state.nvtx:
            self.nvtx.domain.push_range(self.nvtx.attributes)
            return shared
        if not _state.nvtx or self.nvtx.domain is None:
            return NULL_REGION
        return _alloc(Region)._start(self, attributes)

    def open_inner(self) -> Region | NullRegion | InnerRegion:
        """The gate of :meth:`open`, for a region that nests directly in the current
        :class:`Region` of this thread (a submodule's forward inside its model's region):
        when nothing needs a Region of its own, the entry is an :class:`InnerRegion`, which
        records the same span (same name, ids, nesting, times, error) for a fraction of the
        cost, else what :meth:`open` returns.

        An inner entry is not made current; the Region it nests in stands for it
        (:attr:`Region.inner_id`), so regions and OpenTelemetry spans started inside it are
        still its children. It needs: timing on; no torch profiler (record_function); no
        memory readings for this region; and a current Region of this thread, timed, still
        open, entered in this process, and without device events (CUDA was not initialized
        when it was entered: then this entry's device time would be wanted too). Otherwise the
        entry is a Region, as from :meth:`open`.

        The owner stands for whichever inner entry is open *now*: a thread or asyncio task that
        copied the context inside an inner entry and starts a span after that entry ended gets
        the owner (or a later entry) as its parent; a backward pass that raised leaves its
        inner entries open, and their owner standing for them, until the model's next forward
        closes them. Entries stay balanced either way.
        """
        if not _state.enabled:
            return NULL_REGION
        n = self.every or _state.sample_every
        if n != 1 and next(self.calls) % n:
            return NULL_REGION
        if _state.timing and _cur_get is not None:
            owner = _cur_get()
            if _SPAN_KEY is not None:
                owner = owner.get(_SPAN_KEY)
            memory = self.memory
            if (type(owner) is Region and owner._timed and not owner.t1
                    and owner.start_event is None and owner.thread_id == _get_ident()
                    and owner._gen == _FORK.generation
                    and not (memory or (memory is None and _state.memory))
                    and not _torch_profiler._is_profiler_enabled):
                dom = rid = None
                if _state.nvtx:
                    dom = self.nvtx.domain
                    if dom is not None:
                        if self.asynchronous:
                            rid = dom.start_range(self.nvtx.attributes)
                        else:
                            dom.push_range(self.nvtx.attributes)
                outer = owner.inner_id
                owner.inner_id = span_id = _getrandbits(64) or 1
                return _new_tuple(InnerRegion, (owner, self.index, span_id,
                                                outer or owner.span_id, outer, dom, rid,
                                                _perf_ns()))
        return self.enter()

    def open_handle(self, attributes: dict[str, Any] | None = None) -> Region:
        """The gate for entries handed to the user (``timed_region``, steps): a Region of its
        own in every case, entered when sampled in, unentered (``recorded`` False) if not."""
        if self.sampled():
            return _alloc(Region)._start(self, attributes)  # as open(): no __init__ first
        return Region(self, attributes)

    @classmethod
    def create(
        cls,
        name: str,
        *,
        domain: str = "perfsdk",
        color: str | int | None = None,
        category: str | None = None,
        payload: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        code: Mapping[str, Any] | None = None,
        sync: bool = False,
        asynchronous: bool = False,
        memory: bool | None = None,
        every: int | None = None,
        where: str = "profiled",
    ) -> RegionSpec:
        argb = validate_options(name, domain=domain, color=color, category=category,
                                payload=payload, sync=sync, where=where, memory=memory)
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"{where}: every={every!r}; accepted values are None or an "
                             "integer >= 1")
        attrs = dict(code or {})
        attrs.update(validate_attributes(attributes, where))
        if category:
            attrs["perfsdk.category"] = category
        if payload is not None:
            attrs["perfsdk.payload"] = payload
        return cls(
            name=name,
            domain=domain,
            color=argb,
            category=category,
            payload=payload,
            attributes=MappingProxyType(attrs),
            sync=sync,
            asynchronous=asynchronous,
            nvtx=markers.NvtxMarker(domain, name, argb, category, payload),
            memory=memory,
            every=every,
        )


def validate_options(
    name: str, *, domain: str, color: str | int | None, category: str | None,
    payload: int | None, sync: bool, where: str, memory: bool | None = None,
) -> int:
    """Check a region's declared options; return the ARGB color. Raises ValueError naming the
    bad argument and the values it accepts."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name={name!r}; accepted values are non-empty strings")
    if not isinstance(domain, str) or not domain:
        raise ValueError(f"{where}: domain={domain!r}; accepted values are non-empty strings")
    if category is not None and (not isinstance(category, str) or not category):
        raise ValueError(
            f"{where}: category={category!r}; accepted values are None or a non-empty string"
        )
    if payload is not None and (isinstance(payload, bool) or not isinstance(payload, int)
                                or not -(2**63) <= payload < 2**63):
        raise ValueError(
            f"{where}: payload={payload!r}; accepted values are None or a signed 64-bit "
            "integer, -2**63 to 2**63-1 (NVTX and OTLP carry payloads as int64)"
        )
    if not isinstance(sync, bool):
        raise ValueError(f"{where}: sync={sync!r}; accepted values are True or False")
    if memory is not None and not isinstance(memory, bool):
        raise ValueError(f"{where}: memory={memory!r}; accepted values are None (the "
                         "configured default), True or False")
    return _parse_color(color, name, where)


def _parse_color(color: str | int | None, name: str, where: str) -> int:
    try:
        return markers.parse_color(color, name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class NullRegion:
    """An entry that records nothing: what the gate returns for a disabled or sampled-out
    entry (:data:`NULL_REGION`, shared by all). Its methods are those a shell calls on an
    entry (``exit``, ``set_attribute`` ...), and do nothing."""

    __slots__ = ()
    recorded: Final = False
    entered: Final = False
    t0: Final = 0
    t1: Final = 0
    trace_id: Final = 0
    span_id: Final = 0
    parent_id: Final = 0
    host_ms: Final = math.nan

    def enter(self) -> NullRegion:
        return self

    def exit(self, error: BaseException | None = None, t1: int = 0) -> None:
        """Nothing to close."""

    def set_attribute(self, key: str, value: Any) -> None:
        """Ignored: nothing is recorded."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Ignored: nothing is recorded."""

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        """Ignored: nothing is recorded."""

    def __enter__(self) -> NullRegion:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.exit(exc)

    def __repr__(self) -> str:
        return "<NullRegion>"


NULL_REGION: Final = NullRegion()
"""The shared null region: every disabled or sampled-out entry of every region."""


class _NvtxRange(NullRegion):
    """A push/pop region's entry in NVTX-only mode, shared by all its entries: the gate
    pushed the range, exit pops it (push/pop ranges keep no per-entry state)."""

    __slots__ = ("_pop",)

    def __init__(self, domain: Any) -> None:
        self._pop = domain.pop_range

    def exit(self, error: BaseException | None = None, t1: int = 0) -> None:
        self._pop()

    def __repr__(self) -> str:
        return "<NullRegion NVTX-only>"


class InnerRegion(tuple):  # type: ignore[type-arg]
    """An entry of :meth:`RegionSpec.open_inner`: a region nested directly in the current
    :class:`Region` (its *owner*) of the same thread, which stands for it as the current span
    (``owner.inner_id``) instead of this entry becoming current itself. Enter pushed its NVTX
    range and read the clock; :meth:`exit` reads the clock, pops the range and queues the same
    record a :class:`Region` would: its own span id, the innermost entry open around it (or the
    owner) as parent, the owner's trace and thread. A plain tuple, made without a Python call:
    (owner, spec index, span id, parent id, the owner's ``inner_id`` before it, NVTX domain or
    None, NVTX range id of a start/end range or None for a push/pop one, host t0)."""

    __slots__ = ()

    def exit(self, error: BaseException | None = None, t1: int = 0) -> None:
        """End the entry: its record goes to the pipeline (as :meth:`Region.exit`)."""
        if not t1:
            t1 = _perf_ns()
        owner, index, span_id, parent_id, outer, dom, rid, t0 = self
        owner.inner_id = outer
        if dom is not None:
            if rid is None:
                dom.pop_range()
            else:
                dom.end_range(rid)
        # No OOM forensics (Region._on_oom): an inner entry rides only on a region entered
        # while CUDA was not initialized, with no allocator state to record.
        record = (index, owner.trace_id, span_id, parent_id, t0, t1, owner.thread_id, error,
                  None, None, None, None, None, None, None)
        if len(_queue) < PIPELINE.max_pending:  # PIPELINE.submit(record)
            _enqueue(record)
        else:
            PIPELINE.spill(record)

    def __repr__(self) -> str:
        return f"<InnerRegion {_record.SPECS[self[1]].name!r} in {self[0]!r}>"


class Region(_ctx.SpanBase):  # type: ignore[misc]
    """One entry into a region; also the OpenTelemetry current span while its body runs.

    The handle that ``timed_region`` yields: ``host_ms`` is known at exit, ``device_ms`` once the
    GPU has finished the region's work (None without a GPU), and :meth:`result` waits for this
    one region only. A handle whose entry was not recorded (perfsdk disabled, the call sampled
    out, or NVTX-only mode) has ``recorded`` False and ``host_ms`` NaN, so code that prints or
    adds it keeps running.
    """

    __slots__ = (
        "_attributes", "_gen", "_mem", "_nvtx", "_range_id", "_rf", "_timed", "_token",
        "device_ms",
        "end_event", "entered", "error", "events", "inner_id", "memory", "parent_id", "resolved",
        "span_id", "spec", "start_event", "t0", "t1", "thread_id", "trace_id",
    )
    trace_id: int
    span_id: int
    parent_id: int
    thread_id: int
    inner_id: int
    """The span id of the innermost :class:`InnerRegion` open in this region (0: none). While
    one is open, this region stands for it as the current span: regions and OpenTelemetry
    spans started then get it as their parent (:meth:`get_span_context` says so)."""

    def __init__(self, spec: RegionSpec, attributes: dict[str, Any] | None = None) -> None:
        """An entry not entered yet (a handle; :meth:`enter` enters it). The gate makes its
        entries without this, with every field set by :meth:`_start`."""
        self.spec = spec
        self._attributes = attributes
        self.events: list[tuple[str, dict[str, Any], int]] | None = None
        self.start_event: _device.Event | None = None
        self.end_event: _device.Event | None = None
        self.device_ms: float | None = None
        self.error: BaseException | None = None
        self.resolved = False
        self.entered = False
        self.inner_id = 0
        self.t0 = 0
        self.t1 = 0
        self._rf: Any = None
        self._mem: Any = None
        self.memory: tuple[Any, ...] | None = None

    # -- live half: on the calling thread -------------------------------------------------
    def enter(self) -> Region:
        return self._start(self.spec, self._attributes)

    def _start(self, spec: RegionSpec, attributes: dict[str, Any] | None) -> Region:
        """Set every field of this entry and enter it: the gate's whole per-entry work, in one
        frame (the region hot path; see benchmarks/overhead.py)."""
        self.spec = spec
        self._attributes = attributes
        self.events = None
        self.start_event = None
        self.end_event = None
        self.device_ms = None
        self.error = None
        self.memory = None
        self.resolved = False
        self.entered = True
        self.inner_id = 0
        self.t1 = 0
        self._rf = None
        self._mem = None
        if _state.nvtx:
            marker = spec.nvtx
            dom = marker.domain
            if dom is not None:
                if spec.asynchronous:  # ranges that may interleave with other tasks
                    self._range_id = dom.start_range(marker.attributes)
                else:
                    dom.push_range(marker.attributes)
        else:
            dom = None
        self._nvtx = dom  # exit closes exactly what enter opened, whatever configure() did since
        self._timed = timed = _state.timing
        if not timed:  # NVTX-only mode (PERFSDK_TIMING=0)
            self.t0 = 0
            return self
        if not PIPELINE.started:
            PIPELINE.start()
        self._gen = _FORK.generation
        if _torch_profiler._is_profiler_enabled:
            rf = _record_function(spec.name)
            rf.__enter__()
            self._rf = rf
        # The parent: the current span (perfsdk.context.CURRENT, read directly).
        if _SPAN_KEY is not None:
            context = _cur_get()  # type: ignore[misc]
            parent = context.get(_SPAN_KEY)
        elif _cur_get is not None:
            parent = _cur_get()
        else:
            parent = _current_span()
        if type(parent) is Region:
            self.trace_id = parent.trace_id
            self.parent_id = parent.inner_id or parent.span_id
        elif parent is None:
            self.trace_id = _getrandbits(128) or 1
            self.parent_id = 0
        else:  # a span of the user's, or OpenTelemetry's invalid span
            trace_id, self.parent_id = _parent_ids(parent)
            self.trace_id = trace_id or _getrandbits(128) or 1
        self.span_id = _getrandbits(64) or 1
        self.thread_id = ident = _get_ident()
        if ident not in _noted:  # the thread's name, once per thread, for sinks that run after it
            _note_thread()
        if _SPAN_KEY is not None:  # what attach(set_span_in_context(self)) does
            values = context.copy()
            values[_SPAN_KEY] = self
            self._token = _cur_set(_Context(values))  # type: ignore[misc]
        elif _cur_set is not None:
            self._token = _cur_set(self)
        else:
            self._token = _attach(self)
        memory = spec.memory
        on_gpu = _device._is_initialized()
        if memory or (memory is None and _state.memory):
            self._mem = _memory.TRACKER.enter() if on_gpu else _memory.TRACKER.rss.baseline()
        if on_gpu:
            event = _event_pool(_device.get_backend()).get()
            event.record()
            self.start_event = event
        self.t0 = _perf_ns()
        return self

    def _close_nvtx(self) -> None:
        dom = self._nvtx
        if dom is not None:
            if self.spec.asynchronous:
                dom.end_range(self._range_id)
            else:
                dom.pop_range()

    def exit(self, error: BaseException | None = None, t1: int = 0) -> None:
        """End the region; ``t1``: a host clock reading (:func:`now_ns`) taken by the caller
        just before, to end at (a step computes its rate from it), else the clock now."""
        if not self._timed:
            self._close_nvtx()
            return
        if self._gen != _FORK.generation:
            self._forget()
            return
        if not t1:
            t1 = _perf_ns()
        start = self.start_event
        if start is None:
            end = None
            self.resolved = True
        else:
            end = _event_pool(_device.get_backend()).get()
            end.record()
            self.end_event = end
        self.t1 = t1
        self.error = error
        mem = self._mem
        if mem is None:
            memory = None
        elif type(mem) is int:  # entered on the host: the peak-RSS reading only
            self.memory = memory = _memory.TRACKER.rss.host_exit(mem)
        else:
            self.memory = memory = _memory.TRACKER.exit(mem)
        if error is not None and isinstance(error, torch.OutOfMemoryError):
            self._on_oom(error, memory)
        token = self._token
        self._token = None  # fewer live objects for the garbage collector to walk
        try:
            _cur_reset(token)
        except Exception:  # a token of another context: detach says so (OpenTelemetry logs)
            _detach(token)
        finally:
            rf = self._rf
            if rf is not None:
                self._rf = None
                rf.__exit__(None, None, None)
            spec = self.spec
            dom = self._nvtx
            if dom is not None:
                if spec.asynchronous:
                    dom.end_range(self._range_id)
                else:
                    dom.pop_range()
            if end is not None:
                if spec.sync:
                    PIPELINE.resolve_region(self, wait=True)
                PIPELINE.poke()
            # A plain tuple (see perfsdk.record); the Region rides along only with GPU events.
            record = (spec.index, self.trace_id, self.span_id, self.parent_id, self.t0, t1,
                      self.thread_id, error, self._attributes, self.events, memory, start, end,
                      None if end is None else self, None)
            if len(_queue) < PIPELINE.max_pending:  # PIPELINE.submit(record)
                _enqueue(record)
            else:
                PIPELINE.spill(record)

    def _forget(self) -> None:
        """Exit of a region entered before a fork, in the child: the region is the parent's (it
        records it itself), so the child restores its context and closes its markers only."""
        try:
            _detach(self._token)
        except Exception:  # the token belongs to the parent's context: nothing to restore
            pass
        self._token = None
        rf, self._rf = self._rf, None
        if rf is not None:
            try:
                rf.__exit__(None, None, None)
            except Exception:
                pass
        self._close_nvtx()

    def _on_oom(self, error: BaseException, memory: Any) -> None:
        """OOM forensics: the allocator's state at the failure onto the span (never raises)."""
        attrs = _memory.oom_attributes(memory)
        if attrs:
            if self._attributes is None:
                self._attributes = {}
            self._attributes.update(attrs)

    def __enter__(self) -> Region:
        return self.enter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.exit(exc)

    # -- the handle -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def recorded(self) -> bool:
        """Whether this entry is timed and becomes a span: False when perfsdk was disabled, the
        call was sampled out, or in NVTX-only mode (``PERFSDK_TIMING=0``)."""
        return self.entered and self._timed

    @property
    def host_ms(self) -> float:
        """Host (wall) milliseconds; NaN until the region has exited, and for an entry that was
        not :attr:`recorded`."""
        return (self.t1 - self.t0) / 1e6 if self.t1 else math.nan

    @property
    def attributes(self) -> Mapping[str, Any]:
        """The region's attributes: declared, per call, and those set while it ran."""
        if self._attributes:
            merged = dict(self.spec.attributes)
            merged.update(self._attributes)
            return MappingProxyType(merged)
        return self.spec.attributes

    def result(self) -> RegionResult:
        """Wait for this region's device time (only this region's end event) and return it.

        For an entry that was not recorded (perfsdk disabled, the call sampled out, NVTX-only
        mode) the result says so (``recorded`` False, ``host_ms`` NaN), so code that reads it
        keeps running whatever the launch settings.
        """
        if not self.recorded:
            return RegionResult(name=self.spec.name, host_ms=math.nan, device_ms=None,
                                attributes=self.attributes, error=None, start_ns=0, end_ns=0,
                                trace_id=0, span_id=0, parent_span_id=0, thread_id=0,
                                recorded=False)
        if not self.t1:
            raise RuntimeError(f"region {self.spec.name!r} has not exited yet; call result() "
                               "after its 'with' block")
        PIPELINE.resolve_region(self, wait=True)
        return RegionResult(
            name=self.spec.name,
            host_ms=(self.t1 - self.t0) / 1e6,
            device_ms=self.device_ms,
            attributes=self.attributes,
            error=self.error,
            start_ns=clocks.epoch_ns(self.t0),
            end_ns=clocks.epoch_ns(self.t1),
            trace_id=self.trace_id,
            span_id=self.span_id,
            parent_span_id=self.parent_id,
            thread_id=self.thread_id,
            memory=None if self.memory is None else MappingProxyType(
                _memory.memory_attributes(self.memory)),
        )

    # -- the OpenTelemetry Span interface (so user code can annotate the current region) ----
    def get_span_context(self) -> Any:
        """This region's ids; while an :class:`InnerRegion` is open in it, that one's (so an
        OpenTelemetry span started inside it is its child)."""
        return _ctx.span_context(self.trace_id, self.inner_id or self.span_id)

    def is_recording(self) -> bool:
        return not self.t1

    def set_attribute(self, key: str, value: Any) -> None:
        """Add an attribute to the region's span while it runs (ignored once it has ended, as
        OpenTelemetry ignores attributes set on an ended span)."""
        if self.t1:
            return
        if self._attributes is None:
            self._attributes = {}
        self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
    ) -> None:
        if self.events is None:
            self.events = []
        when = timestamp if timestamp is not None else clocks.epoch_ns(_perf_ns())
        self.events.append((name, dict(attributes or {}), when))

    def update_name(self, name: str) -> None:
        """Names are fixed where the region is declared; renaming is ignored."""

    def set_status(self, status: Any, description: str | None = None) -> None:
        """Status is derived from whether the body raised."""

    def record_exception(
        self, exception: BaseException, attributes: Any = None, timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event("exception", {"exception.type": type(exception).__qualname__,
                                     "exception.message": str(exception)}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        """A region ends when its block or call does."""

    def __repr__(self) -> str:
        state = ("not recorded" if not self.recorded else "running" if not self.t1
                 else f"{self.host_ms:.3f} ms")
        return f"<Region {self.spec.name!r} {state}>"


def _inner_gate_python(spec: RegionSpec) -> Callable[[], Region | NullRegion | InnerRegion]:
    """The pure-Python gate: the spec's bound :meth:`RegionSpec.open_inner`."""
    return spec.open_inner


inner_gate: Callable[[RegionSpec], Callable[[], Region | NullRegion | InnerRegion]] = (
    _inner_gate_python)
"""``inner_gate(spec)()`` is ``spec.open_inner()``: for the per-module hot paths
(:mod:`perfsdk.auto`), which make a gate per module once. Where perfsdk's compiled module is
built it is ``perfsdk._fastpath.InnerGate``: the same code without a Python frame, with the
spec's fixed fields read once and the Region's and settings' slots read directly; whatever
is off its fast path (sampling, no owner to ride on) it hands to :meth:`RegionSpec.open_inner`.
There :meth:`InnerRegion.exit` is compiled too."""


def _start_python(spec: RegionSpec, attributes: dict[str, Any] | None) -> Region:
    """A fresh Region of ``spec``, entered: the gate's per-entry work (:meth:`Region._start`)."""
    return _alloc(Region)._start(spec, attributes)


def _starter_python(spec: RegionSpec) -> Callable[[dict[str, Any] | None], Region]:
    return functools.partial(_start_python, spec)


_exit_python: Callable[[Region, BaseException | None, int], None] = Region.exit
"""``region.exit(error, t1)``, called as ``Region.exit(region, error, t1)``: no frame of its
own."""

region_starter: Callable[[RegionSpec], Callable[[dict[str, Any] | None], Region]] = (
    _starter_python)
"""``region_starter(spec)(attributes)`` is a fresh :class:`Region` of ``spec``, entered, and
``exit_region(region, error, t1)`` is ``region.exit(error, t1)``: for the steps of
:mod:`perfsdk.auto`, the first Python work after a training step's torch calls, where every
Python frame and call costs several microseconds (the caches hold torch's data). Where
perfsdk's compiled module is built they are ``perfsdk._fastpath.RegionStart`` and
``region_exit``: the common case (an entry on the host, timing on, no profiler, no memory
readings, a push/pop NVTX range, the parent a Region or nothing) without a Python frame, the
clock read and the ids drawn without a call, the NVTX range pushed through the marker's
compiled range; anything else is handed to the Python code before anything is done."""
exit_region: Callable[[Region, BaseException | None, int], None] = _exit_python


def spec_starter(spec: RegionSpec) -> Callable[[dict[str, Any] | None], Region]:
    """``region_starter(spec)``, made at the spec's first call and kept on it (``starter``):
    what a ``timed_region`` enters with once its gate said yes."""
    start = spec.starter
    if start is None:
        start = region_starter(spec)
        object.__setattr__(spec, "starter", start)
    return start


def _opener_python(spec: RegionSpec) -> Callable[..., Region | NullRegion]:
    """The pure-Python gate: the spec's bound :meth:`RegionSpec.open`."""
    return spec.open


def _opener_compiled(spec: RegionSpec) -> Callable[..., Region | NullRegion]:
    return _fastpath.RegionStart(spec, gate=True)  # type: ignore[no-any-return]


region_opener: Callable[[RegionSpec], Callable[..., Region | NullRegion]] = _opener_python
"""``region_opener(spec)(attributes=None)`` is ``spec.open(attributes)``, and
``exit_compiled``, where not None, is ``exit_compiled(entry, None, 0)`` for ``entry.exit(None)``
of what it returned: for ``@profiled``'s wrappers, made once per decorated function. Where
perfsdk's compiled module is built the gate is ``perfsdk._fastpath.RegionStart(spec,
gate=True)`` (enabled, unsampled and timed: the compiled entry of :data:`region_starter`;
anything else: ``spec.open``) and ``exit_compiled`` is ``region_exit``, which hands whatever
is not a plain region ending on its fast path to its own ``exit``."""
exit_compiled: Callable[[Any, BaseException | None, int], None] | None = None


def compiled_module() -> Any:
    """perfsdk's compiled module when its region paths are bound (``inner_gate`` is its
    ``InnerGate``), else None."""
    return _fastpath if inner_gate is not _inner_gate_python else None


exit_inner_python = InnerRegion.exit
"""The pure-Python :meth:`InnerRegion.exit` (the compiled one replaces it on the class)."""


def python_twins() -> list[tuple[Any, str, Any]]:
    """``(owner, name, pure-Python twin)`` for each of the compiled region paths (inner
    entries, a step's region, ``@profiled``'s gate and exit): the tests swap them to run the
    same checks on both, as with :func:`perfsdk.auto.steps.python_twins` and
    :func:`perfsdk.phases.python_twins`."""
    module = sys.modules[__name__]
    return [(module, "inner_gate", _inner_gate_python), (InnerRegion, "exit", exit_inner_python),
            (module, "region_starter", _starter_python), (module, "exit_region", _exit_python),
            (module, "region_opener", _opener_python), (module, "exit_compiled", None)]

_fastpath: Any = None
if extensions_enabled():
    try:  # optional: built at install where a C compiler is found
        import perfsdk._fastpath as _fastpath
    except ImportError:
        _fastpath = None
if _fastpath is not None and hasattr(_fastpath, "InnerGate"):
    try:  # it reads Region's and the settings' slots by offset: they must be plain slots
        InnerRegion.exit = _fastpath.bind_inner(  # type: ignore[method-assign]
            globals(), InnerRegion, Region, NULL_REGION, _state, _FORK, _Context)
    except Exception as exc:  # never break the import: the Python twins record the same
        warn_once("fastpath-inner", f"perfsdk: compiled inner regions are off ({exc!r}); "
                  "using the pure-Python path")
    else:
        inner_gate = _fastpath.InnerGate
        if hasattr(_fastpath, "RegionStart"):
            try:
                _fastpath.bind_region(_ctx.CURRENT, vars(_device), _device.TORCH_CUDA)
            except Exception as exc:  # never break the import
                warn_once("fastpath-region", f"perfsdk: compiled step regions are off "
                          f"({exc!r}); using the pure-Python path")
            else:
                region_starter = _fastpath.RegionStart
                exit_region = _fastpath.region_exit
                region_opener = _opener_compiled
                exit_compiled = _fastpath.region_exit
