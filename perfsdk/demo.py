"""``perfsdk demo``: train a small model with instrumented steps, then show what was measured."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

import perfsdk
from perfsdk import _device

__all__ = ["run_demo"]


def run_demo(
    steps: int = 200,
    batch_size: int = 64,
    output_dir: str | os.PathLike[str] | None = None,
    exporters: tuple[str, ...] = ("file",),
    out: TextIO | None = None,
) -> Path:
    """Train a small MLP on synthetic data with ``@profiled`` steps; print the summary.

    Returns the spans file written (``<output_dir>/spans-<pid>.jsonl``).
    """
    if steps < 1:
        raise ValueError(f"steps={steps!r}; accepted values are integers >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; accepted values are integers >= 1")
    stream = sys.stdout if out is None else out
    config = perfsdk.configure(
        exporter=exporters or "none",
        output_dir=output_dir if output_dir is not None else perfsdk.get_config().output_dir,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    weights = torch.randn(64, 10)

    @perfsdk.profiled("data", category="input")
    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, 64)
        return x, (x @ weights).argmax(dim=1)

    @perfsdk.profiled("forward", category="compute")
    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(model(x), y)
        return loss

    @perfsdk.profiled("backward", category="compute")
    def backward(loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    @perfsdk.profiled("optimizer", category="compute")
    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @perfsdk.profiled("train_step")
    def train_step() -> torch.Tensor:
        x, y = next_batch()
        loss = forward(x, y)
        backward(loss)
        update()
        return loss.detach()

    stream.write(f"perfsdk demo: training a 3-layer MLP for {steps} steps "
                 f"(batch {batch_size}) on {'CUDA' if _device.initialized() else 'CPU'}\n")
    started = time.perf_counter()
    losses = []
    for step in range(steps):
        with perfsdk.timed_region("step", step=step):
            losses.append(train_step())
        if (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
            stream.write(f"  step {step + 1:>5}/{steps}  loss {losses[-1].item():.4f}\n")
    elapsed = time.perf_counter() - started
    stream.write(f"done in {elapsed:.2f} s ({steps * batch_size / elapsed:,.0f} samples/s)\n\n")
    perfsdk.summary(file=stream)
    perfsdk.flush()
    spans = Path(config.output_dir) / f"spans-{os.getpid()}.jsonl"
    if "file" in config.exporters:
        stream.write(f"\nspans written to {spans}\n")
    return spans
