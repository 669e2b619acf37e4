"""Helpers for the gpu tests: a GPU kernel of a known length (``torch.cuda._sleep`` spins for a
number of cycles; :func:`spin_for` calibrates that number on the GPU at hand) and torch's sync
debug mode for a block (:func:`sync_debug_mode`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from perfsdk.sync.debug import set_debug_mode


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """torch's CUDA sync debug mode set to ``mode`` for the block, then back to ``default``.
    Setting it warns once a process that the mode is a prototype: under the tests'
    ``-W error`` that raised after the mode was set (an H200 run: left at ``error``, it made
    every later test's ``model.to("cuda")`` raise), so that one warning is ignored here."""
    set_debug_mode(torch.cuda, mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
