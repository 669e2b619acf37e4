"""instrument_dataloader with a real DataLoader and worker processes: one ``data_wait`` region
per batch, around the loop's real wait for a slow dataset (each wait ends after the workers
produced its batch, on the host clock every process shares)."""

from __future__ import annotations

import copy
import itertools
import pickle
import time
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import perfsdk
import perfsdk.auto as auto
from perfsdk import clocks
from perfsdk.testing import capture

SLEEP_S = 0.01


class SlowDataset(Dataset[torch.Tensor]):
    """Item i is ``[i, when it was made]``: perf_counter_ns is CLOCK_MONOTONIC, one clock for
    every process on the machine."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return torch.tensor([index, time.perf_counter_ns()])


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.full((2,), float(i)) for i in range(4))


@pytest.fixture(autouse=True)
def fresh_steps() -> Iterator[None]:
    auto.set_schedule(None)
    yield
    auto.end_step()


def test_one_data_wait_per_batch_with_two_workers():
    loader = DataLoader(SlowDataset(), batch_size=2, num_workers=2)
    wrapped = auto.instrument_dataloader(loader)
    assert len(wrapped) == 4
    assert wrapped.dataset is loader.dataset
    assert wrapped.num_workers == 2
    assert wrapped.batch_size == 2
    assert wrapped.loader is loader
    with capture() as cap:
        t0 = time.perf_counter_ns()
        batches = [b for b in wrapped]
        t1 = time.perf_counter_ns()
    assert [b[:, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    waits = cap.named("data_wait")
    assert len(waits) == len(batches) == 4
    assert [w.attributes["perfsdk.batch"] for w in waits] == [0, 1, 2, 3]
    assert all(w.attributes["perfsdk.category"] == "data" for w in waits)
    # The waits are the loop's: one after another, inside it...
    starts_ends = [(w.start_ns, w.end_ns) for w in waits]
    assert clocks.epoch_ns(t0) <= starts_ends[0][0]
    assert starts_ends[-1][1] <= clocks.epoch_ns(t1)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(starts_ends))
    # ... and each ends only once a worker had made its batch (it waited for the data).
    for wait, batch in zip(waits, batches, strict=True):
        made = clocks.epoch_ns(int(batch[:, 1].max().item()))
        assert wait.end_ns >= made, (wait.end_ns, made)


def test_the_instrumented_loader_is_a_dataloader():
    loader = DataLoader(SlowDataset(), batch_size=2, num_workers=2)
    wrapped = auto.instrument_dataloader(loader)
    assert isinstance(wrapped, DataLoader)  # what Lightning, HF and user code check
    assert isinstance(perfsdk.instrument_dataloader(loader), DataLoader)
    assert type(loader) is DataLoader  # the user's loader is not changed
    assert wrapped.sampler is loader.sampler
    assert wrapped.batch_sampler is loader.batch_sampler
    assert wrapped.dataset is loader.dataset
    assert auto.instrument_dataloader(wrapped) is wrapped
    with capture() as cap:
        first = [b[:, 0].tolist() for b in wrapped]
        second = [b[:, 0].tolist() for b in wrapped]
    assert first == second == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # one wait per batch in each epoch: the next() that ends an epoch is not recorded
    assert [w.attributes["perfsdk.batch"] for w in cap.named("data_wait")] == [0, 1, 2, 3] * 2


def test_the_instrumented_loader_pickles_and_copies():
    wrapped = auto.instrument_dataloader(DataLoader(SlowDataset(), batch_size=4, num_workers=2))
    for twin in (pickle.loads(pickle.dumps(wrapped)), copy.copy(wrapped),
                 copy.deepcopy(wrapped)):
        assert isinstance(twin, auto.InstrumentedLoader)
        assert isinstance(twin, DataLoader)
        assert twin.loader is not wrapped.loader
        with capture() as cap:
            assert len(list(twin)) == 2
        assert len(cap.named("data_wait")) == 2


def test_each_epoch_counts_batches_from_zero():
    wrapped = auto.instrument_dataloader(DataLoader(SlowDataset(), batch_size=4, num_workers=2,
                                                    persistent_workers=True))
    with capture() as cap:
        for _ in range(2):
            for _batch in wrapped:
                pass
    assert [w.attributes["perfsdk.batch"] for w in cap.named("data_wait")] == [0, 1, 0, 1]


def test_waits_inside_plain_call_steps_nest_under_them():
    wrapped = auto.instrument_dataloader(DataLoader(SlowDataset(), batch_size=4, num_workers=2))
    with capture() as cap:
        it = iter(wrapped)
        for _ in range(2):
            with auto.step(samples=4):
                next(it)
    steps = cap.named("step")
    waits = cap.named("data_wait")
    assert [w.parent_span_id for w in waits] == [s.span_id for s in steps]


def test_a_wait_inside_an_open_data_wait_region_is_counted_once():
    """A framework's integration (the Lightning profiler) may time the same wait: the loader's
    own region steps aside inside a ``data_wait`` that is already open, and only there."""
    wrapped = auto.instrument_dataloader(DataLoader(SlowDataset(), batch_size=4))
    with capture() as cap:
        it = iter(wrapped)
        with perfsdk.timed_region("data_wait"):
            next(it)
        with perfsdk.timed_region("other"):
            next(it)
    waits = cap.named("data_wait")
    assert len(waits) == 2
    outer, inner = sorted(waits, key=lambda w: "perfsdk.batch" in w.attributes)
    assert "perfsdk.batch" not in outer.attributes  # the framework's, not the loader's
    assert inner.parent_span_id == cap.named("other")[0].span_id
    assert inner.attributes["perfsdk.batch"] == 1


def test_iterable_without_len_and_disabled():
    wrapped = auto.instrument_dataloader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(TypeError):
        len(wrapped)
    with capture() as cap:
        assert len(list(wrapped)) == 2
        perfsdk.configure(enabled=False)
        assert len(list(wrapped)) == 2
    # without len() the wait that ended the epoch is recorded too (it is a wait)
    assert [w.attributes["perfsdk.batch"] for w in cap.named("data_wait")] == [0, 1, 2]


def test_plain_iterables_and_bad_input():
    wrapped = auto.instrument_dataloader([1, 2, 3])
    assert auto.instrument_dataloader(wrapped) is wrapped
    with capture() as cap:
        assert list(wrapped) == [1, 2, 3]
    assert len(cap.named("data_wait")) == 3
    with pytest.raises(ValueError, match="loader="):
        auto.instrument_dataloader(3)  # type: ignore[arg-type]


def test_an_error_in_the_dataset_is_recorded_and_propagates():
    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> int:
            raise KeyError(index)

    wrapped = auto.instrument_dataloader(DataLoader(Broken(), batch_size=1))
    with capture() as cap, pytest.raises(KeyError):
        next(iter(wrapped))
    (wait,) = cap.named("data_wait")
    assert isinstance(wait.error, KeyError)
