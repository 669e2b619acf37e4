"""Test set-up for perfsdk-lightning: Lightning's own warnings filtered by message (the repo's
``filterwarnings = error`` stays on for everything else) and perfsdk's settings restored after
each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import perfsdk.config
import perfsdk.errors
from perfsdk.auto import STEPS
from perfsdk.pipeline import PIPELINE

# Lightning's, not ours: each is matched by its own message.
_LIGHTNING_WARNINGS = (
    # lightning/pytorch/utilities/_pytree.py on torch >= 2.10
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated",
    # a DataLoader without workers (the tests' tiny in-memory loaders)
    r"ignore:The '\w+_dataloader' does not have many workers",
    # max_steps smaller than an epoch's batches times the logging interval
    r"ignore:The number of training batches \(\d+\) is smaller than the logging interval",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in _LIGHTNING_WARNINGS:
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(autouse=True)
def fresh_perfsdk() -> Iterator[None]:
    """After each test: no step left open, every step recorded, settings from the environment
    again and warning counts cleared."""
    yield
    STEPS.set_schedule(None)
    PIPELINE.drain(wait=True)
    perfsdk.config.reset_from_env()
    perfsdk.errors.reset_counts()
