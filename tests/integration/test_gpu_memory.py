"""On a real GPU: per-region memory from the caching allocator's counters, with true peaks when
regions nest (the allocator's peak is process-global, pytorch#16266), and the allocator's state
on a region that ran out of memory.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import pickle

import pytest
import torch

import perfsdk
from perfsdk.config import configure
from perfsdk.testing import capture

pytestmark = pytest.mark.gpu

MB = 1 << 20
PEAK = "perfsdk.memory.peak_bytes"
DELTA = "perfsdk.memory.allocated_delta_bytes"
RESERVED = "perfsdk.memory.reserved_bytes"


def _mem(cap, name):
    [region] = cap.named(name)
    assert region.memory is not None, name
    return region.memory


def _block(mb: int) -> torch.Tensor:
    return torch.empty(mb * MB, dtype=torch.uint8, device="cuda")  # 2 MB multiples: exact sizes


def test_nested_and_sibling_peaks_on_the_real_allocator():
    keep = _block(8)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with capture() as cap, perfsdk.timed_region("outer", memory=True):
        a = _block(16)
        with perfsdk.timed_region("inner", memory=True):
            b = _block(32)
            del b
        with perfsdk.timed_region("sibling", memory=True):
            c = _block(4)
            del c
        del a
    assert _mem(cap, "inner")[PEAK] == base + 48 * MB
    assert _mem(cap, "inner")[DELTA] == 0
    assert _mem(cap, "sibling")[PEAK] == base + 20 * MB  # not the inner region's 48 MB
    assert _mem(cap, "outer")[PEAK] == base + 48 * MB  # never below an inner region's
    assert _mem(cap, "outer")[DELTA] == 0
    assert _mem(cap, "outer")[RESERVED] >= base + 48 * MB
    assert torch.cuda.max_memory_allocated() >= base  # perfsdk resets it; it still reads sanely
    del keep


def test_out_of_memory_in_a_region_records_the_allocator_and_a_snapshot(tmp_path):
    configure(output_dir=tmp_path, memory_snapshots=True)
    try:
        keep = _block(4)
        too_much = 4 * torch.cuda.get_device_properties(0).total_memory
        with capture() as cap, pytest.raises(torch.OutOfMemoryError), \
                perfsdk.timed_region("oom", memory=True):
            torch.empty(too_much, dtype=torch.uint8, device="cuda")
    finally:
        configure(memory_snapshots=False)
    attrs = cap.named("oom")[0].attributes
    assert attrs["perfsdk.oom.allocated_bytes"] >= 4 * MB
    assert attrs["perfsdk.oom.reserved_bytes"] >= attrs["perfsdk.oom.allocated_bytes"]
    assert attrs["perfsdk.oom.peak_bytes"] >= 4 * MB
    assert attrs["perfsdk.oom.largest_free_block_bytes"] >= 0
    with open(attrs["perfsdk.memory.snapshot_path"], "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"], "the real snapshot lists the allocator's segments"
    assert cap.span("oom").status.status_code.name == "ERROR"
    del keep
