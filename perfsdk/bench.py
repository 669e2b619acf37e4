"""Benchmark harness: time a callable the way a careful person would, and compare variants.

:func:`benchmark` warms up, then times each call (CUDA events through perfsdk's device interface
on a GPU, ``time.perf_counter_ns`` on the CPU), cycling through copies of the tensor inputs so
caches cannot flatter it: median, p95, p99, spread, samples/s, peak memory. :func:`compare` runs
variants interleaved in one process, so drift hits all alike, and prints the comparison table.
:func:`compare_runs` compares two saved runs (``perfsdk run``'s) region by region, with
confidence intervals, as a regression gate; :func:`compare_samples` does it for two lists of
times (both from :mod:`perfsdk.compare`).

Example:
    >>> import torch
    >>> from perfsdk.bench import benchmark, compare
    >>> x = torch.randn(32, 32)
    >>> r = benchmark(torch.mm, x, x, warmup=1, iters=5, batch_size=32)
    >>> r.device, len(r.times_ms), r.median_ms > 0, r.samples_per_s > 0
    ('cpu', 5, True, True)
    >>> c = compare({"mm": torch.mm, "matmul": torch.matmul}, x, x, warmup=1, iters=6, rounds=3)
    >>> c.baseline, c.speedup("mm"), sorted(c.results)
    ('mm', 1.0, ['matmul', 'mm'])
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from perfsdk import _device
from perfsdk.compare import RegionComparison, RunComparison, compare_runs, compare_samples
from perfsdk.export.summary import percentile

__all__ = ["BenchResult", "Comparison", "RegionComparison", "RunComparison", "benchmark",
           "compare", "compare_runs", "compare_samples"]

_DEFAULT_MIN_TIME = 1.0  # seconds, when neither iters nor min_time is given
_MIN_TIME_ITERS = 3  # min_time mode times at least this many calls
_MAX_ITERS = 100_000  # min_time mode stops here even if min_time has not passed
_now_ns = time.perf_counter_ns  # the host clock (tests swap it)


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What :func:`benchmark` measured (times in milliseconds).

    Attributes:
        name: The function's name, or the name given.
        times_ms: One time per timed call, in the order they ran.
        median_ms, p95_ms, p99_ms, min_ms, mean_ms: Statistics of ``times_ms`` (percentiles
            by linear interpolation).
        spread: ``(p90 - p10) / median``: the relative width of the middle 80%.
        samples_per_s: ``batch_size`` / median seconds; None without ``batch_size``.
        peak_memory_bytes: Peak CUDA memory allocated during the timed calls; None on the CPU.
        device: ``"cpu"`` (host clock) or ``"cuda"`` (CUDA events).
        warmup, iters: Untimed calls made first; timed calls.
    """

    name: str
    times_ms: tuple[float, ...]
    median_ms: float
    p95_ms: float
    p99_ms: float
    min_ms: float
    mean_ms: float
    spread: float
    samples_per_s: float | None
    peak_memory_bytes: int | None
    device: str
    warmup: int
    iters: int

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (``times_ms`` as a list), ready for JSON."""
        return {**dataclasses.asdict(self), "times_ms": list(self.times_ms)}

    def __str__(self) -> str:
        text = (f"{self.name}: median {_ms(self.median_ms)} ms, p95 {_ms(self.p95_ms)} ms, "
                f"spread {self.spread:.1%}, {self.iters} iters on {self.device}")
        if self.samples_per_s is not None:
            text += f", {_rate(self.samples_per_s)} samples/s"
        if self.peak_memory_bytes is not None:
            text += f", peak {_mib(self.peak_memory_bytes)} MiB"
        return text


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The results of :func:`compare`, keyed by variant name, and which one is the baseline."""

    results: dict[str, BenchResult]
    baseline: str

    @property
    def fastest(self) -> str:
        """The name of the variant with the lowest median."""
        return min(self.results, key=lambda n: self.results[n].median_ms)

    def speedup(self, name: str) -> float:
        """Baseline median / ``name``'s median (above 1: ``name`` is faster)."""
        if name not in self.results:
            raise ValueError(f"name must be one of {sorted(self.results)}, got {name!r}")
        base, this = self.results[self.baseline].median_ms, self.results[name].median_ms
        if this > 0:
            return base / this
        return 1.0 if base == 0 else math.inf

    def table(self) -> str:
        """An aligned text table: one row per variant, fastest marked, device in the footer."""
        with_memory = any(r.peak_memory_bytes is not None for r in self.results.values())
        header = ["variant", "median ms", "p95 ms", "spread", "samples/s", "speedup", "iters"]
        if with_memory:
            header.append("peak MiB")
        fastest = self.fastest if len(self.results) > 1 else None
        rows: list[list[str]] = []
        scale = min(r.median_ms for r in self.results.values())  # one precision per column
        for name, r in self.results.items():
            row = [name, _ms(r.median_ms, scale), _ms(r.p95_ms, scale), f"{r.spread:.1%}",
                   _rate(r.samples_per_s), f"{self.speedup(name):.2f}x", str(r.iters)]
            if with_memory:
                row.append(_mib(r.peak_memory_bytes))
            notes = {"baseline": name == self.baseline, "fastest": name == fastest}
            rows.append([*row, ", ".join(n for n, on in notes.items() if on)])
        widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:  # name left, numbers right, then the notes
            body = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=False)]
            note = f"<- {cells[-1]}" if len(cells) > len(header) and cells[-1] else ""
            return "  ".join([cells[0].ljust(widths[0]), *body[:len(header) - 1], note]).rstrip()

        lines = [line(header), "-" * len(line(header)), *(line(r) for r in rows)]
        first = next(iter(self.results.values()))
        lines.append(f"device: {first.device}; warm-up {first.warmup} calls per variant; "
                     f"speedup = {self.baseline} median / median")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def benchmark(fn: Callable[..., Any], *inputs: Any, warmup: int = 3, iters: int | None = None,
              min_time: float | None = None, batch_size: int | None = None, rotate: int = 4,
              name: str | None = None, device: str | torch.device | None = None) -> BenchResult:
    """Time ``fn(*inputs)``: warm-up, then ``iters`` timed calls or calls for ``min_time`` s.

    Args:
        fn: What to time; called as ``fn(*inputs)``. Its return value is discarded.
        *inputs: Positional arguments. Tensors in them (also inside tuples, lists and dicts)
            are cloned ``rotate - 1`` times and the sets are cycled call by call.
        warmup: Untimed calls made first (compilation, autotuning, allocator warm-up).
        iters: Number of timed calls. Give ``iters`` or ``min_time``, not both.
        min_time: Keep calling until this many seconds have passed (at least 3 calls, at most
            100,000), checking the clock between calls. The default when neither is given: 1 s.
        batch_size: Samples per call; gives ``samples_per_s``.
        rotate: Number of input sets to cycle through (1: the inputs as given, every call).
        name: The result's name; defaults to ``fn``'s ``__name__`` (or its class name).
        device: ``"cpu"``: host clock. ``"cuda"``: CUDA events on the current stream, one sync
            at the end; peak memory (resets torch's peak counter). None: ``"cuda"`` if an input
            tensor is on a GPU, or no input is a tensor and the app has initialized CUDA.

    Returns:
        The :class:`BenchResult`.

    Raises:
        ValueError: An argument is out of range (the message names it and what is accepted).
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function, module or method), got {fn!r}")
    iters, min_time = _check_plan(warmup, iters, min_time, batch_size, rotate)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a str or None, got {name!r}")
    name = name if name is not None else str(getattr(fn, "__name__", type(fn).__name__))
    timing = _Timing(inputs, device)
    run = _Run(name, fn, _input_sets(inputs, rotate), timing)
    run.call(warmup)
    gc.collect()
    run.timed(iters, min_time, _MIN_TIME_ITERS, _MAX_ITERS)
    timing.finish([run])
    return run.result(warmup, batch_size)


def compare(fns: Mapping[str, Callable[..., Any]], *inputs: Any, warmup: int = 3,
            iters: int | None = None, min_time: float | None = None,
            batch_size: int | None = None, rounds: int = 5, baseline: str | None = None,
            show: bool = False, rotate: int = 4,
            device: str | torch.device | None = None) -> Comparison:
    """Benchmark several variants on the same inputs, interleaved, and compare them.

    All are warmed up first; then in each of ``rounds`` rounds every variant runs its share
    (``iters / rounds`` calls or ``min_time / rounds`` s), the order rotating by one each round,
    so drift and "who ran first" effects spread over all. All see the same input sets.

    Args:
        fns: ``{name: fn}``; each is called as ``fn(*inputs)``.
        *inputs, warmup, batch_size, rotate, device: As in :func:`benchmark` (per variant).
        iters: Timed calls per variant, in total. Give ``iters`` or ``min_time``, not both.
        min_time: Seconds per variant, in total (default 1 s when neither is given).
        rounds: Number of interleaved rounds.
        baseline: The name speedups are relative to; defaults to the first in ``fns``.
        show: Print the table.

    Returns:
        The :class:`Comparison` (``str()`` of it is the table).

    Raises:
        ValueError: An argument is out of range (the message names it and what is accepted).
    """
    if not isinstance(fns, Mapping) or not fns:
        raise ValueError(f"fns must be a non-empty mapping of name to callable, got {fns!r}")
    for key, fn in fns.items():
        if not isinstance(key, str):
            raise ValueError(f"fns keys must be str names, got {key!r}")
        if not callable(fn):
            raise ValueError(f"fns[{key!r}] must be callable, got {fn!r}")
    iters, min_time = _check_plan(warmup, iters, min_time, batch_size, rotate)
    _check_int("rounds", rounds, 1)
    if baseline is None:
        baseline = next(iter(fns))
    elif baseline not in fns:
        raise ValueError(f"baseline must be one of {list(fns)}, got {baseline!r}")
    timing = _Timing(inputs, device)
    sets = _input_sets(inputs, rotate)
    runs = [_Run(key, fn, sets, timing) for key, fn in fns.items()]
    for run in runs:
        run.call(warmup)
    gc.collect()
    seconds = None if min_time is None else min_time / rounds
    least = -(-_MIN_TIME_ITERS // rounds)  # min_time mode: at least 3 calls in all
    for r in range(rounds):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            share = None if iters is None else iters // rounds + (r < iters % rounds)
            if share != 0:
                run.timed(share, seconds, least, _MAX_ITERS // rounds)
    timing.finish(runs)
    comparison = Comparison({run.name: run.result(warmup, batch_size) for run in runs}, baseline)
    if show:
        print(comparison.table())
    return comparison


# -- internals -----------------------------------------------------------------------------------
class _Timing:
    """Where the work runs, and the clock that times it (host counter or CUDA events)."""

    def __init__(self, inputs: tuple[Any, ...], device: str | torch.device | None) -> None:
        self.where: torch.device | None = None  # for the memory counters
        self.device = self._resolve(inputs, device)
        self.backend = _device.get_backend() if self.device == "cuda" else None
        self.last_end: Any = None  # the end event recorded last, the one to synchronize

    def _resolve(self, inputs: tuple[Any, ...], device: str | torch.device | None) -> str:
        tensors = list(_tensors(inputs))
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        self.where = cuda[0] if cuda else None
        if device is None:  # inputs on a GPU, or no tensor inputs in an app using CUDA
            return "cuda" if (cuda or not tensors) and _device.active() is not None else "cpu"
        kind = str(device).split(":")[0] if isinstance(device, (str, torch.device)) else None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r}")
        if (kind == "cuda" and _device.active() is None
                and not _device.get_backend().is_available()):
            raise ValueError("device is 'cuda' but CUDA is not available; use 'cpu' or None")
        if kind == "cuda" and ":" in str(device):
            self.where = torch.device(device)
        return kind

    def finish(self, runs: list[_Run]) -> None:
        """One synchronization (the last end event), then every call's device time."""
        if self.last_end is not None:
            self.last_end.synchronize()
        for run in runs:
            run.times.extend(start.elapsed_time(end) for start, end in run.events)
            run.events.clear()


class _Run:
    """One variant: its function, its turn through the input sets, and its times so far."""

    def __init__(self, name: str, fn: Callable[..., Any], sets: list[tuple[Any, ...]],
                 timing: _Timing) -> None:
        self.name, self.fn, self.sets, self.timing = name, fn, sets, timing
        self.next_set = 0
        self.times: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        self.peak: int | None = None

    def _args(self) -> tuple[Any, ...]:
        args = self.sets[self.next_set]
        self.next_set = (self.next_set + 1) % len(self.sets)
        return args

    def call(self, n: int) -> None:
        for _ in range(n):
            self.fn(*self._args())

    def timed(self, iters: int | None, seconds: float | None, least: int, most: int) -> None:
        """Time ``iters`` calls, or calls until ``seconds`` pass (``least``..``most`` calls)."""
        fn, backend, where, now = self.fn, self.timing.backend, self.timing.where, _now_ns
        if backend is not None:
            backend.reset_peak_memory_stats(where)
        deadline = now() + int(seconds * 1e9) if seconds is not None else 0
        n = 0
        while n < iters if iters is not None else n < least or (n < most and now() < deadline):
            args = self._args()
            if backend is None:
                t0 = now()
                fn(*args)
                t1 = now()
                self.times.append((t1 - t0) / 1e6)
            else:
                start = backend.Event(enable_timing=True)
                end = backend.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                self.events.append((start, end))
                self.timing.last_end = end
            n += 1
        if backend is not None:
            self.peak = max(self.peak or 0, backend.max_memory_allocated(where))

    def result(self, warmup: int, batch_size: int | None) -> BenchResult:
        times = sorted(self.times)
        median = percentile(times, 50)
        samples = None if batch_size is None else batch_size * 1e3 / median if median else math.inf
        spread = (percentile(times, 90) - percentile(times, 10)) / median if median > 0 else 0.0
        return BenchResult(
            name=self.name, times_ms=tuple(self.times), median_ms=median,
            p95_ms=percentile(times, 95), p99_ms=percentile(times, 99), min_ms=times[0],
            mean_ms=math.fsum(times) / len(times), spread=spread, samples_per_s=samples,
            peak_memory_bytes=self.peak, device=self.timing.device, warmup=warmup,
            iters=len(times))


def _check_int(arg: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        accepted = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{arg} must be {accepted}, got {value!r}")


def _check_plan(warmup: Any, iters: Any, min_time: Any, batch_size: Any,
                rotate: Any) -> tuple[int | None, float | None]:
    """Validate the shared arguments; returns (iters, min_time) with the default filled in."""
    _check_int("warmup", warmup, 0)
    _check_int("iters", iters, 1, optional=True)
    _check_int("batch_size", batch_size, 1, optional=True)
    _check_int("rotate", rotate, 1)
    number = isinstance(min_time, (int, float)) and not isinstance(min_time, bool)
    if min_time is not None and not (number and math.isfinite(min_time) and min_time > 0):
        raise ValueError(f"min_time must be a number of seconds > 0 or None, got {min_time!r}")
    if iters is not None and min_time is not None:
        raise ValueError(f"give iters or min_time, not both: {iters=}, {min_time=}")
    return iters, None if iters is not None else float(min_time or _DEFAULT_MIN_TIME)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (tensors, and tuples / lists / dicts of them, nested)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(item)


def _clone(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an equal copy (containers keep their type)."""
    if isinstance(obj, torch.Tensor):
        out = obj.detach().clone()
        return out.requires_grad_(True) if obj.requires_grad else out
    if isinstance(obj, (list, dict)):
        copied = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict, list subclass)
        for key in range(len(obj)) if isinstance(obj, list) else obj:
            copied[key] = _clone(obj[key])
        return copied
    if isinstance(obj, tuple):
        items = [_clone(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # namedtuple
    return obj


def _input_sets(inputs: tuple[Any, ...], rotate: int) -> list[tuple[Any, ...]]:
    """``rotate`` argument tuples: the inputs as given, then ``rotate - 1`` clones of them."""
    if not any(True for _ in _tensors(inputs)):
        return [inputs]
    with torch.no_grad():
        return [inputs, *(tuple(_clone(x) for x in inputs) for _ in range(rotate - 1))]


def _ms(value: float, scale: float | None = None) -> str:
    scale = value if scale is None else scale
    return f"{value:.{4 if scale < 1 else 3 if scale < 10 else 2 if scale < 100 else 1}f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f}"
