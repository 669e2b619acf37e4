"""On a real GPU: device time from CUDA events, with no synchronization added by perfsdk.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import pytest
import torch

import perfsdk
from perfsdk.testing import capture

pytestmark = pytest.mark.gpu


def test_device_time_of_real_kernels_without_a_sync():
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()

    @perfsdk.profiled("gpu.matmul")
    def matmul(a: torch.Tensor) -> torch.Tensor:
        return a @ a

    with capture() as cap:
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call now raises
        try:
            for _ in range(5):
                with perfsdk.timed_region("gpu.block") as handle:
                    y = matmul(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert handle.host_ms is not None
        result = handle.result()  # waits for this region's end event only
        assert result.device_ms is not None
        assert result.device_ms > 0
        perfsdk.flush()
    assert y.shape == x.shape
    blocks = cap.named("gpu.block")
    assert len(blocks) == 5
    assert all(r.device_ms is not None and r.device_ms > 0 for r in blocks)
    matmuls = cap.named("gpu.matmul")
    assert all(m.device_ms <= b.device_ms + 1e-3 for m, b in zip(matmuls, blocks, strict=True))
