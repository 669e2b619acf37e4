#!/usr/bin/env python
"""What a flush of the trace file costs as the file grows.

Usage::

    python benchmarks/trace_flush.py                  # 10k, 40k and 160k regions (about a minute)
    python benchmarks/trace_flush.py --quick          # 500 and 2,000 regions, for a smoke test
    python benchmarks/trace_flush.py --output x.json  # default: benchmarks/results/...json

Records come from real training-loop regions: ``perfsdk.step(samples=8)`` holding ``forward``,
``backward`` and ``optimizer`` phases (what ``perfsdk run`` records with its trace file), taken
from the pipeline. For each size, a ``TraceSink`` (the trace exporter's sink, writing to a
temporary directory) is handed that many records in batches of 64, as the pipeline hands them
over, and flushed once. Then, alternating, each repeat:

- ``flush``: one more step's four records, then ``sink.flush()``: the wall time the caller of
  :func:`perfsdk.flush` waits for the file (the writer thread renders the four regions and writes
  out the text already rendered);
- ``whole``: the yardstick, what every flush did before 2026-11-30: render every region of the
  file again and write it (``_TraceFile`` fed all the sink's regions at once, then written).

Then the same flush ``--repeats`` times beside a thread running pure Python, which holds the GIL
(a training thread between torch calls, a data-loading thread): the file's text goes out in
``os.writev`` calls, each releasing the GIL once; written a buffer at a time, each buffer waited
for the GIL (11.6 to 28 s for 200,000 regions, against 0.11 s). The sink is handed its regions
first and left to render them itself (32 at a time, as between writes in a training run).

Also: the writer thread's CPU time per region rendered, while the records were handed over (it
renders every ``RENDER_EVERY_S`` seconds, and at the flush). Medians and interquartile ranges
of the repeats. The exit status is 0 whatever the numbers (a measurement). See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from metrics_cost import stats
from overhead import clean_environment, fill_counts, machine_info, versions
from summary_cost import step_records

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "trace_flush.json"
BATCH = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small files, few repeats (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--repeats", type=int, help="flushes per size and variant (default 7; quick 3)")
    p.add_argument("--sizes", help="comma list of regions in the file before the timed flushes "
                   "(default 10000,40000,160000; quick 500,2000)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("repeats", 7, 3),))
    if args.sizes is None:
        args.sizes = "500,2000" if args.quick else "10000,40000,160000"
    try:
        args.size_list = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: accepted values are integers >= 4, comma-separated")
    if not args.size_list or min(args.size_list) < 4:
        p.error(f"--sizes {args.sizes!r}: accepted values are integers >= 4, comma-separated")
    return args


def writer_cpu_ns() -> int:
    """CPU time of the trace writer thread so far (0 where unknown)."""
    from overhead import threads_cpu

    return threads_cpu().get("perfsdk-trace-writer", 0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's perfsdk
    from perfsdk.config import Config
    from perfsdk.export import trace

    largest = max(args.size_list)
    more = args.repeats * 3 * 4  # one more step per timed flush (quiet and busy)
    records = step_records(-(-(largest + more) // 4))
    out: dict[str, Any] = {}
    for size in args.size_list:
        with tempfile.TemporaryDirectory() as tmp:
            sink = trace.TraceSink(Config(exporters=("trace",), output_dir=Path(tmp)),
                                   max_events=largest + more)
            gc.collect()
            cpu0 = writer_cpu_ns()
            for i in range(0, size, BATCH):
                sink.consume(records[i:min(i + BATCH, size)])
            deadline = time.monotonic() + 600
            while sink._file.pending and time.monotonic() < deadline:
                time.sleep(0.05)  # the writer's own renderings, 32 regions at a time
            sink.flush(600.0)
            render_ns = (writer_cpu_ns() - cpu0) / size
            path = sink.path
            assert path is not None
            file_mb = path.stat().st_size / 1e6
            flush_ms: list[float] = []
            whole_ms: list[float] = []
            nxt = size
            for rep in range(args.repeats):
                for variant in (("flush", "whole") if rep % 2 == 0 else ("whole", "flush")):
                    gc.collect()
                    if variant == "flush":
                        sink.consume(records[nxt:nxt + 4])
                        nxt += 4
                        t0 = time.perf_counter()
                        sink.flush(600.0)
                        flush_ms.append((time.perf_counter() - t0) * 1e3)
                    else:
                        events = whole_events(sink, records[:nxt])  # as the sink holds them
                        t0 = time.perf_counter()
                        whole = trace._TraceFile()
                        whole.render(events, sink._file.threads)
                        whole.write(Path(tmp) / "whole.json", 0)
                        whole_ms.append((time.perf_counter() - t0) * 1e3)
            busy_ms = []
            for _ in range(args.repeats):  # beside a thread that holds the GIL (pure Python)
                stop = threading.Event()
                spinner = threading.Thread(target=spin, args=(stop,), daemon=True)
                spinner.start()
                sink.consume(records[nxt:nxt + 4])
                nxt += 4
                t0 = time.perf_counter()
                sink.flush(600.0)
                busy_ms.append((time.perf_counter() - t0) * 1e3)
                stop.set()
                spinner.join()
            written = json.loads(path.read_text())["otherData"]["perfsdk.regions"]
            out[str(size)] = {
                "regions_in_file": written, "file_mb": file_mb,
                "flush_ms": stats(flush_ms), "whole_render_ms": stats(whole_ms),
                "flush_beside_busy_thread_ms": stats(busy_ms),
                "whole_over_flush": stats(whole_ms)["median"] / stats(flush_ms)["median"],
                "writer_cpu_ns_per_region": render_ns,
            }
            sink.shutdown(60.0)
    return {
        "benchmark": "perfsdk trace flush",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "repeats": args.repeats, "sizes": args.size_list,
                     "batch": BATCH, "order": "flush and whole alternate each repeat"},
        "machine": machine_info(),
        "versions": versions(),
        "results": out,
    }


def spin(stop: threading.Event) -> None:
    """Python work that holds the GIL until ``stop`` (a training thread between its torch
    calls, a data-loading thread)."""
    count = 0
    while not stop.is_set():
        count += 1


def whole_events(sink: Any, records: list[Any]) -> list[Any]:
    """The stored regions of ``records``, as the sink made them (lane keys from its threads)."""
    from perfsdk import gpu
    from perfsdk.export import trace

    lane = {ident: key for ident, (key, _) in sink._file.lane_of.items()}
    return [trace._from_record(rec, gpu.TELEMETRY.window, lane[rec[trace.THREAD]])
            for rec in records]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    clean_environment()
    result = measure(args)
    s = result["settings"]
    print(f"\nperfsdk's trace file: a flush after one more step, by regions already in the file; "
          f"{s['repeats']} repeats, alternating with the yardstick")
    print("busy = the same flush beside a thread running Python (it holds the GIL); whole = every "
          "region rendered again and written (every flush before 2026-11-30)\n")
    head = (f"{'regions':>9}{'file MB':>9}{'flush ms':>11}{'[p25-p75]':>17}"
            f"{'busy ms':>10}{'whole ms':>11}{'whole/flush':>13}{'render us/region':>18}")
    print(head)
    print("-" * len(head))
    for size, r in result["results"].items():
        f, w = r["flush_ms"], r["whole_render_ms"]
        spread = f"[{f['p25']:.1f}-{f['p75']:.1f}]"
        print(f"{int(size):>9,}{r['file_mb']:>9.1f}{f['median']:>11.1f}{spread:>17}"
              f"{r['flush_beside_busy_thread_ms']['median']:>10.1f}"
              f"{w['median']:>11.1f}{r['whole_over_flush']:>12.1f}x"
              f"{r['writer_cpu_ns_per_region'] / 1e3:>18.1f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
