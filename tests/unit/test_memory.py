"""Memory per region: true nested peaks on the fake allocator, RSS growth for real, OOM
forensics with a memory_viz snapshot."""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import perfsdk
from perfsdk import memory
from perfsdk.config import Config, configure
from perfsdk.testing import capture

PEAK = "perfsdk.memory.peak_bytes"
DELTA = "perfsdk.memory.allocated_delta_bytes"
RESERVED = "perfsdk.memory.reserved_bytes"
MB = 1 << 20


def _mem(cap, name):
    [region] = cap.named(name)
    assert region.memory is not None, name
    return region.memory


def test_nested_and_sibling_peaks_are_each_true(fake_cuda):
    fake_cuda.alloc(100)
    with capture() as cap, perfsdk.timed_region("outer", memory=True):
        fake_cuda.alloc(1_000)
        with perfsdk.timed_region("inner", memory=True):
            fake_cuda.alloc(5_000)
            fake_cuda.free(5_000)
        with perfsdk.timed_region("sibling", memory=True):
            fake_cuda.alloc(300)
            fake_cuda.free(300)
        with perfsdk.timed_region("after", memory=True):
            fake_cuda.alloc(50)
        fake_cuda.free(1_050)
    assert _mem(cap, "inner")[PEAK] == 6_100
    assert _mem(cap, "inner")[DELTA] == 0
    assert _mem(cap, "sibling")[PEAK] == 1_400  # not polluted by the inner region's 6,100
    assert _mem(cap, "after")[PEAK] == 1_150
    assert _mem(cap, "after")[DELTA] == 50
    assert _mem(cap, "outer")[PEAK] == 6_100  # never lower than any inner region's
    assert _mem(cap, "outer")[DELTA] == 0
    assert _mem(cap, "outer")[RESERVED] == fake_cuda.reserved == 2 * MB


def test_outer_peak_after_the_inner_region_counts_too(fake_cuda):
    with capture() as cap, perfsdk.timed_region("outer", memory=True):
        with perfsdk.timed_region("inner", memory=True):
            fake_cuda.alloc(10)
        fake_cuda.alloc(90_000)  # after inner's exit, before outer's
        fake_cuda.free(90_010)
    assert _mem(cap, "inner")[PEAK] == 10
    assert _mem(cap, "outer")[PEAK] == 90_010


def test_peak_when_the_body_raises(fake_cuda):
    def failing():
        with perfsdk.timed_region("failing", memory=True):
            fake_cuda.alloc(7_000)
            raise ValueError("boom")

    with capture() as cap, perfsdk.timed_region("outer", memory=True):
        with pytest.raises(ValueError, match="boom"):
            failing()
        fake_cuda.free(7_000)
    assert _mem(cap, "failing")[PEAK] == 7_000
    assert _mem(cap, "failing")[DELTA] == 7_000
    assert _mem(cap, "outer")[PEAK] == 7_000
    assert memory.TRACKER._open == []  # nothing left open


def test_threads_see_the_process_wide_peak_and_keep_nesting(fake_cuda):
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def work(size):
        with perfsdk.timed_region("t.outer", memory=True, size=size):
            barrier.wait()
            with perfsdk.timed_region("t.inner", memory=True, size=size):
                with lock:
                    fake_cuda.alloc(size)
                barrier.wait()
                with lock:
                    fake_cuda.free(size)

    with capture() as cap:
        threads = [threading.Thread(target=work, args=(s,)) for s in (1_000, 2_000, 3_000, 4_000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    inner = {r.attributes["size"]: r.memory[PEAK] for r in cap.named("t.inner")}
    outer = {r.attributes["size"]: r.memory[PEAK] for r in cap.named("t.outer")}
    # all four allocations were live together (the barrier), and the allocator is shared
    assert set(outer.values()) == {10_000}
    assert all(outer[s] >= inner[s] >= s for s in inner)
    assert memory.TRACKER._open == []


def test_memory_is_off_by_default_and_follows_configure(fake_cuda):
    assert Config.from_env({}).memory is False
    assert Config.from_env({"PERFSDK_MEMORY": "1"}).memory is True

    @perfsdk.profiled("m.fn")
    def fn():
        fake_cuda.alloc(10)

    @perfsdk.profiled("m.never", memory=False)
    def never():
        pass

    with capture() as cap:
        fn()
        configure(memory=True)
        fn()
        never()
    first, second = cap.named("m.fn")
    assert first.memory is None
    assert "perfsdk.memory.peak_bytes" not in first.attributes
    assert second.memory[DELTA] == 10
    assert cap.named("m.never")[0].memory is None
    span = [s for s in cap.spans if s.name == "m.fn"][1]
    assert span.attributes[DELTA] == 10
    assert span.attributes[PEAK] == 20


def test_bad_memory_argument_is_named():
    with pytest.raises(ValueError, match=r"memory='yes'.*None .*True or False"):
        perfsdk.profiled("x", memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"configure\(memory=1\)"):
        configure(memory=1)  # type: ignore[arg-type]


def test_a_call_site_that_passed_memory_true_still_refuses_memory_1():
    """timed_region caches its spec per call site and arguments; 1 == True must not make a
    refused value a cache hit."""
    refused = []
    for value in (True, 1):
        try:
            perfsdk.timed_region("m.site", memory=value)  # type: ignore[arg-type]
        except ValueError as exc:
            refused.append((value, str(exc)))
    assert len(refused) == 1
    assert type(refused[0][0]) is int  # 1, not True
    assert "memory=1" in refused[0][1]


def test_without_cuda_only_rss_is_reported():
    with capture() as cap, perfsdk.timed_region("cpu", memory=True):
        pass
    mem = _mem(cap, "cpu")
    assert set(mem) == {"perfsdk.memory.rss_delta_bytes", "perfsdk.memory.rss_peak_bytes"}
    assert mem["perfsdk.memory.rss_peak_bytes"] > 10 * MB
    assert mem["perfsdk.memory.rss_delta_bytes"] >= 0


PEAK_RSS_READERS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    memory.peak_rss is memory._peak_rss_python, reason="perfsdk._fastpath is not built"))]


@pytest.mark.parametrize("reader", PEAK_RSS_READERS)
def test_peak_rss_is_getrusage_self(reader):
    """Both readers give RUSAGE_SELF's ru_maxrss in bytes (the compiled one and the Python
    one ask for RUSAGE_THREAD on Linux, which reports the same high-water mark)."""
    read = memory._peak_rss_python if reader == "python" else memory.peak_rss
    unit = 1 if sys.platform == "darwin" else 1024
    for _ in range(3):
        before = read()
        self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
        after = read()
        assert before <= self_peak <= after


@pytest.mark.parametrize("reader", PEAK_RSS_READERS)
@pytest.mark.parametrize("where", ["here", "thread"])
def test_rss_growth_of_a_region_that_touches_new_memory(tmp_path, reader, where):
    """The block is written by the region's own thread, or by another thread while the region
    waits for it: the peak RSS is the process's, whichever thread reads it."""
    script = textwrap.dedent("""
        import os, resource, sys, threading
        import perfsdk
        from perfsdk import memory
        from perfsdk.testing import capture
        assert (memory.peak_rss is memory._peak_rss_python) == (sys.argv[1] == "python")
        assert (memory.RssPeak is memory._RssPeakPython) == (sys.argv[1] == "python")
        page = os.sysconf("SC_PAGE_SIZE")
        with capture() as cap:
            with open("/proc/self/statm") as f:
                current = int(f.read().split()[1]) * page
            peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            # Linux carries ru_maxrss over fork and exec: this process starts with its
            # parent's (pytest's) peak, so the block must reach 512 MiB past that
            size = max(0, peak_before - current) + 512 * 1024 * 1024
            with perfsdk.timed_region("grow", memory=True) as r:
                if sys.argv[2] == "here":
                    block = b"\\x01" * size  # written: every page touched
                else:
                    blocks = []
                    t = threading.Thread(target=lambda: blocks.append(b"\\x01" * size))
                    t.start()
                    t.join()
            with perfsdk.timed_region("quiet", memory=True):
                pass
        grow, quiet = cap.named("grow")[0].memory, cap.named("quiet")[0].memory
        expected = current + size - peak_before  # how far the new block lifts the high-water mark
        print(grow["perfsdk.memory.rss_delta_bytes"], quiet["perfsdk.memory.rss_delta_bytes"],
              expected)
    """)
    env = dict(os.environ, PERFSDK_DISABLE_EXTENSIONS="1" if reader == "python" else "0")
    proc = subprocess.run([sys.executable, "-c", script, reader, where], capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    grow, quiet, expected = map(int, proc.stdout.split())
    assert expected > 256 * MB  # the block really goes above the earlier peak
    assert expected - 32 * MB <= grow <= 512 * MB + 64 * MB
    assert quiet < 16 * MB  # nothing of its own (other threads may nudge the peak)


def test_oom_forensics_and_snapshot(fake_cuda, tmp_path):
    configure(output_dir=tmp_path, memory_snapshots=True)
    assert fake_cuda.history == []  # allocation history is being recorded
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    fake_cuda.alloc(3 * MB)
    fake_cuda.free(2 * MB)  # 1 MB in use of 4 MB reserved: 3 MB cached and free
    def oom():
        with perfsdk.timed_region("oom", memory=True):
            fake_cuda.alloc(512)
            raise error

    with capture() as cap, pytest.raises(torch.OutOfMemoryError) as raised:
        oom()
    assert raised.value is error  # propagates unchanged
    [region] = cap.named("oom")
    attrs = region.attributes
    assert attrs["perfsdk.oom.allocated_bytes"] == MB + 512
    assert attrs["perfsdk.oom.reserved_bytes"] == 4 * MB
    assert attrs["perfsdk.oom.largest_free_block_bytes"] == 3 * MB - 512
    assert attrs["perfsdk.oom.peak_bytes"] == MB + 512
    path = attrs["perfsdk.memory.snapshot_path"]
    assert path.startswith(str(tmp_path.resolve()))
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert set(snapshot) >= {"segments", "device_traces"}
    assert [e["action"] for e in snapshot["device_traces"][0]][-1] == "alloc"
    span = cap.span("oom")
    assert span.status.status_code.name == "ERROR"
    assert span.attributes["perfsdk.memory.snapshot_path"] == path
    configure(memory_snapshots=False)
    assert fake_cuda.history is None


def test_oom_without_snapshots_still_records_the_allocator(fake_cuda, tmp_path):
    configure(output_dir=tmp_path)
    def oom():
        with perfsdk.timed_region("oom2"):
            fake_cuda.alloc(2 * MB)
            raise torch.OutOfMemoryError("out of memory")

    with capture() as cap, pytest.raises(torch.OutOfMemoryError):
        oom()
    attrs = cap.named("oom2")[0].attributes
    assert attrs["perfsdk.oom.allocated_bytes"] == 2 * MB
    assert "perfsdk.memory.snapshot_path" not in attrs
    assert list(tmp_path.iterdir()) == []


def test_largest_free_block_reads_real_snapshot_shapes():
    segments = [{"blocks": [{"size": 10, "state": "inactive"},
                            {"size": 30, "state": "active_allocated"}]},
                {"blocks": [{"size": 25, "state": "inactive"}]}]
    assert memory.largest_free_block(segments) == 25
    assert memory.largest_free_block([]) == 0


def test_a_region_entered_soon_after_a_reading_reuses_it(monkeypatch):
    """The baseline is read at enter unless the last reading began at most REUSE_NS before:
    then that reading is the baseline (one reading a region in a tight loop)."""
    clock = [10**9]
    peak = [100]
    reads: list[int] = []

    def read() -> int:
        reads.append(clock[0])
        return peak[0]

    monkeypatch.setattr(memory, "_clock", lambda: clock[0])
    monkeypatch.setattr(memory, "peak_rss", read)
    tracker = memory.MemoryTracker(memory._RssPeakPython(memory.REUSE_NS))

    token = tracker.enter()  # no reading yet: read
    peak[0] = 130  # the region raises the peak by 30
    clock[0] += 1_000
    assert tracker.exit(token)[3:] == (30, 130)
    assert len(reads) == 2

    clock[0] += memory.REUSE_NS  # exactly REUSE_NS after the exit's reading: reused
    peak[0] = 150  # growth between the two regions ...
    token = tracker.enter()
    assert len(reads) == 2
    peak[0] = 160
    assert tracker.exit(token)[3:] == (30, 160)  # ... is counted: 150 - 130 + 10 (the bound)
    assert len(reads) == 3

    clock[0] += memory.REUSE_NS + 1  # later than that: read again, exact
    peak[0] = 170
    token = tracker.enter()
    assert len(reads) == 4
    assert tracker.exit(token)[3:] == (0, 170)

    tracker.after_fork()  # a child reads afresh
    token = tracker.enter()
    assert len(reads) == 6


RSS_PEAKS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    memory.RssPeak is memory._RssPeakPython, reason="perfsdk._fastpath is not built"))]


@pytest.mark.parametrize("kind", RSS_PEAKS)
def test_rss_peak_readings_compiled_and_python(kind):
    """The compiled RssPeak and its twin: a reading is the process's peak RSS, kept with when
    it began; a baseline reuses it within reuse_ns and reads again after; a host exit reads
    again always and gives (None, None, None, delta, peak)."""
    cls = memory._RssPeakPython if kind == "python" else memory.RssPeak
    unit = 1 if sys.platform == "darwin" else 1024
    never = cls(10**18)  # every baseline after the first reuses the first reading
    assert never.last == (0, -(2**62))
    first = never.baseline()
    assert first >= 10 * MB
    assert first <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    value, when = never.last
    assert value == first
    assert when > 0
    grown = bytearray(64 * MB)  # raises the peak by up to 64 MiB: a new reading would see it
    grown[::4096] = b"\1" * len(grown[::4096])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    assert never.baseline() == first
    assert never.last == (value, when)
    out = never.host_exit(first)  # an exit always reads
    assert out[:3] == (None, None, None)
    assert out[4] >= peak
    assert out[3] == out[4] - first
    assert never.last[0] == out[4]
    assert never.last[1] >= when
    always = cls(-1)  # never reuses
    before = always.baseline()
    _, when = always.last
    assert always.baseline() >= before
    assert always.last[1] >= when
    assert always.read() == always.last[0] >= peak
    always.reset()
    assert always.last == (0, -(2**62))
    del grown


@pytest.mark.skipif(memory.RssPeak is memory._RssPeakPython,
                    reason="perfsdk._fastpath is not built")
def test_compiled_rss_peak_arguments():
    with pytest.raises(TypeError):
        memory.RssPeak()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        memory.RssPeak(REUSE="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        memory.RssPeak(1).host_exit("1")


def test_regions_on_the_host_use_the_trackers_rss_readings(monkeypatch):
    """A memory=True region on the host takes its baseline and exit reading from
    TRACKER.rss (the compiled RssPeak where built): its delta is its exit reading minus
    its baseline."""
    readings = iter([1000, 5000, 5000, 7000])
    taken: list[str] = []

    class Fake:
        def baseline(self) -> int:
            taken.append("baseline")
            return next(readings)

        def host_exit(self, rss0: int):
            taken.append("exit")
            rss1 = next(readings)
            return None, None, None, rss1 - rss0, rss1

    monkeypatch.setattr(memory.TRACKER, "rss", Fake())
    with (capture() as cap, perfsdk.timed_region("outer", memory=True),
          perfsdk.timed_region("inner", memory=True)):
        pass
    assert taken == ["baseline", "baseline", "exit", "exit"]
    assert _mem(cap, "inner") == {"perfsdk.memory.rss_delta_bytes": 0,
                                  "perfsdk.memory.rss_peak_bytes": 5000}
    assert _mem(cap, "outer") == {"perfsdk.memory.rss_delta_bytes": 6000,
                                  "perfsdk.memory.rss_peak_bytes": 7000}


def _child_rss(queue) -> None:  # runs in a forked child
    from perfsdk.memory import current_rss

    grown = bytearray(256 << 20)  # touched: 256 MiB resident in the child only
    grown[:: 4096] = b"\1" * len(grown[:: 4096])
    with open("/proc/self/statm") as f:
        fresh = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    queue.put((current_rss(), fresh))


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/self/statm"),
                    reason="needs fork and /proc")
def test_current_rss_in_a_forked_child_reads_the_childs_own() -> None:
    """The descriptor opened in the parent names the parent's /proc/<pid>/statm; the child's
    reading must be its own (it grew by 256 MiB that the parent never had)."""
    import multiprocessing

    from perfsdk.memory import current_rss

    assert current_rss() is not None  # the parent opens its descriptor first
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_rss, args=(queue,))
    child.start()
    reading, fresh = queue.get(timeout=120)
    child.join(timeout=60)
    assert reading is not None
    assert abs(reading - fresh) < (64 << 20)  # its own RSS, not the parent's 256 MiB less
