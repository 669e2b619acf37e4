"""The advisor's thresholds, its :class:`Finding` and the rules (re-exported by perfsdk.advisor).

Each rule reads a :class:`Run` (the records of one run, with the step-time basis worked out) and
returns a :class:`Finding` or None, adding to ``run.notes`` what it could not check. The rules
follow the seeds' optimization loop: profile, name the bottleneck (data loading, host-device
syncs, launch overhead, memory, compute), apply the matching fix, measure again.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from perfsdk._syncops import OPS
from perfsdk.record import RegionResult
from perfsdk.sync import short_path as _short

__all__ = [
    "COMPUTE_SHARE", "DATA_SHARE", "LAUNCH_HOST_DEVICE_RATIO", "LAUNCH_MIN_IMPACT",
    "LAUNCH_SHORT_STEP_MS", "LAUNCH_UTILIZATION", "MEMORY_PRESSURE", "MEMORY_WEIGHT",
    "SYNCS_PER_STEP", "SYNC_MIN_IMPACT", "SYNC_STALL_MS", "WARMUP_MIN_STEPS", "WARMUP_STEPS",
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

COMPUTE_SHARE = 0.50
"""Compute-bound when nothing above was found and forward/backward regions (category
``module``, ``module.backward`` or ``compute``, or named ``forward`` / ``backward``) take at
least this fraction of the loop time. Impact: that fraction."""

_COMPUTE_CATEGORIES = frozenset({"module", "module.backward", "compute"})
_COMPUTE_NAMES = frozenset({"forward", "backward"})


def severity(impact: float) -> str:
    """``high`` from 0.3, ``medium`` from 0.1, else ``low``."""
    return "high" if impact >= 0.3 else "medium" if impact >= 0.1 else "low"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One bottleneck, with the numbers behind it and the perfsdk call that addresses it."""

    kind: str
    """``data``, ``sync``, ``launch``, ``memory`` or ``compute``."""
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
    """The perfsdk call or setting to apply first."""
    details: tuple[str, ...] = ()
    """More fixes, or the fix for each sync site."""


def _finding(kind: str, title: str, impact: float, evidence: str, data: Mapping[str, Any],
             fix: str, details: Sequence[str] = ()) -> Finding:
    impact = round(min(max(impact, 0.0), 1.0), 4)
    return Finding(kind, title, impact, severity(impact), evidence, dict(data), fix,
                   tuple(details))


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
    return _finding(
        "data", "Data loading: the loop waits for batches", share, evidence, data,
        "perfsdk.optimize.tune_dataloader(dataset, batch_size)",
        ["DataLoader(dataset, batch_size=..., num_workers=min(4, os.cpu_count()), "
         "pin_memory=True, persistent_workers=True)",
         "move per-sample preprocessing out of __getitem__ or onto the GPU"])


def _sites(run: Run, regions: Sequence[RegionResult]) -> list[tuple[str, str, int | None]]:
    """``(file:line, op, count or None)`` per site, most frequent first."""
    seen: Counter[str] = Counter()
    for r in regions:
        for site in r.attributes.get("perfsdk.sync_sites", ()):
            seen[str(site)] += 1
    summary_sites = tuple(getattr(run.summary, "sync_sites", ()) or ())
    if seen:  # the summary's sites are process-wide: keep those of this run's regions
        summary_sites = tuple(s for s in summary_sites
                              if f"{_short(s.file)}:{s.line} {s.op}" in seen)
    if summary_sites:
        return [(f"{_short(s.file)}:{s.line}", s.op, s.count) for s in summary_sites]
    out: list[tuple[str, str, int | None]] = []
    for site, _ in seen.most_common():
        where, _, op = site.rpartition(" ")
        out.append((where or site, op if where else "", None))
    return out


def sync_rule(run: Run) -> Finding | None:
    flagged = [r for r in run.regions if r.attributes.get("perfsdk.syncs")]
    total = sum(int(r.attributes["perfsdk.syncs"]) for r in flagged)
    sites = _sites(run, flagged)
    if not total and sites and run.summary is not None:  # syncs outside any region
        total = sum(count or 0 for _, _, count in sites)
    if not total:
        run.notes.append("host-device syncs: none recorded (they are only counted inside "
                         "perfsdk.no_sync_guard(\"count\"))")
        return None
    per_step = total / run.n_steps if run.n_steps else float(total)
    if run.n_steps and per_step < SYNCS_PER_STEP:
        return None
    step_ms = run.basis_ms / run.n_steps if run.n_steps else run.basis_ms
    impact = min(max(per_step * SYNC_STALL_MS / step_ms if step_ms > 0 else 0.0,
                     SYNC_MIN_IMPACT), 0.5)
    data = {"syncs": total, "syncs_per_step": per_step if run.n_steps else None,
            "sites": [{"where": w, "op": op, "count": c} for w, op, c in sites]}
    count = f"{per_step:.1f} per step ({total} in {run.n_steps} steps)" if run.n_steps \
        else f"{total} in the run"
    evidence = f"{count} at {len(sites)} call site{'s' if len(sites) != 1 else ''}"
    details = [f"{w} {op}{f' ({c}x in all)' if c else ''}: {OPS.get(op, 'remove it from the step')}"
               for w, op, c in sites]
    return _finding("sync", "Host-device syncs stall the GPU every step", impact, evidence,
                    data, 'perfsdk.no_sync_guard("error") around the step (or '
                    "PERFSDK_SYNC_GUARD=error in CI) raises at each line below", details)


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
    return _finding(
        "launch", "Launch overhead: the GPU idles between small kernels", impact, evidence,
        data, "model, report = perfsdk.optimize.optimize(model, x, compile=True)",
        ["model = perfsdk.optimize.apply_cuda_graphs(model)  (inference, fixed shapes)",
         'perfsdk.optimize.apply_compile(model, mode="reduce-overhead")  (CUDA graphs '
         "through torch.compile)",
         "a larger batch does more work per launch"])


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
    return _finding(
        "memory", "Memory pressure: the peak is near the device's capacity", impact, evidence,
        data, "model = perfsdk.optimize.apply_checkpointing(model, segments=2)",
        ["model = perfsdk.optimize.apply_amp(model)  (or TrainStep(..., amp=\"bf16\")): "
         "half-size activations",
         "a smaller batch, with TrainStep(..., accumulate=k) to keep the effective batch"])


def _is_compute(r: RegionResult) -> bool:
    return (_category(r) in _COMPUTE_CATEGORIES or r.name in _COMPUTE_NAMES
            or r.name.rsplit(".", 1)[-1] in _COMPUTE_NAMES)


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
    data = {"compute_ms": total, "share": share, "heaviest": dict(heavy)}
    return _finding(
        "compute", "Compute-bound: forward and backward dominate", share, evidence, data,
        "model = perfsdk.optimize.apply_amp(model)  (training: TrainStep(..., amp=\"bf16\"))",
        ["model, report = perfsdk.optimize.optimize(model, x, auto=True)  (AMP, compile, "
         "channels-last: keeps the fastest that matches)",
         "perfsdk.optimize.apply_compile(model)"])


RULES = (data_rule, sync_rule, launch_rule, memory_rule)
"""The rules that stand alone, in the seeds' order; ``compute_rule`` runs after them."""
