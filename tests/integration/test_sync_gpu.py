"""On a real GPU: no_sync_guard sees real device tensors, and torch's sync debug mode is
turned on only while a guard is open, with its warnings routed to the guard's own context:
counted once in "count" mode, raised as a SyncError in "error" mode.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import perfsdk
from perfsdk import SyncError, no_sync_guard

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_sites() -> Iterator[None]:
    perfsdk.sync.reset()
    torch.cuda.init()
    yield
    perfsdk.sync.reset()


def test_real_syncs_are_named_and_real_non_syncs_are_not() -> None:
    x = torch.randn(1024, device="cuda")
    pinned = torch.randn(1024).pin_memory()
    pageable = torch.randn(1024)
    with no_sync_guard("count") as guard:
        y = (x * 2 + 1).relu()  # ordinary math: no sync
        _ = pinned.to("cuda", non_blocking=True)  # from pinned memory: no sync
        _ = pageable.to("cuda")  # a blocking host-to-device copy is not reported
        _ = y.to("cpu", non_blocking=True)  # pinned destination: no sync
        _ = y.sum().item()
        _ = x[x > 0]
        _ = pageable.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
    ops = sorted(site.op for site in guard.report.sites)
    assert ops == ["item", "mask_index", "pageable_copy", "synchronize"], guard.report
    assert all(site.file == __file__ for site in guard.report.sites)


def test_error_mode_raises_at_the_line() -> None:
    x = torch.randn(16, device="cuda")
    with pytest.raises(SyncError) as info, no_sync_guard("error"):
        x.sum().item()
    assert info.value.file == __file__
    assert info.value.op == "item"


def test_debug_mode_is_scoped_to_the_guard() -> None:
    assert torch.cuda.get_sync_debug_mode() == 0
    x = torch.randn(4096, device="cuda")
    seen: list[int] = []

    def other_thread() -> None:  # no guard here: torch's warnings must not leak (-W error)
        seen.append(int(torch.bincount((x > 0).long()).sum()))

    with no_sync_guard("count") as guard:
        assert torch.cuda.get_sync_debug_mode() == 1
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        torch.bincount((x > 0).long())  # syncs inside the operator (reads the max)
    assert torch.cuda.get_sync_debug_mode() == 0
    assert seen == [4096]
    assert guard.report.total >= 1
    assert all(site.file == __file__ for site in guard.report.sites)


def test_count_mode_counts_an_item_once() -> None:
    """``.item()`` is seen by perfsdk's detector and by torch's debug mode: one site, one sync."""
    x = torch.randn(16, device="cuda")
    with no_sync_guard("count") as guard:
        x.sum().item()
    assert guard.report.total == 1
    assert [site.op for site in guard.report.sites] == ["item"]
    assert torch.cuda.get_sync_debug_mode() == 0


def test_error_mode_raises_for_a_sync_only_torchs_debug_mode_sees() -> None:
    """bincount reads its input's maximum inside the operator: only torch's sync debug mode
    knows, and under "error" that is a SyncError too; the debug mode is restored after it."""
    x = torch.randn(4096, device="cuda")
    with pytest.raises(SyncError) as info, no_sync_guard("error"):
        torch.bincount((x > 0).long())
    assert info.value.op == "cuda"
    assert info.value.file == __file__
    assert torch.cuda.get_sync_debug_mode() == 0
    with no_sync_guard("count") as guard:  # the guard works again after the error
        torch.bincount((x > 0).long())
    assert guard.report.total >= 1
