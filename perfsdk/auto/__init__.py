"""Auto-instrumentation of a training loop: per-module regions, data wait, steps, capture ranges.

- :func:`instrument_module`: a region per submodule, forward and backward, named by its path
  (``SimpleNet.conv1``, ``SimpleNet.conv1.backward``); Transformer encoders keep their fast path.
- :func:`instrument_dataloader`: a ``data_wait`` region around each batch the loop waits for.
- :func:`step` and :func:`schedule`: step regions (samples/s) parenting everything inside them;
  steps outside the schedule's active phase record nothing.
- :func:`capture` and :func:`torch_profile`: an Nsight Systems capture range and a
  ``torch.profiler`` trace over chosen steps.

Example:
    >>> import torch
    >>> import perfsdk.auto as auto
    >>> from perfsdk.testing import capture
    >>> model = torch.nn.Linear(4, 2)
    >>> loader = auto.instrument_dataloader([torch.ones(8, 4)] * 3)
    >>> with capture() as cap, auto.instrument_module(model, backward=False):
    ...     for batch in loader:
    ...         with auto.step(samples=8):
    ...             _ = model(batch)
    >>> sorted({r.name for r in cap.regions})
    ['Linear', 'data_wait', 'step']
"""

from __future__ import annotations

import os

import torch

from perfsdk.auto import steps as _steps
from perfsdk.auto.capture import CaptureRange, TorchProfileRange, nsys_command
from perfsdk.auto.dataloader import InstrumentedLoader, instrument_dataloader
from perfsdk.auto.module import FAST_PATH_TYPES, ModuleInstrumentation, instrument_module
from perfsdk.auto.steps import PHASES, STEPS, Schedule, Step, Steps, schedule

_is_compiling = torch.compiler.is_dynamo_compiling

__all__ = [
    "FAST_PATH_TYPES",
    "PHASES",
    "STEPS",
    "CaptureRange",
    "InstrumentedLoader",
    "ModuleInstrumentation",
    "Schedule",
    "Step",
    "Steps",
    "TorchProfileRange",
    "capture",
    "end_step",
    "instrument_dataloader",
    "instrument_module",
    "nsys_command",
    "schedule",
    "set_schedule",
    "step",
    "torch_profile",
]


def step(samples: int | None = None, *, flops: float | None = None) -> Step:
    """Start the next step (ending the open one): ``with auto.step(samples=64): ...``, or call
    ``auto.step(samples=64)`` at the top of every iteration and :func:`end_step` after the loop.

    The step region is named ``step`` (category ``step``) with ``perfsdk.step`` (0-based index),
    ``perfsdk.samples`` and, at its end, ``perfsdk.samples_per_s``. Given ``flops``, the step's
    model FLOPs (:func:`perfsdk.count_flops` of one step), its end also sets ``perfsdk.flops``,
    ``perfsdk.flops_per_s`` (over the step's host time) and ``perfsdk.mfu`` (that over
    :func:`perfsdk.peak_flops`, when the peak is known; docs/flops.md). Regions inside the step
    nest under it. With a schedule (:func:`set_schedule`), a step outside its active phase
    records nothing, neither itself nor any region inside it. Inside code that
    ``torch.compile`` traces a step steps aside (no index, no record, no recompilation): put
    it around the compiled call.

    Raises:
        ValueError: ``samples`` is not None or an integer >= 1, or ``flops`` is not None or a
            positive finite number.
    """
    if _is_compiling():  # dynamo traces the Python code (the compiled would break the graph)
        return STEPS.step(samples, flops=flops)
    return _steps.step_start(STEPS, samples, flops, False)  # STEPS.step(...), one frame fewer


def end_step() -> None:
    """End the open step (after a loop that calls :func:`step` plainly); idempotent."""
    STEPS.end()


def set_schedule(schedule: Schedule | None) -> None:
    """Record only the steps ``schedule`` makes active (None: every step); counts from step 0.

    Example:
        >>> import perfsdk.auto as auto
        >>> auto.set_schedule(auto.schedule(wait=2, warmup=1, active=3, repeat=1))
        >>> auto.set_schedule(None)
    """
    STEPS.set_schedule(schedule)


def capture(steps: range | int, *, tracker: Steps | None = None) -> CaptureRange:
    """Call ``cudaProfilerStart`` before the chosen steps and ``cudaProfilerStop`` after them.

    Logs (at INFO, logger ``perfsdk.auto``) and returns in ``.command`` the matching
    ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx ...``
    command. Without an initialized CUDA device nothing is called (one NoEffectWarning).

    Args:
        steps: The step indices to capture, e.g. ``range(10, 20)`` (or one index).
        tracker: The :class:`Steps` to follow; default the process-wide :data:`STEPS`.

    Raises:
        ValueError: ``steps`` is not an index or a non-empty range with step 1.
    """
    return CaptureRange(steps, tracker=tracker)


def torch_profile(steps: range | int, *, output_dir: str | os.PathLike[str] | None = None,
                  record_shapes: bool = False, with_stack: bool = False,
                  tracker: Steps | None = None) -> TorchProfileRange:
    """Run ``torch.profiler.profile`` over the chosen steps and save its Chrome trace.

    The trace goes to ``<output_dir>/torch-trace-<pid>-steps-<first>-<last>.json`` (default:
    the configured output directory, next to perfsdk's own files). perfsdk's regions inside
    those steps appear in it as ``record_function`` annotations.

    Raises:
        ValueError: An argument has a value outside those accepted.
    """
    return TorchProfileRange(steps, output_dir=output_dir, record_shapes=record_shapes,
                             with_stack=with_stack, tracker=tracker)
