"""The Chrome / Perfetto trace file: format, nesting, rounding, threads, drops, atomic writes."""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import perfsdk
from perfsdk import clocks
from perfsdk.config import Config
from perfsdk.errors import PerfSDKWarning
from perfsdk.export import trace as trace_module
from perfsdk.export.trace import TraceSink, write_trace
from perfsdk.lifecycle import TRACE
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult
from perfsdk.testing import capture

ORIGIN = clocks.epoch_ns(0)


def result(name: str, start: int, end: int, *, span: int, parent: int = 0,
           thread: int | None = None, **attrs: Any) -> RegionResult:
    """A region from ``start`` to ``end`` ns on the host clock (perf_counter)."""
    return RegionResult(name=name, host_ms=(end - start) / 1e6, device_ms=None,
                        attributes=attrs, error=None, start_ns=ORIGIN + start,
                        end_ns=ORIGIN + end, trace_id=1, span_id=span, parent_span_id=parent,
                        thread_id=threading.get_ident() if thread is None else thread)


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def slices(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def raw_field(path: Path, name: str, key: str) -> list[str]:
    """The literal text of ``key`` in the X events called ``name`` (as a consumer reads it)."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith('{"ph":"X"') and f'"name":{json.dumps(name)}' in line:
            out.append(line.split(f'"{key}":')[1].split(",")[0])
    return out


def test_format_of_a_real_run(tmp_path: Path) -> None:
    with (capture() as cap,
          perfsdk.timed_region("step", category="step", attributes={"perfsdk.step": 3}),
          perfsdk.timed_region("forward", category="compute")):
        pass
    path = write_trace(tmp_path / "t.json", cap.regions)
    data = load(path)
    assert data["displayTimeUnit"] == "ms"
    assert data["otherData"]["perfsdk.dropped_regions"] == 0
    assert data["otherData"]["perfsdk.regions"] == 2
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    assert {e["name"] for e in meta} >= {"process_name", "thread_name"}
    lane = next(e for e in meta if e["name"] == "thread_name")
    assert lane["args"]["name"] == "MainThread"
    assert lane["tid"] == threading.get_native_id()
    by_name = {e["name"]: e for e in slices(data)}
    step, fwd = by_name["step"], by_name["forward"]
    assert step["cat"] == "step"
    assert fwd["cat"] == "compute"
    assert step["pid"] == fwd["pid"] == os.getpid()
    assert step["tid"] == fwd["tid"] == threading.get_native_id()
    assert step["args"]["perfsdk.step"] == 3
    region = cap.named("step")[0]
    assert step["args"]["perfsdk.host_ms"] == pytest.approx(region.host_ms)
    assert round(step["ts"] * 1000) == region.start_ns - ORIGIN
    assert round(step["dur"] * 1000) == region.end_ns - region.start_ns
    assert step["ts"] <= fwd["ts"]
    assert fwd["ts"] + fwd["dur"] <= step["ts"] + step["dur"]


def test_timestamps_are_exact_nanoseconds(tmp_path: Path) -> None:
    # Large clock values whose ns digits a float would round away.
    start = 9_876_543_210_123_457
    path = write_trace(tmp_path / "t.json", [result("r", start, start + 1001, span=1)])
    assert raw_field(path, "r", "ts") == ["9876543210123.457"]
    assert raw_field(path, "r", "dur") == ["1.001"]


def test_child_never_sticks_out_and_ties_put_parent_first(tmp_path: Path) -> None:
    # Parent and child with the same start and the same end, written child first.
    regions = [result("child", 1000, 2000, span=2, parent=1),
               result("parent", 1000, 2000, span=1),
               result("tail", 1999, 2000, span=3, parent=1)]
    path = write_trace(tmp_path / "t.json", regions)
    order = [e["name"] for e in slices(load(path))]
    assert order.index("parent") < order.index("child")
    assert raw_field(path, "parent", "ts") == raw_field(path, "child", "ts") == ["1.000"]
    assert raw_field(path, "tail", "ts") == ["1.999"]
    assert raw_field(path, "tail", "dur") == ["0.001"]
    lanes = {e["tid"] for e in slices(load(path))}
    assert len(lanes) == 1


def test_overlapping_regions_of_one_thread_get_an_overlap_lane(tmp_path: Path) -> None:
    # Two asyncio tasks on one thread: a [0, 10) and b [5, 15) overlap without nesting.
    regions = [result("a", 0, 10_000, span=1), result("b", 5_000, 15_000, span=2),
               result("c", 20_000, 30_000, span=3)]
    data = load(write_trace(tmp_path / "t.json", regions))
    tid = {e["name"]: e["tid"] for e in slices(data)}
    assert tid["a"] == tid["c"] != tid["b"]
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[tid["b"]] == "MainThread (overlap 1)"


def test_two_threads_get_two_named_lanes(tmp_path: Path) -> None:
    done, leave = threading.Event(), threading.Event()

    def work() -> None:
        with perfsdk.timed_region("on-worker"):
            pass
        done.set()
        leave.wait(60)

    thread = threading.Thread(target=work, name="worker-7")
    with capture() as cap:
        thread.start()
        with perfsdk.timed_region("on-main"):
            pass
        done.wait(60)
        perfsdk.flush()
        data = load(write_trace(tmp_path / "t.json", cap.regions))
        leave.set()
        thread.join()
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    tid = {e["name"]: e["tid"] for e in slices(data)}
    assert names[tid["on-main"]] == "MainThread"
    assert names[tid["on-worker"]] == "worker-7"
    assert tid["on-worker"] == thread.native_id


class Held:
    """A pipeline sink that keeps the records it is given, to hand them to a TraceSink later
    (as when the pipeline exports a thread's regions only after the thread ended)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def consume(self, records: list[Any]) -> None:
        self.records.extend(records)

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        pass

    def take(self) -> list[Any]:
        perfsdk.flush()
        out, self.records = self.records, []
        return out


def run_named(name: str, region: str) -> tuple[int, int]:
    """Run a thread called ``name`` that records ``region`` twice and ends; its (ident, OS id)."""
    seen: list[int] = []

    def work() -> None:
        seen.extend((threading.get_ident(), threading.get_native_id()))
        for _ in range(2):
            with perfsdk.timed_region(region):
                pass

    thread = threading.Thread(target=work, name=name)
    thread.start()
    thread.join()
    assert not thread.is_alive()
    return seen[0], seen[1]


def lane_names(data: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_a_thread_that_ended_keeps_its_name_in_the_sink(tmp_path: Path) -> None:
    held = Held()
    PIPELINE.sinks.append(held)
    try:
        _, native = run_named("loader-7", "load")
        records = held.take()
    finally:
        PIPELINE.sinks.remove(held)
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    sink.consume(records)  # exported after the thread ended
    sink.flush(10.0)
    assert sink.path is not None
    data = load(sink.path)
    [tid] = {e["tid"] for e in slices(data) if e["name"] == "load"}
    assert lane_names(data)[tid] == "loader-7"
    assert tid == native


def test_a_thread_that_ended_keeps_its_name_in_write_trace(tmp_path: Path) -> None:
    with capture() as cap:
        run_named("loader-7", "load")
    data = load(write_trace(tmp_path / "t.json", cap.regions))
    [tid] = {e["tid"] for e in slices(data) if e["name"] == "load"}
    assert lane_names(data)[tid] == "loader-7"


def test_a_thread_reusing_an_ident_gets_its_own_lane_and_name(tmp_path: Path) -> None:
    held = Held()
    PIPELINE.sinks.append(held)
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    try:
        first, _ = run_named("loader-7", "a")
        sink.consume(held.take())
        for attempt in range(50):  # CPython on Linux hands a joined thread's ident to the next
            ident, _ = run_named(f"loader-{8 + attempt}", "b")
            if ident == first:
                break
            held.take()
        else:
            pytest.skip("this platform did not reuse a thread ident in 50 threads")
        sink.consume(held.take())
    finally:
        PIPELINE.sinks.remove(held)
    sink.flush(10.0)
    assert sink.path is not None
    data = load(sink.path)
    tid = {e["name"]: e["tid"] for e in slices(data)}
    names = lane_names(data)
    assert names[tid["a"]] == "loader-7"
    assert names[tid["b"]] == f"loader-{8 + attempt}"
    assert tid["a"] != tid["b"]


def test_args_hold_errors_memory_device_time_and_odd_floats(tmp_path: Path,
                                                            fake_cuda: Any) -> None:
    with capture() as cap:
        with pytest.raises(KeyError), perfsdk.timed_region("bad", memory=True):
            raise KeyError("missing")
        with perfsdk.timed_region("odd", attributes={"x": math.nan}):
            pass
        fake_cuda.complete_all()
    data = load(write_trace(tmp_path / "t.json", cap.regions))
    args = {e["name"]: e["args"] for e in slices(data)}
    assert args["bad"]["exception.type"] == "KeyError"
    assert args["bad"]["exception.message"] == "'missing'"
    assert any(k.startswith("perfsdk.memory.") for k in args["bad"])
    assert args["bad"]["perfsdk.device_ms"] == cap.named("bad")[0].device_ms is not None
    assert args["odd"]["x"] == "nan"  # NaN is not JSON; written as a string


def test_sink_writes_on_flush_and_counts_drops(tmp_path: Path) -> None:
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path), max_events=3)
    PIPELINE.sinks.append(sink)
    try:
        for i in range(5):
            with perfsdk.timed_region(f"r{i}"):
                pass
        with pytest.warns(PerfSDKWarning, match="at most 3 regions"):
            perfsdk.flush()
    finally:
        PIPELINE.sinks.remove(sink)
    assert sink.path == tmp_path / f"trace-{os.getpid()}.json"
    data = load(sink.path)
    assert [e["name"] for e in slices(data)] == ["r0", "r1", "r2"]
    assert data["otherData"]["perfsdk.dropped_regions"] == 2
    assert sink.stats() == {"trace_regions": 3, "trace_regions_dropped": 2}


def test_regions_the_pipeline_could_not_queue_count_as_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the pending queue's bound a region never reaches the trace: the file's
    perfsdk.dropped_regions says how many are missing."""
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    PIPELINE.start()  # a first region starts it, under the lock held below
    PIPELINE.drain(wait=True)
    PIPELINE.sinks.append(sink)
    try:
        with PIPELINE._drain_lock, warnings.catch_warnings():  # the pipeline holds still
            warnings.simplefilter("ignore", PerfSDKWarning)  # the overflow's own warning
            monkeypatch.setattr(PIPELINE, "max_pending", len(PIPELINE.queue) + 2)
            for i in range(6):
                with perfsdk.timed_region(f"q{i}"):
                    pass
        monkeypatch.undo()
        perfsdk.flush()
    finally:
        PIPELINE.sinks.remove(sink)
    data = load(sink.path)
    assert [e["name"] for e in slices(data)] == ["q0", "q1"]
    assert data["otherData"]["perfsdk.dropped_regions"] == 4
    assert sink.stats() == {"trace_regions": 2, "trace_regions_dropped": 4}


def test_sink_is_off_without_the_trace_exporter(tmp_path: Path) -> None:
    sink = TraceSink(Config(output_dir=tmp_path))
    with capture():
        pass
    sink.consume([])
    sink.flush(1.0)
    assert sink.path is None
    assert list(tmp_path.iterdir()) == []


def test_each_flush_replaces_the_file_whole(tmp_path: Path) -> None:
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    path = tmp_path / f"trace-{os.getpid()}.json"
    with perfsdk.timed_region("first"):
        pass
    perfsdk.flush()
    first = path.stat().st_ino
    assert [e["name"] for e in slices(load(path))] == ["first"]
    with perfsdk.timed_region("second"):
        pass
    perfsdk.flush()
    assert [e["name"] for e in slices(load(path))] == ["first", "second"]
    assert path.stat().st_ino != first  # a new file moved into place, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    assert perfsdk.diagnostics()["trace_regions"] == 2


def test_turning_the_exporter_off_writes_what_was_collected(tmp_path: Path) -> None:
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    with perfsdk.timed_region("kept"):
        pass
    perfsdk.configure(exporter="none")
    assert TRACE.path is None
    [path] = tmp_path.iterdir()
    assert [e["name"] for e in slices(load(path))] == ["kept"]


def test_unwritable_directory_warns_once_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    perfsdk.configure(exporter="trace", output_dir=blocker / "sub")
    with perfsdk.timed_region("r"):
        pass
    with pytest.warns(PerfSDKWarning, match="could not write the trace file"):
        perfsdk.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        perfsdk.flush()  # the same failure again: counted, not warned again


def test_exporter_name_from_environment_and_configure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFSDK_EXPORTER", "trace")
    assert Config.from_env().exporters == ("trace",)
    assert perfsdk.configure(exporter="trace,file").exporters == ("trace", "file")
    with pytest.raises(ValueError, match="trace"):
        perfsdk.configure(exporter="perfetto")


@pytest.mark.parametrize("path", [None, 3, ""])
def test_write_trace_rejects_bad_path(path: Any) -> None:
    with pytest.raises(ValueError, match=r"write_trace\(path="):
        write_trace(path, [])


@pytest.mark.parametrize("regions", [None, "abc", [object()], {"a": 1}])
def test_write_trace_rejects_bad_regions(regions: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RegionResult"):
        write_trace(tmp_path / "t.json", regions)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_sink_rejects_bad_max_events(value: Any) -> None:
    with pytest.raises(ValueError, match="max_events"):
        TraceSink(Config(), max_events=value)


@pytest.mark.parametrize("through", ["sink", "write_trace"])
def test_slices_carry_the_rank_in_a_multi_process_job(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      through: str) -> None:
    from perfsdk import distributed

    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)  # what torchrun sets on the rank
    monkeypatch.setattr(distributed, "_from_env", None)  # read again
    monkeypatch.setattr(distributed, "_from_group", None)
    if through == "sink":
        perfsdk.configure(exporter="trace", output_dir=tmp_path)
        with perfsdk.timed_region("outer", attributes={"k": 1}), perfsdk.timed_region("inner"):
            pass
        perfsdk.flush()
        path = tmp_path / f"trace-{os.getpid()}.json"
    else:
        with capture() as cap, perfsdk.timed_region("outer", attributes={"k": 1}), \
                perfsdk.timed_region("inner"):
            pass
        path = write_trace(tmp_path / "t.json", cap.regions)
    got = {e["name"]: e["args"] for e in slices(load(path))}
    assert sorted(got) == ["inner", "outer"]
    for args in got.values():
        assert (args["perfsdk.rank"], args["perfsdk.local_rank"],
                args["perfsdk.world_size"]) == (3, 1, 4)
    assert got["outer"]["k"] == 1


def test_a_single_process_has_no_rank_in_its_slices(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from perfsdk import distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_from_env", None)
    monkeypatch.setattr(distributed, "_from_group", None)
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    with perfsdk.timed_region("solo"):
        pass
    perfsdk.flush()
    (args,) = [e["args"] for e in slices(load(tmp_path / f"trace-{os.getpid()}.json"))]
    assert not any(k in args for k in distributed.RANK_ATTRIBUTES)


def test_turning_the_exporter_off_writes_regions_still_waiting_for_the_gpu(
        tmp_path: Path, fake_cuda: Any) -> None:
    """On a GPU a region waits for its end event: turned off right after, the trace file still
    gets it (an H200 run wrote no file: the region was handed on under the new settings)."""
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    with perfsdk.timed_region("kept"):
        fake_cuda.launch(3.0)  # the GPU has not run it when the exporter is turned off
    perfsdk.configure(exporter="none")
    [path] = tmp_path.iterdir()
    assert [e["name"] for e in slices(load(path))] == ["kept"]


# -- rendered once, as regions arrive ---------------------------------------------------------
def test_a_flush_renders_only_the_regions_that_arrived_since_the_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each region is rendered once: a flush after 50 regions and one more renders 1 region,
    not 51 (every flush rendered the whole file again: 1.5 s at 160,000 regions)."""
    rendered: list[str] = []
    args_of = trace_module._args

    def counted(e: Any) -> dict[str, Any]:
        rendered.append(e[0])
        return args_of(e)

    monkeypatch.setattr(trace_module, "_args", counted)
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    path = tmp_path / f"trace-{os.getpid()}.json"
    for i in range(50):
        with perfsdk.timed_region(f"r{i}"):
            pass
    perfsdk.flush()
    assert len(rendered) == 50
    with perfsdk.timed_region("last"):
        pass
    perfsdk.flush()
    assert rendered[50:] == ["last"]
    data = load(path)
    assert [e["name"] for e in slices(data)] == [f"r{i}" for i in range(50)] + ["last"]
    assert data["otherData"]["perfsdk.regions"] == 51


def test_a_parent_written_after_its_children_nests_them_on_their_lane(tmp_path: Path) -> None:
    """A flush inside a region writes its finished children; the region itself comes in a
    later write, on the same lane, holding them (no overlap lane)."""
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    with perfsdk.timed_region("epoch"):
        for i in range(3):
            with (perfsdk.timed_region("step", attributes={"perfsdk.step": i}),
                  perfsdk.timed_region("forward")):
                pass
            perfsdk.flush()
    perfsdk.flush()
    data = load(tmp_path / f"trace-{os.getpid()}.json")
    got = slices(data)
    assert [e["name"] for e in got] == ["step", "forward"] * 3 + ["epoch"]  # epoch: last write
    assert len({e["tid"] for e in got}) == 1
    assert set(lane_names(data).values()) == {"MainThread"}
    epoch = got[-1]
    for e in got[:-1]:
        assert epoch["ts"] <= e["ts"]
        assert e["ts"] + e["dur"] <= epoch["ts"] + epoch["dur"]


def nests(lane: list[tuple[int, int]]) -> bool:
    """Whether every two regions of a lane are disjoint or one holds the other."""
    return all(a1 <= b0 or b1 <= a0 or (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
               for i, (a0, a1) in enumerate(lane) for (b0, b1) in lane[i + 1:])


def tree(rng: Any, t0: int, t1: int, depth: int) -> list[tuple[int, int]]:
    """Random properly nested regions inside [t0, t1] (the region itself first)."""
    out = [(t0, t1)]
    if depth and t1 - t0 > 8:
        cut = sorted(rng.sample(range(t0, t1 + 1), 4))
        for a, b in ((cut[0], cut[1]), (cut[2], cut[3])):
            if rng.random() < 0.8:
                out += tree(rng, a, b, depth - 1)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_lanes_nest_whatever_order_regions_arrive_in(seed: int) -> None:
    import random

    rng = random.Random(seed)
    nested = [r for k in range(20) for r in tree(rng, k * 1000, k * 1000 + rng.randint(0, 999),
                                                  4)]
    crossing = [(a, a + rng.randint(1, 3000)) for a in rng.sample(range(20_000), 15)]
    # In the order they ended (how one thread's regions arrive): properly nested ones share
    # one lane.
    lanes = trace_module._Lanes()
    assert {lanes.place(*r) for r in sorted(nested, key=lambda r: (r[1], -r[0]))} == {0}
    # Any order, with regions that cross others (asyncio tasks, regions held for the GPU):
    # every lane still nests.
    regions = nested + crossing
    rng.shuffle(regions)
    lanes = trace_module._Lanes()
    by_lane: dict[int, list[tuple[int, int]]] = {}
    for r in regions:
        by_lane.setdefault(lanes.place(*r), []).append(r)
    assert all(nests(lane) for lane in by_lane.values())
    assert len(by_lane) > 1  # the crossing regions needed lanes of their own


def test_a_lane_forgets_old_regions_but_an_epoch_still_holds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_module, "_KEEP", 8)
    lanes = trace_module._Lanes()
    steps = [(10 * i, 10 * i + 5) for i in range(1, 40)]  # each the end of a step
    assert {lanes.place(*s) for s in steps} == {0}
    assert len(lanes.lanes[0][0]) <= 9  # the oldest forgotten, their span noted
    assert lanes.place(12, 14) == 1  # inside a forgotten step: it cannot be checked
    assert lanes.place(3, 200) == 1  # crosses forgotten steps: another lane
    assert lanes.place(0, 1000) == 0  # the epoch: holds every step, forgotten or kept
    assert lanes.lanes[0] == ([0], [1000])


def test_the_writer_writes_the_file_while_regions_arrive_so_a_killed_process_leaves_it(
        tmp_path: Path) -> None:
    """No flush and no exit (SIGKILL): the file the writer thread wrote on its own holds the
    regions."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        import perfsdk
        from perfsdk.lifecycle import TRACE
        TRACE.write_every_s = 0.05  # the default is 30 s
        perfsdk.configure(exporter="trace", output_dir=sys.argv[1])
        for i in range(5):
            with perfsdk.timed_region("work", attributes={"i": i}):
                pass
        path = TRACE.path
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().count('"name":"work"') == 5:
                break
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [path] = out.glob("trace-*.json")
    data = load(path)
    assert [e["args"]["i"] for e in slices(data)] == list(range(5))


def test_a_write_that_outlasts_the_flush_timeout_warns(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush (or the exit) that cannot wait for the file says so, naming the file and the
    timeout; the write still lands once the disk lets it."""
    release = threading.Event()
    write = trace_module._atomic_write

    def slow(path: Path, parts: list[bytes]) -> None:
        release.wait(60)
        write(path, parts)

    monkeypatch.setattr(trace_module, "_atomic_write", slow)
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    with capture() as cap, perfsdk.timed_region("r"):
        pass
    sink.consume(list(cap.records))
    with pytest.warns(PerfSDKWarning, match=r"trace file .*trace-\d+\.json was not written "
                      r"within 0\.05 s at flush"):
        sink.flush(0.05)
    release.set()
    sink.flush(60.0)
    assert sink.path is not None
    assert [e["name"] for e in slices(load(sink.path))] == ["r"]


def test_a_region_that_cannot_be_written_is_counted_and_the_rest_written(
        tmp_path: Path) -> None:
    class Unwritable:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    regions = [result("good", 0, 10, span=1), result("bad", 20, 30, span=2, odd=Unwritable()),
               result("after", 40, 50, span=3)]
    with pytest.warns(PerfSDKWarning, match="could not be written to the trace file"):
        data = load(write_trace(tmp_path / "t.json", regions))
    assert [e["name"] for e in slices(data)] == ["good", "after"]
    assert data["otherData"]["perfsdk.regions"] == 2
    assert data["otherData"]["perfsdk.dropped_regions"] == 1


def renders_noted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(regions, thread name) of each rendering of a trace file, from now on."""
    batches: list[tuple[int, str]] = []
    render = trace_module._TraceFile.render

    def noted(self: Any, events: list[Any], threads: Any) -> int:
        if events:
            batches.append((len(events), threading.current_thread().name))
        return render(self, events, threads)

    monkeypatch.setattr(trace_module._TraceFile, "render", noted)
    return batches


def hundred_records() -> list[Any]:
    with capture() as cap:
        for i in range(100):
            with perfsdk.timed_region(f"r{i}"):
                pass
    return list(cap.records)


def test_between_writes_the_writer_renders_in_chunks_with_rests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a flush the writer renders a few regions at a time and rests between, so the
    training thread never waits long for the GIL; a flush then has nothing left to render."""
    from tests.waiting import wait_until

    batches = renders_noted(monkeypatch)
    rests: list[float] = []
    monkeypatch.setattr(trace_module, "_rest", rests.append)
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    sink.render_every_s = 0.01
    sink.consume(hundred_records())
    # the last chunk's rest comes after its rendering: wait for both
    assert wait_until(lambda: sum(n for n, _ in batches) == 100
                      and len(rests) >= len(batches))
    assert {name for _, name in batches} == {"perfsdk-trace-writer"}
    assert max(n for n, _ in batches) <= trace_module.RENDER_CHUNK < 100
    assert len(rests) >= len(batches)
    assert set(rests) == {trace_module.RENDER_REST_S}
    sink.flush(60.0)
    assert sum(n for n, _ in batches) == 100  # nothing rendered twice
    assert sink.path is not None
    assert [e["name"] for e in slices(load(sink.path))] == [f"r{i}" for i in range(100)]


@pytest.mark.parametrize("how", ["writev", "short writes", "no writev"])
def test_the_file_is_written_in_few_system_calls_whole(tmp_path: Path, how: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The text goes out in os.writev calls of at most 512 buffers (each releases the GIL once;
    a write per buffer waited for the GIL after each, behind a busy training thread); a short
    write's rest, and a platform without writev, still give the whole file."""
    parts = [f"part {i:05d}\n".encode() * (1 + i % 7) for i in range(1_300)]
    calls: list[int] = []
    writev = os.writev

    def noted(fd: int, buffers: list[bytes]) -> int:
        calls.append(len(buffers))
        if how == "short writes":
            return os.write(fd, buffers[0][:3])  # what a signal or a full pipe may leave
        return writev(fd, buffers)

    if how == "no writev":
        monkeypatch.delattr(os, "writev")
    else:
        monkeypatch.setattr(os, "writev", noted)
    path = tmp_path / "t.json"
    trace_module._atomic_write(path, parts)
    assert path.read_bytes() == b"".join(parts)
    if how != "no writev":
        assert calls == [512, 512, 276]
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_flush_asked_during_paced_rendering_gets_the_rest_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.waiting import wait_until

    batches = renders_noted(monkeypatch)
    sink = TraceSink(Config(exporters=("trace",), output_dir=tmp_path))
    rests: list[float] = []

    def rest_then_ask(seconds: float) -> None:
        rests.append(seconds)
        if len(rests) == 1:
            sink._request()  # a flush arrives after the first chunk

    monkeypatch.setattr(trace_module, "_rest", rest_then_ask)
    sink.render_every_s = 0.01
    sink.consume(hundred_records())
    assert wait_until(lambda: sum(n for n, _ in batches) == 100)
    assert [n for n, _ in batches] == [trace_module.RENDER_CHUNK,
                                       100 - trace_module.RENDER_CHUNK]
    assert len(rests) == 1
    sink.flush(60.0)
    assert sink.path is not None
    assert len(slices(load(sink.path))) == 100
