"""The summary: counts, totals and percentiles against numbers computed independently; the
table; bounded memory with exact counts."""

from __future__ import annotations

import io
import math
import random
from typing import Any

import numpy as np
import pytest

import perfsdk
from perfsdk import lifecycle, profiled, timed_region
from perfsdk.export import summary as summary_mod
from perfsdk.export.summary import RegionStats, Summary, percentile
from perfsdk.pipeline import PIPELINE


@pytest.fixture(autouse=True)
def empty_summary():
    PIPELINE.drain(wait=True)
    lifecycle.SUMMARY.reset()
    yield
    PIPELINE.drain(wait=True)
    lifecycle.SUMMARY.reset()


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q))


# -- percentiles --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = sorted(rng.uniform(0, 100) for _ in range(n))
    for q in (0, 1, 25, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(pct(values, q), rel=1e-12, abs=1e-12)


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


# -- host times through the real pipeline ------------------------------------------------------
def test_host_stats_match_the_captured_regions(captured):
    @profiled("host.step")
    def step(n):
        return sum(range(n))

    for i in range(60):
        step(100 * (i % 7))
    with pytest.raises(ValueError, match="x"), timed_region("host.step"):
        raise ValueError("x")

    table = perfsdk.summary(show=False)
    host = [r.host_ms for r in captured.named("host.step")]
    assert len(host) == 61
    row = table["host.step"]
    assert row.count == 61
    assert row.errors == 1
    assert row.total_ms == pytest.approx(math.fsum(host), rel=1e-9)
    assert row.mean_ms == pytest.approx(math.fsum(host) / 61, rel=1e-9)
    assert row.p50_ms == pytest.approx(pct(host, 50), rel=1e-9)
    assert row.p95_ms == pytest.approx(pct(host, 95), rel=1e-9)
    assert row.p99_ms == pytest.approx(pct(host, 99), rel=1e-9)
    assert row.device_count == 0
    assert row.device_total_ms is None
    assert row.device_p50_ms is None


# -- device times with known values (fake GPU) --------------------------------------------------
def test_device_stats_from_known_durations(fake_cuda):
    durations = [float(i) for i in range(1, 101)]
    random.Random(1).shuffle(durations)
    for ms in durations:
        with timed_region("gpu.step"):
            fake_cuda.launch(ms)
    with timed_region("gpu.small"):
        fake_cuda.launch(0.25)
    fake_cuda.complete_all()
    table = perfsdk.summary(show=False)
    row = table["gpu.step"]
    assert row.count == 100
    assert row.device_count == 100
    assert row.device_total_ms == 5050.0
    assert row.device_mean_ms == 50.5
    assert row.device_p50_ms == pytest.approx(50.5)
    assert row.device_p95_ms == pytest.approx(95.05)
    assert row.device_p99_ms == pytest.approx(99.01)
    assert [r.name for r in table] == ["gpu.step", "gpu.small"]  # biggest GPU total first
    assert table["gpu.small"].device_total_ms == 0.25


def test_rows_are_ordered_by_total(captured):
    @profiled("cheap")
    def cheap():
        pass

    @profiled("dear")
    def dear():
        sum(range(200_000))

    cheap()
    dear()
    table = perfsdk.summary(show=False)
    totals = {r.name: r.host_ms for r in captured.regions}
    assert [r.name for r in table] == sorted(totals, key=totals.__getitem__, reverse=True)


# -- the table ----------------------------------------------------------------------------------
def test_table_text_and_data(capsys):
    @profiled("forward")
    def forward():
        pass

    for _ in range(3):
        forward()
    data = perfsdk.summary(show=False)
    assert capsys.readouterr().out == ""
    assert isinstance(data, Summary)
    assert len(data) == 1
    assert "forward" in data
    assert "backward" not in data
    (row,) = list(data)
    assert isinstance(row, RegionStats)
    assert data.as_dicts()[0]["count"] == 3
    with pytest.raises(KeyError):
        data["backward"]

    shown = perfsdk.summary()
    out = capsys.readouterr().out
    assert shown == data
    lines = out.strip().splitlines()
    header = lines[0].split()
    for column in ("region", "calls", "errors", "total", "mean", "p50", "p95", "p99"):
        assert column in header
    assert set(lines[1]) == {"-"}
    assert lines[2].split()[0] == "forward"
    assert lines[2].split()[1] == "3"
    assert "gpu" not in out  # no device columns without device timings
    assert str(data) == out.rstrip("\n")

    buffer = io.StringIO()
    perfsdk.summary(file=buffer)
    assert buffer.getvalue() == out


def test_table_has_gpu_columns_and_errors(fake_cuda):
    with timed_region("k"):
        fake_cuda.launch(1234.5)
    with pytest.raises(RuntimeError), timed_region("k"):
        raise RuntimeError
    fake_cuda.complete_all()
    text = str(perfsdk.summary(show=False))
    header, rule, line = text.splitlines()
    assert "gpu total ms" in header
    assert "gpu p99" in header
    assert len(rule) == len(header)
    cells = line.split()
    assert cells[:3] == ["k", "2", "1"]  # name, calls, errors
    assert "1,234.5" in cells  # device total, thousands separator


def test_empty_summary():
    table = perfsdk.summary(show=False)
    assert len(table) == 0
    assert "no regions recorded" in str(table)


def test_formatting_of_small_and_large_values():
    rows = (RegionStats("a", 1, 0, 0.0123, 0.0123, 0.0123, 0.0123, 0.0123),
            RegionStats("b", 1_234_567, 0, 12345.678, 5.5, 5.5, 5.5, math.nan))
    text = summary_mod.render(rows)
    assert "0.012" in text
    assert "12,345.7" in text
    assert "1,234,567" in text
    assert "5.50" in text
    assert text.splitlines()[-1].rstrip().endswith("-")  # NaN shows as '-'


# -- bounded memory -----------------------------------------------------------------------------
def test_reservoir_bounds_memory_with_exact_count_and_total():
    series = summary_mod._Series()
    rng = random.Random(7)
    values = [rng.uniform(0, 10) for _ in range(3 * summary_mod.RESERVOIR)]
    for v in values:
        series.add(v)
    assert series.count == len(values)
    assert series.total == pytest.approx(math.fsum(values), rel=1e-12)
    assert len(series.samples) == summary_mod.RESERVOIR
    # a uniform sample of a uniform stream: percentiles close to the true ones
    sample = sorted(series.samples)
    assert percentile(sample, 50) == pytest.approx(pct(values, 50), abs=0.2)
    assert percentile(sample, 95) == pytest.approx(pct(values, 95), abs=0.2)
    # and later values are represented, not just the first RESERVOIR ones
    late = set(values[2 * summary_mod.RESERVOIR:])
    assert sum(1 for s in series.samples if s in late) > summary_mod.RESERVOIR // 5


def test_reservoir_through_the_pipeline(monkeypatch, captured):
    monkeypatch.setattr(summary_mod, "RESERVOIR", 50)

    @profiled("many")
    def many():
        pass

    for _ in range(1000):
        many()
    table = perfsdk.summary(show=False)
    host = [r.host_ms for r in captured.named("many")]
    assert table["many"].count == 1000
    assert table["many"].total_ms == pytest.approx(math.fsum(host), rel=1e-9)
    acc = lifecycle.SUMMARY._acc["many"]
    assert len(acc.host.samples) == 50
    assert min(host) <= table["many"].p50_ms <= max(host)


def test_regions_of_one_name_share_a_row_and_a_reset_starts_them_afresh():
    first = timed_region("shared-name")
    second = timed_region("shared-name", attributes={"k": 1})  # another spec, the same name

    def count_after(*blocks: Any) -> int:
        for block in blocks:
            with block:
                pass
        PIPELINE.drain(wait=True)
        (row,) = [r for r in perfsdk.summary(show=False) if r.name == "shared-name"]
        return row.count

    assert count_after(first, second, first, second, first, second) == 6
    lifecycle.SUMMARY.reset()
    assert count_after(second) == 1
    lifecycle.SUMMARY.after_fork()
    assert count_after(first) == 1


def test_summary_after_fork_starts_empty():
    @profiled("parent-only")
    def f():
        pass

    f()
    PIPELINE.drain(wait=True)
    lifecycle.SUMMARY.after_fork()
    assert len(perfsdk.summary(show=False)) == 0


def test_the_reservoir_stays_a_uniform_sample_far_past_its_size():
    """Past RESERVOIR values, each value is kept with the same chance: the samples of 0..N-1
    spread evenly (each tenth of the range holds about a tenth of them), the last values get in
    as often as the first, and count and total stay exact."""
    from perfsdk.export.summary import RESERVOIR, _Series

    n = 20 * RESERVOIR
    series = _Series()
    for i in range(n):
        series.add(float(i))
    assert series.count == n
    assert series.total == n * (n - 1) / 2
    assert len(series.samples) == RESERVOIR
    tenths = [0] * 10
    for v in series.samples:
        tenths[int(v * 10 // n)] += 1
    expected = RESERVOIR / 10
    # the series' generator is seeded: the same samples every run
    assert all(abs(t - expected) < 0.1 * expected for t in tenths), tenths


# -- the pipeline thread's pass (issue 16) ------------------------------------------------------
def _same(many: Any, one: Any) -> bool:
    """The same series; the totals to 1e-12 (sum() compensates its rounding on Python 3.12+,
    one add at a time does not)."""
    fields = ("count", "seen", "samples", "next", "w")
    return ([getattr(many, f) for f in fields] == [getattr(one, f) for f in fields]
            and many.rng.getstate() == one.rng.getstate()
            and many.total == pytest.approx(one.total, rel=1e-12))


@pytest.mark.parametrize("start", [0, summary_mod.RESERVOIR - 70, summary_mod.RESERVOIR,
                                   3 * summary_mod.RESERVOIR])
def test_add_many_is_add_after_add(start: int) -> None:
    """Batches of every size, across the reservoir's filling and past it (where values enter
    at drawn counts): the same samples, count, sum and generator state as one add each."""
    rng = random.Random(start)
    one, many = summary_mod._Series(), summary_mod._Series()
    for i in range(start):
        one.add(i / 7)
    many.add_many([i / 7 for i in range(start)])
    assert _same(many, one)
    entered = 0
    for size in [0, 1, 2, 63, 64, 65, 500, 3, 4_000, *(rng.randrange(200) for _ in range(60))]:
        values = [rng.uniform(0, 10) for _ in range(size)]
        before = list(one.samples)
        for v in values:
            one.add(v)
        many.add_many(values)
        entered += sum(a != b for a, b in zip(before, one.samples, strict=False))
        assert _same(many, one), size
    assert entered > 0  # the batches crossed values that entered the full reservoir


@pytest.mark.parametrize("start", [0, 5, summary_mod.RESERVOIR - 3, 2 * summary_mod.RESERVOIR])
def test_calls_counted_without_a_sample_leave_the_reservoir_working(start: int) -> None:
    """Regions the pipeline could not queue are tallied (count and total, no sample): values
    added after them still fill the reservoir and enter it at drawn counts, in batches as one
    at a time (a tally of 459,520 such calls made a batch's draw land before its first value:
    IndexError in benchmarks/overhead.py)."""
    one, many = summary_mod._Series(), summary_mod._Series()
    for series in (one, many):
        for i in range(start):
            series.add(float(i))
        series.add_unsampled(459_520, 1.0)  # what SummarySink.tally hands over
    values = [float(i) for i in range(3 * summary_mod.RESERVOIR)]
    for v in values:
        one.add(v)
    for k in range(0, len(values), 64):
        many.add_many(values[k:k + 64])
    assert _same(many, one)
    assert many.count == start + 459_520 + len(values)
    assert len(many.samples) == summary_mod.RESERVOIR  # filled, though count passed its size
    late = set(values[2 * summary_mod.RESERVOIR:])
    assert sum(1 for v in many.samples if v in late) > summary_mod.RESERVOIR // 10  # still drawn


def _records_of_every_shape() -> list[tuple[Any, ...]]:
    from perfsdk.testing import capture, use_fake_cuda

    with capture() as cap:
        for _ in range(3):
            with timed_region("a"):
                pass
            with timed_region("b") as b:
                b.set_attribute("k", 1)
        with pytest.raises(KeyError), timed_region("a"):
            raise KeyError("x")
        with timed_region("synced") as synced:
            synced.set_attribute("perfsdk.syncs", 2)  # what no_sync_guard sets
        with use_fake_cuda() as fake:
            with timed_region("gpu"):
                fake.launch(1.5)
            fake.advance(1.5)
        PIPELINE.drain(wait=True)
    return list(cap.records)


def test_compiled_host_times_is_the_python_pass() -> None:
    from perfsdk.record import ATTRS, DEVICE_MS, ERROR, SPEC, T0, T1

    compiled = pytest.importorskip("perfsdk._fastpath").host_times
    records = _records_of_every_shape()
    for keys in (("k",), ("x", "y"), ()):
        fields = (SPEC, T0, T1, DEVICE_MS, ERROR, ATTRS, keys)
        got = compiled(records, *fields)
        want = summary_mod._host_times_python(records, *fields)
        assert got == want
        assert list(got[0].items()) == list(want[0].items())  # in the same order too
        host, more = got
        assert sorted(len(v) for v in host.values()) == [1, 1, 1, 3, 3]  # 2 sites named "a"
        # b's three when "k" is asked for, a's error and the device time always
        assert len(more) == (5 if "k" in keys else 2)
    # a big int time, a non-tuple record and attributes that are not a dict are refused
    with pytest.raises(OverflowError):
        compiled([(*records[0][:T1], 2**70, *records[0][T1 + 1:])], *fields)
    with pytest.raises(TypeError):
        compiled([list(records[0])], *fields)
    with pytest.raises(TypeError):
        compiled([(*records[0][:ATTRS], ["k"], *records[0][ATTRS + 1:])], *fields)
    assert compiled([], *fields) == ({}, [])


def test_the_summary_is_the_same_through_either_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records_of_every_shape()
    sinks = []
    for fn in (summary_mod._host_times_python, summary_mod.host_times):
        monkeypatch.setattr(summary_mod, "host_times", fn)
        sink = summary_mod.SummarySink()
        sink.consume(records[:4])
        sink.consume(records[4:])
        sinks.append({name: (acc.host.count, acc.host.samples, acc.device.samples, acc.errors,
                             acc.syncs) for name, acc in sink._acc.items()})
    assert sinks[0] == sinks[1]
    assert sinks[0]["a"][0] == 4  # both call sites named "a"
    assert sinks[0]["a"][3] == 1
    assert sinks[0]["gpu"][2] == [1.5]
    assert sinks[0]["synced"][4] == 2
    assert sinks[0]["b"][4] == 0
