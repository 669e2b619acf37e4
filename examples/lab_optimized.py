"""The course lab's training script with the fixes that ``lab_decorated.py``'s advice names,
still measured by perfsdk so the two runs compare.

The fixes, against ``lab_unoptimized.py``:

- the data: ``num_workers=2`` worker processes decode the images while the model trains,
  ``persistent_workers=True`` keeps them across epochs, ``pin_memory`` on a GPU, and a batch four
  times larger (``perfsdk.optimize.tune_dataloader`` measures these settings on your dataset);
- the step: ``perfsdk.optimize.TrainStep`` with autocast (bfloat16 on a CPU, float16 with a
  GradScaler on a GPU), and no ``.item()`` per step: the losses stay on the device and are read
  once at the end;
- the model: ``perfsdk.optimize.apply_channels_last`` (what ``optimize(mode="train",
  auto=True)`` picked for this model in docs/optimize.md).

    python examples/lab_optimized.py
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
from perfsdk.optimize import TrainStep, apply_channels_last

OUTPUT_DIR = Path(os.environ.get("PERFSDK_OUTPUT_DIR") or "perfsdk-output")


def train(images: int, batch_size: int, image_size: int) -> None:
    perfsdk.configure(exporter="file,trace", output_dir=OUTPUT_DIR)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    loader = DataLoader(SyntheticImages(images, image_size), batch_size=batch_size, shuffle=True,
                        num_workers=2, persistent_workers=True, prefetch_factor=4,
                        pin_memory=device.type == "cuda")
    model = apply_channels_last(SimpleNet(image_size).to(device))
    optimizer = optim.SGD(model.parameters(), lr=0.04, momentum=0.9)  # 4x the batch, 4x the lr
    step = TrainStep(model, optimizer, nn.CrossEntropyLoss(),
                     amp="bf16" if device.type == "cpu" else "fp16")
    print(f"training on {device}, batch size {batch_size}, {len(loader)} batches")
    start = time.perf_counter()
    with perfsdk.no_sync_guard("count", assume_device=True):
        for data, target in perfsdk.instrument_dataloader(loader):
            with perfsdk.step(samples=len(data)):
                step(data.to(device, non_blocking=True),
                     target=target.to(device, non_blocking=True))  # no sync: loss stays put
    losses = step.loss_history()  # one transfer for all of them
    elapsed = time.perf_counter() - start
    print(f"loss {sum(losses) / len(losses):.4f}, {elapsed:.2f} s, "
          f"{images / elapsed:.1f} samples/s\n")
    perfsdk.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=192, help="images to train on (192)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (32)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="image side, a multiple of 4 (32; the lab uses 224)")
    args = parser.parse_args()
    train(args.images, args.batch_size, args.image_size)


if __name__ == "__main__":
    main()
