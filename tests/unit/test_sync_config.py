"""``PERFSDK_SYNC_GUARD`` / ``configure(sync_guard=...)`` override the mode of every guard, so
guards can stay in the code: ``error`` in CI, ``off`` in production."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import perfsdk
from perfsdk import SyncError, configure, no_sync_guard
from perfsdk.config import reset_from_env


@pytest.fixture(autouse=True)
def _fresh_sites() -> Iterator[None]:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


def test_error_from_the_environment_beats_a_count_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFSDK_SYNC_GUARD", "error")
    reset_from_env()
    with pytest.raises(SyncError) as info, no_sync_guard("count", assume_device=True):
        torch.ones(3).sum().item()
    assert info.value.op == "item"


def test_off_makes_every_guard_inert() -> None:
    configure(sync_guard="off")
    with no_sync_guard("error", assume_device=True) as guard:
        assert _get_current_dispatch_mode_stack() == []  # nothing watches the ops
        value = torch.ones(3).sum().item()
    assert value == 3.0
    assert guard.report.total == 0


def test_none_gives_each_guard_its_own_mode_back() -> None:
    configure(sync_guard="count")
    configure(sync_guard=None)
    with pytest.raises(SyncError), no_sync_guard("error", assume_device=True):
        torch.ones(3).sum().item()


def test_disabled_perfsdk_turns_guards_off() -> None:
    configure(enabled=False)
    with no_sync_guard("error", assume_device=True) as guard:
        torch.ones(3).sum().item()
    assert guard.report.total == 0
