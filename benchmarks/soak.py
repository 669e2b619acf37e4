#!/usr/bin/env python
"""Soak: regions at full rate for minutes against a failing, a slow, a hung and a healthy exporter.

Usage::

    python benchmarks/soak.py                     # 4 cases x 60 s (about 5 minutes)
    python benchmarks/soak.py --quick             # 4 cases x 3 s, for a smoke test
    python benchmarks/soak.py --seconds 600 --cases blackhole --export-timeout 5

Each case runs in its own child process (fresh perfsdk state, its own RSS): one thread makes
regions back to back (``with perfsdk.timed_region("soak", i=i): pass``) for ``--seconds``, timing
each region's enter and exit with ``time.perf_counter_ns`` into a preallocated buffer that is
folded into a fixed histogram, while a sampler thread reads the RSS, open files, threads and
``perfsdk.diagnostics()`` every ``--sample-every`` seconds. The child then returns, so perfsdk's
own exit path (atexit, bounded by ``PERFSDK_EXPORT_TIMEOUT``) shuts it down; an atexit hook that
runs after perfsdk's writes the final diagnostics, where the span account must balance exactly.
The parent runs the collectors (a TCP black hole, the OTLP receiver) and times the child's exit.

The cases:

- ``dropping``: a SpanExporter whose ``export()`` returns FAILURE at once;
- ``slow``: a SpanExporter that sleeps 50 ms per batch, then returns SUCCESS;
- ``blackhole``: OTLP http/protobuf to a loopback collector that accepts connections and never
  answers (``tests.otlp_receiver.BlackHole``);
- ``healthy``: OTLP http/protobuf to the test OTLP receiver (``tests.otlp_receiver``), which
  parses every request and counts its spans.

The table says PASS or FAIL for each target; the exit status is 0 either way (a measurement).
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

from overhead import clean_environment, fill_counts, machine_info, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "soak.json"
CHILD_FLAG = "SOAK_CHILD"  # not PERFSDK_*: perfsdk reads (and checks) those

CASES = {
    "none": "no exporter: the control (the pipeline thread and the summary only)",
    "dropping": "SpanExporter whose export() returns FAILURE at once",
    "slow": "SpanExporter that sleeps 50 ms per batch, then SUCCESS",
    "blackhole": "OTLP http/protobuf to a loopback TCP collector that never answers",
    "healthy": "OTLP http/protobuf to the test OTLP receiver (parses, counts)",
}
SLOW_EXPORT_S = 0.05

# Targets (issue 13, item 9).
RSS_GROWTH_MAX_MIB = 64.0
P999_MAX_US = 1000.0
EXIT_SLACK_S = 0.5

# The latency histogram: 10 ns buckets below 1 ms; regions of 1 ms or more are kept exactly.
BUCKET_NS = 10
CAP_NS = 1_000_000
CHUNK = 1 << 20  # samples buffered before folding into the histogram (8 MiB)
BATCH = 4096  # regions between two looks at the clock; divides CHUNK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds per case (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--seconds", type=int, help="seconds of regions per case (default 60; quick 3)")
    p.add_argument("--sample-every", type=int,
                   help="seconds between RSS / pending samples (default 5; quick 1)")
    p.add_argument("--warmup", type=int,
                   help="RSS growth is counted from the sample at this second (default 5; quick 1)")
    p.add_argument("--export-timeout", type=float, default=2.0,
                   help="PERFSDK_EXPORT_TIMEOUT in each child, seconds (default 2)")
    p.add_argument("--switch-interval", type=float,
                   help="sys.setswitchinterval() in each child, seconds (default: Python's, "
                        "0.005): how long a thread waiting for the GIL waits at most before "
                        "the holder is asked to let go")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma list of cases to run (default all: {','.join(CASES)})")
    args = p.parse_args(argv)
    fill_counts(p, args, (("seconds", 60, 3), ("sample_every", 5, 1), ("warmup", 5, 1)))
    if not 0 < args.export_timeout <= 86400:
        p.error("--export-timeout must be > 0 and <= 86400")
    if args.switch_interval is not None and not 0 < args.switch_interval <= 1:
        p.error("--switch-interval must be > 0 and <= 1")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"--cases: unknown {unknown}; accepted values are {', '.join(CASES)}")
    # The sample RSS growth is counted from: before the end of the run.
    args.warm_s = args.warmup if args.warmup < args.seconds else max(
        0, args.seconds - args.sample_every)
    return args


# ---------------------------------------------------------------------------------- the parent
def launch(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    clean_environment()
    load_start = os.getloadavg()
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="perfsdk-soak-") as tmp:
        for case in args.cases:
            print(f"soak: {case} ({CASES[case]}), {args.seconds} s ...", flush=True)
            cases[case] = run_case(case, args, Path(tmp))
    load = {"start": load_start, "end": os.getloadavg()}
    result = report(args, cases, load)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


class _CountingReceiver:
    """The test OTLP receiver, counting spans instead of keeping them: at full rate it would
    otherwise hold millions of decoded spans (and spend the CPU decoding them)."""

    @staticmethod
    def make() -> Any:
        from tests.otlp_receiver import OTLPReceiver

        class CountingReceiver(OTLPReceiver):
            spans_received = 0

            def _record_traces(self, request: Any, headers: Any) -> None:
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with self._cond:
                    self.spans_received += n
                    self._cond.notify_all()

        return CountingReceiver("http")


def run_case(case: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One case in a child process; the collector (if any) runs here, in the parent."""
    seconds = args.seconds
    from tests.otlp_receiver import BlackHole

    env = dict(os.environ)
    env.update({
        CHILD_FLAG: case,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        "PERFSDK_EXPORT_TIMEOUT": f"{args.export_timeout:g}",
        "PERFSDK_SAMPLE_EVERY": "1",
    })
    result_path = tmp / f"{case}.json"
    collector: Any = None
    if case == "blackhole":
        collector = BlackHole()
    elif case == "healthy":
        collector = _CountingReceiver.make()
    if collector is not None:
        collector.__enter__()
        env.update({"PERFSDK_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": getattr(collector, "base_endpoint",
                                                           collector.endpoint),
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    command = [sys.executable, str(Path(__file__).resolve()), "--seconds", str(seconds),
               "--sample-every", str(args.sample_every),
               "--warmup", str(args.warmup),
               "--export-timeout", str(args.export_timeout), "--output", str(result_path)]
    if args.switch_interval is not None:
        command += ["--switch-interval", str(args.switch_interval)]
    load_start = os.getloadavg()
    try:
        proc = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=seconds + 10 * args.export_timeout + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        exited = time.monotonic()
    finally:
        received = getattr(collector, "spans_received", None)
        connections = getattr(collector, "connections", None)
        if collector is not None:
            collector.__exit__(None, None, None)
    out: dict[str, Any] = {"case": case, "what": CASES[case], "returncode": proc.returncode,
                           "load_average": {"start": load_start, "end": os.getloadavg()},
                           "stderr": stderr[-8000:], "stdout": stdout[-2000:]}
    try:
        loop = json.loads(result_path.read_text())
        final = json.loads(result_path.with_suffix(".final.json").read_text())
    except (OSError, ValueError) as exc:
        out["error"] = f"the child wrote no complete result ({exc!r}); exit {proc.returncode}"
        print(f"  {out['error']}\n{stderr[-3000:]}", file=sys.stderr)
        return out
    out.update(loop)
    out["final"] = final
    out["exit_s"] = exited - loop["written_monotonic"]
    out["collector"] = {"spans_received": received, "connections": connections}
    out["exit_lines"] = [line for line in stderr.splitlines()
                         if re.match(r"perfsdk: [\d,]+ of [\d,]+ spans were not exported", line)]
    out["warnings"] = [line.strip() for line in stderr.splitlines() if "Warning:" in line]
    return out


# ----------------------------------------------------------------------------------- the child
def child(args: argparse.Namespace) -> int:
    """Regions at full rate for ``args.seconds``; then return and let perfsdk's atexit run."""
    case = os.environ[CHILD_FLAG]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    marks: dict[str, float] = {}
    final_path = args.output.with_suffix(".final.json")

    def final() -> None:
        """Registered before perfsdk is imported, so it runs after perfsdk's atexit."""
        import perfsdk

        end = time.monotonic()
        info = perfsdk.diagnostics()
        final_path.write_text(json.dumps({
            "atexit_shutdown_s": end - marks.get("atexit_start", end),
            "diagnostics": info}, default=str))

    atexit.register(final)

    import numpy as np
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    import perfsdk

    atexit.register(lambda: marks.__setitem__("atexit_start", time.monotonic()))  # runs first

    class CountingExporter(SpanExporter):
        def __init__(self, result: SpanExportResult, sleep_s: float = 0.0) -> None:
            self.result, self.sleep_s = result, sleep_s
            self.calls = self.spans = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.calls += 1
            self.spans += len(spans)
            if self.sleep_s:
                time.sleep(self.sleep_s)
            return self.result

        def shutdown(self) -> None:
            pass

    exporter: CountingExporter | None = None
    if case == "dropping":
        exporter = CountingExporter(SpanExportResult.FAILURE)
    elif case == "slow":
        exporter = CountingExporter(SpanExportResult.SUCCESS, SLOW_EXPORT_S)
    if exporter is not None:
        perfsdk.configure(exporter=exporter)

    page = os.sysconf("SC_PAGE_SIZE")
    progress = [0]
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t_start = [0.0]

    def sample() -> None:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        info = perfsdk.diagnostics()
        samples.append({
            "t_s": round(time.monotonic() - t_start[0], 3), "regions": progress[0],
            "rss_mib": rss / 2**20, "pending_regions": info.get("pending_regions"),
            "spans_pending": info.get("spans_pending"), "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "cpu_s": time.process_time(),
            "spans_exported": info.get("spans_exported"),
            "spans_lost": sum((info.get("spans_lost") or {}).values())})

    def sampler() -> None:
        k = 1
        while not stop.wait(max(0.0, t_start[0] + k * args.sample_every - time.monotonic())):
            sample()
            k += 1

    # Preallocated and touched now, so that measuring adds nothing to the RSS later.
    buf = array("q", bytes(8 * CHUNK))
    hist = np.zeros(CAP_NS // BUCKET_NS, dtype=np.int64)
    hist[:] = 1
    hist[:] = 0
    big: list[tuple[int, int]] = []  # (ns, region index) of regions >= CAP_NS: at most one
    folds = [0.0]                     # per ms of the run

    def fold(n: int, first: int) -> None:
        f0 = time.perf_counter()
        lat = np.frombuffer(buf, dtype=np.int64, count=n)
        small = lat < CAP_NS
        hist[:] += np.bincount(lat[small] // BUCKET_NS, minlength=len(hist))
        slow = np.flatnonzero(~small)
        big.extend(zip(lat[slow].tolist(), (slow + first).tolist(), strict=True))
        folds[0] += time.perf_counter() - f0

    # Garbage collections during the loop, per generation: count, total and longest pause.
    gcs = {g: [0, 0.0, 0.0] for g in range(3)}
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pause = time.perf_counter() - gc_start[0]
            entry = gcs[info["generation"]]
            entry[0] += 1
            entry[1] += pause
            entry[2] = max(entry[2], pause)

    region = perfsdk.timed_region
    pc = time.perf_counter_ns
    t0 = pc()
    with region("soak", i=0):  # the first region sets perfsdk up (threads, exporters)
        pass
    first_ns = pc() - t0
    i, j = 1, 0
    t_start[0] = time.monotonic()
    sample()
    sampler_thread = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
    sampler_thread.start()
    deadline = t_start[0] + args.seconds
    cpu0, thread_cpu0, sched0 = time.process_time(), time.thread_time(), schedstat()
    threads0 = threads_cpu()
    gc.callbacks.append(on_gc)
    while True:
        for _ in range(BATCH):
            t0 = pc()
            with region("soak", i=i):
                pass
            buf[j] = pc() - t0
            j += 1
            i += 1
        progress[0] = i
        if j == CHUNK:
            fold(j, i - j)
            j = 0
        if time.monotonic() >= deadline:
            break
    loop_s = time.monotonic() - t_start[0]
    cpu1, thread_cpu1, sched1 = time.process_time(), time.thread_time(), schedstat()
    threads1 = threads_cpu()
    gc.callbacks.remove(on_gc)
    stop.set()
    sampler_thread.join()
    fold(j, i - j)
    sample()  # at the end of the loop, before exit

    regions = i
    out = {
        "regions": regions, "loop_s": loop_s, "regions_per_s": (regions - 1) / loop_s,
        "first_region_ms": first_ns / 1e6,
        "latency_us": latency_stats(hist, sorted(ns for ns, _ in big)),
        "slowest": [{"us": ns / 1e3, "region": k} for ns, k in sorted(big)[::-1][:20]],
        "gc": {f"gen{g}": {"collections": n, "total_s": tot, "longest_ms": top * 1e3}
               for g, (n, tot, top) in gcs.items()},
        "switch_interval_s": sys.getswitchinterval(),
        "fold_s": folds[0],
        "cpu": {"process_s": cpu1 - cpu0, "caller_thread_s": thread_cpu1 - thread_cpu0,
                "loop_wall_s": loop_s},
        "threads_cpu_s": {name: cpu - threads0.get(name, 0.0)
                          for name, cpu in sorted(threads1.items(), key=lambda kv: -kv[1])},
        "caller_sched": None if sched0 is None or sched1 is None else {
            "running_s": (sched1[0] - sched0[0]) / 1e9,
            "runnable_not_running_s": (sched1[1] - sched0[1]) / 1e9,
            "blocked_s": loop_s - (sched1[0] - sched0[0] + sched1[1] - sched0[1]) / 1e9,
            "timeslices": sched1[2] - sched0[2]},
        "samples": samples,
        "diagnostics_at_loop_end": perfsdk.diagnostics(),
        "exporter": None if exporter is None else {"calls": exporter.calls,
                                                   "spans": exporter.spans},
        "settings": {"PERFSDK_EXPORT_TIMEOUT": os.environ.get("PERFSDK_EXPORT_TIMEOUT"),
                     "config": str(perfsdk.get_config())},
    }
    out["written_monotonic"] = time.monotonic()
    args.output.write_text(json.dumps(out, default=str))
    return 0  # exit: perfsdk's atexit shuts down within PERFSDK_EXPORT_TIMEOUT


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name (from /proc/self/task): for a
    Python thread, about the time it held the GIL."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                out[thread.name] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def schedstat() -> list[int] | None:
    """This thread's ``/proc`` schedstat: ns on a CPU, ns runnable but waiting for one (other
    processes had the CPUs), timeslices; None where there is none. Time in neither is time
    blocked: waiting for the GIL (or a lock, or I/O)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return [int(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def latency_stats(hist: Any, big: list[int]) -> dict[str, Any]:
    """p50, p99, p99.9, p99.99 and max (us) from the histogram (bucket upper edges) and the
    exact samples at or above its cap."""
    import numpy as np

    cum = np.cumsum(hist)
    small = int(cum[-1]) if len(cum) else 0
    total = small + len(big)

    def at(q: float) -> float:
        rank = max(1, int(np.ceil(q * total)))  # the rank-th smallest
        if rank <= small:
            bucket = int(np.searchsorted(cum, rank))
            return (bucket + 1) * BUCKET_NS / 1e3
        return big[rank - small - 1] / 1e3

    if not total:
        return {"count": 0}
    return {"count": total, "p50": at(0.50), "p99": at(0.99), "p99_9": at(0.999),
            "p99_99": at(0.9999), "max": (big[-1] if big else
                                          (int(np.flatnonzero(hist)[-1]) + 1) * BUCKET_NS) / 1e3,
            "at_or_above_1ms": len(big)}


# ---------------------------------------------------------------------------------- the report
def report(args: argparse.Namespace, cases: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    targets = []
    for case, c in cases.items():
        if "error" in c:
            targets.append({"case": case, "name": "ran", "definition": "the case ran to the end",
                            "value": c["error"], "passed": False})
            continue
        targets.extend(case_targets(args, case, c))
    result = {
        "benchmark": "perfsdk soak",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "seconds": args.seconds,
                     "switch_interval_s": args.switch_interval,
                     "sample_every_s": args.sample_every, "warmup_s": args.warm_s,
                     "export_timeout_s": args.export_timeout, "cases": args.cases,
                     "workload": 'with perfsdk.timed_region("soak", i=i): pass, one thread, '
                                 "back to back", "nvtx": "no tool attached"},
        "machine": {**machine_info(), "load_average": load},
        "versions": versions(),
        "cases": cases,
        "targets": targets,
    }
    print_table(result)
    return result


def case_targets(args: argparse.Namespace, case: str, c: dict[str, Any]) -> list[dict[str, Any]]:
    samples = c["samples"]
    warm = next((s for s in samples if s["t_s"] >= args.warm_s - 0.25), samples[0])
    after = [s for s in samples if s["t_s"] >= warm["t_s"]]
    growth = max(s["rss_mib"] for s in after) - warm["rss_mib"]
    c["rss_growth_mib"] = growth
    c["rss_warm_t_s"] = warm["t_s"]
    d = c["final"]["diagnostics"]
    lost = sum(d["spans_lost"].values())
    balance = d["spans_exported"] + lost - d["spans_produced"]
    c["account"] = {"produced": d["spans_produced"], "exported": d["spans_exported"],
                    "lost": d["spans_lost"], "lost_total": lost, "pending": d["spans_pending"],
                    "balance": balance, "regions": c["regions"],
                    "regions_minus_produced": c["regions"] - d["spans_produced"]}
    p999 = c["latency_us"]["p99_9"]
    exit_max = args.export_timeout + EXIT_SLACK_S
    targets = [
        _target(case, "rss_growth", f"RSS growth after warm-up <= {RSS_GROWTH_MAX_MIB:g} MiB "
                f"(highest sample from {warm['t_s']:g} s on, minus that sample)", growth, "<=",
                RSS_GROWTH_MAX_MIB, "MiB"),
        _target(case, "account", "spans_exported + sum(spans_lost) == spans_produced after "
                "shutdown, nothing pending", balance == 0 and d["spans_pending"] == 0, "is",
                True, ""),
        _target(case, "p99_9", f"caller p99.9 per region <= {P999_MAX_US:g} us", p999, "<=",
                P999_MAX_US, "us"),
        _target(case, "exit", f"exit within PERFSDK_EXPORT_TIMEOUT + {EXIT_SLACK_S:g} s "
                "(result written -> process gone)", c["exit_s"], "<=", exit_max, "s"),
    ]
    if case != "none":  # no exporter: no span is produced
        targets.append(_target(
            case, "regions_accounted", "every region's span is in the account "
            "(spans_produced == regions made; DESIGN rule 3)",
            c["regions"] == d["spans_produced"], "is", True, ""))
    return targets


def _target(case: str, name: str, definition: str, value: Any, op: str, threshold: Any,
            unit: str) -> dict[str, Any]:
    passed = value <= threshold if op == "<=" else value is threshold
    return {"case": case, "name": name, "definition": definition, "value": value, "op": op,
            "threshold": threshold, "unit": unit, "passed": bool(passed)}


def print_table(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"\nperfsdk soak: {s['seconds']} s per case of {s['workload']}; "
          f"PERFSDK_EXPORT_TIMEOUT={s['export_timeout_s']:g} s; each case in its own process")
    print("latency: the caller's enter+exit per region (us); RSS in MiB, growth = highest "
          f"sample from {s['warmup_s']} s on minus the {s['warmup_s']} s sample;\n"
          "balance = exported + lost - produced after shutdown; exit: result written -> "
          "process gone (s), of which atexit: perfsdk's exit shutdown\n")
    head = (f"{'case':<10}{'regions/s':>10}{'p50':>7}{'p99':>7}{'p99.9':>8}{'max':>9}"
            f"{'RSS warm':>9}{'end':>7}{'growth':>8}{'exported':>11}{'lost':>11}"
            f"{'balance':>8}{'exit':>6}{'atexit':>7}")
    print(head)
    print("-" * len(head))
    for case, c in result["cases"].items():
        if "error" in c:
            print(f"{case:<10}  ERROR: {c['error']}")
            continue
        lat, a = c["latency_us"], c["account"]
        warm = next(x for x in c["samples"] if x["t_s"] >= c["rss_warm_t_s"])
        print(f"{case:<10}{c['regions_per_s']:>10,.0f}{lat['p50']:>7.1f}{lat['p99']:>7.1f}"
              f"{lat['p99_9']:>8.1f}{lat['max']:>9,.0f}{warm['rss_mib']:>9.1f}"
              f"{c['samples'][-1]['rss_mib']:>7.1f}{c['rss_growth_mib']:>+8.1f}"
              f"{a['exported']:>11,}{a['lost_total']:>11,}{a['balance']:>8}{c['exit_s']:>6.2f}"
              f"{c['final']['atexit_shutdown_s']:>7.2f}")

    print("\nlosses by reason; regions made vs spans produced; first region (sets perfsdk up)")
    for case, c in result["cases"].items():
        if "error" in c:
            continue
        a = c["account"]
        why = ", ".join(f"{k} {v:,}" for k, v in a["lost"].items() if v) or "none"
        print(f"  {case:<10} {why}; regions {a['regions']:,}, produced {a['produced']:,}; "
              f"first region {c['first_region_ms']:.1f} ms; >= 1 ms: "
              f"{c['latency_us']['at_or_above_1ms']:,}; p99.99 {c['latency_us']['p99_99']:,.0f} us")
    print(f"\nsamples every {s['sample_every_s']} s: t s / RSS MiB / pending regions / "
          "spans pending / threads / open fds")
    for case, c in result["cases"].items():
        if "error" in c:
            continue
        print(f"  {case}:")
        print("    " + "  ".join(
            f"{x['t_s']:.0f}/{x['rss_mib']:.0f}/{x['pending_regions']}/{x['spans_pending']}/"
            f"{x['threads']}/{x['fds']}" for x in c["samples"]))
        cpu, load = c["cpu"], c["load_average"]
        gcs = c["gc"]
        sched = c.get("caller_sched")
        if sched:
            print(f"    caller thread over the {cpu['loop_wall_s']:.1f} s loop: running "
                  f"{sched['running_s']:.1f} s, runnable but no CPU free (other processes) "
                  f"{sched['runnable_not_running_s']:.1f} s, blocked (the GIL) "
                  f"{sched['blocked_s']:.1f} s; {sched['timeslices']:,} timeslices")
        print("    CPU by thread during the loop (s): " + ", ".join(
            f"{name} {cpu:.1f}" for name, cpu in c["threads_cpu_s"].items()))
        print(f"    CPU during the loop: process {cpu['process_s']:.1f} s, caller thread "
              f"{cpu['caller_thread_s']:.1f} s of {cpu['loop_wall_s']:.1f} s wall; load average "
              f"{load['start'][0]:.1f} -> {load['end'][0]:.1f}; gc "
              + ", ".join(f"{g} {v['collections']:,}x longest {v['longest_ms']:.1f} ms"
                          for g, v in gcs.items())
              + "; slowest regions (us @ index): "
              + ", ".join(f"{x['us']:,.0f}@{x['region']:,}" for x in c["slowest"][:5]))
        for line in c["exit_lines"]:
            print(f"    stderr: {line}")
    print("\ntargets (issue 13)")
    for t in result["targets"]:
        value = t["value"]
        shown = f"{value:,.2f} {t['unit']}" if isinstance(value, float) else str(value)
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['case']:<10} {t['definition']}: "
              f"{shown}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get(CHILD_FLAG):
        return child(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
