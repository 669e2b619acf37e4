"""``tune_dataloader``: measure DataLoader settings on the real dataset and keep the fastest.

Every combination of ``num_workers``, ``pin_memory``, ``persistent_workers`` and
``prefetch_factor`` that DataLoader accepts is built, warmed up for two batches (worker start-up
is not counted), then timed over ``batches`` batches, including ``consume(batch)`` when given, so
the measure can be "load and copy to the GPU" rather than "load". Workers are shut down after each
trial. Each setting is measured ``repeats`` times, the rounds interleaved so drift hits all
alike; a row gives the median and the spread of its repeats. A setting is kept over a simpler
one only when its median is faster by more than the measured noise (the larger spread of the two,
at least 3%). The result holds the table and the best settings as ``DataLoader`` keyword
arguments.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from perfsdk.optimize.dataloader import tune_dataloader
    >>> data = TensorDataset(torch.randn(64, 3))
    >>> tuning = tune_dataloader(data, 8, num_workers=(0,), batches=4, repeats=2,
    ...                          progress=False)
    >>> loader = DataLoader(data, batch_size=8, **tuning.best)
    >>> tuning.best["num_workers"], len(tuning.rows)
    (0, 1)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from perfsdk import _device
from perfsdk._progress import Progress
from perfsdk.errors import PerfSDKError

__all__ = ["DataLoaderTuning", "tune_dataloader"]

WARMUP = 2
_TIE = 0.03  # the least noise: within 3% of the fastest, the simpler setting (earlier) wins
_now = time.perf_counter  # the host clock of the trials (tests swap it)
_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclasses.dataclass(frozen=True)
class DataLoaderTuning:
    """What :func:`tune_dataloader` measured.

    Attributes:
        best: keyword arguments for ``DataLoader(dataset, batch_size=..., **best)`` (the tried
            settings plus the extra ``loader_kwargs`` given to ``tune_dataloader``).
        rows: one dict per tried setting, in the order tried: the four settings
            (``prefetch_factor`` None without workers), ``batches_per_s``, ``samples_per_s``,
            ``startup_s`` (from ``iter()`` to the end of warm-up) and ``seconds`` (medians of
            the repeats), ``spread`` (``(max - min) / median`` of the repeats' samples/s),
            ``samples_per_s_repeats`` (each repeat's samples/s) and ``error`` (None, or why
            the trial failed).
        notes: what was not tried, and why.
        batch_size: the batch size used.
    """

    best: dict[str, Any]
    rows: list[dict[str, Any]]
    notes: tuple[str, ...] = ()
    batch_size: int = 0

    def table(self) -> str:
        """An aligned text table, the chosen row marked with ``*``, notes below."""
        best = {k: self.best.get(k) for k in _KEYS}
        if not best["num_workers"]:
            best["persistent_workers"] = False
        header = ("", "workers", "pin_memory", "persistent", "prefetch", "batches/s",
                  "samples/s", "spread", "startup_s", "vs best")
        lines: list[tuple[str, ...]] = [header]
        top = max((r["samples_per_s"] for r in self.rows if r["error"] is None), default=0.0)
        for r in self.rows:
            chosen = all(r[k] == best[k] for k in _KEYS)
            if r["error"] is None:
                rel = f"{r['samples_per_s'] / top:.2f}x of best" if top else ""
                cells = (f"{r['batches_per_s']:.1f}", f"{r['samples_per_s']:.1f}",
                         f"{r['spread']:.1%}", f"{r['startup_s']:.3f}", rel)
            else:
                cells = ("-", "-", "-", "-", f"failed: {r['error']}")
            lines.append(("*" if chosen else "", str(r["num_workers"]), str(r["pin_memory"]),
                          str(r["persistent_workers"]),
                          "-" if r["prefetch_factor"] is None else str(r["prefetch_factor"]),
                          *cells))
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        out = []
        for line in lines:
            cols = [c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in
                    enumerate(zip(line, widths, strict=False))]
            out.append(("  ".join(cols) + "  " + line[-1]).rstrip())
        title = f"tune_dataloader (batch_size={self.batch_size})" if self.batch_size else (
            "tune_dataloader")
        return "\n".join([title, *out, *(f"note: {n}" for n in self.notes)])

    def __str__(self) -> str:
        return self.table()


def _choices(name: str, value: Any, kind: type, minimum: int | None = None) -> tuple[Any, ...]:
    values = (value,) if isinstance(value, (bool, int)) else value
    try:
        items: tuple[Any, ...] = tuple(dict.fromkeys(values))
    except TypeError:
        items = ()
    if kind is bool:
        ok = bool(items) and all(isinstance(v, bool) for v in items)
    else:
        ok = bool(items) and all(isinstance(v, int) and not isinstance(v, bool)
                                 and (minimum is None or v >= minimum) for v in items)
    if not ok:
        what = "bools" if kind is bool else f"ints >= {minimum}"
        raise ValueError(f"tune_dataloader: {name} must be a non-empty sequence of {what} "
                         f"(or one such value), got {value!r}")
    return items


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tune_dataloader: {name} must be an int >= 1, got {value!r}")
    return value


def _accelerator_available() -> bool:
    """Whether pinned memory can help: what DataLoader itself checks before pinning."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return _device.get_backend().is_available()  # torch < 2.6


def _combos(num_workers: tuple[int, ...], pin_memory: tuple[bool, ...],
            persistent_workers: tuple[bool, ...], prefetch_factor: tuple[int, ...]
            ) -> list[dict[str, Any]]:
    """The valid settings, simplest first: without workers, persistent_workers and
    prefetch_factor do not apply (DataLoader rejects them), so each pin_memory value gives one."""
    combos: list[dict[str, Any]] = []
    for nw in sorted(num_workers):
        if nw == 0:
            grid: Iterable[tuple[Any, ...]] = ((pm, False, None) for pm in pin_memory)
        else:
            grid = itertools.product(pin_memory, persistent_workers, sorted(prefetch_factor))
        for pm, pw, pf in grid:
            combo = dict(zip(_KEYS, (nw, pm, pw, pf), strict=True))
            if combo not in combos:
                combos.append(combo)
    return combos


def _loader_kwargs(combo: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = {"num_workers": combo["num_workers"], "pin_memory": combo["pin_memory"]}
    if combo["num_workers"]:
        kwargs["persistent_workers"] = combo["persistent_workers"]
        kwargs["prefetch_factor"] = combo["prefetch_factor"]
    return kwargs


def _batch_len(batch: Any, default: int) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else default
        if isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return default


def _shutdown(loader: DataLoader[Any], it: Iterator[Any] | None) -> None:
    """Stop the workers of this trial now (persistent ones included), not at garbage
    collection."""
    for obj in (it, getattr(loader, "_iterator", None)):
        stop = getattr(obj, "_shutdown_workers", None)
        if callable(stop):
            stop()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


class _Feed:
    """Batches from a loader across epoch ends, each passed to ``consume``."""

    def __init__(self, loader: DataLoader[Any], consume: Callable[[Any], Any] | None) -> None:
        self.loader = loader
        self.consume = consume
        self.it: Iterator[Any] = iter(loader)
        self.fresh = True  # nothing yielded yet in this epoch

    def next(self) -> Any:
        while True:
            try:
                batch = next(self.it)
            except StopIteration:
                if self.fresh:
                    raise ValueError("tune_dataloader: the dataset yields no batches") from None
                self.it = iter(self.loader)  # a new epoch: workers restart unless persistent
                self.fresh = True
                continue
            self.fresh = False
            if self.consume is not None:
                self.consume(batch)
            return batch


def _trial(dataset: Any, batch_size: int, kwargs: dict[str, Any], batches: int,
           consume: Callable[[Any], Any] | None) -> dict[str, float]:
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, **kwargs)
    feed: _Feed | None = None
    try:
        start = _now()
        feed = _Feed(loader, consume)
        for _ in range(WARMUP):
            feed.next()
        timed = _now()
        samples = 0
        for _ in range(batches):
            samples += _batch_len(feed.next(), batch_size)
        seconds = max(_now() - timed, 1e-9)
        return {"batches_per_s": batches / seconds, "samples_per_s": samples / seconds,
                "startup_s": timed - start, "seconds": seconds}
    finally:
        _shutdown(loader, None if feed is None else feed.it)


def tune_dataloader(dataset: Any, batch_size: int, *, num_workers: Any = (0, 2, 4),
                    pin_memory: Any = (False, True), persistent_workers: Any = (False, True),
                    prefetch_factor: Any = (2, 4), batches: int = 20, repeats: int = 3,
                    consume: Callable[[Any], Any] | None = None, progress: bool = True,
                    **loader_kwargs: Any) -> DataLoaderTuning:
    """Try DataLoader settings on ``dataset`` and return the fastest with the measured table.

    Args:
        dataset: the dataset to load (map-style or iterable).
        batch_size: the batch size to tune for.
        num_workers: worker counts to try (a value or a sequence).
        pin_memory: values to try; True is tried only where an accelerator is available
            (pinning only speeds host-to-device copies), which the notes say.
        persistent_workers: values to try (with workers only). It pays off across epochs
            only: when a trial stays within one epoch, True is not tried (it cannot help
            there), and the notes say so.
        prefetch_factor: batches each worker loads ahead (with workers only).
        batches: batches timed per setting, after two warm-up batches.
        repeats: measurements of each setting (rounds over all settings, interleaved); the
            median decides, and a setting must beat a simpler one by more than the spread of
            the repeats (at least 3%) to be kept.
        consume: called on each batch inside the timing (e.g. the copy to the GPU); make it
            wait for its own device work if that is to count.
        progress: show a progress bar on stderr when stderr is a terminal.
        **loader_kwargs: passed to every DataLoader (``collate_fn``, ``shuffle``, ...), and
            included in ``best``.

    Returns:
        A :class:`DataLoaderTuning`: ``best`` (DataLoader keyword arguments), ``rows`` and
        ``table()``. A setting that fails is a row with its ``error``.

    Raises:
        ValueError: an argument is out of range (the message names it).
        PerfSDKError: every setting failed (the first failure is chained).
    """
    batch_size = _count("batch_size", batch_size)
    batches = _count("batches", batches)
    repeats = _count("repeats", repeats)
    workers = _choices("num_workers", num_workers, int, 0)
    pins = _choices("pin_memory", pin_memory, bool)
    persistent = _choices("persistent_workers", persistent_workers, bool)
    prefetch = _choices("prefetch_factor", prefetch_factor, int, 1)
    if consume is not None and not callable(consume):
        raise ValueError(f"tune_dataloader: consume must be callable or None, got {consume!r}")
    if "batch_sampler" in loader_kwargs:
        raise ValueError("tune_dataloader: batch_sampler= cannot be combined with batch_size; "
                         "pass only batch_size")

    notes: list[str] = []
    if True in pins and not _accelerator_available():
        pins = (False,)
        notes.append("pin_memory=True not tried: no accelerator (pinned memory only speeds "
                     "host-to-device copies)")
    if 0 in workers and any(workers) and (len(persistent) > 1 or len(prefetch) > 1):
        notes.append("persistent_workers and prefetch_factor apply only with num_workers > 0")
    cpus = _cpu_count()
    if max(workers) > cpus:
        notes.append(f"num_workers above {cpus} exceeds the CPUs this process may use")
    probe: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, **loader_kwargs)
    try:
        epoch: int | None = len(probe)
    except TypeError:  # an iterable dataset without __len__
        epoch = None
    if epoch == 0:
        raise ValueError("tune_dataloader: the dataset yields no batches (empty dataset, or "
                         "drop_last=True with fewer samples than batch_size)")
    if True in persistent and any(workers) and epoch is not None and epoch >= batches + WARMUP:
        if False in persistent:
            persistent = (False,)
            notes.append(f"persistent_workers=True not tried: each trial stays within one "
                         f"epoch ({epoch} batches), where it cannot help; use batches > "
                         f"{epoch - WARMUP} to measure it")
        else:
            notes.append(f"each trial stayed within one epoch ({epoch} batches), where "
                         f"persistent_workers cannot help; use batches > {epoch - WARMUP} to "
                         "measure it")

    combos = _combos(workers, pins, persistent, prefetch)
    measured: list[list[dict[str, float]]] = [[] for _ in combos]
    errors: list[str | None] = [None] * len(combos)
    first_error: BaseException | None = None
    with Progress(len(combos) * repeats, label="tune_dataloader",
                  force=None if progress else False) as bar:
        for _round in range(repeats):  # interleaved: drift hits every setting alike
            for i, combo in enumerate(combos):
                bar.start(" ".join(f"{k}={v}" for k, v in combo.items() if v is not None))
                if errors[i] is None:
                    try:
                        with warnings.catch_warnings():  # trying many workers is the point
                            warnings.filterwarnings("ignore", message="This DataLoader will")
                            measured[i].append(_trial(
                                dataset, batch_size,
                                {**loader_kwargs, **_loader_kwargs(combo)}, batches, consume))
                    except Exception as exc:  # a failing setting is a result, not the end
                        first_error = first_error or exc
                        errors[i] = f"{type(exc).__name__}: {exc}"
                bar.advance()
    rows = [_row(combo, runs, error)
            for combo, runs, error in zip(combos, measured, errors, strict=True)]
    ok = [r for r in rows if r["error"] is None]
    if not ok:
        raise PerfSDKError(f"tune_dataloader: every setting failed; first: "
                           f"{rows[0]['error']}") from first_error
    chosen = _choose(ok)
    best = {**loader_kwargs, **_loader_kwargs(chosen)}
    return DataLoaderTuning(best=best, rows=rows, notes=tuple(notes), batch_size=batch_size)


def _row(combo: dict[str, Any], runs: list[dict[str, float]], error: str | None
         ) -> dict[str, Any]:
    """A table row: the medians of the repeats, and their spread."""
    row: dict[str, Any] = {**combo, "batches_per_s": 0.0, "samples_per_s": 0.0,
                           "startup_s": 0.0, "seconds": 0.0, "spread": 0.0,
                           "samples_per_s_repeats": [r["samples_per_s"] for r in runs],
                           "error": error}
    if error is None and runs:
        for key in ("batches_per_s", "samples_per_s", "startup_s", "seconds"):
            row[key] = statistics.median(r[key] for r in runs)
        rates = row["samples_per_s_repeats"]
        median = row["samples_per_s"]
        row["spread"] = (max(rates) - min(rates)) / median if median > 0 else 0.0
    return row


def _choose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The simplest row (earliest) that the fastest does not beat by more than the noise: the
    larger ``spread`` of the two, and at least 3%. A setting is kept only when its difference
    exceeds what its repeats varied by."""
    top = max(rows, key=lambda r: r["samples_per_s"])
    for row in rows:
        noise = max(_TIE, row["spread"], top["spread"])
        if top["samples_per_s"] <= row["samples_per_s"] * (1 + noise):
            return row
    return top  # pragma: no cover - top itself always qualifies


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
