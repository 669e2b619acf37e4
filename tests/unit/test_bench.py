"""The benchmark harness: statistics, warm-up, input rotation, min_time, validation,
interleaved comparison and its table, and device timing through CUDA events on the fake GPU."""

from __future__ import annotations

import collections
import doctest
import functools
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import perfsdk.bench
from perfsdk.bench import BenchResult, Comparison, benchmark, compare
from perfsdk.testing import FakeCuda, FakeCudaTensor

MiB = 2**20


class FakeClock:
    """A host clock (ns) that only moves when the benchmarked function says so."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def spend(self, ms: float) -> None:
        self.ns += round(ms * 1e6)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(perfsdk.bench, "_now_ns", fake)
    return fake


def _durations(clock: FakeClock, durations_ms: list[float]) -> Any:
    """A function whose n-th call takes durations_ms[n] on the fake clock."""
    it: Iterator[float] = iter(durations_ms)

    def fn(*args: Any) -> None:
        clock.spend(next(it))

    return fn


# -- statistics ----------------------------------------------------------------------------------
def test_statistics_are_exact_on_a_known_clock(clock: FakeClock) -> None:
    fn = _durations(clock, [0.5] * 2 + [float(v) for v in (3, 1, 4, 10, 5, 9, 2, 6, 8, 7)])
    r = benchmark(fn, warmup=2, iters=10)
    assert r.times_ms == (3.0, 1.0, 4.0, 10.0, 5.0, 9.0, 2.0, 6.0, 8.0, 7.0)  # in call order
    assert r.median_ms == pytest.approx(5.5)
    assert r.p95_ms == pytest.approx(9.55)  # linear interpolation: pos 8.55 of 0..9
    assert r.p99_ms == pytest.approx(9.91)
    assert r.min_ms == 1.0
    assert r.mean_ms == pytest.approx(5.5)
    assert r.spread == pytest.approx((9.1 - 1.9) / 5.5)
    assert (r.device, r.warmup, r.iters, r.peak_memory_bytes) == ("cpu", 2, 10, None)


def test_real_sleeps_are_timed_on_the_real_clock() -> None:
    """Each timed call holds its sleep, and the calls together fit in the time the whole
    benchmark took (what holds however busy the machine is)."""
    start = time.perf_counter_ns()
    r = benchmark(lambda: time.sleep(0.002), warmup=1, iters=5)
    wall_ms = (time.perf_counter_ns() - start) / 1e6
    assert r.device == "cpu"
    assert len(r.times_ms) == 5
    assert 2.0 <= r.min_ms <= r.median_ms <= r.p95_ms <= r.p99_ms <= max(r.times_ms)
    assert math.fsum(r.times_ms) <= wall_ms - 2.0  # and the warm-up call's sleep besides
    assert r.min_ms <= r.mean_ms <= max(r.times_ms)
    assert r.spread >= 0


def test_samples_per_s_is_batch_over_median(clock: FakeClock) -> None:
    r = benchmark(lambda: clock.spend(4.0), warmup=0, iters=5, batch_size=32)
    assert r.median_ms == 4.0
    assert r.samples_per_s == pytest.approx(32 / 0.004)
    assert benchmark(lambda: clock.spend(4.0), warmup=0, iters=3).samples_per_s is None


def test_result_as_dict_is_json_ready_and_str_summarizes(clock: FakeClock) -> None:
    r = benchmark(lambda: clock.spend(2.0), warmup=0, iters=3, batch_size=8, name="step")
    data = json.loads(json.dumps(r.as_dict()))
    assert data["times_ms"] == [2.0, 2.0, 2.0]
    assert data["name"] == "step"
    assert set(data) == {f.name for f in BenchResult.__dataclass_fields__.values()}
    text = str(r)
    assert text.startswith("step: median 2.000 ms")
    assert "3 iters on cpu" in text
    assert "4,000 samples/s" in text


def test_default_names() -> None:
    def my_step() -> None:
        pass

    assert benchmark(my_step, iters=1, warmup=0).name == "my_step"
    assert benchmark(functools.partial(my_step), iters=1, warmup=0).name == "partial"
    lin = torch.nn.Linear(2, 2)
    assert benchmark(lin, torch.randn(1, 2), iters=1, warmup=0).name == "Linear"


# -- warm-up, rotation, min_time -----------------------------------------------------------------
def test_warmup_calls_are_made_first_and_not_timed(clock: FakeClock) -> None:
    calls: list[int] = []

    def fn() -> None:
        calls.append(len(calls))
        clock.spend(100.0 if len(calls) <= 3 else 1.0)  # warm-up calls are slow

    r = benchmark(fn, warmup=3, iters=7)
    assert len(calls) == 10
    assert r.times_ms == (1.0,) * 7
    assert (r.warmup, r.iters) == (3, 7)


def test_rotation_passes_equal_copies_of_every_tensor_in_turn() -> None:
    x = torch.randn(4, 3)
    w = torch.randn(3, requires_grad=True)
    nested = {"w": w, "list": [torch.arange(5)], "k": 7}
    seen: list[tuple[Any, ...]] = []

    def fn(a: torch.Tensor, d: dict[str, Any], flag: str) -> None:
        seen.append((a, d, flag))

    benchmark(fn, x, nested, "mode", warmup=0, iters=6, rotate=3)
    ids = [id(a) for a, _, _ in seen]
    assert ids[:3] == ids[3:]
    assert len(set(ids)) == 3
    assert seen[0][0] is x
    assert seen[0][1] is nested
    for a, d, flag in seen[1:3]:
        assert a is not x
        assert torch.equal(a, x)
        assert d is not nested
        assert d["w"] is not w
        assert torch.equal(d["w"], w)
        assert d["w"].requires_grad
        assert d["w"].is_leaf
        assert d["list"][0] is not nested["list"][0]
        assert torch.equal(d["list"][0], nested["list"][0])
        assert d["k"] == 7
        assert flag == "mode"
    assert len({id(d["list"][0]) for _, d, _ in seen[:3]}) == 3


def test_rotation_keeps_container_types() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    od = collections.OrderedDict(t=torch.ones(2))
    seen: list[tuple[Any, Any]] = []
    benchmark(lambda p, o: seen.append((p, o)), Pair(torch.zeros(1), 3), od,
              warmup=0, iters=2, rotate=2)
    p, o = seen[1]
    assert type(p) is Pair
    assert p.b == 3
    assert p.a is not seen[0][0].a
    assert type(o) is collections.OrderedDict
    assert o["t"] is not od["t"]


def test_rotate_1_uses_the_inputs_as_given() -> None:
    x = torch.randn(3)
    seen: list[torch.Tensor] = []
    benchmark(seen.append, x, warmup=2, iters=4, rotate=1)
    assert len(seen) == 6
    assert all(t is x for t in seen)


def test_min_time_is_honored() -> None:
    start = time.perf_counter_ns()
    r = benchmark(lambda: time.sleep(0.001), warmup=0, min_time=0.05)
    wall_ms = (time.perf_counter_ns() - start) / 1e6
    assert wall_ms >= 50.0
    assert r.iters >= 3
    assert r.iters == len(r.times_ms)
    assert min(r.times_ms) >= 1.0  # each call's sleep
    assert math.fsum(r.times_ms) <= wall_ms


def test_min_time_runs_at_least_three_calls(clock: FakeClock) -> None:
    r = benchmark(lambda: clock.spend(1000.0), warmup=0, min_time=0.01)
    assert r.iters == 3


def test_min_time_on_fake_clock_stops_once_elapsed(clock: FakeClock) -> None:
    r = benchmark(lambda: clock.spend(10.0), warmup=0, min_time=0.1)
    assert r.iters == 10  # the clock is checked between calls: 10 x 10 ms = 0.1 s


def test_default_is_min_time_and_iterations_are_capped(
        clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    r = benchmark(lambda: clock.spend(100.0), warmup=0)
    assert r.iters == 10  # the default min_time is 1 s
    monkeypatch.setattr(perfsdk.bench, "_MAX_ITERS", 50)
    assert benchmark(lambda: None, warmup=0, min_time=60.0).iters == 50


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"warmup": -1}, r"warmup must be an int >= 0, got -1"),
    ({"warmup": 1.5}, r"warmup must be an int >= 0"),
    ({"iters": 0}, r"iters must be an int >= 1 or None, got 0"),
    ({"iters": True}, r"iters must be an int >= 1"),
    ({"min_time": 0}, r"min_time must be a number of seconds > 0 or None, got 0"),
    ({"min_time": -1.0}, r"min_time must be"),
    ({"min_time": math.inf}, r"min_time must be"),
    ({"min_time": "1"}, r"min_time must be"),
    ({"rotate": 0}, r"rotate must be an int >= 1, got 0"),
    ({"batch_size": 0}, r"batch_size must be an int >= 1 or None, got 0"),
    ({"iters": 5, "min_time": 1.0}, r"give iters or min_time, not both"),
    ({"name": 3}, r"name must be a str or None"),
    ({"device": "tpu"}, r"device must be 'cpu', 'cuda', 'cuda:N' or None, got 'tpu'"),
    ({"device": 1.5}, r"device must be"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        benchmark(lambda: None, **kwargs)


def test_fn_must_be_callable() -> None:
    with pytest.raises(ValueError, match=r"fn must be callable .* got 3"):
        benchmark(3)  # type: ignore[arg-type]


def test_cuda_requested_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device is 'cuda' but CUDA is not available"):
        benchmark(lambda: None, iters=1, device="cuda")


def test_cuda_requested_asks_the_device_interface(fake_cuda: FakeCuda) -> None:
    fake_cuda.initialized = False  # the application never touched CUDA ...
    fake_cuda.available = False  # ... and there is no GPU
    with pytest.raises(ValueError, match=r"device is 'cuda' but CUDA is not available"):
        benchmark(lambda: None, iters=1, device="cuda")
    fake_cuda.available = True  # a GPU the application has not used yet: timed on it

    def step() -> None:
        fake_cuda.launch(2.0)

    r = benchmark(step, warmup=0, iters=2, device="cuda")
    assert (r.device, r.times_ms) == ("cuda", (2.0, 2.0))


@pytest.mark.parametrize(("fns", "kwargs", "match"), [
    ({}, {}, r"fns must be a non-empty mapping"),
    ([("a", print)], {}, r"fns must be a non-empty mapping"),
    ({"a": 1}, {}, r"fns\['a'\] must be callable, got 1"),
    ({1: print}, {}, r"fns keys must be str names, got 1"),
    ({"a": print}, {"rounds": 0}, r"rounds must be an int >= 1, got 0"),
    ({"a": print}, {"baseline": "b"}, r"baseline must be one of \['a'\], got 'b'"),
    ({"a": print}, {"iters": 2, "min_time": 0.1}, r"give iters or min_time, not both"),
    ({"a": print}, {"warmup": -2}, r"warmup must be an int >= 0"),
])
def test_compare_bad_arguments(fns: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compare(fns, **kwargs)


def test_speedup_of_an_unknown_name(clock: FakeClock) -> None:
    c = compare({"a": lambda: clock.spend(1.0)}, iters=2)
    with pytest.raises(ValueError, match=r"name must be one of \['a'\], got 'z'"):
        c.speedup("z")


# -- compare -------------------------------------------------------------------------------------
def test_compare_interleaves_in_rotating_order() -> None:
    order: list[str] = []
    fns = {n: functools.partial(order.append, n) for n in "abc"}
    c = compare(fns, warmup=1, iters=6, rounds=3)
    assert "".join(order) == "abc" + "aabbcc" + "bbccaa" + "ccaabb"
    assert all(r.iters == 6 and r.warmup == 1 for r in c.results.values())


def test_compare_spreads_uneven_iters_over_rounds() -> None:
    order: list[str] = []
    fns = {n: functools.partial(order.append, n) for n in "ab"}
    c = compare(fns, warmup=0, iters=5, rounds=3)
    assert "".join(order) == "aabb" + "bbaa" + "ab"
    assert [r.iters for r in c.results.values()] == [5, 5]


def test_compare_gives_every_variant_the_same_inputs() -> None:
    x = torch.randn(8)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    fns = {n: functools.partial(lambda name, t: seen[name].append(id(t)), n) for n in seen}
    compare(fns, x, warmup=2, iters=9, rounds=3, rotate=4)
    assert seen["a"] == seen["b"]
    assert len(set(seen["a"])) == 4


def test_compare_min_time_gives_each_variant_at_least_three_calls(clock: FakeClock) -> None:
    c = compare({"a": lambda: clock.spend(500.0), "b": lambda: clock.spend(1.0)},
                warmup=0, min_time=0.02, rounds=5)
    assert c.results["a"].iters == 5  # one per round (at least 3 in all)
    assert c.results["b"].iters == 20  # 4 ms per round at 1 ms a call


def test_speedup_math_and_fastest(clock: FakeClock) -> None:
    fns = {"slow": lambda: clock.spend(4.0), "fast": lambda: clock.spend(2.0),
           "same": lambda: clock.spend(4.0)}
    c = compare(fns, warmup=1, iters=5, rounds=5, batch_size=10)
    assert c.baseline == "slow"
    assert c.fastest == "fast"
    assert c.speedup("slow") == 1.0
    assert c.speedup("same") == 1.0
    assert c.speedup("fast") == pytest.approx(2.0)
    assert c.results["fast"].samples_per_s == pytest.approx(5000.0)
    c2 = compare(fns, warmup=0, iters=2, rounds=1, baseline="fast")
    assert c2.speedup("slow") == pytest.approx(0.5)


def test_table_lists_every_variant_aligned(clock: FakeClock,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    fns = {"eager fp32": lambda: clock.spend(12.5), "compiled": lambda: clock.spend(5.0),
           "bf16": lambda: clock.spend(10.0)}
    c = compare(fns, warmup=0, iters=4, rounds=2, batch_size=16, show=True)
    printed = capsys.readouterr().out
    assert printed == c.table() + "\n"
    assert str(c) == c.table()
    lines = c.table().splitlines()
    header, rows = lines[0], lines[2:5]
    assert header.split() == ["variant", "median", "ms", "p95", "ms", "spread", "samples/s",
                              "speedup", "iters"]
    assert set(lines[1]) == {"-"}
    for name, row in zip(fns, rows, strict=True):
        assert row.startswith(name)
    assert rows[0].endswith("1.00x      4  <- baseline")
    assert rows[1].endswith("2.50x      4  <- fastest")
    assert "1.25x" in rows[2]
    assert "<-" not in rows[2]
    assert "12.500" in rows[0]
    assert "1,280" in rows[0]
    assert "3,200" in rows[1]
    end = header.index("median ms") + len("median ms")  # numbers right-aligned under headers
    assert all(row[end - 6:end] in ("12.500", " 5.000", "10.000") for row in rows)
    assert "device: cpu" in lines[-1]


def test_table_of_one_variant_marks_only_the_baseline(clock: FakeClock) -> None:
    c = compare({"only": lambda: clock.spend(1.0)}, warmup=0, iters=2, rounds=1)
    assert c.table().splitlines()[2].endswith("<- baseline")
    assert isinstance(c, Comparison)
    assert list(c.results) == ["only"]


# -- device timing on the fake GPU ---------------------------------------------------------------
def test_cuda_inputs_are_timed_with_events_and_one_sync(fake_cuda: FakeCuda) -> None:
    x = FakeCudaTensor(torch.randn(4, 4))
    seen: list[Any] = []

    def step(t: torch.Tensor) -> None:
        seen.append(t)
        fake_cuda.launch(2.0)

    r = benchmark(step, x, warmup=3, iters=8, batch_size=16)
    assert r.device == "cuda"
    assert r.times_ms == (2.0,) * 8
    assert r.median_ms == 2.0
    assert r.p99_ms == 2.0
    assert r.samples_per_s == pytest.approx(16 / 0.002)
    assert fake_cuda.sync_calls == ["Event.synchronize"]  # once, after the timed loop
    assert fake_cuda.events_created == 16
    assert all(isinstance(t, FakeCudaTensor) for t in seen)  # the rotated copies stay on device
    assert len({id(t) for t in seen}) == 4


def test_cuda_event_times_follow_the_gpu_not_the_host(fake_cuda: FakeCuda) -> None:
    work = iter([1.0, 3.0, 2.0, 5.0, 4.0])

    def step(t: torch.Tensor) -> None:
        fake_cuda.launch(next(work))
        time.sleep(0.001)  # host time does not count: only the events do

    r = benchmark(step, FakeCudaTensor(torch.zeros(1)), warmup=0, iters=5)
    assert r.times_ms == (1.0, 3.0, 2.0, 5.0, 4.0)
    assert (r.median_ms, r.min_ms, r.mean_ms) == (3.0, 1.0, 3.0)
    assert r.p95_ms == pytest.approx(4.8)


def test_device_choice(fake_cuda: FakeCuda) -> None:
    def step(*args: Any) -> None:
        fake_cuda.launch(1.0)

    assert benchmark(step, iters=2).device == "cuda"  # no tensor inputs, CUDA in use
    assert benchmark(step, torch.zeros(2), iters=2).device == "cpu"  # inputs on the host
    assert benchmark(step, FakeCudaTensor(torch.zeros(2)), iters=2, device="cpu").device == "cpu"
    assert benchmark(step, torch.zeros(2), iters=2, device="cuda:0").device == "cuda"
    fake_cuda.initialized = False  # the application never touched CUDA
    assert benchmark(step, iters=2).device == "cpu"


def test_peak_memory_from_the_device_counters(fake_cuda: FakeCuda) -> None:
    fake_cuda.alloc(1 * MiB)  # held by the application all along
    fake_cuda.alloc(8 * MiB)  # an earlier peak, before the benchmark
    fake_cuda.free(8 * MiB)

    def step(t: torch.Tensor) -> None:
        fake_cuda.alloc(3 * MiB)
        fake_cuda.launch(1.0)
        fake_cuda.free(3 * MiB)

    r = benchmark(step, FakeCudaTensor(torch.zeros(2)), warmup=1, iters=3)
    assert r.peak_memory_bytes == 4 * MiB  # reset before the timed loop
    assert "peak 4.0 MiB" in str(r)
    assert benchmark(lambda t: None, torch.zeros(1), iters=1).peak_memory_bytes is None


def test_compare_on_the_fake_gpu(fake_cuda: FakeCuda) -> None:
    def variant(ms: float, mib: int) -> Any:
        def step(t: torch.Tensor) -> None:
            fake_cuda.alloc(mib * MiB)
            fake_cuda.launch(ms)
            fake_cuda.free(mib * MiB)
        return step

    c = compare({"eager": variant(6.0, 2), "graphs": variant(2.0, 5)},
                FakeCudaTensor(torch.zeros(2)), warmup=2, iters=10, rounds=5)
    assert fake_cuda.sync_calls == ["Event.synchronize"]  # one for the whole comparison
    assert c.results["eager"].times_ms == (6.0,) * 10
    assert c.results["graphs"].median_ms == 2.0
    assert c.speedup("graphs") == pytest.approx(3.0)
    assert c.results["eager"].peak_memory_bytes == 2 * MiB
    assert c.results["graphs"].peak_memory_bytes == 5 * MiB
    table = c.table()
    assert "peak MiB" in table
    assert "device: cuda" in table


# -- docs ----------------------------------------------------------------------------------------
def test_module_docstring_example_runs() -> None:
    result = doctest.testmod(perfsdk.bench, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
