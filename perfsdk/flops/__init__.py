"""FLOPs and MFU: what a model computes, and what the device could compute.

- :func:`count_flops` counts one call's model FLOPs (forward, or forward and backward) with
  torch's own ``FlopCounterMode`` (:mod:`perfsdk.flops.count`);
- :func:`peak_flops` is the device's peak FLOP/s: ``PERFSDK_PEAK_FLOPS``, a table of GPUs by
  name, or a measured GEMM peak on a CPU (:mod:`perfsdk.flops.peaks`).

``perfsdk.step(samples=..., flops=...)`` divides the two: each step gets ``perfsdk.flops``,
``perfsdk.flops_per_s`` and ``perfsdk.mfu`` (docs/flops.md).
"""

from __future__ import annotations

from perfsdk.flops.count import ModelFlops, count_flops
from perfsdk.flops.peaks import (
    CPU_BUDGET_S,
    DTYPES,
    GPUS,
    DeviceSpec,
    Peak,
    clear_peak_cache,
    find_peak,
    measure_cpu_peak,
    peak_flops,
)

__all__ = [
    "CPU_BUDGET_S",
    "DTYPES",
    "GPUS",
    "DeviceSpec",
    "ModelFlops",
    "Peak",
    "clear_peak_cache",
    "count_flops",
    "find_peak",
    "measure_cpu_peak",
    "peak_flops",
]
