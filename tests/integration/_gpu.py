"""A GPU kernel of a known length for the gpu tests: ``torch.cuda._sleep`` spins for a number
of cycles; :func:`spin_for` calibrates that number on the GPU at hand."""

from __future__ import annotations

import torch


def sleep_ms(cycles: int) -> float:
    """How long ``torch.cuda._sleep(cycles)`` keeps the GPU busy, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def spin_for(ms: float) -> tuple[int, float]:
    """(cycles, measured ms) of a spin of about ``ms`` milliseconds on this GPU."""
    sleep_ms(1000)  # the kernel loaded, the clocks up
    cycles = max(1, int(1_000_000 * ms / sleep_ms(1_000_000)))
    return cycles, sleep_ms(cycles)
