"""The bottleneck advisor: reads a run's regions and names what to fix first, and how.

:func:`advise` applies deterministic rules, in the order of the optimization loop the course
material teaches (profile, find the bottleneck, apply the matching fix, measure again):

- ``data``: ``data_wait`` regions take more than :data:`DATA_SHARE` of the loop time;
  fix ``perfsdk.optimize.tune_dataloader(loader.dataset, loader.batch_size)``.
- ``sync``: the steps' regions carry ``perfsdk.syncs``, at least :data:`SYNCS_PER_STEP` per
  step (syncs outside the steps are reported as such, never divided by the steps); fix
  ``perfsdk.configure(sync_guard="error")`` and the fix for each call site.
- ``launch`` (only with device times): host time at least :data:`LAUNCH_HOST_DEVICE_RATIO`
  times device time, or GPU utilization below :data:`LAUNCH_UTILIZATION` with short steps;
  fix ``perfsdk.optimize.optimize(model, inputs, compile=True)`` / ``apply_cuda_graphs``.
- ``memory``: a peak above :data:`MEMORY_PRESSURE` of ``device_memory_bytes``, or an
  out-of-memory error; fix ``apply_checkpointing``, AMP, a smaller batch.
- ``memory_creep``: memory that grows every step, a leak: over at least
  :data:`CREEP_MIN_STEPS` steps, the steps' peak allocated GPU memory (or the process's RSS)
  rises in each of :data:`CREEP_SEGMENTS` parts of the run, close to a line
  (:data:`CREEP_FIT`), by at least :data:`CREEP_MIN_BYTES` and :data:`CREEP_MIN_FRACTION` of
  the start; the finding gives the slope per step, the growth per 1,000 steps and the region
  where it grows; fix ``perfsdk.configure(memory=True, memory_snapshots=True)`` and the usual
  causes (tensors kept with their graph, lists that grow every step, unbounded caches).
- ``compute``: none of data, sync, launch, and forward/backward take at least
  :data:`COMPUTE_SHARE`; fix ``perfsdk.optimize.optimize(model, inputs, auto=True)``, which
  measures AMP, compile and channels-last on this machine.

Findings are ordered by their estimated impact (the share of the loop time at stake). The first
step is left out as warm-up when there are at least :data:`WARMUP_MIN_STEPS`. A fix the regions
say is already on (``perfsdk.amp``, ``perfsdk.transforms``: autocast, compile, channels-last,
checkpointing, CUDA graphs) is not recommended again; the finding says it is on. Every fix is a
statement that runs as printed, given ``perfsdk``, ``torch`` and :data:`NAMES` (``model``,
``inputs``, ``loader``, ``optimizer``, ``loss_fn``), or a ``#`` comment. What a rule could not
check (no steps, no device times, no memory records) is listed in ``notes``. See
docs/advisor.md.

Example (on a fake clock, so the numbers are exact; a real loop reads the real one):
    >>> import perfsdk
    >>> from perfsdk.advisor import advise
    >>> from perfsdk.testing import capture, use_fake_clock
    >>> with use_fake_clock() as clock, capture() as cap:
    ...     for i in range(3):
    ...         with perfsdk.timed_region("data_wait", category="data"):
    ...             clock.advance(20)  # a slow dataset: 20 ms a batch
    ...         with perfsdk.timed_region("step", category="step"):
    ...             clock.advance(1)
    >>> advice = advise(cap.regions)
    >>> advice.findings[0].kind, round(advice.findings[0].impact, 2)
    ('data', 0.95)
    >>> advice.findings[0].fix
    'tuning = perfsdk.optimize.tune_dataloader(loader.dataset, loader.batch_size)'
"""

from __future__ import annotations

from perfsdk.advisor.advice import KINDS, Advice, advise
from perfsdk.advisor.rules import (
    COMPUTE_SHARE,
    CREEP_FIT,
    CREEP_MIN_BYTES,
    CREEP_MIN_FRACTION,
    CREEP_MIN_STEPS,
    CREEP_SEGMENTS,
    DATA_SHARE,
    LAUNCH_HOST_DEVICE_RATIO,
    LAUNCH_MIN_IMPACT,
    LAUNCH_SHORT_STEP_MS,
    LAUNCH_UTILIZATION,
    MEMORY_PRESSURE,
    MEMORY_WEIGHT,
    NAMES,
    SYNC_MIN_IMPACT,
    SYNC_STALL_MS,
    SYNCS_PER_STEP,
    WARMUP_MIN_STEPS,
    WARMUP_STEPS,
    Finding,
)

__all__ = [
    "COMPUTE_SHARE", "CREEP_FIT", "CREEP_MIN_BYTES", "CREEP_MIN_FRACTION", "CREEP_MIN_STEPS",
    "CREEP_SEGMENTS", "DATA_SHARE", "KINDS", "LAUNCH_HOST_DEVICE_RATIO", "LAUNCH_MIN_IMPACT",
    "LAUNCH_SHORT_STEP_MS", "LAUNCH_UTILIZATION", "MEMORY_PRESSURE", "MEMORY_WEIGHT", "NAMES",
    "SYNCS_PER_STEP", "SYNC_MIN_IMPACT", "SYNC_STALL_MS", "WARMUP_MIN_STEPS", "WARMUP_STEPS",
    "Advice", "Finding", "advise",
]
