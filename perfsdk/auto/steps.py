"""Step boundaries and the schedule that decides which steps are recorded.

A step is a region named ``step`` (category ``step``) with attributes ``perfsdk.step`` (0-based
index), ``perfsdk.samples`` and, set at its end, ``perfsdk.samples_per_s``; given ``flops`` (the
step's model FLOPs, :func:`perfsdk.count_flops`), also ``perfsdk.flops``, ``perfsdk.flops_per_s``
and ``perfsdk.mfu`` (against :func:`perfsdk.peak_flops`) at its end. Regions entered
inside a step nest under it (regions nest by context), so the step span parents the step's
``data_wait``, module and user regions.

A step outside the schedule's ``active`` phase records nothing at all: while it runs perfsdk's
``state.enabled`` flag is off, so every region entry (``@profiled``, ``timed_region``, module
hooks, ``data_wait``) takes the disabled path, the one flag test each already makes; the flag
goes back to the configured value when the step ends. No new check is added to the hot path.
Two consequences: functions *decorated* during a skipped step are returned unwrapped (as with
``PERFSDK_ENABLED=0`` at decoration time), and a ``configure(enabled=...)`` made during a skipped
step takes effect when that step ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

import torch

from perfsdk import config as _config
from perfsdk import distributed as _distributed
from perfsdk import region as _region
from perfsdk.distributed import run_id, step_trace_id
from perfsdk.flops.peaks import peak_flops
from perfsdk.memory import current_rss
from perfsdk.region import Region, RegionSpec

__all__ = [
    "PHASES", "STEPS", "Schedule", "Step", "StepListener", "Steps", "autocast_dtype", "schedule",
]

PHASES = ("wait", "warmup", "active", "done")
"""What :meth:`Schedule.phase` returns; only ``active`` steps are recorded."""

_state = _config.state
_is_compiling = torch.compiler.is_dynamo_compiling


def _flops(value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or value == float("inf")):
        raise ValueError(f"step: flops={value!r}; accepted values are None or a positive "
                         "finite number (the step's model FLOPs, e.g. perfsdk.count_flops(...))")
    return value


def _count(where: str, arg: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {arg}={value!r}; accepted values are integers >= {minimum}")
    return value


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which steps are recorded, as ``torch.profiler.schedule`` decides which are profiled.

    After ``skip_first`` steps, cycles of ``wait`` unrecorded steps, ``warmup`` unrecorded
    steps and ``active`` recorded ones, ``repeat`` times (0: forever), then nothing.
    Build one with :func:`schedule`.
    """

    wait: int
    warmup: int
    active: int
    repeat: int = 0
    skip_first: int = 0

    def __post_init__(self) -> None:
        for arg, minimum in (("wait", 0), ("warmup", 0), ("active", 1), ("repeat", 0),
                             ("skip_first", 0)):
            _count("schedule", arg, getattr(self, arg), minimum)

    def phase(self, step: int) -> str:
        """``wait``, ``warmup``, ``active`` or ``done`` (after the last repeat) for a step."""
        if step < self.skip_first:
            return "wait"
        step -= self.skip_first
        cycle = self.wait + self.warmup + self.active
        if self.repeat and step >= cycle * self.repeat:
            return "done"
        at = step % cycle
        if at < self.wait:
            return "wait"
        return "warmup" if at < self.wait + self.warmup else "active"

    def is_active(self, step: int) -> bool:
        """Whether step ``step`` is recorded."""
        return self.phase(step) == "active"


def schedule(*, wait: int, warmup: int, active: int, repeat: int = 0,
             skip_first: int = 0) -> Schedule:
    """A :class:`Schedule` (the arguments of ``torch.profiler.schedule``).

    Example:
        >>> from perfsdk.auto import schedule
        >>> s = schedule(wait=1, warmup=1, active=2, repeat=1)
        >>> [s.phase(i) for i in range(5)]
        ['wait', 'warmup', 'active', 'active', 'done']
    """
    return Schedule(wait, warmup, active, repeat, skip_first)


class StepListener(Protocol):
    """Told when each step starts and ends (capture ranges, torch.profiler windows)."""

    def on_step_start(self, index: int) -> None: ...
    def on_step_end(self, index: int) -> None: ...


_autocast_on = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)
"""One call without arguments (about 150 ns) that tells whether autocast is on for any device:
``torch.is_autocast_enabled(device)`` parses its device string, about 400 ns a device."""


def autocast_dtype() -> str | None:
    """The dtype ``torch.autocast`` is on with in this thread (``"bfloat16"``, ``"float16"``),
    CUDA's first, or None: what a region records as ``perfsdk.amp`` at its entry."""
    if _any_autocast is not None and not _any_autocast():
        return None  # the common case: one call
    for device in ("cuda", "cpu"):
        if _autocast_on(device):
            return str(_autocast_dtype(device)).removeprefix("torch.")
    return None


def _step_spec() -> RegionSpec:
    """The step region's spec, made at the first step (then read from ``_STEP_SPEC``)."""
    global _STEP_SPEC
    if _STEP_SPEC is None:
        _STEP_SPEC = RegionSpec.create("step", category="step", every=1, where="step")
    return _STEP_SPEC


def _step_start() -> Callable[[dict[str, Any] | None], Region]:
    """What enters a step's region (``_region.region_starter``, compiled where built), made at
    the first step (then read from ``_STEP_START``)."""
    global _STEP_START
    if _STEP_START is None:
        _STEP_START = _region.region_starter(_step_spec())
    return _STEP_START


_new_step = object.__new__
_STEP_SPEC: RegionSpec | None = None
_STEP_START: Callable[[dict[str, Any] | None], Region] | None = None


class Step:
    """One step: a ``with`` block, or open until the next :meth:`Steps.step` call.

    Attributes:
        index: The step's 0-based index.
        samples: Samples processed in the step, if given.
        flops: The step's model FLOPs, if given.
        phase: The schedule's phase for it (``active`` without a schedule).
        region: The step's region while recorded, else None.
    """

    __slots__ = ("_steps", "flops", "index", "phase", "region", "samples")

    def __init__(self, steps: Steps, index: int, samples: int | None, phase: str,
                 flops: float | None = None) -> None:
        self._steps = steps
        self.index = index
        self.samples = samples
        self.flops = flops
        self.phase = phase
        self.region: Region | None = None

    @property
    def recorded(self) -> bool:
        """Whether the step is in the schedule's active phase (its regions are recorded)."""
        return self.phase == "active"

    def end(self, error: BaseException | None = None) -> None:
        """End the step (idempotent). Inside code that ``torch.compile`` traces it steps aside
        (see :func:`_aside`)."""
        if not _is_compiling():
            step_end(self._steps, self, error)

    # Where perfsdk's compiled module is built, the class takes TwinMethods for these two (at
    # the end of this module): eager code runs a compiled with block, torch.compile inlines
    # these (the __func__ of the bound twin).
    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not _is_compiling():  # end(exc), written out: it runs every step
            step_end(self._steps, self, exc)

    def __repr__(self) -> str:
        return f"<Step {self.index} {self.phase}>"


class Steps:
    """The step boundaries of one loop, with an optional :class:`Schedule`.

    ``perfsdk.auto.step()`` uses a process-wide instance; make your own for a second loop.

    Example:
        >>> from perfsdk.auto import Steps, schedule
        >>> steps = Steps(schedule(wait=1, warmup=0, active=1))
        >>> for batch in range(4):
        ...     with steps.step(samples=8) as s:
        ...         pass
        >>> s.index, s.phase
        (3, 'active')
    """

    # Slots: a step's compiled start and end read and write these at fixed offsets (no
    # attribute lookup: in place, after a training step's torch calls, each lookup's cache
    # misses cost more than its instructions).
    __slots__ = ("__weakref__", "_indices", "_paused", "current", "explicit", "listeners",
                 "next_index", "schedule")

    def __init__(self, schedule: Schedule | None = None) -> None:
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(f"Steps: schedule={schedule!r}; accepted values are None (record "
                             "every step) or perfsdk.auto.schedule(...)")
        self.schedule = schedule
        self.next_index = 0
        """The index the next step gets (while steps start in several threads at once, it can
        trail by the steps still starting: the indices themselves are distinct)."""
        self._indices = itertools.count()  # next() is atomic under the GIL: no lock per step
        self.current: Step | None = None
        self.listeners: list[StepListener] = []
        self._paused = False
        self.explicit = False
        """Whether any step was started by a plain :meth:`step` call (not ``implicit``)."""

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Use ``schedule`` from now on (None: record every step) and count steps from 0."""
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(f"set_schedule: schedule={schedule!r}; accepted values are None "
                             "(record every step) or perfsdk.auto.schedule(...)")
        self.end()
        self.schedule = schedule
        self.next_index = 0
        self._indices = itertools.count()
        self.explicit = False

    def step(self, samples: int | None = None, *, flops: float | None = None,
             implicit: bool = False) -> Step:
        """End the open step, if any, and start the next; use it as a call or a ``with``.

        ``implicit`` marks a boundary perfsdk drew itself (``perfsdk run`` starts a step at each
        DataLoader batch, and stops once the script calls ``step()`` on its own: see
        :attr:`explicit`)."""
        if _is_compiling():
            return _aside(samples, flops)
        return step_start(self, samples, flops, implicit)

    def end(self) -> None:
        """End the open step (the last one of a loop that calls :meth:`step` plainly)."""
        if _is_compiling():  # steps aside (see _aside)
            return
        current = self.current
        if current is not None:
            current.end()

    def _end(self, step: Step, error: BaseException | None) -> None:
        if self.current is not step:
            return  # already ended
        self.current = None
        region, step.region = step.region, None
        if region is not None:
            t1 = 0
            flops = step.flops
            samples = step.samples
            if (samples is not None or flops is not None) and region.t0:
                t1 = _region._perf_ns()  # the step ends here: its rate is samples / its time
                seconds = (t1 - region.t0) / 1e9
                attrs = region._attributes  # the dict its entry was given: set it directly
                if seconds > 0 and samples is not None and attrs is not None:
                    attrs["perfsdk.samples_per_s"] = samples / seconds
                if flops is not None:
                    _set_flops(region, flops, seconds)
            if _state.memory and region.t0:  # the advisor's leak rule: RSS at each step's end
                rss = current_rss()
                if rss is not None:
                    region.set_attribute("perfsdk.memory.rss_bytes", rss)
            _region.exit_region(region, error, t1)
        if self._paused:
            self._pause(False)
        if self.listeners:
            for listener in list(self.listeners):
                _notify(listener.on_step_end, step.index)

    def _pause(self, paused: bool) -> None:
        """Skipped steps record nothing: the disabled path every region entry already tests."""
        self._paused = paused
        _state.enabled = (not paused) and _config.get_config().enabled


def _check(samples: int | None, flops: float | None) -> None:
    """A step's arguments: raises ValueError naming a bad one."""
    if samples is not None and (type(samples) is not int or samples < 1):
        _count("step", "samples", samples, 1)  # raises, unless an int subclass >= 1
    if flops is not None:
        _flops(flops)


def _step_python(steps: Steps, samples: int | None, flops: float | None,
                 implicit: bool) -> Step:
    """:meth:`Steps.step`'s work, in Python (``step_start``: compiled where built)."""
    _check(samples, flops)
    if not implicit:
        steps.explicit = True
    current = steps.current
    if current is not None:
        steps._end(current, None)
    index = next(steps._indices)  # two threads never get the same index
    steps.next_index = index + 1
    sched = steps.schedule
    phase = "active" if sched is None else sched.phase(index)
    step = _new_step(Step)  # Step(steps, index, samples, phase, flops), written out: the
    step._steps = steps  # first Python work after the last step's torch calls, where a
    step.index = index  # frame costs microseconds
    step.samples = samples
    step.flops = flops
    step.phase = phase
    step.region = None
    steps.current = step
    if steps.listeners:
        for listener in list(steps.listeners):
            _notify(listener.on_step_start, index)
    if phase != "active":
        steps._pause(True)
    elif _state.enabled and not _is_compiling():
        attrs: dict[str, Any] = {"perfsdk.step": index}
        if samples is not None:
            attrs["perfsdk.samples"] = samples
        if _any_autocast is None or _any_autocast():  # one call in the common case
            amp = autocast_dtype()
            if amp is not None:  # the step runs under autocast (the advisor: "already on")
                attrs["perfsdk.amp"] = amp
        run = run_id()  # before the step's clock starts: the first call may ask the store
        # The gate, written out: enabled (tested above) and every=1 (steps are not sampled).
        region = (_STEP_START or _step_start())(attrs)
        if region.t0 and not region.parent_id:  # a root step: the run's trace for it
            shared = step_trace_id(index, run) if run else None
            if shared is not None:
                region.trace_id = shared
        step.region = region
    return step


def _set_flops(region: Region, flops: float, seconds: float) -> None:
    """``perfsdk.flops``, and over the step's time ``perfsdk.flops_per_s`` and ``perfsdk.mfu``
    (the peak is cached after its first lookup: a CPU measures it once, ~0.3 s, here)."""
    region.set_attribute("perfsdk.flops", flops)
    if seconds > 0:
        rate = flops / seconds
        region.set_attribute("perfsdk.flops_per_s", rate)
        try:
            peak = peak_flops()
        except Exception as exc:  # a broken device query must not break the training loop
            from perfsdk.errors import warn_once

            warn_once(f"peak-flops:{type(exc).__name__}",
                      f"perfsdk: no peak FLOP/s ({exc!r}), so no MFU; the loop goes on")
            peak = None
        if peak:
            region.set_attribute("perfsdk.mfu", rate / peak)


def _notify(fn: Any, index: int) -> None:
    try:
        fn(index)
    except Exception as exc:  # a listener must never break the training loop
        from perfsdk.errors import warn_once

        warn_once(f"step-listener:{type(exc).__name__}",
                  f"perfsdk: a step listener failed ({exc!r}); the loop goes on")


def _aside(samples: int | None, flops: float | None) -> Step:
    """A step started inside code that ``torch.compile`` traces (DESIGN rule 5: a region there
    steps aside): its arguments checked, then a step that counts no index, ends no step and
    records nothing. It reads and writes none of the steps' state, so dynamo has nothing to
    guard on: reading ``STEPS._indices``, as the step's Python code does, made dynamo recompile
    the function at every call until its recompile limit (8), and then run it all eagerly.
    Made here, in the traced code, so that dynamo enters its ``with`` block (it does not enter
    a context manager made outside). Put the step around the compiled call to record it."""
    _check(samples, flops)
    step = _new_step(Step)
    step._steps = _ASIDE
    step.index = -1
    step.samples = samples
    step.flops = flops
    step.phase = "aside"
    step.region = None
    return step


_ASIDE = Steps()
"""The steps of the steps that stepped aside (never started: ending one does nothing)."""

step_start: Callable[[Steps, int | None, float | None, bool], Step] = _step_python
"""``step_start(steps, samples, flops, implicit)`` is what :meth:`Steps.step` does, and
``step_end(steps, step, error)`` is ``steps._end(step, error)``. Where perfsdk's compiled module
is built they are ``perfsdk._fastpath.step_start`` and ``step_end``: the common case (no
schedule, no listeners, no ``flops``, ``samples`` an int or None, perfsdk enabled, not a
``torchrun`` job with a shared run id, no memory readings) without a Python frame; anything
else is handed to the Python code before anything is done. A step boundary is the first
Python work after the last step's torch calls, where every frame costs microseconds. While
dynamo traces (``torch.compiler.is_dynamo_compiling()``, asked by their Python callers) the
Python code runs: dynamo cannot trace a C function, and a step must not break the graph."""
step_end: Callable[[Steps, Step, BaseException | None], None] = Steps._end


_STEP_WITH = (Step.__enter__, Step.__exit__)  # the Python methods


def python_twins() -> list[tuple[Any, str, Any]]:
    """``(owner, name, pure-Python twin)`` for each of the compiled step paths: the tests swap
    them to run the same checks on both."""
    module = sys.modules[__name__]
    return [(module, "step_start", _step_python), (module, "step_end", Steps._end),
            (Step, "__enter__", _STEP_WITH[0]), (Step, "__exit__", _STEP_WITH[1])]


_fastpath = _region.compiled_module()
if _fastpath is not None and _region.exit_region is getattr(_fastpath, "region_exit", None):
    try:
        _fastpath.bind_steps(globals(), vars(_distributed), Steps, Step)
        # Step's with block, compiled for eager code, while torch.compile traces the Python
        # methods (TwinMethod: dynamo inlines a bound method's __func__)
        for _name, _compiled, _python in zip(("__enter__", "__exit__"),
                                             _fastpath.step_methods(), _STEP_WITH,
                                             strict=True):
            setattr(Step, _name, _fastpath.TwinMethod(_compiled, _python))
    except Exception as exc:  # never break the import: the Python twins record the same
        from perfsdk.errors import warn_once

        warn_once("fastpath-steps", f"perfsdk: compiled steps are off ({exc!r}); using the "
                  "pure-Python path")
    else:
        step_start = _fastpath.step_start
        step_end = _fastpath.step_end

STEPS = Steps()
"""The process-wide step boundaries behind :func:`perfsdk.auto.step`, :func:`perfsdk.auto.capture`
and :func:`perfsdk.auto.torch_profile`."""
