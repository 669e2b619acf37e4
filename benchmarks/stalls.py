#!/usr/bin/env python
"""The calling thread's longest stalls while perfsdk's background threads build and export spans.

Usage::

    python benchmarks/stalls.py                  # 3 repeats of 3 arms x 200,000 calls (~30 s)
    python benchmarks/stalls.py --quick          # a few seconds, for a smoke test
    python benchmarks/stalls.py --output x.json  # default: benchmarks/results/stalls.json

A loop calls a body that releases the GIL for a few microseconds (sha256 of 4 KiB, as a
training step's torch ops do), timing every call. perfsdk exports every region's span to an
exporter that drops them (queue and batch as large as ``overhead.py``'s: 65,536 and 2,048), so
its export thread builds a batch of 2,048 spans at a time while the loop runs. Three arms, in one
process, their order rotating each repeat:

- ``bare``: the body undecorated;
- ``compiled``: ``@perfsdk.profiled``, spans built by ``perfsdk.export._spanbuild`` (the default
  where it is built);
- ``python``: the same with the pure-Python builder (what ``PERFSDK_DISABLE_EXTENSIONS=1`` or an
  install without a C compiler gets).

Per arm: the longest call, the 99.99th and 99.9th percentile, the calls over 1 ms and over 10 ms
(medians over repeats), and the garbage collector's full (generation 2) collections during the
loops, with the longest one and the thread it ran on: a collection holds the GIL from start to
end, and with torch loaded one walks ~180,000 objects. The exit status is 0: a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import threading
import time
from array import array
from hashlib import sha256
from pathlib import Path
from typing import Any

from overhead import fill_counts, machine_info, percentile, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "stalls.json"
ARMS = ("bare", "compiled", "python")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--calls", type=int, help="calls per loop (default 200000; quick 5000)")
    p.add_argument("--repeats", type=int, help="loops per arm (default 3; quick 1)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("calls", 200_000, 5_000), ("repeats", 3, 1)))
    return args


class Collections:
    """Full collections (generation 2) while it is on: how long each held the GIL, where."""

    def __init__(self) -> None:
        self.on = False
        self.started: dict[int, int] = {}
        self.full: list[tuple[float, str]] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on or info.get("generation") != 2:
            return
        ident = threading.get_ident()
        if phase == "start":
            self.started[ident] = time.perf_counter_ns()
        elif ident in self.started:
            ms = (time.perf_counter_ns() - self.started.pop(ident)) / 1e6
            self.full.append((ms, threading.current_thread().name))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    import perfsdk
    from perfsdk.export import spans

    class Drop(SpanExporter):
        def __init__(self) -> None:
            self.spans = 0

        def export(self, batch: Any) -> SpanExportResult:
            self.spans += len(batch)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    drop = Drop()
    perfsdk.configure(exporter=drop, export_queue_size=65_536, export_batch_size=2_048,
                      export_delay_s=1.0)
    data = bytes(4096)  # hashlib releases the GIL for data of 2 KiB and more

    def body() -> int:
        sha256(data)
        return 1

    profiled = perfsdk.profiled("bench.stalls")(body)
    for _ in range(200):  # warm-up: the threads, and the compiled builder's first-batch check
        profiled()
    perfsdk.flush()
    builder = spans.COMPILED.builder
    checked = spans.COMPILED.checked
    collections = Collections()
    gc.callbacks.append(collections)
    results: dict[str, dict[str, list[Any]]] = {
        arm: {"max_ms": [], "p9999_ms": [], "p999_ms": [], "over_1ms": [], "over_10ms": [],
              "median_us": [], "full_collections": []} for arm in ARMS}
    try:
        for rep in range(args.repeats):
            order = ARMS[rep % 3:] + ARMS[:rep % 3]
            for arm in order:
                if builder is None and arm == "compiled":
                    continue
                spans.COMPILED.builder = builder if arm == "compiled" else None
                spans.COMPILED.checked = checked
                fn = body if arm == "bare" else profiled
                perfsdk.flush()
                gc.collect()
                times = array("q", bytes(8 * args.calls))
                clock = time.perf_counter_ns
                collections.full, collections.on = [], True
                for i in range(args.calls):
                    t0 = clock()
                    fn()
                    times[i] = clock() - t0
                perfsdk.flush()  # the loop's spans, built and exported before the next arm
                collections.on = False
                ordered = sorted(times)
                r = results[arm]
                r["max_ms"].append(ordered[-1] / 1e6)
                r["p9999_ms"].append(percentile(ordered, 99.99) / 1e6)
                r["p999_ms"].append(percentile(ordered, 99.9) / 1e6)
                r["over_1ms"].append(sum(1 for t in times if t > 1_000_000))
                r["over_10ms"].append(sum(1 for t in times if t > 10_000_000))
                r["median_us"].append(percentile(ordered, 50) / 1e3)
                r["full_collections"].append(list(collections.full))
    finally:
        spans.COMPILED.builder, spans.COMPILED.checked = builder, checked
        gc.callbacks.remove(collections)
    out = report(args, results, builder is not None, drop.spans)
    print_table(out)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def report(args: argparse.Namespace, results: dict[str, dict[str, list[Any]]],
           compiled: bool, exported: int) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm, r in results.items():
        if not r["max_ms"]:
            continue
        full = [c for loop in r["full_collections"] for c in loop]
        arms[arm] = {
            **{k: percentile(v, 50) for k, v in r.items() if k != "full_collections"},
            "per_repeat": {k: v for k, v in r.items() if k != "full_collections"},
            "full_collections": len(full),
            "full_collection_longest_ms": max((ms for ms, _ in full), default=0.0),
            "full_collection_threads": sorted({name for _, name in full}),
        }
    return {
        "benchmark": "stalls",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"calls": args.calls, "repeats": args.repeats, "quick": args.quick,
                     "compiled_builder": compiled},
        "machine": machine_info(), "versions": versions(), "arms": arms,
        "spans_exported": exported,
        "notes": ["per-call wall times of a sha256 (4 KiB) loop; medians over repeats",
                  "full collections: generation 2, while the loops ran (any thread)"],
    }


def print_table(out: dict[str, Any]) -> None:
    s = out["settings"]
    print(f"\nperfsdk stalls: {s['repeats']} x {s['calls']:,} calls per arm of a sha256 (4 KiB) "
          "loop, spans to a dropping exporter (queue 65,536, batch 2,048)")
    print(f"{'arm':<10}{'median us':>10}{'p99.9 ms':>10}{'p99.99 ms':>11}{'max ms':>9}"
          f"{'>1 ms':>7}{'>10 ms':>8}{'full GCs':>10}{'longest ms':>12}  on")
    print("-" * 100)
    for arm, a in out["arms"].items():
        print(f"{arm:<10}{a['median_us']:>10.2f}{a['p999_ms']:>10.3f}{a['p9999_ms']:>11.3f}"
              f"{a['max_ms']:>9.2f}{a['over_1ms']:>7.0f}{a['over_10ms']:>8.0f}"
              f"{a['full_collections']:>10}{a['full_collection_longest_ms']:>12.1f}  "
              f"{', '.join(a['full_collection_threads']) or '-'}")
    print("(medians over repeats; full GCs: generation-2 collections during all of the arm's "
          "loops, the longest, and the threads they ran on)")
    if not out["settings"]["compiled_builder"]:
        print("note: perfsdk.export._spanbuild is not built here: no compiled arm")


if __name__ == "__main__":
    sys.exit(main())
