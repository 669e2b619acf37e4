#!/usr/bin/env python
"""What recording a region's metrics costs perfsdk's pipeline thread, with perfsdk's own
histogram aggregation and with OpenTelemetry's instruments.

Usage::

    python benchmarks/metrics_cost.py                  # 9 repeats (a few seconds)
    python benchmarks/metrics_cost.py --quick          # 2 repeats, for a smoke test
    python benchmarks/metrics_cost.py --output x.json  # default: benchmarks/results/...json

Records come from real regions (three names, every 50th one raising), taken from the
pipeline. Two ``MetricsSink`` s with private MeterProviders consume the same records in batches
of 64 (as the pipeline thread hands them over), interleaved, their order alternating each repeat:

- ``own``: a ``MetricExporter`` (what ``PERFSDK_EXPORTER=otlp``, ``console`` and ``file`` make):
  perfsdk aggregates the duration histograms itself (perfsdk.export.histograms);
- ``sdk``: a ``MetricReader`` instance (as with a Prometheus reader, or the application's own
  MeterProvider): each value goes through the SDK's ``Histogram.record``.

The figure is the consuming thread's CPU time per record (``time.thread_time_ns``), median and
interquartile range across repeats; each repeat ends with an export (``flush``), outside the
timing. A second set, timed the same way in the same repeats, is training steps given
``samples=`` (``perfsdk.step(samples=32)``): their samples/s also feed the
``perfsdk.step.throughput`` histogram (``cpu_ns_per_step_record``). The exit status is 0
whatever the numbers (a measurement). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from overhead import clean_environment, fill_counts, machine_info, percentile, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "metrics_cost.json"
VARIANTS = {
    "own": "MetricExporter: perfsdk aggregates the histograms",
    "sdk": "MetricReader: each value through Histogram.record",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repeats and records (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--repeats", type=int, help="repeats per variant (default 9; quick 2)")
    p.add_argument("--records", type=int, help="records per repeat (default 20000; quick 640)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("repeats", 9, 2), ("records", 20_000, 640)))
    return args


def stats(values: list[float]) -> dict[str, Any]:
    p25, p75 = percentile(values, 25), percentile(values, 75)
    return {"median": percentile(values, 50), "p25": p25, "p75": p75, "iqr": p75 - p25,
            "samples": [round(v, 1) for v in values]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's perfsdk
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        MetricExportResult,
    )

    import perfsdk
    from perfsdk.config import Config
    from perfsdk.export.metrics import MetricsSink
    from perfsdk.pipeline import PIPELINE
    from perfsdk.record import ATTRS

    class Dropping(MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.exports = 0

        def export(self, metrics_data: Any, timeout_millis: float = 10_000,
                   **kwargs: Any) -> MetricExportResult:
            self.exports += 1
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    class Grab:
        def __init__(self) -> None:
            self.records: list[Any] = []

        def consume(self, records: list[Any]) -> None:
            self.records.extend(records)

        def flush(self, timeout: float) -> None:
            pass

        def shutdown(self, timeout: float) -> None:
            pass

    grab = Grab()
    PIPELINE.sinks.append(grab)
    for i in range(args.records):
        try:
            with perfsdk.timed_region(f"bench.{i % 3}"):
                if i % 50 == 0:
                    raise ValueError(i)
        except ValueError:
            pass
    PIPELINE.drain(wait=True)
    records, grab.records = grab.records, []
    for _ in range(max(64, args.records // 4)):
        with perfsdk.step(samples=32):
            pass
    PIPELINE.drain(wait=True)
    PIPELINE.sinks.remove(grab)
    steps = [rec for rec in grab.records if rec[ATTRS] and "perfsdk.samples_per_s" in rec[ATTRS]]
    dropping = Dropping()
    sinks = {"own": MetricsSink(Config(exporters=(dropping,)), global_provider=False),
             "sdk": MetricsSink(Config(exporters=(InMemoryMetricReader(),)),
                                global_provider=False)}
    for sink in sinks.values():
        sink.settle()
        sink.consume(records[:64])  # first use
    aggregated = {name: sink._instruments is not None and sink._instruments.histograms
                  is not None for name, sink in sinks.items()}
    cpu: dict[str, list[float]] = {name: [] for name in sinks}
    step_cpu: dict[str, list[float]] = {name: [] for name in sinks}
    for rep in range(args.repeats):
        for name in (("own", "sdk") if rep % 2 == 0 else ("sdk", "own")):
            sink = sinks[name]
            for batch, out in ((records, cpu), (steps, step_cpu)):
                gc.collect()
                t0 = time.thread_time_ns()
                for i in range(0, len(batch), 64):
                    sink.consume(batch[i:i + 64])
                out[name].append((time.thread_time_ns() - t0) / len(batch))
            sink.flush(5.0)
    for sink in sinks.values():
        sink.shutdown(5.0)
    variants = {name: {"label": VARIANTS[name], "aggregated_by_perfsdk": aggregated[name],
                       "cpu_ns_per_record": stats(values),
                       "cpu_ns_per_step_record": stats(step_cpu[name])}
                for name, values in cpu.items()}
    own = variants["own"]["cpu_ns_per_record"]["median"]
    sdk = variants["sdk"]["cpu_ns_per_record"]["median"]
    return {
        "benchmark": "perfsdk metrics cost",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "repeats": args.repeats, "records": len(records),
                     "step_records": len(steps),
                     "batch": 64, "order": "variants alternate each repeat"},
        "machine": machine_info(),
        "versions": versions(),
        "variants": variants,
        "sdk_over_own": sdk / own if own > 0 else float("inf"),
        "exports": dropping.exports,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    clean_environment()
    result = measure(args)
    s = result["settings"]
    print(f"\nperfsdk metrics per region on the pipeline thread: {s['repeats']} repeats x "
          f"{s['records']:,} records, batches of {s['batch']}, interleaved")
    print("CPU ns per record: median [p25-p75]\n")
    head = f"{'variant':<54}{'median':>9}{'[p25-p75]':>18}"
    print(head)
    print("-" * len(head))
    for key, what in (("cpu_ns_per_record", "regions"),
                      ("cpu_ns_per_step_record", f"{s['step_records']:,} steps with samples=")):
        print(f"{what}:")
        for v in result["variants"].values():
            c = v[key]
            spread = f"[{c['p25']:,.0f}-{c['p75']:,.0f}]"
            print(f"  {v['label']:<52}{c['median']:>9,.0f}{spread:>18}")
    print(f"\nthe SDK's instruments cost {result['sdk_over_own']:.1f}x perfsdk's aggregation")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
