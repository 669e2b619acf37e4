"""The record of one finished region, as it travels from the calling thread to the sinks.

A record is a *plain tuple* whose fields are numbers, strings and ``None`` in the common case
(no GPU events, no per-call attributes, no error). CPython's garbage collector stops tracking
such tuples at its first pass, so a backlog of records waiting for the background thread never
promotes objects into the old generation, and the training thread does not pay for full
collections that walk all of torch's objects (measured: 7 full collections, 0.68 s, in 200k
calls when records were objects). The :class:`~perfsdk.region.RegionSpec` is referenced by
its index in :data:`SPECS`, for the same reason.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from perfsdk import clocks
from perfsdk.distributed import rank_attributes
from perfsdk.memory import memory_attributes

__all__ = ["NOTED", "SPECS", "THREAD_NAMES", "RegionResult", "attributes", "note_thread",
           "register", "to_result"]

# Field indices of a record tuple.
(SPEC, TRACE, SPAN, PARENT, T0, T1, THREAD, ERROR, ATTRS, EVENTS, MEMORY, START, END, REGION,
 DEVICE_MS) = range(15)
# MEMORY: None, or (allocated_delta, peak, reserved, rss_delta, rss_peak) from perfsdk.memory.

Record = tuple[Any, ...]

SPECS: list[Any] = []
"""Every RegionSpec ever created, by index (a spec is made once per declaration)."""

_lock = threading.Lock()


def register(spec: Any) -> int:
    with _lock:
        SPECS.append(spec)
        return len(SPECS) - 1


NOTED: set[int] = set()
"""Idents of the live threads that have put their name in :data:`THREAD_NAMES`. Read at each
region entry (``if ident not in NOTED: note_thread()``: a set lookup, where a thread-local
attribute costs three times as much); a thread's ident leaves it when the thread ends (its
thread-local state is cleared, see :class:`_Forget`), so a later thread that reuses the ident
notes itself again."""

_alive = threading.local()


class _Forget:
    """Held in a thread's own thread-local state: when the thread ends, Python clears that
    state, and this takes the thread's ident out of :data:`NOTED`."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __del__(self) -> None:
        try:
            NOTED.discard(self.ident)
        except Exception:  # interpreter teardown: nothing left to keep
            pass


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in a child."""
    NOTED.intersection_update((threading.get_ident(),))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

THREAD_NAMES: dict[int, tuple[str, int | None]] = {}
"""Thread ident (``threading.get_ident()``, a record's ``THREAD``) -> (name, OS thread id) of
the most recent thread with that ident that entered a region. Sinks that run after a thread
has ended (the trace file) name its regions from here. Python reuses the ident of a thread
that ended for a later one; that thread notes itself again and its entry replaces the old one
(a new tuple, so a sink can tell a new thread from the old)."""

_MAX_THREAD_NAMES = 10_000


def note_thread() -> None:
    """Remember the calling thread's name and OS id under its ident (once per thread)."""
    thread = threading.current_thread()
    ident = thread.ident
    if ident is not None:
        if len(THREAD_NAMES) >= _MAX_THREAD_NAMES:  # bounded: forget threads that ended
            live = {t.ident for t in threading.enumerate()}
            for gone in list(THREAD_NAMES):  # a copy: other threads may add meanwhile
                if gone not in live:
                    THREAD_NAMES.pop(gone, None)
        THREAD_NAMES[ident] = (thread.name, thread.native_id)
        _alive.forget = _Forget(ident)
        NOTED.add(ident)


def spec_of(record: Record) -> Any:
    """The :class:`~perfsdk.region.RegionSpec` a record was made from."""
    return SPECS[record[SPEC]]


def host_ms(record: Record) -> float:
    return float((record[T1] - record[T0]) / 1e6)


def attributes(record: Record) -> dict[str, Any]:
    """Declared attributes, then per-call ones and those set while the region ran, then the
    process's rank in a multi-process job (:func:`perfsdk.distributed.rank_attributes`)."""
    attrs: dict[str, Any] = SPECS[record[SPEC]].attributes.copy()
    extra = record[ATTRS]
    if extra:
        attrs.update(extra)
    ranks = rank_attributes()
    if ranks:
        attrs.update(ranks)
    return attrs


@dataclasses.dataclass(frozen=True)
class RegionResult:
    """A resolved region: what ``Region.result()`` returns and ``perfsdk.testing`` captures."""

    name: str
    host_ms: float
    device_ms: float | None
    attributes: Mapping[str, Any]
    error: BaseException | None
    start_ns: int
    end_ns: int
    trace_id: int
    span_id: int
    parent_span_id: int
    thread_id: int
    memory: Mapping[str, int] | None = None
    """``perfsdk.memory.*`` attribute name to bytes, when the region tracked memory."""
    recorded: bool = True
    """False for the result of an entry that was not recorded (perfsdk disabled, the call
    sampled out, NVTX-only mode): its ``host_ms`` is NaN and its times and ids are 0."""


def to_result(record: Record) -> RegionResult:
    return RegionResult(
        name=SPECS[record[SPEC]].name,
        host_ms=host_ms(record),
        device_ms=record[DEVICE_MS],
        attributes=MappingProxyType(attributes(record)),
        error=record[ERROR],
        start_ns=clocks.epoch_ns(record[T0]),
        end_ns=clocks.epoch_ns(record[T1]),
        trace_id=record[TRACE],
        span_id=record[SPAN],
        parent_span_id=record[PARENT],
        thread_id=record[THREAD],
        memory=None if record[MEMORY] is None else MappingProxyType(
            memory_attributes(record[MEMORY])),
    )
