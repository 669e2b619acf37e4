"""stragglers() on chosen times: the rank that held a step up is named even though every rank's
step took as long (the others waited in a collective), collectives are found below nested
regions and by category, and steps seen on one rank only are left out."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from perfsdk.distributed import stragglers

_ids = itertools.count(1)


def region(name: str, ms: float, parent: int = 0, **attributes: object) -> SimpleNamespace:
    return SimpleNamespace(name=name, host_ms=ms, span_id=next(_ids), parent_span_id=parent,
                           attributes=attributes)


def step(index: int, rank: int, ms: float) -> SimpleNamespace:
    return region("step", ms, **{"perfsdk.step": index, "perfsdk.rank": rank})


def test_the_rank_the_others_waited_for_is_named():
    regions = []
    for index, slow in enumerate((1, 0, 1)):
        for rank in (0, 1):
            s = step(index, rank, 61.0)
            wait = 0.5 if rank == slow else 50.5  # the fast rank waits for the slow one
            regions += [s, region("all_reduce", wait, s.span_id)]
    report = stragglers(regions)
    assert [r.step for r in report] == [0, 1, 2]
    assert [r.slowest_rank for r in report] == [1, 0, 1]
    for r in report:
        assert r.step_ms_by_rank == {0: 61.0, 1: 61.0}  # alike: step times hide it
        assert r.busy_ms_by_rank[r.slowest_rank] == 60.5
        assert r.busy_ms_by_rank[1 - r.slowest_rank] == 10.5
        assert r.spread_ms == 50.0
        assert r.spread == pytest.approx(50.0 / 35.5)  # over the median busy time


def test_collectives_nested_deeper_and_by_category_count():
    s0, s1 = step(0, 0, 40.0), step(0, 1, 40.0)
    sync = region("grad_sync", 35.0, s0.span_id)
    regions = [s0, s1, sync, region("all_gather", 30.0, sync.span_id),  # two levels down
               region("exchange", 5.0, s0.span_id, **{"perfsdk.category": "collective"}),
               region("forward", 20.0, s1.span_id)]  # not a collective: busy time
    (r,) = stragglers(regions)
    assert r.busy_ms_by_rank == {0: 5.0, 1: 40.0}
    assert r.slowest_rank == 1


def test_steps_seen_on_one_rank_are_left_out_and_without_collectives_busy_is_step_time():
    regions = [step(0, 0, 10.0), step(0, 1, 12.0), step(1, 0, 10.0)]
    (r,) = stragglers(regions)
    assert r.step == 0
    assert r.busy_ms_by_rank == r.step_ms_by_rank == {0: 10.0, 1: 12.0}
    assert (r.slowest_rank, r.spread_ms) == (1, 2.0)
    assert stragglers([]) == []
