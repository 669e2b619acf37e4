"""Capture ranges over chosen steps: Nsight Systems (``cudaProfilerStart/Stop``) and
``torch.profiler``. Both listen to a :class:`~perfsdk.auto.Steps` (the process-wide one by
default) and act at step boundaries: the range starts before the first chosen step's region
and ends after the last one's, so the steps' own ranges are inside."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from perfsdk import _device
from perfsdk.auto.steps import STEPS, Steps
from perfsdk.config import get_config
from perfsdk.errors import NoEffectWarning, warn_once

__all__ = ["CaptureRange", "TorchProfileRange", "nsys_command", "step_range"]

logger = logging.getLogger("perfsdk.auto")

CYCLE_NOTE = "Warning: Profiler clears events at the end of each cycle"
"""What ``torch.profiler`` (2.11) warns when a profile starts without ``acc_events``."""


def step_range(where: str, steps: Any) -> range:
    """``steps`` as a non-empty range of consecutive step indices (an int is one step)."""
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
        return range(steps, steps + 1)
    if isinstance(steps, range) and steps.step == 1 and len(steps) and steps.start >= 0:
        return steps
    raise ValueError(f"{where}: steps={steps!r}; accepted values are a step index (int >= 0) "
                     "or a non-empty range of step indices with step 1, e.g. range(10, 20)")


def nsys_command(output: str | os.PathLike[str], argv: list[str] | None = None) -> str:
    """The ``nsys profile`` command that records only the cudaProfilerStart/Stop range."""
    argv = list(sys.argv if argv is None else argv) or ["train.py"]
    return shlex.join(["nsys", "profile", "--capture-range=cudaProfilerApi",
                       "--capture-range-end=stop", "-t", "cuda,nvtx", "-o", str(output),
                       "python", *argv])


class _Range:
    """A window of steps on a :class:`Steps`; detaches itself after the last step."""

    def __init__(self, where: str, steps: Any, tracker: Steps | None) -> None:
        self.steps = step_range(where, steps)
        self.tracker = tracker if tracker is not None else STEPS
        if not isinstance(self.tracker, Steps):
            raise ValueError(f"{where}: tracker={tracker!r}; accepted values are None (the "
                             "process-wide steps) or a perfsdk.auto.Steps")
        self.running = False
        self.done = False
        if self.steps.start < self.tracker.next_index:
            warn_once(f"{where}-past", f"perfsdk: {where}(steps={steps!r}): step "
                      f"{self.steps.start} has already started (the next step is "
                      f"{self.tracker.next_index}); nothing will be captured",
                      NoEffectWarning)
            self.done = True
            return
        self.tracker.listeners.append(self)

    def on_step_start(self, index: int) -> None:
        if index == self.steps.start and not self.running and not self.done:
            self.running = True
            self._start()

    def on_step_end(self, index: int) -> None:
        if self.running and index >= self.steps[-1]:
            self.remove()

    def remove(self) -> None:
        """Stop now if running, and stop listening; idempotent."""
        if self in self.tracker.listeners:
            self.tracker.listeners.remove(self)
        if self.running:
            self.running = False
            self._stop()
        self.done = True

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


class CaptureRange(_Range):
    """``cudaProfilerStart`` before the first chosen step, ``cudaProfilerStop`` after the last.

    Attributes:
        steps: The chosen steps.
        command: The matching ``nsys profile`` command line (also logged at INFO).
        calls: What was called, in order: ``"start"``, ``"stop"``.
    """

    def __init__(self, steps: Any, *, tracker: Steps | None = None) -> None:
        super().__init__("capture", steps, tracker)
        self.calls: list[str] = []
        out = get_config().output_dir / f"nsys-steps-{self.steps.start}-{self.steps[-1]}"
        self.command = nsys_command(out)
        logger.info("perfsdk: steps %d-%d are a cudaProfilerApi capture range; record them "
                    "with:\n  %s", self.steps.start, self.steps[-1], self.command)

    def _call(self, what: str) -> None:
        backend = _device.active()
        if backend is None:
            warn_once("capture-no-cuda", "perfsdk: capture(): CUDA is not initialized in this "
                      "process, so no cudaProfilerStart/Stop was called (nothing for nsys to "
                      "capture)", NoEffectWarning)
            return
        try:
            if what == "start":
                backend.profiler_start()
            else:
                backend.profiler_stop()
        except Exception as exc:  # never break the loop
            warn_once(f"capture-{what}", f"perfsdk: cudaProfiler{what.title()} failed: {exc!r}")
            return
        self.calls.append(what)

    def _start(self) -> None:
        self._call("start")

    def _stop(self) -> None:
        self._call("stop")

    def __repr__(self) -> str:
        return f"<CaptureRange steps {self.steps.start}-{self.steps[-1]}>"


class TorchProfileRange(_Range):
    """``torch.profiler.profile`` over the chosen steps; its Chrome trace saved at the end.

    Attributes:
        steps: The chosen steps.
        path: Where the trace is (or will be) written.
        profiler: The ``torch.profiler.profile`` once started (its ``key_averages()`` etc.).
        saved: Whether the trace file was written.
    """

    def __init__(self, steps: Any, *, output_dir: str | os.PathLike[str] | None = None,
                 record_shapes: bool = False, with_stack: bool = False,
                 tracker: Steps | None = None) -> None:
        for arg, value in (("record_shapes", record_shapes), ("with_stack", with_stack)):
            if not isinstance(value, bool):
                raise ValueError(f"torch_profile: {arg}={value!r}; accepted values are True or "
                                 "False")
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise ValueError(f"torch_profile: output_dir={output_dir!r}; accepted values are "
                             "None (the configured output directory) or a path")
        super().__init__("torch_profile", steps, tracker)
        directory = Path(output_dir) if output_dir is not None else get_config().output_dir
        self.path = directory / (f"torch-trace-{os.getpid()}-steps-{self.steps.start}-"
                                 f"{self.steps[-1]}.json")
        self.profiler: Any = None
        self.saved = False
        self._record_shapes = record_shapes
        self._with_stack = with_stack

    def _start(self) -> None:
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        if _device.initialized() and isinstance(_device.get_backend(), _device.TorchCuda):
            activities.append(tp.ProfilerActivity.CUDA)
        try:
            self.profiler = tp.profile(activities=activities, record_shapes=self._record_shapes,
                                       with_stack=self._with_stack)
            with warnings.catch_warnings():
                # torch 2.11 notes at every start that a profiling cycle's end clears its
                # events: this range is one cycle (and under -W error the note failed it)
                warnings.filterwarnings("ignore", message=CYCLE_NOTE, category=UserWarning)
                self.profiler.__enter__()
        except Exception as exc:
            self.profiler = None
            warn_once("torch-profile-start", f"perfsdk: torch_profile could not start "
                      f"torch.profiler: {exc!r}")

    def _stop(self) -> None:
        profiler = self.profiler
        if profiler is None:
            return
        try:
            profiler.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(self.path))
            self.saved = True
            logger.info("perfsdk: torch.profiler trace of steps %d-%d written to %s",
                        self.steps.start, self.steps[-1], self.path)
        except Exception as exc:
            warn_once("torch-profile-save", f"perfsdk: torch_profile could not save "
                      f"{self.path}: {exc!r}")

    def __repr__(self) -> str:
        return f"<TorchProfileRange steps {self.steps.start}-{self.steps[-1]} -> {self.path}>"
