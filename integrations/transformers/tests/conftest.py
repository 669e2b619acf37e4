"""Set-up for the perfsdk-transformers tests: nothing is fetched from the Hugging Face Hub, and
perfsdk's process-wide state (an open step, warning counts) is reset around every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Before transformers or huggingface_hub is imported anywhere: offline, so nothing is fetched.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import perfsdk.errors
from perfsdk.auto import STEPS
from perfsdk.pipeline import PIPELINE


@pytest.fixture(autouse=True)
def fresh_perfsdk() -> Iterator[None]:
    perfsdk.errors.reset_counts()
    yield
    STEPS.end()
    perfsdk.errors.reset_counts()
    PIPELINE.drain(wait=True)
