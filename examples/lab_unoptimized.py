"""The course lab's unoptimized training script, on the CPU with synthetic data.

The lab (``training_unoptimized.py``) trains its SimpleNet on CIFAR-10 resized to 224x224 with
every classic mistake: a small batch, ``num_workers=0`` so the training loop decodes every image
itself, no pinned memory, and a host-device sync (``.item()``, ``torch.cuda.synchronize()``) on
every step. This copy keeps all of them, replaces the CIFAR download with a dataset that makes
its images (and spends a little CPU per image, as decoding and resizing would), and shrinks the
images so that it runs in seconds on a CPU. It has no perfsdk in it: it is what
``perfsdk run examples/lab_unoptimized.py`` is for.

    python examples/lab_unoptimized.py                 # 24 steps at 32x32
    perfsdk run examples/lab_unoptimized.py --steps 40 # the same, measured, with advice

``lab_decorated.py`` is the same script with perfsdk's regions in it; ``lab_optimized.py`` has
the fixes.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn, optim
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset


class SimpleNet(nn.Module):
    def __init__(self, image_size: int = 224) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv3 = nn.Conv2d(128, 256, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(256 * (image_size // 4) ** 2, 512)
        self.fc2 = nn.Linear(512, 10)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.conv3(x))
        x = x.reshape(x.size(0), -1)  # the lab's x.view(...) fails on channels-last tensors
        x = self.relu(self.fc1(x))
        return self.fc2(x)  # type: ignore[no-any-return]


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Samples made on the fly: a 96x96 image "decoded" (a few smoothing passes stand in for JPEG
    decoding and augmentation), resized to ``size`` and normalized, as the lab's transforms do,
    so that each item costs the loading process a millisecond or two of CPU."""

    def __init__(self, length: int, size: int) -> None:
        self.length, self.size = length, size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(index)
        image = torch.rand(1, 3, 96, 96, generator=gen)
        for _ in range(8):
            image = functional.avg_pool2d(functional.pad(image, (1, 1, 1, 1), mode="reflect"),
                                          3, stride=1)
        image = functional.interpolate(image, size=(self.size, self.size), mode="bilinear")
        return (image[0] - 0.5) / 0.5, index % 10


def train(steps: int, batch_size: int, image_size: int) -> None:
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
    for batch, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)  # synchronous copies
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()  # a host-device sync on every step
        if batch % 10 == 0:
            print(f"batch {batch}, loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start
    print(f"loss {total / len(loader):.4f}, {elapsed:.2f} s, "
          f"{steps * batch_size / elapsed:.1f} samples/s")


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
