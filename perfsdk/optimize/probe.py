"""A tiny measured probe: does autocast to a low-precision dtype pay on this machine?

CPUs differ: with AMX-BF16 (or AVX-512 BF16) a bfloat16 matmul is fast; with only AVX2 it is
emulated, and a bf16 training step has been measured 15x slower than fp32. So nothing decides
from the CPU's name: :func:`autocast_speedup` times a small convolution-and-matmul step in fp32
and under autocast, interleaved, and returns the ratio. It is measured once per process, device
and dtype (well under a second), and callers use it to prune candidates that cannot win here
before spending real time on them.

Example:
    >>> import torch
    >>> from perfsdk.optimize.probe import autocast_speedup
    >>> ratio = autocast_speedup(torch.bfloat16)
    >>> ratio > 0
    True
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from perfsdk import _device

__all__ = ["PRUNE_BELOW", "autocast_speedup", "autocast_pays"]

PRUNE_BELOW = 0.8
"""A dtype whose probe runs at less than this fraction of fp32's speed is not worth trying:
nothing in a real model's step makes up that much (an emulated bf16 measures 0.05-0.3x)."""

_ROUNDS = 7


def _workload(device: str) -> tuple[nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32 * 16 * 16, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(8, 16, 16, 16, generator=generator)
    return model.to(device), x.to(device)


def _time(fn: Callable[[], None], sync: bool) -> float:
    started = time.perf_counter()
    fn()
    if sync:  # a probe, not an instrumented path: it waits for the GPU to time it
        _device.get_backend().synchronize()
    return time.perf_counter() - started


@functools.cache
def autocast_speedup(dtype: torch.dtype, device: str = "cpu") -> float:
    """fp32 time over autocast-``dtype`` time for a small training step (forward and backward)
    on ``device``, the median of interleaved rounds: above 1 autocast is faster here, below 1 it
    is slower. Measured once per process for each ``(dtype, device)``.

    Raises:
        ValueError: ``dtype`` is not ``torch.bfloat16`` or ``torch.float16``.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast_speedup: dtype={dtype!r}; accepted values are "
                         "torch.bfloat16 and torch.float16")
    device_type = torch.device(device).type
    model, x = _workload(device)

    def step(low: bool) -> None:
        with torch.autocast(device_type, dtype=dtype, enabled=low):
            model(x).float().sum().backward()

    sync = device_type == "cuda"
    plain, low = functools.partial(step, False), functools.partial(step, True)
    try:
        for fn in (plain, low, plain, low):  # warm-up: kernels picked, caches filled
            fn()
        ratios = [_time(plain, sync) / max(_time(low, sync), 1e-9) for _ in range(_ROUNDS)]
    except RuntimeError:  # the dtype is not supported under autocast on this device
        return 0.0
    return statistics.median(ratios)


def autocast_pays(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether autocast to ``dtype`` is worth measuring on a real model here: the probe runs at
    least :data:`PRUNE_BELOW` of fp32's speed."""
    return autocast_speedup(dtype, device) >= PRUNE_BELOW
