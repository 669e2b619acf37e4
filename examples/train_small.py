"""Train a small MLP on synthetic data with every training step instrumented by perfsdk.

Runs on the CPU in a few seconds. Each step is split into four decorated regions (data,
forward, backward, optimizer) nested under a ``train_step`` region, and each epoch is a
``timed_region``. At the end it prints perfsdk's summary table and the path of the JSON-lines
file the ``file`` exporter wrote (one OpenTelemetry span per region).

    python examples/train_small.py            # writes ./perfsdk-output/spans-<pid>.jsonl
    PERFSDK_OUTPUT_DIR=/tmp/out python examples/train_small.py

On a machine with a GPU the same script runs on CUDA; run it under Nsight Systems
(``nsys profile -t nvtx,cuda python examples/train_small.py``) to see the NVTX ranges.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import perfsdk

STEPS_PER_EPOCH = 50
EPOCHS = 3
BATCH = 64
FEATURES = 32
CLASSES = 4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUTPUT_DIR = Path(os.environ.get("PERFSDK_OUTPUT_DIR") or "perfsdk-output")

# Spans go to <OUTPUT_DIR>/spans-<pid>.jsonl. An explicit configure() argument beats the
# PERFSDK_* environment variables, which beat the defaults.
perfsdk.configure(exporter="file", output_dir=OUTPUT_DIR)

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
).to(DEVICE)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
# A fixed random "teacher" makes the synthetic labels learnable.
teacher = torch.randn(FEATURES, CLASSES)


@perfsdk.profiled("data", color="green", category="input")
def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, FEATURES)
    y = (x @ teacher).argmax(dim=1)
    return x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)


@perfsdk.profiled("forward", color="blue", category="compute")
def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(x), y)


@perfsdk.profiled("backward", color="red", category="compute")
def backward(loss: torch.Tensor) -> None:
    loss.backward()


@perfsdk.profiled("optimizer", color="orange", category="compute")
def optimizer_step() -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@perfsdk.profiled  # bare: the region is named after the function ("train_step")
def train_step(step: int) -> torch.Tensor:
    x, y = next_batch(step)
    loss = forward(x, y)
    backward(loss)
    optimizer_step()
    return loss.detach()


def main() -> int:
    started = time.perf_counter()
    first_loss = last_loss = float("nan")
    for epoch in range(EPOCHS):
        with perfsdk.timed_region("epoch", epoch=epoch, steps=STEPS_PER_EPOCH) as region:
            losses = [train_step(step) for step in range(STEPS_PER_EPOCH)]
        # .item() once per epoch, outside the timed steps: perfsdk itself never syncs.
        mean_loss = torch.stack(losses).mean().item()
        if epoch == 0:
            first_loss = mean_loss
        last_loss = mean_loss
        print(f"epoch {epoch}: mean loss {mean_loss:.4f}  ({region.host_ms:.1f} ms)")

    print()
    perfsdk.summary()  # flushes, then prints count / total / mean / p50 / p95 / p99 per region
    perfsdk.flush()  # make sure every span is in the file before we print its path
    spans_file = OUTPUT_DIR / f"spans-{os.getpid()}.jsonl"
    if spans_file.is_file():
        print(f"\nspans written to {spans_file.resolve()}")
    print(f"trained {EPOCHS * STEPS_PER_EPOCH} steps on {DEVICE} in "
          f"{time.perf_counter() - started:.1f} s; loss {first_loss:.3f} -> {last_loss:.3f}")
    if not perfsdk.get_config().enabled:
        print("perfsdk is disabled (PERFSDK_ENABLED=0): no regions were recorded, no spans "
              "written")
    elif not spans_file.is_file():
        print("error: no spans file was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
