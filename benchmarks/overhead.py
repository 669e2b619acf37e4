#!/usr/bin/env python
"""Per-call overhead of ``@profiled`` against a bare call, NVTX, torch.profiler and OpenTelemetry.

Usage::

    python benchmarks/overhead.py                  # full run (about a minute)
    python benchmarks/overhead.py --quick          # a few repeats, for a smoke test
    python benchmarks/overhead.py --output x.json  # default: benchmarks/results/overhead.json

The script builds the NVTX recording injection library (``tests/nvtx_injection/recorder.c``) and
re-executes itself with ``NVTX_INJECTION64_PATH`` pointing at it, so every NVTX push and pop goes
through a real tool's callbacks, as under Nsight Systems. Every variant then runs in that one
child process; repeats interleave the variants (in a rotating order) to cancel drift, and the
table reports the median ns/call with p10/p90 across repeats. See benchmarks/README.md for what
each number means. The exit status is 0 whether or not the targets are met: this is a
measurement; the table says PASS or FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "overhead.json"
CHILD_FLAG = "PERFSDK_BENCH_CHILD"
NVTX_ERROR = "PERFSDK_BENCH_NVTX_ERROR"
NVTX_LIB = "PERFSDK_BENCH_NVTX_LIB"

# Targets from issue 2 ("Overhead benchmark").
FULL_ADDED_MAX_NS = 3000.0
FULL_VS_OTEL_MIN = 5.0
WHOLE_VS_OTEL_MIN = 3.0
NVTX_ONLY_VS_PUSHPOP_MAX = 1.5
MEMORY_ADDED_MAX_NS = 1000.0  # issue 3
NVML_CORE_MAX = 0.01  # issue 3
DISABLED_RUNTIME_VS_WRAPS_MAX = 1.2
FULL_VS_WRAPS_MAX = 25.0  # issue 16
INFLATION_MAX = 0.20  # issue 16
BUSY_RATIO = 1.15  # wall / CPU time above this in single-threaded variants: the machine was busy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repeats and calls (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--repeats", type=int, help="repeats per variant (default 15; quick 3)")
    p.add_argument("--calls", type=int, help="calls per repeat (default 20000; quick 2000)")
    p.add_argument("--whole-calls", type=int,
                   help="calls in each whole-cost loop (default 200000; quick 5000)")
    p.add_argument("--whole-repeats", type=int, help="whole-cost repeats (default 5; quick 1)")
    p.add_argument("--gil-calls", type=int,
                   help="calls in each loop of the background-thread section (default 50000; "
                        "quick 2000)")
    p.add_argument("--gil-repeats", type=int,
                   help="repeats of the background-thread section (default 7; quick 2)")
    p.add_argument("--nvtx-record", choices=("off", "file"), default="off",
                   help="off: the injection library's callbacks run but write nothing (default); "
                        "file: it also writes every event as JSON to a temporary file")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("repeats", 15, 3), ("calls", 20_000, 2_000),
                              ("whole_calls", 200_000, 5_000), ("whole_repeats", 5, 1),
                              ("gil_calls", 50_000, 2_000), ("gil_repeats", 7, 2)):
        value = getattr(args, name)
        if value is None:
            setattr(args, name, small if quick else full)
        elif value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Build the NVTX injection library, then run the measurement in a child process."""
    sys.path.insert(0, str(REPO_ROOT))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "NVTX_"))}
    env.update({
        CHILD_FLAG: "1",
        "PERFSDK_ENABLED": "1",
        "PERFSDK_NVTX": "1",
        "PERFSDK_SAMPLE_EVERY": "1",
        "PERFSDK_EXPORTER": "none",
        "PERFSDK_EXPORT_TIMEOUT": "300",  # the whole-cost flush must not be cut short
    })
    with tempfile.TemporaryDirectory(prefix="perfsdk-bench-") as tmp:
        try:
            from tests.nvtx_injection.recorder import build_library

            lib = build_library(Path(tmp) / "nvtx")
        except Exception as exc:  # measure without injection, and say so
            env[NVTX_ERROR] = f"{type(exc).__name__}: {exc}"
            print(f"warning: NVTX injection library unavailable ({exc}); NVTX calls will be "
                  "near no-ops and the table says so.", file=sys.stderr)
        else:
            env["NVTX_INJECTION64_PATH"] = str(lib)
            env[NVTX_LIB] = str(lib)
            if args.nvtx_record == "file":
                env["NVTX_RECORD_PATH"] = str(Path(tmp) / "nvtx-events.jsonl")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv],
                              env=env, check=False)
    return proc.returncode


# ------------------------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, Any]:
    return {"median": percentile(values, 50), "p10": percentile(values, 10),
            "p90": percentile(values, 90), "samples": [round(v, 2) for v in values]}


def timed_loop(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(wall ns per call, calling-thread CPU ns per call) of ``n`` back-to-back calls."""
    calls = itertools.repeat(None, n)
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    for _ in calls:
        fn()
    t1 = time.perf_counter_ns()
    c1 = time.thread_time_ns()
    return (t1 - t0) / n, (c1 - c0) / n


def _noop() -> None:
    pass


@dataclasses.dataclass
class Variant:
    name: str
    label: str
    fn: Callable[[], Any]
    setup: Callable[[], None] = _noop  # before warm-up; sets perfsdk's configuration
    pause: Callable[[], None] = _noop  # right before the timed loop
    teardown: Callable[[], None] = _noop
    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    spans: list[int] = dataclasses.field(default_factory=list)  # exported per timed loop
    pending: list[int] = dataclasses.field(default_factory=list)  # queued when the loop ends
    others: list[dict[str, float]] = dataclasses.field(default_factory=list)  # other threads'
    # CPU ns per call during each timed loop, by thread name (background section)


def body() -> Callable[[], int]:
    """A fresh zero-argument function whose body is ``return 1``."""
    def fn() -> int:
        return 1
    return fn


def passthrough(fn: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


# ------------------------------------------------------------------------------ measurement
def measure(args: argparse.Namespace) -> int:
    caught: list[str] = []
    show = warnings.showwarning

    def record_warning(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        caught.append(f"{category.__name__}: {message}")
        show(message, category, *rest, **kw)

    warnings.showwarning = record_warning

    import nvtx
    import torch
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    import perfsdk
    from perfsdk.pipeline import PIPELINE

    class DropExporter(SpanExporter):
        """Counts the spans it is handed and drops them."""

        def __init__(self) -> None:
            self.spans = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    notes: list[str] = []

    # perfsdk's own pipeline ("owned" mode) with a dropping exporter instance.
    perfsdk_drop = DropExporter()
    notes.append("full: configure(exporter=DropExporter()) - perfsdk's own pipeline, spans "
                 "built and handed to an exporter that drops them")

    # OpenTelemetry's own tracer on an SDK provider with the same BatchSpanProcessor settings
    # perfsdk uses. Not installed globally: perfsdk must stay in its owned mode (a global SDK
    # provider would switch it to "user" mode); a provider's tracer does the same work per span
    # whether or not the provider is the global one.
    otel_drop = DropExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "perfsdk-bench"}))
    provider.add_span_processor(BatchSpanProcessor(
        otel_drop, max_queue_size=65536, max_export_batch_size=2048, schedule_delay_millis=1000))
    tracer = provider.get_tracer("perfsdk-bench")
    notes.append("otel: SDK TracerProvider (not set globally, so perfsdk stays in its owned "
                 "mode in the same process) + BatchSpanProcessor(max_queue_size=65536, "
                 "max_export_batch_size=2048, schedule_delay_millis=1000, the same as "
                 "perfsdk's export queue here) + DropExporter")

    # perfsdk's export queue as large as the OTel comparison's BatchSpanProcessor, so both keep
    # every span of a timed loop (the default, OTEL_BSP_MAX_QUEUE_SIZE=2048, would drop most).
    QUEUE = {"export_queue_size": 65536, "export_batch_size": 2048, "export_delay_s": 1.0}

    def settle() -> None:
        """Nothing left in the background before a timed loop; a clean garbage collector."""
        perfsdk.flush()
        provider.force_flush()
        gc.collect()

    def use_exporter(exporter: Any) -> Callable[[], None]:
        return lambda: perfsdk.configure(exporter=exporter, timing=True, **QUEUE)

    def nvtx_only() -> None:
        perfsdk.configure(exporter="none", timing=False)

    interval = getattr(PIPELINE, "interval", None)

    def pause_pipeline() -> None:
        PIPELINE.interval = 3600.0  # the thread sleeps this long after its current wait
        PIPELINE.wake()
        time.sleep(0.02)

    def resume_pipeline() -> None:
        PIPELINE.interval = interval
        PIPELINE.wake()

    # -- the variants ----------------------------------------------------------------------
    bare = body()

    perfsdk.configure(enabled=False)
    try:
        raw = body()
        disabled_decorated = perfsdk.profiled("bench.disabled_at_decoration")(raw)
    finally:
        perfsdk.configure(enabled=True)
    returns_itself = disabled_decorated is raw

    dom = nvtx.get_domain("bench")
    attrs = dom.get_event_attributes(message="bench.pushpop", color=0xFF4E79A7)

    def pushpop() -> int:
        dom.push_range(attrs)
        try:
            return 1
        finally:
            dom.pop_range()

    def record_function() -> int:
        with torch.profiler.record_function("bench.record_function"):
            return 1

    def otel_span() -> int:
        with tracer.start_as_current_span("bench.otel"):
            return 1

    full = perfsdk.profiled("bench.full")(body())
    variants = [
        Variant("bare", "bare call", bare),
        Variant("wraps", "functools.wraps passthrough", passthrough(body())),
        Variant("disabled_decoration", "@profiled disabled at decoration", disabled_decorated),
        Variant("disabled_runtime", "@profiled disabled at run time",
                perfsdk.profiled("bench.disabled_at_runtime")(body()),
                setup=lambda: perfsdk.configure(enabled=False),
                teardown=lambda: perfsdk.configure(enabled=True)),
        Variant("nvtx_only", "@profiled NVTX-only (PERFSDK_TIMING=0)",
                perfsdk.profiled("bench.nvtx_only")(body()), setup=nvtx_only,
                teardown=lambda: perfsdk.configure(timing=True)),
        Variant("full", "@profiled full (spans, dropping exporter)", full,
                setup=use_exporter(perfsdk_drop)),
        Variant("nvtx_annotate", "nvtx.annotate decorator",
                nvtx.annotate("bench.annotate", color="blue", domain="bench")(body())),
        Variant("nvtx_pushpop", "nvtx domain push/pop, pre-built attrs", pushpop),
        Variant("record_function", "torch.profiler.record_function", record_function),
        Variant("otel", "OTel start_as_current_span + BSP", otel_span),
    ]
    if interval is not None and hasattr(PIPELINE, "wake"):
        variants.insert(6, Variant(
            "full_paused", "@profiled full, pipeline thread paused", full,
            setup=use_exporter(perfsdk_drop), pause=pause_pipeline, teardown=resume_pipeline))
        variants.insert(7, Variant(
            "memory_paused", "@profiled full + memory=True, pipeline paused",
            perfsdk.profiled("bench.memory", memory=True)(body()),
            setup=use_exporter(perfsdk_drop), pause=pause_pipeline, teardown=resume_pipeline))
        notes.append("full_paused: the pipeline's background thread is held asleep during the "
                     "timed loop (PIPELINE.interval set to an hour); the regions are drained "
                     "after the loop, outside the timing")
        notes.append("memory_paused: full_paused plus memory=True (on this CPU machine: the "
                     "process's peak RSS from getrusage at enter and exit)")
    else:
        notes.append("full_paused: skipped (perfsdk.pipeline.PIPELINE has no interval/wake)")

    nvtx_lib = os.environ.get(NVTX_LIB)
    loaded = False
    if nvtx_lib and Path("/proc/self/maps").exists():
        loaded = nvtx_lib in Path("/proc/self/maps").read_text()
    nvtx_info = {
        "library": nvtx_lib, "loaded": loaded, "error": os.environ.get(NVTX_ERROR),
        "record": "file" if os.environ.get("NVTX_RECORD_PATH") else "off",
    }

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None

    # -- calling-thread cost: interleaved repeats ----------------------------------------
    warm = min(args.calls, 1000)
    for v in variants:  # first use: lazy set-up (NVTX domains, span mode, exporter threads)
        v.setup()
        timed_loop(v.fn, warm)
        v.teardown()
    phase = random.Random(0)
    for rep in range(args.repeats):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            v.setup()
            timed_loop(v.fn, min(warm, 100))
            settle()
            # gc.collect() holds the GIL longer than the pipeline thread's interval, so that
            # thread always drains (nothing) right after it, and a loop shorter than the interval
            # would never see it run. Start each loop at a random point of its cycle instead.
            time.sleep(phase.uniform(0.0, interval or 0.0))
            before = perfsdk_drop.spans + otel_drop.spans
            v.pause()
            wall, cpu = timed_loop(v.fn, args.calls)
            v.pending.append(getattr(PIPELINE, "pending", -1))
            v.teardown()
            perfsdk.flush()
            provider.force_flush()
            v.wall.append(wall)
            v.cpu.append(cpu)
            v.spans.append(perfsdk_drop.spans + otel_drop.spans - before)
    settle()

    # -- whole cost: a long loop plus the final flush -------------------------------------
    def whole_full() -> tuple[float, int]:
        perfsdk.configure(exporter=perfsdk_drop, **QUEUE)
        timed_loop(full, 100)
        settle()
        before = perfsdk_drop.spans
        t0 = time.perf_counter_ns()
        timed_loop(full, args.whole_calls)
        perfsdk.flush()
        return (time.perf_counter_ns() - t0) / args.whole_calls, perfsdk_drop.spans - before

    def whole_otel() -> tuple[float, int]:
        timed_loop(otel_span, 100)
        settle()
        before = otel_drop.spans
        t0 = time.perf_counter_ns()
        timed_loop(otel_span, args.whole_calls)
        provider.force_flush()
        return (time.perf_counter_ns() - t0) / args.whole_calls, otel_drop.spans - before

    whole: dict[str, dict[str, Any]] = {
        "full": {"label": "@profiled full + perfsdk.flush()", "run": whole_full},
        "otel": {"label": "OTel start_as_current_span + force_flush()", "run": whole_otel},
    }
    for w in whole.values():
        w["ns"], w["spans"], w["gc"] = [], [], []
    for rep in range(args.whole_repeats):
        for key in (("full", "otel") if rep % 2 == 0 else ("otel", "full")):
            gc_before = [g["collections"] for g in gc.get_stats()]
            ns, spans = whole[key]["run"]()
            gc_after = [g["collections"] for g in gc.get_stats()]
            whole[key]["ns"].append(ns)
            whole[key]["spans"].append(spans)
            whole[key]["gc"].append([a - b for a, b in zip(gc_after, gc_before, strict=True)])
    settle()

    # -- background: what the pipeline thread's work costs the caller ----------------------
    background = measure_background(
        args, torch, perfsdk, PIPELINE, setup=use_exporter(perfsdk_drop), pause=pause_pipeline,
        resume=resume_pipeline, settle=settle, interval=interval or 0.0)
    settle()

    # The NVML sampler at its default interval, against perfsdk's fake NVML (this machine has
    # no GPU): perfsdk's own per-round work, not the driver's call latency.
    from perfsdk.nvml import GpuSampler
    from perfsdk.testing import FakeNvml

    fake_nvml = FakeNvml(1)
    sampler = GpuSampler(perfsdk.get_config().gpu_sample_interval_s or 0.1, nvml=fake_nvml,
                         device_uuids=fake_nvml.uuids)
    sampler.start()
    time.sleep(0.5 if args.quick else 3.0)
    sampler.stop()
    stats = sampler.overhead()
    args.nvml = {"interval_s": perfsdk.get_config().gpu_sample_interval_s or 0.1,
                 "rounds": stats.rounds, "cpu_s": stats.cpu_s, "wall_s": stats.wall_s,
                 "core_fraction": stats.core_fraction, "nvml": "perfsdk.testing.FakeNvml(1)"}
    notes.append(f"nvml sampler: {stats.rounds} rounds in {stats.wall_s:.1f} s against the fake "
                 f"NVML (1 GPU), {stats.cpu_s * 1e3:.1f} ms of CPU: perfsdk's own work per round; "
                 "a real driver's call latency is not in it")

    load = {"start": load_start, "end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    result = report(args, variants, whole, returns_itself, nvtx_info, notes, load, background)
    result["perfsdk_diagnostics"] = perfsdk.diagnostics()
    result["warnings"] = caught
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


# ------------------------------------------------------------------- background (issue 16)
BACKGROUND_KINDS = {
    "tight": "return 1 (the caller never releases the GIL)",
    "hash": "sha256 of 4 KiB (the caller releases the GIL for a few microseconds a call)",
    "torch": "torch.mm of two 64x64 float tensors, 1 intra-op thread (the caller releases the "
             "GIL for the op's microseconds, as a training step's ops do)",
}


def measure_background(args: argparse.Namespace, torch: Any, perfsdk: Any, pipeline: Any, *,
                       setup: Callable[[], None], pause: Callable[[], None],
                       resume: Callable[[], None], settle: Callable[[], None],
                       interval: float) -> dict[str, Any]:
    """How much of the pipeline thread's work lands on the caller (issue 16): for each loop
    body in :data:`BACKGROUND_KINDS`, ``--gil-calls`` calls of the body bare, decorated (the
    pipeline thread running as usual: it wakes every ``interval`` and resolves, summarizes,
    builds metrics and queues spans while the loop runs) and decorated with the pipeline
    thread held asleep (its work done after the loop, outside the timing). Loops long enough
    for the pipeline thread to wake several times; repeats interleaved, order rotated."""
    x = torch.ones(64, 64)
    mm = torch.mm
    data = bytes(4096)  # hashlib releases the GIL for data of 2 KiB and more

    def make(kind: str) -> Callable[[], int]:
        if kind == "tight":
            return body()
        if kind == "hash":
            def fn() -> int:
                sha256(data)
                return 1
            return fn

        def op() -> int:
            mm(x, x)
            return 1
        return op

    loops: dict[str, list[Variant]] = {}
    for kind in BACKGROUND_KINDS:
        full = perfsdk.profiled(f"bench.background.{kind}")(make(kind))
        loops[kind] = [
            Variant("bare", "bare", make(kind)),
            Variant("full", "@profiled full", full, setup=setup),
            Variant("full_paused", "@profiled full, pipeline paused", full, setup=setup,
                    pause=pause, teardown=resume),
        ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the op on the calling thread only: the other core stays free
    max_pending = pipeline.max_pending
    pipeline.max_pending = max(max_pending, 2 * args.gil_calls)  # paused loops: nothing spilled
    phase = random.Random(1)
    try:
        for rep in range(args.gil_repeats):
            for variants in loops.values():
                k = rep % len(variants)
                for v in variants[k:] + variants[:k]:
                    v.setup()
                    timed_loop(v.fn, 200)
                    settle()
                    time.sleep(phase.uniform(0.0, interval))
                    v.pause()
                    before = threads_cpu()
                    wall, cpu = timed_loop(v.fn, args.gil_calls)
                    after = threads_cpu()
                    v.pending.append(pipeline.pending)
                    v.teardown()
                    perfsdk.flush()
                    v.wall.append(wall)
                    v.cpu.append(cpu)
                    v.others.append({name: (ns - before.get(name, 0)) / args.gil_calls
                                     for name, ns in after.items()})
    finally:
        pipeline.max_pending = max_pending
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"calls": args.gil_calls, "repeats": args.gil_repeats, "loops": {}}
    for kind, variants in loops.items():
        med = {v.name: percentile(v.wall, 50) for v in variants}
        own = med["full_paused"] - med["bare"]
        out["loops"][kind] = {
            "body": BACKGROUND_KINDS[kind],
            "variants": {v.name: {"label": v.label, "ns_per_call": stats(v.wall),
                                  "thread_cpu_ns_per_call": stats(v.cpu),
                                  "pipeline_pending_after_loop": v.pending} for v in variants},
            "added_ns": med["full"] - med["bare"],
            "added_paused_ns": own,
            "inflation": _div(med["full"] - med["full_paused"], own),
            "background_cpu_ns_per_call": background_cpu(
                next(v for v in variants if v.name == "full").others),
        }
    return out


def threads_cpu() -> dict[str, int]:
    """CPU time (ns) of every thread but the calling one, by thread name (summed when names
    repeat); empty where the platform has no per-thread CPU clocks."""
    out: dict[str, int] = {}
    me = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        try:
            ns = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # no per-thread CPU clocks, or the thread ended
            continue
        out[thread.name] = out.get(thread.name, 0) + ns
    return out


def background_cpu(loops: list[dict[str, float]]) -> dict[str, float]:
    """Median CPU ns per call of each other thread across the loops: ``perfsdk-pipeline``,
    the export threads (``perfsdk-export-*``), the rest grouped as ``other``. Holding the GIL
    is what a Python thread's CPU time mostly is, so this is what the caller's loop could lose
    to them at most (as it does when its own GIL-free stretches are short)."""
    grouped: list[dict[str, float]] = []
    for loop in loops:
        g: dict[str, float] = {}
        for name, ns in loop.items():
            key = name if name.startswith("perfsdk-") else "other"
            g[key] = g.get(key, 0.0) + ns
        grouped.append(g)
    names = sorted({n for g in grouped for n in g})
    out = {n: percentile([g.get(n, 0.0) for g in grouped], 50) for n in names}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------- report
def report(args: argparse.Namespace, variants: list[Variant], whole: dict[str, dict[str, Any]],
           returns_itself: bool, nvtx_info: dict[str, Any], notes: list[str],
           load: dict[str, Any], background: dict[str, Any] | None = None) -> dict[str, Any]:
    by = {v.name: v for v in variants}
    med = {v.name: percentile(v.wall, 50) for v in variants}
    bare, wraps = med["bare"], med["wraps"]
    out_variants: dict[str, Any] = {}
    for v in variants:
        out_variants[v.name] = {
            "label": v.label, "calls": args.calls, "repeats": len(v.wall),
            "ns_per_call": stats(v.wall), "thread_cpu_ns_per_call": stats(v.cpu),
            "added_ns": med[v.name] - bare, "ratio_vs_bare": med[v.name] / bare,
            "ratio_vs_wraps": med[v.name] / wraps,
            "spans_per_call": sum(v.spans) / (args.calls * len(v.spans)),
            "pipeline_pending_after_loop": v.pending,
        }
    out_whole: dict[str, Any] = {}
    for key, w in whole.items():
        ns = stats(w["ns"])
        out_whole[key] = {"label": w["label"], "calls": args.whole_calls,
                          "repeats": len(w["ns"]), "ns_per_call": ns,
                          "added_ns": ns["median"] - bare, "spans_exported": w["spans"],
                          "gc_collections_per_generation": w["gc"],
                          "complete": all(s == args.whole_calls for s in w["spans"])}

    added = {k: med[k] - bare for k in med}
    full_added = added["full"]
    whole_full = out_whole["full"]["added_ns"]
    whole_otel = out_whole["otel"]["added_ns"]
    targets = [
        _target("full_added", f"full adds <= {FULL_ADDED_MAX_NS:.0f} ns per call on the calling "
                "thread (added = full - bare, medians)", full_added, "<=", FULL_ADDED_MAX_NS,
                also=_full_also(by, med, bare)),
        _target("full_vs_otel", f"full >= {FULL_VS_OTEL_MIN:g}x cheaper than OTel "
                "start_as_current_span on the calling thread (otel added / full added)",
                _div(added["otel"], full_added), ">=", FULL_VS_OTEL_MIN),
        _target("whole_vs_otel", f"whole cost (loop + final flush) >= {WHOLE_VS_OTEL_MIN:g}x "
                "below OTel's (otel whole added / full whole added; added = per call - bare)",
                _div(whole_otel, whole_full), ">=", WHOLE_VS_OTEL_MIN),
        _target("nvtx_only_vs_pushpop", f"NVTX-only within {NVTX_ONLY_VS_PUSHPOP_MAX:g}x of nvtx "
                "domain push/pop (added costs: nvtx_only added / pushpop added)",
                _div(added["nvtx_only"], added["nvtx_pushpop"]), "<=",
                NVTX_ONLY_VS_PUSHPOP_MAX,
                also={"ratio_of_per_call_totals": med["nvtx_only"] / med["nvtx_pushpop"],
                      "ratio_vs_nvtx_annotate_added": _div(added["nvtx_only"],
                                                           added["nvtx_annotate"])}),
        *([_target("memory_added", f"memory tracking adds <= {MEMORY_ADDED_MAX_NS:.0f} ns per "
                   "region on CPU (memory_paused - full_paused, medians)",
                   med["memory_paused"] - med["full_paused"], "<=", MEMORY_ADDED_MAX_NS)]
          if "memory_paused" in med else []),
        *([_target("nvml_core_fraction", "the NVML sampler at its default interval costs "
                   f"<= {NVML_CORE_MAX:.0%} of one core (fake NVML, 1 GPU)",
                   args.nvml["core_fraction"], "<=", NVML_CORE_MAX)]
          if getattr(args, "nvml", None) else []),
        {"name": "disabled_decoration_identity", "definition": "disabled at decoration "
         "returns the function itself (profiled(fn) is fn)", "value": returns_itself,
         "threshold": True, "op": "is", "passed": returns_itself},
        _target("disabled_runtime_vs_wraps", f"disabled at run time <= "
                f"{DISABLED_RUNTIME_VS_WRAPS_MAX:g}x the functools.wraps passthrough "
                "(per-call medians, bare call included)", med["disabled_runtime"] / wraps, "<=",
                DISABLED_RUNTIME_VS_WRAPS_MAX),
        _target("full_vs_wraps", f"full <= {FULL_VS_WRAPS_MAX:g}x the functools.wraps "
                "passthrough on the calling thread (per-call medians, bare call included)",
                med["full"] / wraps, "<=", FULL_VS_WRAPS_MAX,
                also={"added_over_added": _div(full_added, added["wraps"]),
                      "pipeline_thread_paused": med["full_paused"] / wraps,
                      "calling_thread_cpu": percentile(by["full"].cpu, 50)
                      / percentile(by["wraps"].cpu, 50)}),
    ]
    if background is not None:
        loops = background["loops"]
        worst = max(loops, key=lambda kind: loops[kind]["inflation"])
        targets.append(_target(
            "pipeline_inflation", "the pipeline thread inflates the caller's added cost by <= "
            f"{INFLATION_MAX:.0%}: (full - full_paused) / (full_paused - bare), medians of "
            f"{background['calls']:,}-call loops, the worst of the loop bodies "
            f"{', '.join(loops)} (here: {worst})",
            loops[worst]["inflation"], "<=", INFLATION_MAX,
            also={f"{kind}_inflation": loop["inflation"] for kind, loop in loops.items()}))
    for name in ("nvtx_only", "full"):
        if name in by:
            if any(p < 0 for p in by[name].pending):
                continue  # the pipeline no longer reports what is pending
            drained = sum(p != args.calls for p in by[name].pending)
            notes.append(f"{name}: the pipeline thread handled regions during {drained} of "
                         f"{len(by[name].pending)} timed loops (it wakes every "
                         f"{_interval()} s; the rest of the regions wait for the next flush)")
    # Without background threads of their own, these variants' wall time should equal the
    # calling thread's CPU time; more means other processes took the CPU during the loops.
    quiet = [n for n in ("bare", "wraps", "disabled_runtime", "nvtx_annotate", "nvtx_pushpop",
                         "record_function") if n in by]
    busy = percentile([med[n] / percentile(by[n].cpu, 50) for n in quiet], 50)
    machine_busy = busy > BUSY_RATIO
    if machine_busy:
        notes.insert(0, f"WARNING: the machine was busy: wall time was {busy:.2f}x the calling "
                     f"thread's CPU time in variants without background threads (load average "
                     f"{_load(load)}); wall-time numbers are inflated, the cpu column less so")
    if not all(w["complete"] for w in out_whole.values()):
        notes.append("WARNING: a whole-cost run exported fewer spans than calls "
                     "(spans dropped or flush cut short); its whole cost is understated")

    result = {
        "benchmark": "perfsdk overhead",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "repeats": args.repeats, "calls": args.calls,
                     "whole_calls": args.whole_calls, "whole_repeats": args.whole_repeats,
                     "gil_calls": args.gil_calls, "gil_repeats": args.gil_repeats,
                     "order": "variants interleaved per repeat, order rotated each repeat",
                     "gc": "enabled; gc.collect() and a flush before every timed loop"},
        "nvtx_injection": nvtx_info,
        "machine": {**machine_info(), "load_average": load, "wall_over_cpu": busy,
                    "busy": machine_busy},
        "versions": versions(),
        "variants": out_variants,
        "whole_cost": out_whole,
        "background": background,
        "targets": targets,
        "nvml_sampler": getattr(args, "nvml", None),
        "notes": notes,
    }
    print_table(result, by)
    return result


def _load(load: dict[str, Any]) -> str:
    if load["start"] is None:
        return "unknown"
    return f"{load['start'][0]:.1f} at start, {load['end'][0]:.1f} at end"


def _interval() -> Any:
    from perfsdk.pipeline import PIPELINE

    return getattr(PIPELINE, "interval", "?")


def _full_also(by: dict[str, Variant], med: dict[str, float], bare: float) -> dict[str, float]:
    also = {}
    if "full_paused" in by:
        also["pipeline_thread_paused_added_ns"] = med["full_paused"] - bare
    cpu_bare = percentile(by["bare"].cpu, 50)
    also["calling_thread_cpu_added_ns"] = percentile(by["full"].cpu, 50) - cpu_bare
    return also


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def _target(name: str, definition: str, value: float, op: str, threshold: float,
            also: dict[str, float] | None = None) -> dict[str, Any]:
    passed = value <= threshold if op == "<=" else value >= threshold
    out = {"name": name, "definition": definition, "value": value, "op": op,
           "threshold": threshold, "passed": passed}
    if also:
        out["also"] = also  # the same comparison under other definitions, for information
    return out


def print_table(result: dict[str, Any], by: dict[str, Variant]) -> None:
    s = result["settings"]
    nv = result["nvtx_injection"]
    if nv["loaded"]:
        how = ("callbacks run, nothing written" if nv["record"] == "off"
               else "every event written as JSON to a file")
        nvtx_line = f"NVTX injection: recorder attached ({how})"
    else:
        nvtx_line = f"NVTX injection: NOT attached ({nv['error'] or 'library not loaded'})"
    print(f"\nperfsdk overhead: {s['repeats']} repeats x {s['calls']:,} calls, interleaved; "
          f"{nvtx_line}")
    print("ns per call on the calling thread: median and p10/p90 across repeats; "
          "added = median - bare; cpu = calling-thread CPU time;\n"
          "spans = spans reaching the dropping exporters per call\n")
    head = (f"{'variant':<44}{'median':>9}{'p10':>9}{'p90':>9}{'x bare':>8}{'x wraps':>9}"
            f"{'added':>9}{'cpu':>9}{'spans':>7}")
    print(head)
    print("-" * len(head))
    for v in result["variants"].values():
        ns, cpu = v["ns_per_call"], v["thread_cpu_ns_per_call"]
        print(f"{v['label']:<44}{ns['median']:>9.0f}{ns['p10']:>9.0f}{ns['p90']:>9.0f}"
              f"{v['ratio_vs_bare']:>8.2f}{v['ratio_vs_wraps']:>9.2f}{v['added_ns']:>9.0f}"
              f"{cpu['median']:>9.0f}{v['spans_per_call']:>7.2f}")
    print(f"\nwhole cost: {s['whole_repeats']} x ({s['whole_calls']:,} calls + the final flush), "
          "wall ns per call")
    head = f"{'':<44}{'median':>9}{'p10':>9}{'p90':>9}{'added':>9}  spans exported"
    print(head)
    print("-" * len(head))
    for w in result["whole_cost"].values():
        ns = w["ns_per_call"]
        spans = ", ".join(f"{n:,}" for n in w["spans_exported"])
        flag = "" if w["complete"] else "  INCOMPLETE"
        print(f"{w['label']:<44}{ns['median']:>9.0f}{ns['p10']:>9.0f}{ns['p90']:>9.0f}"
              f"{w['added_ns']:>9.0f}  {spans}{flag}")
    bg = result.get("background")
    if bg:
        print(f"\nbackground: {bg['repeats']} x {bg['calls']:,}-call loops, wall ns per call; "
              "the pipeline thread running (full) or held asleep (full_paused)")
        head = (f"{'loop body':<10}{'bare':>9}{'full':>9}{'paused':>9}{'added':>9}"
                f"{'paused+':>9}{'inflation':>11}  full p10/p90")
        print(head)
        print("-" * len(head))
        for kind, loop in bg["loops"].items():
            v = loop["variants"]
            full = v["full"]["ns_per_call"]
            print(f"{kind:<10}{v['bare']['ns_per_call']['median']:>9.0f}{full['median']:>9.0f}"
                  f"{v['full_paused']['ns_per_call']['median']:>9.0f}{loop['added_ns']:>9.0f}"
                  f"{loop['added_paused_ns']:>9.0f}{loop['inflation']:>11.1%}"
                  f"  {full['p10']:.0f}/{full['p90']:.0f}")
        print("(added = full - bare; paused+ = full_paused - bare; inflation = (full - "
              "full_paused) / paused+)")
        print("other threads' CPU ns per call during the full loops (medians): "
              + "; ".join(f"{kind}: " + ", ".join(
                  f"{n.removeprefix('perfsdk-')} {ns:.0f}"
                  for n, ns in loop["background_cpu_ns_per_call"].items() if ns >= 1)
                  for kind, loop in bg["loops"].items()))
    print("\ntargets (issues 2, 3 and 16)")
    for t in result["targets"]:
        value = t["value"]
        def fmt(x: Any, name: str = t["name"]) -> str:
            if isinstance(x, bool):
                return str(x)
            if name.endswith("_added"):
                return f"{x:,.0f} ns"
            if name.endswith("_fraction"):
                return f"{x:.3%}"
            if name.endswith("_inflation"):
                return f"{x:.1%}"
            return f"{x:.2f}x"

        shown, limit = fmt(value), fmt(t["threshold"])
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['definition']}: {shown} "
              f"(target {t['op']} {limit})")
        if t.get("also"):
            print("        other definitions: " + "; ".join(
                f"{k.removesuffix('_ns').replace('_', ' ')} "
                + (f"{v:,.0f} ns" if k.endswith("_ns") else f"{v:.1%}"
                   if k.endswith("_inflation") else f"{v:.2f}x")
                for k, v in t["also"].items()))
    print("\nnotes")
    for note in result["notes"]:
        print(f"  - {note}")


def fill_counts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                counts: tuple[tuple[str, int, int], ...]) -> None:
    """Each ``(option, full, quick)`` left unset gets its default for ``--quick`` or a full run;
    every count given, and ``--threads`` where there is one, must be >= 1 (``parser.error``
    otherwise)."""
    for name, full, small in counts:
        value = getattr(args, name)
        if value is None:
            setattr(args, name, small if args.quick else full)
        elif value < 1:
            parser.error(f"--{name} must be >= 1")
    if getattr(args, "threads", 1) < 1:
        parser.error("--threads must be >= 1")


def clean_environment() -> None:
    """Measure perfsdk's defaults, whatever the shell exported (PERFSDK_SYNC_GUARD included):
    no PERFSDK_* or OTEL_* variable, and no exporter (for the benchmarks run in-process)."""
    for key in [k for k in os.environ if k.startswith(("PERFSDK_", "OTEL_"))]:
        del os.environ[key]
    os.environ["PERFSDK_EXPORTER"] = "none"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "cpus_usable": affinity,
            "python": sys.version.split()[0],
            "implementation": platform.python_implementation()}


def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {}
    for dist in ("perfsdk", "torch", "nvtx", "opentelemetry-api", "opentelemetry-sdk"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    import perfsdk

    out["perfsdk_path"] = str(Path(perfsdk.__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--",
                                "perfsdk"], capture_output=True, text=True, check=True).stdout
        out["git_commit"] = head
        out["perfsdk_dirty"] = bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):
        out["git_commit"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(CHILD_FLAG) == "1":
        # This checkout's perfsdk, whatever is installed: the JSON names this checkout's commit.
        sys.path.insert(0, str(REPO_ROOT))
        return measure(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
