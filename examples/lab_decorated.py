"""The course lab's unoptimized training script with perfsdk in it: the same loop and the same
mistakes as ``lab_unoptimized.py``, now measured from the inside.

What changed against the unoptimized script, line by line:

- ``perfsdk.instrument_dataloader(loader)``: each wait for a batch is a ``data_wait`` region;
- ``perfsdk.instrument_module(model, depth=1)``: a region per layer, forward and backward;
- ``with perfsdk.step(samples=...)``: a step region around each iteration, with samples/s;
- ``perfsdk.no_sync_guard("count", assume_device=True)``: counts the host-device syncs (here the
  ``loss.item()`` of every step), naming their line, even on a CPU;
- ``perfsdk.configure(exporter="file,trace")``: spans and a Perfetto trace in the output
  directory; at the end, the summary and the advisor's findings.

    python examples/lab_decorated.py
    PERFSDK_OUTPUT_DIR=/tmp/out python examples/lab_decorated.py --steps 40

``lab_optimized.py`` applies what the advice says.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from lab_unoptimized import SimpleNet, SyntheticImages
from torch import nn, optim
from torch.utils.data import DataLoader

import perfsdk
from perfsdk.testing import capture

OUTPUT_DIR = Path(os.environ.get("PERFSDK_OUTPUT_DIR") or "perfsdk-output")


def train(steps: int, batch_size: int, image_size: int) -> None:
    perfsdk.configure(exporter="file,trace", output_dir=OUTPUT_DIR)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    loader = DataLoader(SyntheticImages(steps * batch_size, image_size), batch_size=batch_size,
                        shuffle=True, num_workers=0, pin_memory=False)  # the lab's settings
    model = SimpleNet(image_size).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    print(f"training on {device}, batch size {batch_size}, {len(loader)} batches")
    start = time.perf_counter()
    total = 0.0
    # capture() keeps this run's regions for the advisor (perfsdk.testing: also for users)
    with capture() as run, perfsdk.no_sync_guard("count", assume_device=True), \
            perfsdk.instrument_module(model, depth=1):
        for batch, (data, target) in enumerate(perfsdk.instrument_dataloader(loader)):
            with perfsdk.step(samples=len(data)):
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                loss = criterion(model(data), target)
                loss.backward()
                optimizer.step()
                total += loss.item()  # a host-device sync on every step: the guard counts it
            if batch % 10 == 0:
                print(f"batch {batch}, loss {loss.item():.4f}")
        perfsdk.flush()
    elapsed = time.perf_counter() - start
    print(f"loss {total / len(loader):.4f}, {elapsed:.2f} s, "
          f"{steps * batch_size / elapsed:.1f} samples/s\n")
    summary = perfsdk.summary()
    print()
    print(perfsdk.advise(run.regions, summary=summary))
    print(f"\ntrace written to {OUTPUT_DIR / f'trace-{os.getpid()}.json'} "
          "(open it in https://ui.perfetto.dev)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="training steps (24)")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size (8: too small)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="image side, a multiple of 4 (32; the lab uses 224)")
    args = parser.parse_args()
    train(args.steps, args.batch_size, args.image_size)


if __name__ == "__main__":
    main()
