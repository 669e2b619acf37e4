"""On a real GPU: count_flops of a CUDA model, the peak of the device perfsdk reads by its
name, and a step's MFU, all without a host-device sync.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import perfsdk
from perfsdk.flops import find_peak
from perfsdk.testing import capture
from tests.integration._gpu import sync_debug_mode

pytestmark = pytest.mark.gpu


def test_count_flops_of_a_cuda_model_adds_no_sync() -> None:
    layer = torch.nn.Linear(256, 128, device="cuda")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    with sync_debug_mode("error"):  # any synchronizing call now raises
        forward = perfsdk.count_flops(layer, x)
        both = perfsdk.count_flops(layer, x, backward=True)
    assert forward == 2 * 64 * 256 * 128
    assert both == 3 * forward
    assert layer.weight.grad is None


def test_the_devices_peak_and_a_steps_mfu() -> None:
    torch.zeros(1, device="cuda")  # the application initializes CUDA; perfsdk never does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a GPU missing from the table warns once
        peak = find_peak()
    name = torch.cuda.get_device_name()
    if peak is None:
        pytest.skip(f"{name!r} is not in perfsdk's peak table")
    assert peak.device == name
    assert peak.dtype in ("bf16", "fp16")
    assert peak.flops > 1e12
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with capture() as cap:
        for _ in range(3):
            with perfsdk.step(flops=2 * 4096**3 * 10):
                for _ in range(10):
                    a @ a
        torch.cuda.synchronize()
    for step in cap.named("step"):
        assert 0 < step.attributes["perfsdk.mfu"] == (
            step.attributes["perfsdk.flops_per_s"] / peak.flops)
