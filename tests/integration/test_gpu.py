"""On a real GPU: device time from CUDA events, with no synchronization added by perfsdk: the
regions' device time is the kernels', resolved by the background poller.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import pytest
import torch

import perfsdk
from perfsdk.testing import capture
from tests.integration._gpu import spin_for, sync_debug_mode
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu


def test_device_time_of_real_kernels_without_a_sync():
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()

    @perfsdk.profiled("gpu.matmul")
    def matmul(a: torch.Tensor) -> torch.Tensor:
        return a @ a

    with capture() as cap:
        with sync_debug_mode("error"):  # any synchronizing call now raises
            for _ in range(5):
                with perfsdk.timed_region("gpu.block") as handle:
                    y = matmul(x)
        assert handle.host_ms >= 0
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


def test_device_ms_of_a_known_kernel_resolves_in_the_background_without_a_sync(monkeypatch):
    """A 20 ms GPU spin launched in microseconds: the region's device time is the spin's, its
    host time is the launch's, and it resolves on perfsdk's poller while nothing synchronizes
    (every synchronize entry point of torch.cuda is counted)."""
    x = torch.ones(1, device="cuda")
    x.add_(0)  # the add kernel loaded now: CUDA loads a module lazily, at its first launch,
    # and that waited for the spin to end (an H200 run: the outer region 10 ms past it)
    cycles, reference_ms = spin_for(20.0)
    syncs: list[str] = []
    for owner, attr, name in ((torch.cuda, "synchronize", "torch.cuda.synchronize"),
                              (torch.cuda.Event, "synchronize", "Event.synchronize"),
                              (torch.cuda.Stream, "synchronize", "Stream.synchronize")):
        original = getattr(owner, attr)

        def counting(*args, _original=original, _name=name, **kwargs):
            syncs.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, attr, counting)
    with capture() as cap:
        with perfsdk.timed_region("gpu.outer"):
            with perfsdk.timed_region("gpu.spin"):
                torch.cuda._sleep(cycles)
            x.add_(1)
        resolved = wait_until(lambda: len(cap.regions) == 2, timeout=10.0)
        seen = list(syncs)  # before capture() drains at its end
    monkeypatch.undo()
    assert resolved, "the background poller did not resolve the regions within 10 s"
    assert seen == []
    spin, outer = cap.named("gpu.spin")[0], cap.named("gpu.outer")[0]
    assert isinstance(spin.device_ms, float)
    assert spin.device_ms == pytest.approx(reference_ms, rel=0.25)
    assert spin.host_ms < spin.device_ms / 2  # the launch returned long before the GPU was done
    assert outer.device_ms is not None
    assert spin.device_ms <= outer.device_ms <= spin.device_ms + 5.0
    assert outer.span_id == spin.parent_span_id
    assert float(x) == 2.0


def test_perfsdks_events_record_on_the_current_stream():
    """perfsdk's events find the current stream without torch.cuda.current_stream()'s Python:
    recorded inside ``torch.cuda.stream(side)``, they time the side stream's work."""
    from perfsdk import _device

    backend = _device.get_backend()
    side = torch.cuda.Stream()
    cycles, reference_ms = spin_for(20.0)
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    assert type(start).__name__ == "QuickEvent"  # torch has what the quick record needs
    with torch.cuda.stream(side):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
    assert not end.query()  # behind the spin on the side stream
    side.synchronize()
    assert start.elapsed_time(end) == pytest.approx(reference_ms, rel=0.25)
    other = backend.Event(enable_timing=True)
    other.record()  # back on the default stream, outside the block
    torch.cuda.synchronize()
    assert other.query()
