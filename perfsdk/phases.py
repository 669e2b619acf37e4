"""``phase``: a region for one phase of the region around it, at a fraction of a
``timed_region``'s cost (a training step's forward, backward and optimizer)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from threading import get_ident
from types import TracebackType
from typing import Any

from perfsdk import region as _region
from perfsdk.region import InnerRegion, NullRegion, Region, RegionSpec

__all__ = ["open_here", "phase"]

_Entry = Region | NullRegion | InnerRegion


class phase:
    """Time one phase of the region around it: ``with perfsdk.phase("forward"): ...``.

    A phase records the span a :class:`~perfsdk.timing.timed_region` would (name, ids,
    nesting, times, the error it ended with, its NVTX range) at a fraction of the cost on the
    calling thread (under callgrind 5.6k instructions a block against 20k; in place, after a
    step's torch work, 27 to 37 against 57 to 79 us on the 2-core development machine),
    because it does not become the current span: inside it, ``trace.get_current_span()`` is
    the region around it (the step), which stands for the phase while it is open. Regions
    and OpenTelemetry spans started inside a phase are still the phase's children. It has no
    handle (``as`` gives None) and no per-entry attributes: use a ``timed_region`` where the
    block needs its own span object.

    This is how ``perfsdk run`` and the Lightning callback record the forward, backward and
    optimizer phases of each step. Where a phase cannot ride on the region around it, it is a
    region of its own, as ``timed_region`` records: outside any region, in another thread than
    that region's, with memory readings (``memory=True``), with the torch profiler on, or
    inside a region that records device time (CUDA was initialized when it began).

    Hooks that open a phase in one callback and close it in another use ``open()``, which
    returns the entry; call its ``exit(error=None)`` once, on the same thread. Use phases
    around compiled code, not inside it: ``torch.compile`` does not trace a phase's ``with``
    block (dynamo does not enter a context manager made outside the compiled function), so
    inside a compiled function the block is a graph break (an error with ``fullgraph=True``),
    and runs, and records, eagerly.

    Example:
        >>> import perfsdk, torch
        >>> from perfsdk.testing import capture
        >>> model = torch.nn.Linear(4, 2)
        >>> forward = perfsdk.phase("forward", category="compute")
        >>> with capture() as cap, perfsdk.step(samples=8):
        ...     with forward:
        ...         loss = model(torch.ones(8, 4)).sum()
        >>> [(r.name, r.parent_span_id == step.span_id)
        ...  for step in cap.named("step") for r in cap.named("forward")]
        [('forward', True)]
    """

    __slots__ = ("__weakref__", "_active", "_args", "_enter", "_exit", "open", "spec")

    def __init__(
        self,
        name: str,
        /,
        *,
        domain: str = "perfsdk",
        color: str | int | None = None,
        category: str | None = None,
        memory: bool | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        self._args = (name, domain, color, category, memory, attributes)
        self.spec = _spec_for(name, domain, color, category, memory, attributes)
        # open(): the gate of RegionSpec.open_inner (compiled where perfsdk._fastpath is)
        self.open: Callable[[], _Entry] = _region.inner_gate(self.spec)
        self._active: list[_Entry] = []
        # The with block's work, compiled where the gate is (called by the compiled methods
        # without a frame); else None: the Python methods below do it.
        self._enter: Callable[[], None] | None = None
        self._exit: Callable[[BaseException | None], None] | None = None
        fast = _region.compiled_module()
        if fast is not None and hasattr(fast, "PhaseExit") and type(self.open) is getattr(
                fast, "InnerGate", None):
            self._enter = fast.PhaseEnter(self.open, self._active)
            self._exit = fast.PhaseExit(self._active, _exit_many)
        with _named_lock:
            named = _NAMED.get(name)
            if named is None:
                if len(_NAMED) >= SPECS_CACHED:  # bounded: names with no live phase go
                    for key, live in list(_NAMED.items()):
                        if not live:
                            del _NAMED[key]
                named = _NAMED[name] = weakref.WeakSet()
            named.add(self)

    # The with block. Where perfsdk's compiled module is built, the class takes compiled
    # methods instead (bind_phase, below), which call the instance's _enter / _exit without a
    # Python frame, and these for an instance without them (the Python gates chosen).
    # torch.compile does not trace a phase's with block: dynamo does not enter a context
    # manager made outside the compiled code (a graph break, and the block runs eagerly).
    def __enter__(self) -> None:
        enter = self._enter
        if enter is not None:
            enter()
        else:
            self._active.append(self.open())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        leave = self._exit
        if leave is not None:
            leave(exc)
            return
        active = self._active
        n = len(active)
        if n == 1:  # the usual case
            entry = active.pop()
        elif n:  # one phase object open in several threads at once: this thread's entry
            _exit_many(active, exc)
            return
        else:  # an exit without an entry: nothing to end
            return
        entry.exit(exc)

    def __reduce__(self) -> tuple[Any, ...]:
        name, *options = self._args
        return (_rebuild, (name, *options))

    def __repr__(self) -> str:
        return f"phase({self._args[0]!r})"


_NAMED: dict[str, weakref.WeakSet[phase]] = {}
"""The live phase objects by name, for :func:`open_here` (added once, when made: the ``with``
block costs nothing more). Names whose phases are all gone leave it once it holds
:data:`SPECS_CACHED` names."""
_named_lock = threading.Lock()


def open_here(name: str) -> bool:
    """Whether a phase named ``name`` has a ``with`` block open on this thread (an entry from
    ``open()`` is not tracked). ``perfsdk run`` asks before opening its own ``backward`` or
    ``optimizer``, so a script that writes its own gets one span, not two nested."""
    try:
        for p in list(_NAMED.get(name, ())):
            active = p._active
            if active and _this_threads(active) >= 0:
                return True
    except RuntimeError:  # a phase made on another thread while we looked: not ours
        pass
    return False


def _spec_for(name: str, domain: str, color: str | int | None, category: str | None,
              memory: bool | None, attributes: Mapping[str, Any] | None) -> RegionSpec:
    """The spec of a phase with these arguments: one per distinct set (at most
    :data:`SPECS_CACHED` kept), so ``with perfsdk.phase("forward"):`` written inside the loop
    registers one spec, not one per step (every spec stays in the record table for good)."""
    try:
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                             for k, v in (attributes or {}).items()))
        return _spec(name, domain, color, category, memory, items)
    except TypeError:  # an unhashable argument: let the validation name it
        return RegionSpec.create(name, domain=domain, color=color, category=category,
                                 attributes=attributes, memory=memory, where="phase")


SPECS_CACHED = 4096
"""Distinct phase specs kept for reuse (as ``timed_region``'s)."""


@functools.lru_cache(maxsize=SPECS_CACHED, typed=True)  # memory=1 is not memory=True
def _spec(name: str, domain: str, color: str | int | None, category: str | None,
          memory: bool | None, items: tuple[tuple[str, Any], ...]) -> RegionSpec:
    return RegionSpec.create(name, domain=domain, color=color, category=category,
                             attributes=dict(items) or None, memory=memory, where="phase")


def _exit_many(active: list[_Entry], error: BaseException | None) -> None:
    """One phase object open in several threads at once: end this thread's entry."""
    active.pop(_this_threads(active)).exit(error)


def _this_threads(active: list[_Entry]) -> int:
    """The index of the last entry opened on this thread (an entry that records nothing
    belongs to no thread: any will do)."""
    ident = get_ident()
    for i in range(len(active) - 1, -1, -1):
        entry = active[i]
        if type(entry) is InnerRegion:
            if entry[0].thread_id == ident:
                return i
        elif type(entry) is not Region or entry.thread_id == ident:
            return i
    return -1


def _rebuild(name: str, domain: str, color: Any, category: Any, memory: Any,
             attributes: Any) -> phase:
    return phase(name, domain=domain, color=color, category=category, memory=memory,
                 attributes=attributes)


_PYTHON_METHODS = (phase.__enter__, phase.__exit__)


def python_twins() -> list[tuple[Any, str, Any]]:
    """``(owner, name, pure-Python twin)`` for the compiled with block: the tests swap them to
    run the same checks on both."""
    return [(phase, "__enter__", _PYTHON_METHODS[0]), (phase, "__exit__", _PYTHON_METHODS[1])]


_fastpath = _region.compiled_module()
if _fastpath is not None and hasattr(_fastpath, "bind_phase"):
    try:
        for _name, _method in zip(("__enter__", "__exit__"),
                                  _fastpath.bind_phase(phase, *_PYTHON_METHODS), strict=True):
            setattr(phase, _name, _method)
    except Exception as exc:  # never break the import: the Python methods record the same
        from perfsdk.errors import warn_once

        warn_once("fastpath-phase", f"perfsdk: the compiled phase block is off ({exc!r}); "
                  "using the pure-Python one")
