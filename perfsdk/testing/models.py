"""Reference models for tests, benchmarks, docs and ``perfsdk demo``: the course lab's SimpleNet
(deliberately unoptimized) and a small Transformer encoder. Random weights; nothing downloaded."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

__all__ = ["SimpleNet", "SyntheticImages", "encoder", "simplenet_inputs"]


class SimpleNet(nn.Module):
    """The lab's CNN: three 3x3 convolutions, two max-pools, two linear layers.

    ``image_size`` is the input's height and width (the lab uses 224 on GPU; 112 keeps CPU runs
    short); it must be divisible by 4.
    """

    def __init__(self, image_size: int = 112, num_classes: int = 10) -> None:
        super().__init__()
        if image_size <= 0 or image_size % 4:
            raise ValueError(f"SimpleNet: image_size={image_size!r}; accepted values are "
                             "positive multiples of 4")
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv3 = nn.Conv2d(128, 256, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        side = image_size // 4
        self.fc1 = nn.Linear(256 * side * side, 512)
        self.fc2 = nn.Linear(512, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.conv3(x))
        x = x.reshape(x.size(0), -1)
        x = self.relu(self.fc1(x))
        return self.fc2(x)  # type: ignore[no-any-return]


def simplenet_inputs(batch: int = 16, image_size: int = 112, *, seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random images and labels for :class:`SimpleNet`."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return images, labels


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Images for :class:`SimpleNet` made on the fly, each costing the loading process a
    millisecond or two of CPU as decoding and resizing would: a 96x96 image smoothed a few
    times, resized to ``image_size`` and normalized; the label is ``index % 10``."""

    def __init__(self, length: int, image_size: int) -> None:
        self.length, self.image_size = length, image_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(index)
        image = torch.rand(1, 3, 96, 96, generator=gen)
        for _ in range(8):  # stands in for JPEG decoding and augmentation
            image = functional.avg_pool2d(functional.pad(image, (1, 1, 1, 1), mode="reflect"),
                                          3, stride=1)
        image = functional.interpolate(image, size=(self.image_size, self.image_size),
                                       mode="bilinear")
        return (image[0] - 0.5) / 0.5, index % 10


def encoder(d_model: int = 256, layers: int = 4, heads: int = 8) -> nn.TransformerEncoder:
    """A ``batch_first`` TransformerEncoder (``d_model`` wide, ``layers`` deep)."""
    layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                       batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
