"""The advisor's thresholds, its :class:`Finding` and the rules (re-exported by perfsdk.advisor).

Each rule reads a :class:`Run` (the records of one run, with the step-time basis worked out) and
returns a :class:`Finding` or None, adding to ``run.notes`` what it could not check. The rules
follow the seeds' optimization loop: profile, name the bottleneck (data loading, host-device
syncs, launch overhead, memory pressure, memory creep, compute), apply the matching fix,
measure again.

A rule claims only what the run shows: syncs are those of this run's regions (and, from a
summary, those outside any region while the run's regions ran), counted per step only inside
the steps; a transform the regions say was on (``perfsdk.amp``, ``perfsdk.transforms``) is not
recommended again. Every fix is a Python statement that runs as printed (or a ``#`` comment),
given :data:`NAMES`.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from perfsdk.advisor.trend import off_line, segment_medians, theil_sen
from perfsdk.export.summary import format_flops, format_mfu
from perfsdk.record import RegionResult
from perfsdk.sync.ops import OPS

__all__ = [
    "COMPUTE_SHARE", "DATA_SHARE", "LAUNCH_HOST_DEVICE_RATIO", "LAUNCH_MIN_IMPACT",
    "LAUNCH_SHORT_STEP_MS", "LAUNCH_UTILIZATION", "MEMORY_PRESSURE", "MEMORY_WEIGHT", "NAMES",
    "SYNCS_PER_STEP", "SYNC_MIN_IMPACT", "SYNC_STALL_MS", "WARMUP_MIN_STEPS", "WARMUP_STEPS",
    "CREEP_FIT", "CREEP_MIN_BYTES", "CREEP_MIN_FRACTION", "CREEP_MIN_STEPS", "CREEP_SEGMENTS",
    "Finding", "Run", "RULES",
]

DATA_SHARE = 0.20
"""Data-bound when ``data_wait`` regions (or category ``data``) take more than this fraction of
the loop time (the steps plus any data wait outside them). Impact: that fraction."""

WARMUP_STEPS = 1
"""Steps left out at the start (compilation, allocator and cuDNN warm-up, first-call costs),
with every region that started before the last of them ended, ..."""

WARMUP_MIN_STEPS = 4
"""... when the run has at least this many steps."""

SYNCS_PER_STEP = 0.5
"""Host-device syncs are reported from this many per step on (one every two steps); a value
read every N steps for logging stays below it. Without steps, any sync is reported."""

SYNC_STALL_MS = 0.05
"""Assumed cost of one sync (ms): the GPU drains its queue and idles while the host launches
the next kernels. Only used to rank the finding."""

SYNC_MIN_IMPACT = 0.05
"""Floor of a sync finding's estimated impact, so that it is listed even where the steps are
long; its ceiling is 0.5."""

LAUNCH_HOST_DEVICE_RATIO = 2.0
"""Launch-bound when host time is at least this multiple of device time (the GPU is busy less
than half the time the host spends), over the steps, else over top-level timed regions."""

LAUNCH_UTILIZATION = 0.5
"""... or when the NVML ``hw.gpu.utilization`` over the steps averages below this ...
"""

LAUNCH_SHORT_STEP_MS = 20.0
"""... while steps take less than this many milliseconds on average (short steps that leave
the GPU idle point at launches, not at a big kernel)."""

LAUNCH_MIN_IMPACT = 0.10
"""A launch finding needs the GPU's idle share, less what the data rule already explains, to be
at least this."""

MEMORY_PRESSURE = 0.90
"""Memory pressure when a region's ``perfsdk.memory.peak_bytes`` exceeds this fraction of the
device's memory (``device_memory_bytes``). An out-of-memory error always counts."""

MEMORY_WEIGHT = 0.25
"""Memory costs no time by itself: its impact is ``MEMORY_WEIGHT * peak / capacity`` (1.0 after
an out-of-memory error), so a measured time loss above about a quarter ranks first."""

CREEP_MIN_STEPS = 20
"""Memory creep is looked for over at least this many steps with memory readings (after the
warm-up step): fewer cannot tell a leak from noise."""

CREEP_SEGMENTS = 4
"""Memory creeps when the median reading of each of this many consecutive parts of the steps
is above the previous part's (a one-time jump lifts one part only) ..."""

CREEP_FIT = 0.10
"""... and the readings lie on a straight line: the median distance of a reading from the
Theil-Sen line is at most this fraction of the growth over the steps (a jump or two is a
staircase, far from any line; a leak with a transient spike now and then stays on it) ..."""

CREEP_MIN_BYTES = 32 * 2**20
"""... and the growth over the steps (the Theil-Sen slope times the steps spanned) is at least
this many bytes (32 MiB) ..."""

CREEP_MIN_FRACTION = 0.05
"""... and at least this fraction of the memory in use at the start (the first part's median)."""

COMPUTE_SHARE = 0.50
"""Compute-bound when nothing above was found and forward/backward regions (category
``module``, ``module.backward`` or ``compute``, or named ``forward`` / ``backward``) take at
least this fraction of the loop time. Impact: that fraction."""

NAMES = ("model", "inputs", "loader", "optimizer", "loss_fn")
"""The names a printed fix uses besides ``perfsdk`` and ``torch``: your model, an example batch
of its inputs, your DataLoader, optimizer and loss function. With those bound each fix runs as
printed."""

_COMPUTE_CATEGORIES = frozenset({"module", "module.backward", "compute"})
_STATES = {"amp": "autocast", "compile": "torch.compile", "channels_last": "channels-last",
           "checkpointing": "activation checkpointing", "cuda_graphs": "CUDA graphs"}
_COMPUTE_NAMES = frozenset({"forward", "backward"})


def severity(impact: float) -> str:
    """``high`` from 0.3, ``medium`` from 0.1, else ``low``."""
    return "high" if impact >= 0.3 else "medium" if impact >= 0.1 else "low"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One bottleneck, with the numbers behind it and the perfsdk call that addresses it."""

    kind: str
    """``data``, ``sync``, ``launch``, ``memory``, ``memory_creep`` or ``compute``."""
    title: str
    impact: float
    """Estimated share of the loop time at stake, 0..1 (findings are ordered by it)."""
    severity: str
    """``high``, ``medium`` or ``low``, from ``impact``."""
    evidence: str
    """The numbers, as one line of text."""
    data: Mapping[str, Any]
    """The same numbers as data (milliseconds, fractions, counts, bytes)."""
    fix: str
    """What to do first: one Python statement that runs as printed, given ``perfsdk``,
    ``torch`` and :data:`NAMES` (``model = perfsdk.optimize.apply_compile(model)``), or a
    ``#`` comment where the fix is a change to your own code (a leak on the CPU)."""
    details: tuple[str, ...] = ()
    """More statements, each runnable as printed, and ``#`` comments that explain them."""
    sites: tuple[str, ...] = ()
    """For syncs: each call site of this run, how often it synced and its fix."""
    already_on: tuple[str, ...] = ()
    """What the run's regions say was already on (``autocast (bfloat16)``, ``torch.compile``),
    so that its fix is not recommended again."""


@dataclasses.dataclass(frozen=True)
class _Fix:
    """A candidate fix: a statement, comments on it, and the state that makes it redundant."""

    code: str
    comment: str = ""
    state: str = ""


def _finding(run: Run, kind: str, title: str, impact: float, evidence: str,
             data: Mapping[str, Any], fixes: Sequence[_Fix], sites: Sequence[str] = (),
             covers: Sequence[str] = ()) -> Finding:
    """The finding, with the fixes whose state the run already had left out (and said so;
    ``covers`` names more states a fix, such as ``optimize(auto=True)``, would try)."""
    impact = round(min(max(impact, 0.0), 1.0), 4)
    kept = [f for f in fixes if not (f.state and f.state in run.on)]
    skipped = sorted({s for s in (*(f.state for f in fixes), *covers) if s and s in run.on},
                     key=list(_STATES).index)
    already = tuple(run.on[state] for state in skipped)
    lines: list[str] = []
    for f in kept:
        lines += [f.code, *([f"# {f.comment}"] if f.comment else [])]
    if not lines or (lines[0].startswith("#") and len(kept) < len(fixes)):
        lines.insert(0, "# nothing new to apply: the fixes for this are already on (see below)")
    data = {**data, "already_on": list(skipped)}
    return Finding(kind, title, impact, severity(impact), evidence, data, lines[0],
                   tuple(lines[1:]), tuple(sites), already)


def _category(r: RegionResult) -> Any:
    return r.attributes.get("perfsdk.category")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(x: float) -> str:
    return f"{x:,.1f} ms" if x >= 10 else f"{x:.2f} ms" if x >= 0.1 else f"{x:.3f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class Run:
    """The records of one run, and the time every share is a share of."""

    def __init__(self, regions: Sequence[RegionResult], summary: Any = None,
                 device_memory_bytes: int | None = None) -> None:
        self.all_regions = regions  # memory peaks count from the first step on
        self.summary = summary
        self.capacity = device_memory_bytes
        self.notes: list[str] = []
        self.on = _states(regions)
        steps = sorted((r for r in regions if r.name == "step" or _category(r) == "step"),
                       key=lambda r: r.start_ns)
        self.warmup = WARMUP_STEPS if len(steps) >= WARMUP_MIN_STEPS else 0
        if self.warmup:
            cutoff = steps[self.warmup - 1].end_ns
            regions = [r for r in regions if r.start_ns >= cutoff]
            what = "step" if self.warmup == 1 else f"{self.warmup} steps"
            self.notes.append(f"warm-up: the first {what}, and what ran before it ended, are left "
                              "out (memory peaks excepted)")
        self.regions = regions
        self.by_span = {r.span_id: r for r in regions}
        self.steps = [r for r in regions if r.name == "step" or _category(r) == "step"]
        self.data = [r for r in regions if r.name == "data_wait" or _category(r) == "data"]
        step_ids = {r.span_id for r in self.steps}
        outside = [r for r in self.data if not self._inside(r, step_ids)]
        self.data_outside_ms = sum(r.host_ms for r in outside)
        if self.steps:
            self.basis = "steps"
            self.basis_ms = sum(r.host_ms for r in self.steps) + self.data_outside_ms
        else:
            self.basis = "run"
            self.basis_ms = ((max(r.end_ns for r in regions) - min(r.start_ns for r in regions))
                             / 1e6 if regions else 0.0)
            if regions:
                self.notes.append(
                    "no `step` regions: shares are of the whole recorded time "
                    f"({_ms(self.basis_ms)}); mark steps with timed_region(\"step\", "
                    "category=\"step\") for per-step numbers")
        self.data_share = 0.0  # set by the data rule; the launch rule subtracts it

    def _inside(self, r: RegionResult, ids: set[int]) -> bool:
        seen = 0
        parent = r.parent_span_id
        while parent and seen < 256:
            if parent in ids:
                return True
            up = self.by_span.get(parent)
            if up is None:
                return False
            parent, seen = up.parent_span_id, seen + 1
        return False

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def share(self, ms: float) -> float:
        return ms / self.basis_ms if self.basis_ms > 0 else 0.0

    def of_loop(self) -> str:
        return "step time" if self.steps else "recorded time"


def _states(regions: Sequence[RegionResult]) -> dict[str, str]:
    """What the regions say the run had on: ``{"amp": "autocast (bfloat16)", ...}``."""
    on: dict[str, str] = {}
    for r in regions:
        amp = r.attributes.get("perfsdk.amp")
        if isinstance(amp, str) and amp:
            on["amp"] = f"autocast ({amp})"
        for name in r.attributes.get("perfsdk.transforms", ()) or ():
            if name in _STATES:
                on.setdefault(str(name), _STATES[str(name)])
    return on


def data_rule(run: Run) -> Finding | None:
    if not run.data:
        run.notes.append("data loading not checked: no `data_wait` regions (wrap the batch "
                         "fetch in timed_region(\"data_wait\", category=\"data\"))")
        return None
    total = sum(r.host_ms for r in run.data)
    mean = total / len(run.data)
    share = run.data_share = run.share(total)
    if share <= DATA_SHARE:
        return None
    data = {"data_wait_ms_mean": mean, "data_wait_ms_total": total, "batches": len(run.data),
            "share": share, "basis_ms": run.basis_ms}
    evidence = (f"data_wait {_ms(mean)} per batch (mean of {len(run.data)}), {_ms(total)} of "
                f"{_ms(run.basis_ms)} = {_pct(share)} of {run.of_loop()} "
                f"(threshold {_pct(DATA_SHARE)})")
    return _finding(run, "data", "Data loading: the loop waits for batches", share, evidence,
                    data, [
        _Fix("tuning = perfsdk.optimize.tune_dataloader(loader.dataset, loader.batch_size)",
             "measures workers, pinned memory and prefetching on this machine; pass your "
             "loader's other arguments (shuffle=True, collate_fn=...) too"),
        _Fix("loader = torch.utils.data.DataLoader(loader.dataset, tuning.batch_size, "
             "**tuning.best)"),
        _Fix("# or move per-sample preprocessing out of __getitem__, or onto the GPU")])


def _region_sites(r: RegionResult) -> list[tuple[str, int]]:
    """``("file:line op", count)`` for each call site a region synced at; the syncs beyond the
    sites a region lists (more than 16 sites) as one ``"(other sites)"``."""
    sites = [str(x) for x in r.attributes.get("perfsdk.sync_sites", ()) or ()]
    counts = [int(x) for x in r.attributes.get("perfsdk.sync_counts", ()) or ()]
    if len(counts) != len(sites):  # recorded without per-site counts: one each, at least
        counts = [1] * len(sites)
    out = list(zip(sites, counts, strict=True))
    rest = int(r.attributes.get("perfsdk.syncs", 0) or 0) - sum(counts)
    if rest > 0:
        out.append(("(other sites)", rest))
    return out


def _outside_regions(run: Run, regions: Sequence[RegionResult]) -> Counter[str]:
    """Syncs of the summary's sites that happened outside any region while ``regions`` ran
    (from the first one's start to the last one's end): syncs of this run that no region
    holds. Those of other runs, before or after, are not counted."""
    found: Counter[str] = Counter()
    if run.summary is None or not regions:
        return found
    start = min(r.start_ns for r in regions)
    end = max(r.end_ns for r in regions)
    for site in getattr(run.summary, "sync_sites", ()) or ():
        n = sum(1 for t in getattr(site, "outside_ns", ()) if start <= t <= end)
        if n:
            found[site.label] += n
    return found


def sync_rule(run: Run) -> Finding | None:
    step_ids = {r.span_id for r in run.steps}
    in_steps: Counter[str] = Counter()
    out_steps: Counter[str] = Counter()
    for r in run.regions:
        if not r.attributes.get("perfsdk.syncs"):
            continue
        into = in_steps if (r.span_id in step_ids or run._inside(r, step_ids)) else out_steps
        for site, n in _region_sites(r):
            into[site] += n
    out_steps += _outside_regions(run, run.regions)
    everywhere: Counter[str] = Counter()  # the whole run, warm-up included: "Nx in all"
    for r in run.all_regions:
        for site, n in _region_sites(r):
            everywhere[site] += n
    everywhere += _outside_regions(run, run.all_regions)
    n_in, n_out = sum(in_steps.values()), sum(out_steps.values())
    if not n_in and not n_out:
        run.notes.append("host-device syncs: none recorded in this run (they are only counted "
                         "inside perfsdk.no_sync_guard(\"count\")" + (
                             "; those outside any region only with "
                             "summary=perfsdk.summary(show=False))" if run.summary is None
                             else ")"))
        return None
    if run.n_steps:
        per_step = n_in / run.n_steps
        if per_step < SYNCS_PER_STEP:
            if n_in:
                run.notes.append(
                    f"host-device syncs: {n_in} in {run.n_steps} steps ({per_step:.2f} per step, "
                    f"below {SYNCS_PER_STEP}): occasional, e.g. a value read for logging")
            if n_out:
                run.notes.append(
                    f"host-device syncs outside the steps: {n_out} at "
                    + ", ".join(out_steps)
                    + "; not counted per step (a step region around the whole iteration counts "
                    "them there)")
            return None
        total = n_in
    else:
        per_step, total = float(n_in + n_out), n_in + n_out
        in_steps, out_steps = in_steps + out_steps, Counter()
    step_ms = run.basis_ms / run.n_steps if run.n_steps else run.basis_ms
    rate = per_step if run.n_steps else float(total)
    impact = min(max(rate * SYNC_STALL_MS / step_ms if step_ms > 0 else 0.0,
                     SYNC_MIN_IMPACT), 0.5)
    order = [site for site, _ in in_steps.most_common()] + [
        site for site, _ in out_steps.most_common() if site not in in_steps]
    rows = [{"where": _where_op(site)[0], "op": _where_op(site)[1],
             "count": everywhere.get(site, in_steps[site] + out_steps[site]),
             "in_steps": in_steps[site], "outside_steps": out_steps[site]} for site in order]
    data = {"syncs": total, "syncs_per_step": per_step if run.n_steps else None,
            "outside_steps": n_out if run.n_steps else 0, "sites": rows}
    where = sum(1 for row in rows if row["in_steps"])
    if run.n_steps:
        evidence = (f"{per_step:.1f} per step ({n_in} in {run.n_steps} steps) at {where} call "
                    f"site{'s' if where != 1 else ''}")
        if n_out:
            evidence += f"; {n_out} more outside the steps"
    else:
        evidence = f"{total} in the run at {where} call site{'s' if where != 1 else ''}"
    sites = []
    for row in rows:
        op = str(row["op"])
        outside = " (outside the steps)" if run.n_steps and not row["in_steps"] else ""
        fix = OPS.get(op, "more call sites than a region lists; see perfsdk.summary()")
        sites.append(f"{row['where']} {op} ({row['count']}x in all){outside}: {fix}")
    return _finding(run, "sync", "Host-device syncs stall the GPU every step", impact, evidence,
                    data, [
        _Fix('perfsdk.configure(sync_guard="error")',
             "every perfsdk.no_sync_guard then raises at the line that syncs "
             "(PERFSDK_SYNC_GUARD=error in CI); the fix for each site is below")], sites)


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _where_op(site: str) -> tuple[str, str]:
    """``("file:line", "op")`` of a ``"file:line op"`` site."""
    where, _, op = site.rpartition(" ")
    return (where, op) if where and ":" in where else (site, "")


def _timed(run: Run) -> list[RegionResult]:
    """Steps with device times, else top-level device-timed regions that are not data."""
    steps = [r for r in run.steps if r.device_ms is not None]
    if steps:
        return steps
    data_ids = {r.span_id for r in run.data}
    timed = [r for r in run.regions if r.device_ms is not None and r.span_id not in data_ids]
    ids = {r.span_id for r in timed}
    return [r for r in timed if not run._inside(r, ids)]


def launch_rule(run: Run) -> Finding | None:
    timed = _timed(run)
    if not timed:
        run.notes.append("launch overhead not checked: no device times (a CPU-only run, or "
                         "CUDA not initialized before the regions)")
        return None
    host = sum(r.host_ms for r in timed)
    device = sum(r.device_ms or 0.0 for r in timed)
    ratio = host / device if device > 0 else float("inf")
    idle = 1.0 - device / host if host > 0 else 0.0
    utils = [(float(r.attributes["hw.gpu.utilization"]), r.host_ms) for r in run.steps
             if isinstance(r.attributes.get("hw.gpu.utilization"), (int, float))]
    util = (sum(u * w for u, w in utils) / sum(w for _, w in utils)
            if utils and sum(w for _, w in utils) > 0 else None)
    step_ms = host / len(timed)
    signals = []
    if ratio >= LAUNCH_HOST_DEVICE_RATIO:
        signals.append(f"host {_ms(host)} vs device {_ms(device)} ({ratio:.1f}x)")
    if util is not None and util < LAUNCH_UTILIZATION and step_ms < LAUNCH_SHORT_STEP_MS:
        signals.append(f"GPU utilization {_pct(util)} over {_ms(step_ms)} steps")
        idle = max(idle, 1.0 - util)
    impact = idle - run.data_share
    if not signals or impact < LAUNCH_MIN_IMPACT:
        return None
    short = [r.device_ms for r in run.regions if r.device_ms is not None]
    median = statistics.median(short)
    data = {"host_ms": host, "device_ms": device, "host_device_ratio": ratio,
            "gpu_utilization": util, "idle_share": idle, "regions_timed": len(short),
            "median_device_ms": median}
    evidence = "; ".join(signals) + (f"; {len(short)} regions with device times, median "
                                     f"{_ms(median)}")
    return _finding(run, "launch", "Launch overhead: the GPU idles between small kernels",
                    impact, evidence, data, [
        _Fix("model, report = perfsdk.optimize.optimize(model, inputs, compile=True)",
             "compiled against eager on your inputs, checked and timed", "compile"),
        _Fix('model = perfsdk.optimize.apply_compile(model, mode="reduce-overhead")',
             "CUDA graphs through torch.compile", "compile"),
        _Fix("model = perfsdk.optimize.apply_cuda_graphs(model)",
             "inference with fixed shapes", "cuda_graphs"),
        _Fix("# a larger batch does more work per launch")])


def memory_rule(run: Run) -> Finding | None:
    peaks = [r.memory["perfsdk.memory.peak_bytes"] for r in run.all_regions
             if r.memory and "perfsdk.memory.peak_bytes" in r.memory]
    ooms = [r for r in run.all_regions if "perfsdk.oom.allocated_bytes" in r.attributes
            or type(r.error).__name__ == "OutOfMemoryError"]
    if ooms:
        peaks += [int(r.attributes.get("perfsdk.oom.peak_bytes", 0)) for r in ooms]
    if not peaks:
        run.notes.append("memory pressure not checked: no memory records (memory=True on the "
                         "regions or PERFSDK_MEMORY=1, on CUDA)")
        return None
    peak = max(peaks)
    fraction = peak / run.capacity if run.capacity else None
    if not ooms:
        if fraction is None:
            run.notes.append("memory pressure not checked: device capacity unknown (pass "
                             "device_memory_bytes=torch.cuda.get_device_properties(0)"
                             ".total_memory)")
            return None
        if fraction <= MEMORY_PRESSURE:
            return None
    impact = 1.0 if ooms else MEMORY_WEIGHT * (fraction or 0.0)
    evidence = f"peak {_mib(peak)}"
    if run.capacity:
        evidence += f" of {_mib(run.capacity)} ({_pct(fraction or 0.0)}, threshold " \
                    f"{_pct(MEMORY_PRESSURE)})"
    if ooms:
        evidence += f"; {len(ooms)} region(s) ran out of memory"
    data = {"peak_bytes": peak, "capacity_bytes": run.capacity, "fraction": fraction,
            "oom_regions": len(ooms)}
    return _finding(run, "memory", "Memory pressure: the peak is near the device's capacity",
                    impact, evidence, data, [
        _Fix("model = perfsdk.optimize.apply_checkpointing(model, segments=2)",
             "recomputes activations in backward instead of keeping them", "checkpointing"),
        _Fix("model = perfsdk.optimize.apply_amp(model)", "half-size activations", "amp"),
        _Fix("step = perfsdk.optimize.TrainStep(model, optimizer, loss_fn, accumulate=2)",
             "with half the batch size per call: the same effective batch in less memory")])


# -- memory creep --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Source:
    """A per-step memory reading the creep rule can follow."""

    name: str
    """``data["source"]``."""
    key: str
    """The reading: a ``perfsdk.memory.*`` key of ``RegionResult.memory`` or an attribute."""
    what: str
    subtree: bool
    """A step's level is the largest reading of the step and the regions inside it (peaks);
    else the step's own reading."""


_CUDA = _Source("cuda", "perfsdk.memory.peak_bytes", "the steps' peak allocated GPU memory", True)
_RSS = _Source("rss", "perfsdk.memory.rss_bytes", "the process's RSS at each step's end", False)
_RSS_PEAK = _Source("rss_peak", "perfsdk.memory.rss_peak_bytes",
                    "the process's peak RSS (its high-water mark)", True)
_DELTA = "perfsdk.memory.allocated_delta_bytes"


def _reading(r: RegionResult, key: str) -> float | None:
    value = r.memory.get(key) if r.memory else None
    if value is None:
        value = r.attributes.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _members(run: Run) -> dict[int, list[tuple[RegionResult, int]]]:
    """Each step's span id -> the regions nested in it, with their depth (1: a child)."""
    step_ids = {s.span_id for s in run.steps}
    out: dict[int, list[tuple[RegionResult, int]]] = {sid: [] for sid in step_ids}
    known: dict[int, tuple[int, int]] = {}  # span id -> (its step, its depth); step 0: none
    for r in run.regions:
        if r.span_id in step_ids:
            continue
        chain: list[int] = []
        parent, found = r.parent_span_id, (0, 0)
        while parent and len(chain) < 256:
            if parent in step_ids:
                found = (parent, 0)
                break
            if parent in known:
                found = known[parent]
                break
            chain.append(parent)
            up = run.by_span.get(parent)
            if up is None:
                break
            parent = up.parent_span_id
        step, depth = found
        for n, span in enumerate(reversed(chain), 1):  # the outermost first
            known[span] = (step, depth + n if step else 0)
        if step:
            out[step].append((r, depth + len(chain) + 1))
    return out


def _series(run: Run, source: _Source, members: Mapping[int, list[tuple[RegionResult, int]]]
            ) -> tuple[list[float], list[float], list[RegionResult]]:
    """``(step numbers, levels, steps)`` of the steps that have the reading. Step numbers are
    ``perfsdk.step`` where every step has it (a schedule's gaps count), else 0, 1, 2..."""
    steps = sorted(run.steps, key=lambda r: r.start_ns)
    given = [s.attributes.get("perfsdk.step") for s in steps]
    numbers = [n for n in given if isinstance(n, int) and not isinstance(n, bool)]
    if len(numbers) != len(steps) or any(b <= a for a, b in itertools.pairwise(numbers)):
        numbers = list(range(len(steps)))
    xs: list[float] = []
    ys: list[float] = []
    kept: list[RegionResult] = []
    for number, step in zip(numbers, steps, strict=True):
        readings = [_reading(step, source.key)]
        if source.subtree:
            readings += [_reading(r, source.key) for r, _ in members.get(step.span_id, ())]
        present = [v for v in readings if v is not None]
        if present:
            xs.append(float(number))
            ys.append(max(present))
            kept.append(step)
    return xs, ys, kept


def _creeps(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, list[float]] | None:
    """``(slope, part medians)`` when the series grows steadily and materially, else None."""
    slope = theil_sen(xs, ys)
    medians = segment_medians(ys, CREEP_SEGMENTS)
    growth = slope * (xs[-1] - xs[0])
    material = growth >= CREEP_MIN_BYTES and growth >= CREEP_MIN_FRACTION * max(medians[0], 0.0)
    if not (material and all(b > a for a, b in itertools.pairwise(medians))):
        return None
    return (slope, medians) if off_line(xs, ys, slope) <= CREEP_FIT * growth else None


def _grows_in(steps: Sequence[RegionResult], members: Mapping[int, list[tuple[RegionResult, int]]],
              slope: float) -> tuple[str | None, float | None]:
    """Where the allocated memory grows: ``(region name, its growth per step)``; the name is
    None for "between the steps" and the step's own name when no region inside it accounts for
    the growth. A region accounts for it when the median of its net allocation per step
    (``allocated_delta_bytes`` summed over its calls in a step) is within half to one and a
    half times the slope; of several, the deepest. Regions whose allocation another frees
    later in the step (a forward's activations, freed by backward) allocate far more than the
    slope and are not named."""
    own = [_reading(s, _DELTA) for s in steps]
    if all(v is not None for v in own):
        median = float(statistics.median(v for v in own if v is not None))
        if median < 0.5 * slope:
            return None, median
    per_step: dict[str, list[float]] = {}
    depth: dict[str, int] = {}
    for k, step in enumerate(steps):
        for r, d in members.get(step.span_id, ()):
            delta = _reading(r, _DELTA)
            if delta is not None:
                per_step.setdefault(r.name, [0.0] * len(steps))[k] += delta
                depth[r.name] = max(depth.get(r.name, 0), d)
    best: tuple[tuple[int, float, str], float] | None = None
    for name, sums in per_step.items():
        grows = float(statistics.median(sums))
        if 0.5 * slope <= grows <= 1.5 * slope:
            rank = (-depth[name], abs(grows - slope), name)
            if best is None or rank < best[0]:
                best = (rank, grows)
    if best is not None:
        return best[0][2], best[1]
    return steps[0].name, None


def creep_rule(run: Run) -> Finding | None:
    """Memory that grows every step: a leak. Reads, per step after the warm-up, the steps'
    peak allocated GPU memory (``perfsdk.memory.peak_bytes`` of the step and the regions in
    it), then the process's RSS at each step's end (``perfsdk.memory.rss_bytes``) or, without
    it, its peak RSS; see :data:`CREEP_MIN_STEPS` for when it fires."""
    if not run.steps:
        return None
    members = _members(run)
    host = _RSS if any(_reading(s, _RSS.key) is not None for s in run.steps) else _RSS_PEAK
    counted: list[int] = []
    for source in (_CUDA, host):
        xs, ys, steps = _series(run, source, members)
        if not ys:
            continue
        counted.append(len(ys))
        if len(ys) < CREEP_MIN_STEPS:
            continue
        found = _creeps(xs, ys)
        if found is not None:
            return _creep_finding(run, source, xs, ys, steps, members, *found)
    if not counted:
        run.notes.append("memory creep not checked: the steps record no memory "
                         "(perfsdk.configure(memory=True) or PERFSDK_MEMORY=1)")
    elif max(counted) < CREEP_MIN_STEPS:
        run.notes.append(f"memory creep not checked: {max(counted)} steps with memory readings "
                         f"after warm-up, {CREEP_MIN_STEPS} needed")
    elif len(counted) == 1 and host is _RSS_PEAK:
        run.notes.append("memory creep on the CPU read from the peak RSS, which shows growth "
                         "only once it passes the process's earlier high-water mark")
    return None


def _size(n: float) -> str:
    """Bytes in MiB (GiB from 1 GiB), three significant digits."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.3g} GiB"
    mib = n / 2**20
    return f"{mib:,.0f} MiB" if abs(mib) >= 100 else f"{mib:.3g} MiB"


def _creep_finding(run: Run, source: _Source, xs: Sequence[float], ys: Sequence[float],
                   steps: Sequence[RegionResult],
                   members: Mapping[int, list[tuple[RegionResult, int]]], slope: float,
                   medians: Sequence[float]) -> Finding:
    growth = slope * (xs[-1] - xs[0])
    step_name = steps[0].name
    if source is _CUDA:
        region, there = _grows_in(steps, members, slope)
        if region is None:
            where = "between the steps, outside the step regions (their own growth is " \
                    f"{_size(there or 0.0)}/step)"
        elif there is None:
            where = f"in `{region}` itself (no region inside it with memory readings accounts " \
                    "for the growth)"
        else:
            where = f"in `{region}` ({_size(there)}/step there)"
    else:
        region, there = step_name, None
        where = f"in `{step_name}` (RSS is read per step: no region inside it is named)"
    evidence = (f"{source.what} rises {_size(slope)}/step over {len(ys)} steps, higher in each "
                f"of {CREEP_SEGMENTS} parts of the run: {_size(ys[0])} to {_size(ys[-1])} "
                f"(+{_size(growth)}), +{_size(1000 * slope)} per 1,000 steps; grows {where}")
    if source is _RSS_PEAK:
        evidence += "; the peak shows growth only past the earlier high-water mark"
    to_capacity = None
    if source is _CUDA and run.capacity:
        to_capacity = max(0, int((run.capacity - ys[-1]) // slope))
        evidence += f"; the device's {_mib(run.capacity)} are full in ~{to_capacity:,} steps"
    data = {"source": source.name, "slope_bytes_per_step": slope,
            "growth_per_1000_steps_bytes": 1000 * slope, "growth_bytes": growth,
            "steps": len(ys), "first_step": int(xs[0]), "last_step": int(xs[-1]),
            "start_bytes": ys[0], "end_bytes": ys[-1], "part_medians_bytes": list(medians),
            "region": region, "region_slope_bytes_per_step": there,
            "steps_to_capacity": to_capacity}
    gpu = source is _CUDA
    named = region is not None and there is not None  # a region inside the step
    title = f"Memory creep: {'GPU memory' if gpu else 'the process memory'} grows every step"
    return _finding(run, "memory_creep", title, MEMORY_WEIGHT, evidence, data, [
        *([_Fix("perfsdk.configure(memory_snapshots=True)",
                f"an out-of-memory error then writes an allocation snapshot with the stack of "
                f"every live block, those `{region}` keeps among them (open it at "
                "pytorch.org/memory_viz)")] if gpu and named else []),
        *([_Fix("perfsdk.configure(memory=True, memory_snapshots=True)",
                "every region then records its memory, so that the next run names the region "
                "where it grows; an out-of-memory error writes an allocation snapshot with "
                "the stack of every live block (open it at pytorch.org/memory_viz)")]
          if gpu and not named else []),
        _Fix("# keep numbers, not tensors that hold their autograd graph: "
             "total_loss += loss.detach() (loss.item() to print it), not total_loss += loss"),
        _Fix("# a list that grows every step keeps every tensor in it: append out.detach() "
             "(.cpu() frees the GPU), or keep a bounded collections.deque(maxlen=100)"),
        _Fix("# run evaluation and metrics under torch.no_grad(), so that they build no graph"),
        _Fix("# a cache keyed by each batch (shapes, ids, strings) grows without bound: bound "
             "it (functools.lru_cache(maxsize=128)) or clear it"),
        _Fix("# memory that follows the data (longer sequences, bigger batches later in the run) "
             "is not a leak")])


def _is_compute(r: RegionResult) -> bool:
    return (_category(r) in _COMPUTE_CATEGORIES or r.name in _COMPUTE_NAMES
            or r.name.rsplit(".", 1)[-1] in _COMPUTE_NAMES)


def _mfu(steps: Sequence[RegionResult]) -> tuple[float, float] | None:
    """(MFU, FLOP/s) of the steps that have ``perfsdk.mfu``, weighted by their time."""
    timed = [(r.attributes["perfsdk.mfu"], r.attributes.get("perfsdk.flops_per_s", 0.0),
              r.host_ms) for r in steps if r.attributes.get("perfsdk.mfu") is not None]
    ms = sum(t for _, _, t in timed)
    if not timed or ms <= 0:
        return None
    return (sum(m * t for m, _, t in timed) / ms, sum(f * t for _, f, t in timed) / ms)


def compute_rule(run: Run, found: Sequence[Finding]) -> Finding | None:
    compute = [r for r in run.regions if _is_compute(r)]
    if not compute:
        run.notes.append("compute not checked: no forward/backward regions (category module "
                         "or compute, or named forward/backward)")
        return None
    if any(f.kind in ("data", "sync", "launch") for f in found):
        return None  # fix those first: they hide the compute time
    ids = {r.span_id for r in compute}
    top = [r for r in compute if not run._inside(r, ids)]
    total = sum(r.host_ms for r in top)
    share = run.share(total)
    if share < COMPUTE_SHARE:
        run.notes.append(f"no bottleneck found: forward/backward take {_pct(share)} of "
                         f"{run.of_loop()} (compute-bound from {_pct(COMPUTE_SHARE)})")
        return None
    top_ids = {r.span_id for r in top}
    by_name: dict[str, float] = {}
    for r in compute:
        if _category(r) in ("module", "module.backward") or r.span_id in top_ids:
            by_name[r.name] = by_name.get(r.name, 0.0) + r.host_ms
    heavy = sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    per = run.n_steps or 1
    evidence = (f"forward/backward {_ms(total / per)} per {'step' if run.n_steps else 'run'}"
                f" = {_pct(share)} of {run.of_loop()}; heaviest: "
                + ", ".join(f"{n} {_ms(ms / per)}" for n, ms in heavy))
    data: dict[str, Any] = {"compute_ms": total, "share": share, "heaviest": dict(heavy)}
    mfu = _mfu(run.steps)
    if mfu is not None:  # the steps were given their FLOPs: how busy the math units were
        data["mfu"], data["flops_per_s"] = mfu
        evidence += f"; MFU {format_mfu(mfu[0])} ({format_flops(mfu[1])} achieved)"
    measured = [s for s in ("amp", "compile", "channels_last") if s not in run.on]
    return _finding(run, "compute", "Compute-bound: forward and backward dominate", share,
                    evidence, data, [
        *([_Fix("model, report = perfsdk.optimize.optimize(model, inputs, auto=True)",
                f"measures {_and([_STATES[s] for s in measured])} on this machine and keeps "
                "the fastest that computes the same")] if measured else []),
        _Fix("model = perfsdk.optimize.apply_amp(model)",
             "by hand: autocast (bfloat16 on a CPU, float16 on CUDA); measure it, some CPUs "
             "emulate bfloat16", "amp"),
        _Fix('step = perfsdk.optimize.TrainStep(model, optimizer, loss_fn, amp="bf16")',
             "training: forward under autocast, loss = step(inputs, target=target)", "amp"),
        _Fix("model = perfsdk.optimize.apply_compile(model)", "", "compile")],
                    covers=("amp", "compile", "channels_last"))


RULES = (data_rule, sync_rule, launch_rule, memory_rule, creep_rule)
"""The rules that stand alone, in the seeds' order; ``compute_rule`` runs after them."""
