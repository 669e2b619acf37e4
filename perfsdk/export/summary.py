"""The in-process summary: count, total, mean and p50/p95/p99 of host and device time per region,
and for steps given their FLOPs (``perfsdk.step(flops=...)``) the achieved FLOP/s and MFU.

Each name keeps at most ``RESERVOIR`` samples (uniform reservoir sampling beyond that), so a
million-step run uses bounded memory while count, total and mean stay exact.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from perfsdk.config import extensions_enabled
from perfsdk.record import ATTRS, DEVICE_MS, ERROR, SPEC, SPECS, T0, T1

__all__ = ["RegionStats", "Summary", "SummarySink", "format_flops", "format_mfu"]

RESERVOIR = 10_000


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class RegionStats:
    """One row of the summary (milliseconds). Device fields are None without device timings."""

    name: str
    count: int
    errors: int
    total_ms: float
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    device_count: int = 0
    device_total_ms: float | None = None
    device_mean_ms: float | None = None
    device_p50_ms: float | None = None
    device_p95_ms: float | None = None
    device_p99_ms: float | None = None
    syncs: int = 0
    """Host-device syncs that a ``no_sync_guard`` saw inside this region (all calls)."""
    flops_per_s: float | None = None
    """Achieved FLOP/s over the calls that had ``perfsdk.flops_per_s`` (steps given ``flops``):
    their FLOPs over their host time; None without any."""
    mfu: float | None = None
    """Model FLOPs utilization, 0..1, over the calls that had ``perfsdk.mfu``, weighted by
    their host time; None without any."""


class _Series:
    """Count, total and a uniform sample of at most :data:`RESERVOIR` values.

    Past the reservoir's size, Li's "Algorithm L" (ACM TOMS 20(4), 1994) draws how many values
    to skip before the next one replaces a random slot, so the common ``add`` is two additions
    and a comparison, with no random number (drawing one per value, as Algorithm R does, cost
    more than the rest of a record's summary on the pipeline thread). The draws count the
    values offered (``seen``), not the calls counted without one (:meth:`add_unsampled`)."""

    __slots__ = ("count", "next", "rng", "samples", "seen", "total", "w")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.seen = 0
        """Values offered to the reservoir (``count`` less the calls counted without one)."""
        self.samples: list[float] = []
        self.rng = random.Random(0)
        self.w = 1.0
        self.next = 0
        """The value (by ``seen``) that next enters the full reservoir."""

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.seen = seen = self.seen + 1
        if seen <= RESERVOIR:
            self.samples.append(value)
            if seen == RESERVOIR:
                self.w = 1.0
                self._skip()
        elif seen == self.next:
            self.samples[int(self.rng.random() * RESERVOIR)] = value
            self._skip()

    def add_many(self, values: list[float]) -> None:
        """:meth:`add` each of ``values`` in turn, with the same samples, count and draws:
        the values before the reservoir is full go in as one slice, and past that only the
        values that enter it cost a step each (the skips between them are counted, not
        walked). The total is ``sum()``'s, which Python 3.12 and later compensate: it can
        differ from adding one at a time in the last digits, towards the exact sum."""
        n = len(values)
        self.count += n
        self.total = sum(values, self.total)
        seen, i = self.seen, 0
        if seen < RESERVOIR:
            i = min(n, RESERVOIR - seen)
            self.samples += values[:i] if i < n else values
            seen += i
            if seen == RESERVOIR:
                self.seen = seen
                self.w = 1.0
                self._skip()
        while i < n:
            j = i + self.next - seen - 1  # the value that makes seen self.next (next > seen)
            if j >= n:
                seen += n - i
                break
            self.samples[int(self.rng.random() * RESERVOIR)] = values[j]
            self.seen = seen = self.next
            self._skip()
            i = j + 1
        self.seen = seen

    def _skip(self) -> None:
        """Draw the next value (by ``seen``) that enters the reservoir."""
        rng = self.rng
        self.w *= math.exp(math.log(1.0 - rng.random()) / RESERVOIR)
        w = min(self.w, 1.0 - 1e-16)
        self.next = self.seen + int(math.log(1.0 - rng.random()) / math.log1p(-w)) + 1

    def add_unsampled(self, count: int, total: float) -> None:
        """Calls that count in ``count`` and ``total`` but left no sample for percentiles (the
        reservoir's draws go on as if they had not been: they were never offered)."""
        self.count += count
        self.total += total


class _Acc:
    __slots__ = ("device", "errors", "flops", "host", "syncs")

    def __init__(self) -> None:
        self.host = _Series()
        self.device = _Series()
        self.errors = 0
        self.syncs = 0
        self.flops: list[float] | None = None
        """[FLOPs, seconds, MFU x seconds, seconds with an MFU] of the calls with a FLOP rate."""

    def add_flops(self, attrs: dict[str, Any], seconds: float) -> None:
        flops = self.flops
        if flops is None:
            flops = self.flops = [0.0, 0.0, 0.0, 0.0]
        flops[0] += attrs["perfsdk.flops_per_s"] * seconds
        flops[1] += seconds
        mfu = attrs.get("perfsdk.mfu")
        if mfu is not None:
            flops[2] += mfu * seconds
            flops[3] += seconds

    def flop_rates(self) -> tuple[float | None, float | None]:
        flops = self.flops
        if flops is None or flops[1] <= 0:
            return None, None
        return flops[0] / flops[1], (flops[2] / flops[3] if flops[3] > 0 else None)


@dataclasses.dataclass(frozen=True)
class Summary:
    """The summary table: iterate it, index it by name, or ``print`` it."""

    rows: tuple[RegionStats, ...]
    sync_sites: tuple[Any, ...] = ()
    """Every host-device sync a ``no_sync_guard`` recorded (``perfsdk.SyncSite``), most
    frequent first."""

    def __iter__(self) -> Iterator[RegionStats]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> RegionStats:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(row.name == name for row in self.rows)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(row) for row in self.rows]

    def __str__(self) -> str:
        text = render(self.rows)
        if self.sync_sites:
            from perfsdk.sync.report import render as render_syncs

            text += "\n\n" + render_syncs(self.sync_sites)
        return text


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value >= 100:
        return f"{value:,.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_flops(value: float, unit: str = "FLOP/s") -> str:
    """A FLOP count or rate with an SI prefix: ``312.5 TFLOP/s``, ``1.2 GFLOP``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def format_mfu(value: float) -> str:
    """MFU (0..1) as a percentage, with two significant digits below 1%: ``41.3%``, ``0.032%``."""
    percent = 100 * value
    return f"{percent:.1f}%" if percent >= 1 else f"{percent:.2g}%"


def render(rows: Sequence[RegionStats]) -> str:
    """A plain-text table, widest region first; device columns only when there are timings,
    FLOP/s and MFU columns only when a region (a step given ``flops``) has them."""
    if not rows:
        return "perfsdk summary: no regions recorded yet."
    device = any(r.device_count for r in rows)
    syncs = any(r.syncs for r in rows)
    flops = any(r.flops_per_s is not None for r in rows)
    headers = ["region", "calls", "errors", "total ms", "mean ms", "p50 ms", "p95 ms", "p99 ms"]
    if device:
        headers += ["gpu total ms", "gpu mean ms", "gpu p50", "gpu p95", "gpu p99"]
    if syncs:
        headers.append("syncs")
    if flops:
        headers += ["FLOP/s", "MFU"]
    body = []
    for r in rows:
        line = [r.name, f"{r.count:,}", f"{r.errors:,}" if r.errors else "", _ms(r.total_ms),
                _ms(r.mean_ms), _ms(r.p50_ms), _ms(r.p95_ms), _ms(r.p99_ms)]
        if device:
            line += [_ms(r.device_total_ms), _ms(r.device_mean_ms), _ms(r.device_p50_ms),
                     _ms(r.device_p95_ms), _ms(r.device_p99_ms)]
        if syncs:
            line.append(f"{r.syncs:,}" if r.syncs else "")
        if flops:
            line += [format_flops(r.flops_per_s, "") if r.flops_per_s is not None else "",
                     format_mfu(r.mfu) if r.mfu is not None else ""]
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(fmt(headers))
    return "\n".join([fmt(headers), rule, *(fmt(b) for b in body)])


def _host_times_python(records: list[Any], spec: int, t0: int, t1: int, device_ms: int,
                       error: int, attrs: int, keys: tuple[str, ...],
                       ) -> tuple[dict[int, list[float]], list[Any]]:
    """``({spec index: [host ms, ...]}, [records with a device time, an error or one of
    ``keys`` among their attributes])``, in the records' order: the summary's pass over a chunk
    of records (the twin of the compiled ``perfsdk._fastpath.host_times``)."""
    host: dict[int, list[float]] = {}
    more: list[Any] = []
    wanted = frozenset(keys)
    for rec in records:
        times = host.get(rec[spec])
        if times is None:
            times = host[rec[spec]] = []
        times.append((rec[t1] - rec[t0]) / 1e6)
        if rec[device_ms] is not None or rec[error] is not None or (
                rec[attrs] is not None and not wanted.isdisjoint(rec[attrs])):
            more.append(rec)
    return host, more


_MORE_KEYS = ("perfsdk.syncs", "perfsdk.flops_per_s")
"""The attributes the summary reads (a record with neither needs only its host time)."""


host_times: Callable[..., tuple[dict[int, list[float]], list[Any]]] = _host_times_python
"""The summary's pass over a chunk of records: ``perfsdk._fastpath.host_times`` where it is
built, else :func:`_host_times_python` (the whole sink, ``benchmarks/summary_cost.py``: 163 ns
a record with the compiled pass, 250 with the Python one, 287 before either)."""
if extensions_enabled():
    try:  # optional: built at install where a C compiler is found
        import perfsdk._fastpath as _fastpath

        host_times = _fastpath.host_times
    except ImportError:
        pass


class SummarySink:
    """Aggregates resolved regions by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acc: dict[str, _Acc] = {}
        self._by_spec: dict[int, _Acc] = {}
        """The same accumulators by spec index (specs of one name share theirs)."""

    def _acc_of(self, index: int) -> _Acc:
        name = SPECS[index].name
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = _Acc()
        self._by_spec[index] = acc
        return acc

    def consume(self, records: list[Any]) -> None:
        # Host times grouped by spec first (compiled where perfsdk._fastpath is built), then
        # added a group at a time (_Series.add_many); the few records with more to say (a
        # device time, an error, attributes) go round again.
        host, more = host_times(records, SPEC, T0, T1, DEVICE_MS, ERROR, ATTRS, _MORE_KEYS)
        with self._lock:
            by_spec = self._by_spec
            for index, times in host.items():
                acc = by_spec.get(index)
                if acc is None:
                    acc = self._acc_of(index)
                acc.host.add_many(times)
            for rec in more:
                self._add_more(by_spec[rec[SPEC]], rec)

    @staticmethod
    def _add_more(acc: _Acc, rec: Any) -> None:
        """A record's device time, error, syncs and FLOP rate (beyond its host time)."""
        device_ms = rec[DEVICE_MS]
        if device_ms is not None:
            acc.device.add(device_ms)
        if rec[ERROR] is not None:
            acc.errors += 1
        attrs = rec[ATTRS]
        if attrs:
            if "perfsdk.syncs" in attrs:
                acc.syncs += int(attrs["perfsdk.syncs"])
            if "perfsdk.flops_per_s" in attrs:
                acc.add_flops(attrs, (rec[T1] - rec[T0]) / 1e9)

    def tally(self, overflow: dict[int, list[int]]) -> None:
        """Regions the pipeline could not queue (``{spec index: [calls, host ns, errors]}``):
        their count, total and errors still reach the table (percentiles are of the rest)."""
        specs = SPECS
        with self._lock:
            for index, (calls, host_ns, errors) in overflow.items():
                name = specs[index].name
                acc = self._acc.get(name)
                if acc is None:
                    acc = self._acc[name] = _Acc()
                acc.host.add_unsampled(calls, host_ns / 1e6)
                acc.errors += errors

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        pass

    def after_fork(self) -> None:
        """A new lock (the parent's may have been held by its pipeline thread at the fork)
        and an empty table."""
        self._lock = threading.Lock()
        self._acc = {}
        self._by_spec = {}

    def reset(self) -> None:
        with self._lock:
            self._acc.clear()
            self._by_spec.clear()

    def snapshot(self) -> Summary:
        with self._lock:
            items = [(name, acc.host.count, acc.host.total, sorted(acc.host.samples), acc.errors,
                      acc.device.count, acc.device.total, sorted(acc.device.samples), acc.syncs,
                      acc.flop_rates())
                     for name, acc in self._acc.items()]
        rows = []
        for name, count, total, host, errors, dcount, dtotal, dev, syncs, rates in items:
            rows.append(RegionStats(
                name=name, count=count, errors=errors, total_ms=total, mean_ms=total / count,
                p50_ms=percentile(host, 50), p95_ms=percentile(host, 95),
                p99_ms=percentile(host, 99), device_count=dcount,
                device_total_ms=dtotal if dcount else None,
                device_mean_ms=dtotal / dcount if dcount else None,
                device_p50_ms=percentile(dev, 50) if dcount else None,
                device_p95_ms=percentile(dev, 95) if dcount else None,
                device_p99_ms=percentile(dev, 99) if dcount else None, syncs=syncs,
                flops_per_s=rates[0], mfu=rates[1],
            ))
        rows.sort(key=lambda r: (r.device_total_ms or 0.0, r.total_ms), reverse=True)
        return Summary(tuple(rows))
