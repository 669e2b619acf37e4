"""stragglers() on chosen times: the rank that held a step up is named even though every rank's
step took as long (the others waited in a collective), collectives are found below nested
regions and by category, and steps seen on one rank only are left out. The run id: torchrun's
``none`` is no run id, and the ranks then agree on a fresh one through the job's store (a real
``TCPStore`` on 127.0.0.1), once per process, never on a constant."""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from perfsdk import distributed
from perfsdk.distributed import run_id, step_trace_id, stragglers
from perfsdk.errors import PerfSDKWarning

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


# -- the run id --------------------------------------------------------------------------------
# Under plain torchrun (no --rdzv-id, no --standalone) TORCHELASTIC_RUN_ID is the string "none":
# the ranks agree on a fresh id once through the job's store, never on a constant.

_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
                  "RANK", "LOCAL_RANK")


@pytest.fixture
def fresh_run_id(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No run id settled yet in this process, and no torchrun variables."""
    monkeypatch.setattr(distributed, "_run_id", None)
    monkeypatch.setattr(distributed, "_agreed", {})
    for name in _TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def a_store() -> dist.TCPStore:
    """A c10d store like the one the torchrun agent hosts (a fresh one: a new job)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         multi_tenant=True, timeout=datetime.timedelta(seconds=30))


def torchrun_env(store: dist.TCPStore, **more: str) -> dict[str, str]:
    """What torchrun sets on a worker launched without --rdzv-id (static rendezvous)."""
    return {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", **more}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_run_id_torchrun_gave_is_used_and_a_restart_names_its_attempt(fresh_run_id) -> None:
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", "job-42")
    assert run_id() == "job-42"
    fresh_run_id.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # torchrun restarted the workers
    assert run_id() == "job-42:restart-2"
    assert step_trace_id(0) != step_trace_id(0, "job-42")  # never merges with attempt 0


def test_no_torchrun_no_run_id(fresh_run_id) -> None:
    assert run_id() is None
    assert step_trace_id(0) is None  # each step keeps a random trace of its own


def test_run_id_follows_the_environment_as_it_changes(fresh_run_id) -> None:
    """run_id() reads os.environ's own dict for its fast "not under torchrun" answer: a
    variable set or removed later is seen at the next call."""
    assert run_id() is None
    os.environ["TORCHELASTIC_RUN_ID"] = "job-7"
    try:
        assert run_id() == "job-7"
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    assert run_id() is None
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", "job-8")
    assert run_id() == "job-8"


@pytest.mark.parametrize("placeholder", ["none", "", "None"])
def test_none_is_no_run_id_and_without_a_store_each_process_makes_its_own(
        fresh_run_id, placeholder: str) -> None:
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", placeholder)
    fresh_run_id.setenv("WORLD_SIZE", "2")
    fresh_run_id.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # no agent store to ask
    with pytest.warns(PerfSDKWarning, match=r"--rdzv-id.*share_run_id\(\)"):
        first = run_id()
    assert first
    assert first.lower() != "none"
    assert run_id() == first  # settled once per process
    fresh_run_id.setattr(distributed, "_agreed", {})  # another process
    assert run_id() not in (first, None)  # never a constant


def test_a_single_process_under_torchrun_without_a_store_does_not_warn(fresh_run_id) -> None:
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", "none")
    fresh_run_id.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_id()


def test_share_run_id_wins(fresh_run_id) -> None:
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", "none")
    shared = distributed.share_run_id()  # a single process: makes one
    assert run_id() == shared


def test_ranks_agree_through_the_jobs_store_first_writer_wins() -> None:
    store = a_store()
    key = "perfsdk/run_id/0"
    got: list[tuple[str | None, str]] = []
    threads = [threading.Thread(target=lambda: got.append(
        distributed._agree_in_store("127.0.0.1", store.port, key, 10.0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = {g for g, _ in got}
    assert len(got) == 4
    assert len(ids) == 1, got
    assert None not in ids, got
    assert store.get(key).decode() == ids.pop()  # the first writer's id, in the job's store
    job2 = a_store()
    other = distributed._agree_in_store("127.0.0.1", job2.port, key, 10.0)[0]
    assert other not in (None, store.get(key).decode())  # another job: another id


def test_run_id_asks_the_agent_store_once(fresh_run_id) -> None:
    store = a_store()
    for name, value in torchrun_env(store).items():
        fresh_run_id.setenv(name, value)
    calls = []
    real = distributed._agree_in_store

    def counting(*args: object) -> tuple[str | None, str]:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    fresh_run_id.setattr(distributed, "_agree_in_store", counting)
    first = run_id()
    assert first == store.get("perfsdk/run_id/0").decode()
    assert [run_id() for _ in range(100)] == [first] * 100
    assert len(calls) == 1  # one connection per process, at the first call
    fresh_run_id.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the next attempt: a new id
    second = run_id()
    assert second == store.get("perfsdk/run_id/1").decode() != first
    assert len(calls) == 2


def test_an_unreachable_store_falls_back_to_an_id_of_its_own(fresh_run_id) -> None:
    got, why = distributed._agree_in_store("127.0.0.1", closed_port(), "k", 0.2)
    assert got is None
    assert "127.0.0.1" in why
    fresh_run_id.setattr(distributed, "_STORE_TIMEOUT_S", 0.2)
    fresh_run_id.setenv("TORCHELASTIC_RUN_ID", "none")
    fresh_run_id.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    fresh_run_id.setenv("MASTER_ADDR", "127.0.0.1")
    fresh_run_id.setenv("MASTER_PORT", str(closed_port()))
    fresh_run_id.setenv("WORLD_SIZE", "2")
    with pytest.warns(PerfSDKWarning, match="could not be asked"):
        own = run_id()
    assert own
    assert own != "none"
