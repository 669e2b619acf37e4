"""The pending queue (perfsdk.pipeline): bounded, never on the caller, one exit budget."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import perfsdk
from perfsdk import pipeline as _pipeline
from perfsdk.export.summary import SummarySink
from perfsdk.pipeline import Pipeline
from perfsdk.region import RegionSpec

ROOT = Path(__file__).resolve().parents[2]


def record(spec: RegionSpec, t0: int, t1: int, error: BaseException | None = None
           ) -> tuple[Any, ...]:
    return (spec.index, 1, 2, 0, t0, t1, threading.get_ident(), error, None, None, None, None,
            None, None, None)


class Recorder:
    """A sink that records what reaches it, and on which thread."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.threads: set[str] = set()
        self.overflow: list[dict[int, list[int]]] = []
        self.timeouts: list[float] = []

    def consume(self, records: list[Any]) -> None:
        self.threads.add(threading.current_thread().name)
        self.records.extend(records)

    def tally(self, overflow: dict[int, list[int]]) -> None:
        self.overflow.append(overflow)

    def flush(self, timeout: float) -> None:
        self.timeouts.append(timeout)

    def shutdown(self, timeout: float) -> None:
        self.timeouts.append(timeout)


def test_the_pending_queue_is_bounded_and_the_summary_still_counts_every_region() -> None:
    spec = RegionSpec.create("bounded")
    pipe = Pipeline(max_pending=10)
    summary, sink = SummarySink(), Recorder()
    pipe.sinks += [summary, sink]
    lost: list[tuple[int, str]] = []
    pipe.on_lost = lambda count, reason: lost.append((count, reason))
    for i in range(100):  # no pipeline thread: nothing drains while we submit
        pipe.submit(record(spec, 0, (i + 1) * 1_000_000, ValueError() if i % 10 == 0 else None))
    assert pipe.pending == 10  # never more than the bound
    assert pipe.drain(wait=False) == 10
    assert len(sink.records) == 10
    assert lost == [(90, "queue_full")]  # the span sink counts their spans as lost
    row = summary.snapshot()["bounded"]
    assert row.count == 100  # calls, total and errors include the 90 that overflowed
    assert row.total_ms == pytest.approx(sum(range(1, 101)))
    assert row.errors == 10
    assert row.p50_ms == pytest.approx(5.5)  # percentiles: of the 10 that were queued


def test_flush_and_summary_leave_the_work_to_the_pipeline_thread(captured: Any) -> None:
    sink = Recorder()
    _pipeline.PIPELINE.sinks.append(sink)
    try:
        with perfsdk.timed_region("background"):
            pass
        perfsdk.flush(timeout=30)
        with perfsdk.timed_region("background"):
            pass
        table = perfsdk.summary(show=False)
    finally:
        _pipeline.PIPELINE.sinks.remove(sink)
    assert table["background"].count == 2
    assert len(sink.records) == 2
    assert sink.threads == {"perfsdk-pipeline"}  # never the caller's thread


def test_shutdown_shares_one_budget_among_the_sinks() -> None:
    pipe = Pipeline()

    class Slow(Recorder):
        def shutdown(self, timeout: float) -> None:
            super().shutdown(timeout)
            time.sleep(0.3)

    first, second = Slow(), Recorder()
    pipe.sinks += [first, second]
    pipe.shutdown(10.0)
    assert first.timeouts[0] <= 10.0 - _pipeline.shutdown_margin(10.0)  # room for bookkeeping
    # The second sink gets what the first left: at least the 0.3 s it slept less (a sum of
    # per-stage timeouts was how exit used to take twice PERFSDK_EXPORT_TIMEOUT).
    assert second.timeouts[0] <= first.timeouts[0] - 0.3


def test_flush_gives_each_sink_a_share_so_a_stuck_one_starves_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink that waits out whatever it is given (spans queued for a retry to an unreachable
    collector) gets its share of what is left; the sinks after it still flush, with what it
    left them; what a quick sink leaves goes on to the next. Time is a fake clock that only
    the waiting sink advances."""
    now = [1000.0]
    monkeypatch.setattr(_pipeline, "_monotonic", lambda: now[0])
    pipe = Pipeline()

    class Stuck(Recorder):
        def flush(self, timeout: float) -> None:
            super().flush(timeout)
            now[0] += timeout  # waits until its time is up

    quick, stuck, after, last = Recorder(), Stuck(), Recorder(), Recorder()
    pipe.sinks += [quick, stuck, after, last]
    pipe.flush(8.0)
    assert quick.timeouts == [2.0]  # 8 s over 4 sinks; it used none of it
    assert stuck.timeouts == [8.0 / 3]  # what is left over the 3 still to flush
    assert after.timeouts == [pytest.approx((8.0 - 8.0 / 3) / 2)]
    assert last.timeouts == [pytest.approx(8.0 - 8.0 / 3)]


def test_a_worker_exits_within_the_worker_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    budgets: list[float] = []
    monkeypatch.setattr(_pipeline.PIPELINE, "shutdown", budgets.append)
    monkeypatch.setattr(_pipeline, "lost_report", lambda: [])
    monkeypatch.setattr(_pipeline.multiprocessing, "parent_process", lambda: object())
    perfsdk.configure(export_timeout_s=7)
    _pipeline.at_exit()
    assert budgets == [_pipeline.WORKER_EXIT_BUDGET]
    monkeypatch.setattr(_pipeline.multiprocessing, "parent_process", lambda: None)
    _pipeline.at_exit()
    assert budgets[-1] == 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_records_its_own_regions_never_the_inherited_one(tmp_path: Path) -> None:
    """fork inside a region: the child's own regions are its own; the open region it inherited
    is the parent's (recorded once, by the parent); span ids never repeat across the two."""
    script = tmp_path / "fork_app.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import perfsdk
        from perfsdk.testing import capture

        with capture() as cap:
            with perfsdk.timed_region("outer"):
                pid = os.fork()
                if pid == 0:
                    for i in range(3):
                        with perfsdk.timed_region("child_work", i=i):
                            pass
            if pid == 0:
                perfsdk.flush()
        who = "child" if pid == 0 else "parent"
        with open(sys.argv[1] + "." + who, "w") as f:
            json.dump([[r.name, r.span_id, r.parent_span_id] for r in cap.regions], f)
        if pid != 0:
            os.waitpid(pid, 0)
    """))
    out = tmp_path / "regions"
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    import json

    parent = json.loads(Path(f"{out}.parent").read_text())
    child = json.loads(Path(f"{out}.child").read_text())
    assert [r[0] for r in parent] == ["outer"]
    assert sorted(r[0] for r in child) == ["child_work"] * 3  # no second "outer"
    outer_id = parent[0][1]
    assert all(r[2] == outer_id for r in child)  # the child's regions nest under the parent's
    ids = [r[1] for r in parent + child]
    assert len(set(ids)) == len(ids)


def test_regions_still_pending_when_the_exit_budget_runs_out_are_counted(fake_cuda: Any) -> None:
    """A region whose GPU work never finishes holds the pipeline's last drain: exit goes on
    when its budget is spent and counts the region's span as lost (shutdown)."""
    pipe = Pipeline(interval=0.01)
    lost: list[tuple[int, str]] = []
    pipe.on_lost = lambda count, reason: lost.append((count, reason))
    pipe.sinks.append(Recorder())
    pipe.start()
    hung = threading.Event()

    class Stuck:
        resolved = False
        start_event = end_event = None

    def stuck_resolve(region: Any, wait: bool) -> bool:
        if wait:
            hung.wait(LONG)  # the GPU never gets there (until the test ends)
        return False

    pipe.resolve_region = stuck_resolve  # type: ignore[method-assign]
    spec = RegionSpec.create("stuck")
    rec = list(record(spec, 0, 1))
    rec[12], rec[13] = object(), Stuck()  # an end event: the record waits for the GPU
    pipe.submit(tuple(rec))
    pipe.shutdown(0.2)
    hung.set()
    assert lost == [(1, "shutdown")]


LONG = 30.0


def test_shutdown_during_a_busy_round_still_hands_over_everything() -> None:
    """Exit while the pipeline thread is in the middle of a round: the final request is served
    after that round (it used to end the thread unserved, so shutdown waited out its whole
    budget and the regions still queued were neither delivered nor counted)."""
    pipe = Pipeline(interval=0.01)
    entered, release = threading.Event(), threading.Event()
    seen = Recorder()

    class Busy(Recorder):
        def consume(self, records: list[Any]) -> None:
            super().consume(records)
            if not entered.is_set():
                entered.set()
                release.wait(LONG)

    busy = Busy()
    pipe.sinks += [busy, seen]
    pipe.start()
    spec = RegionSpec.create("busy")
    for i in range(10):
        pipe.submit(record(spec, i, i + 1))
    pipe.wake()
    assert entered.wait(LONG)  # the thread is inside a round
    for i in range(1000):
        pipe.submit(record(spec, i, i + 1))
    timer = threading.Timer(0.2, release.set)  # the round ends after shutdown has begun
    timer.start()
    pipe.shutdown(LONG)
    timer.join()
    assert len(seen.records) == 1010
    assert pipe.pending == 0


def test_routine_rounds_rest_between_chunks_and_waited_for_rounds_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline thread's own rounds give the GIL back between chunks (a rest after every
    chunk but the last); a drain someone waits for (flush, summary, exit) runs straight
    through."""
    rests: list[float] = []
    monkeypatch.setattr(_pipeline, "_rest", rests.append)
    ticks = iter(range(1_000_000))  # each chunk takes HOLD_S: the chunks keep their size
    monkeypatch.setattr(_pipeline, "_clock", lambda: next(ticks) * _pipeline.HOLD_S)
    spec = RegionSpec.create("paced")
    pipe = Pipeline()
    seen = Recorder()
    pipe.sinks.append(seen)
    n = 3 * _pipeline.CHUNK + 1  # four chunks
    for i in range(n):
        pipe.submit(record(spec, i, i + 1))
    assert pipe.drain(wait=False, pace=True) == n
    assert rests == [_pipeline.PACE_S] * 3
    for i in range(n):
        pipe.submit(record(spec, i, i + 1))
    assert pipe.drain(wait=True) == n
    assert len(rests) == 3  # no rest when someone waits
    assert len(seen.records) == 2 * n


def test_routine_rounds_size_their_chunks_by_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sinks that take long per record get smaller chunks, so the pipeline thread holds the
    GIL about HOLD_S between rests whatever the sinks cost; the size moves halfway at a time
    and stays within MIN_CHUNK and MAX_CHUNK."""
    now = [0.0]
    monkeypatch.setattr(_pipeline, "_clock", lambda: now[0])
    monkeypatch.setattr(_pipeline, "_rest", lambda seconds: None)
    sizes: list[int] = []
    per_record = [_pipeline.HOLD_S / 16]  # 16 records fill a hold

    class Slow(Recorder):
        def consume(self, records: list[Any]) -> None:
            super().consume(records)
            sizes.append(len(records))
            now[0] += len(records) * per_record[0]

    spec = RegionSpec.create("timed-chunks")
    pipe = Pipeline()
    pipe.sinks.append(Slow())
    for i in range(1000):
        pipe.submit(record(spec, i, i + 1))
    assert pipe.drain(wait=False, pace=True) == 1000
    assert sizes[:8] == [_pipeline.CHUNK, 40, 28, 22, 19, 18, 17, 16]
    assert set(sizes[8:-1]) == {16}
    assert sum(sizes) == 1000
    per_record[0] = _pipeline.HOLD_S / 10_000  # cheap sinks: as large as allowed
    sizes.clear()
    for i in range(5000):
        pipe.submit(record(spec, i, i + 1))
    assert pipe.drain(wait=False, pace=True) == 5000
    assert max(sizes) == _pipeline.MAX_CHUNK
    assert _pipeline.chunk_for(_pipeline.MIN_CHUNK, 1.0) == _pipeline.MIN_CHUNK
    assert _pipeline.chunk_for(100, 0.0) == 200


def test_the_gpu_samplers_gate_is_asked_about_log_n_ends_not_every_record() -> None:
    """Records wait until the GPU sampler has passed their end; a drain asks the gate about
    log2(n) of the ends, not every record's (a drain per region had asked it about every
    waiting record: 214,000 times for 2,000 regions on an H200)."""
    spec = RegionSpec.create("gated")
    pipe = Pipeline()
    sink = Recorder()
    pipe.sinks.append(sink)
    horizon = 50
    asked: list[int] = []

    def gate(end: int) -> bool:
        asked.append(end)
        return end <= horizon

    pipe.gate = gate
    for t1 in [*range(1, 101), 30, 70]:  # in order, as one thread's regions end, and two late
        pipe.submit(record(spec, 0, t1))
    assert pipe.drain(wait=False) == 51  # 1..50 and the late 30
    assert sorted(r[5] for r in sink.records) == sorted([*range(1, 51), 30])
    assert len(asked) <= 8
    assert pipe.pending == 51  # 51..100 and the late 70 wait for the sampler
    horizon = 100
    asked.clear()
    assert pipe.drain(wait=False) == 51
    assert len(asked) <= 8
    assert pipe.pending == 0


def test_region_exits_wake_the_pipeline_at_most_once_per_gap(fake_cuda: Any, monkeypatch: Any
                                                             ) -> None:
    """An exit on the GPU wakes the pipeline thread for a finished region, but not more often
    than POKE_GAP_S: one query() in the gap, however many regions end in it."""
    now = [100.0]
    monkeypatch.setattr(_pipeline, "_monotonic", lambda: now[0])
    pipe = Pipeline()
    spec = RegionSpec.create("poked")
    start, end = fake_cuda.Event(enable_timing=True), fake_cuda.Event(enable_timing=True)
    start.record()
    end.record()
    pipe._waiting.append((spec.index, 1, 2, 0, 0, 1, 0, None, None, None, None, start, end,
                          None, None))
    before = fake_cuda.queries
    for _ in range(10):
        pipe.poke()
    assert fake_cuda.queries - before == 1
    assert pipe._wake.is_set()  # the region is done: the thread is woken
    pipe._wake.clear()
    now[0] += 2 * _pipeline.POKE_GAP_S
    pipe.poke()
    assert fake_cuda.queries - before == 2
    assert pipe._wake.is_set()
