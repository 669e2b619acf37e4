"""assume_device=True flags what would sync on a GPU, not torch's host-side bookkeeping: a real
DataLoader with forked workers (seeds drawn with ``.item()``, a dataset that calls ``.tolist()``
in the worker) and Adam (step counters read with ``.item()``) run under an ``error`` guard."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import perfsdk
from perfsdk import SyncError, no_sync_guard


@pytest.fixture(autouse=True)
def _fresh_sites() -> Iterator[None]:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


class HostWork(Dataset[torch.Tensor]):
    """Worker-side CPU work that would be a sync in the training process."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        row = torch.arange(4) * i
        return torch.tensor(row.tolist(), dtype=torch.float32)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_forked_workers_and_seeds_are_not_the_guarded_code() -> None:
    loader = DataLoader(HostWork(), batch_size=4, num_workers=2, shuffle=True,
                        multiprocessing_context="fork")
    total = torch.zeros(())
    with no_sync_guard("error", assume_device=True) as guard:
        for batch in loader:
            total += batch.sum()
    assert guard.report.total == 0
    assert total.item() == sum(6 * i for i in range(16))
    # the guard still works in the parent after the workers are gone
    with pytest.raises(SyncError), no_sync_guard("error", assume_device=True):
        total.item()


def test_adam_step_counters_are_host_side() -> None:
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with no_sync_guard("count", assume_device=True) as guard:
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert guard.report.total == 0, str(guard.report)
