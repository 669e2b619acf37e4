#!/usr/bin/env python
"""What the in-process summary costs perfsdk's pipeline thread per region record.

Usage::

    python benchmarks/summary_cost.py                  # 9 repeats (a few seconds)
    python benchmarks/summary_cost.py --quick          # 2 repeats, for a smoke test
    python benchmarks/summary_cost.py --output x.json  # default: benchmarks/results/...json

Records come from real training-loop regions: ``perfsdk.step(samples=8)`` holding
``forward``, ``backward`` and ``optimizer`` phases (what ``perfsdk run`` and the callbacks
record; the step's records carry attributes), taken from the pipeline. ``SummarySink`` s consume
the same records in batches of 64 (as the pipeline thread hands them over), interleaved, their
order rotating each repeat:

- ``compiled``: the sink as it runs, its pass over a batch in C (``perfsdk._fastpath.host_times``;
  absent where the module is not built);
- ``python``: the same with the pure-Python pass (``_host_times_python``);
- ``one_add_each``: the sink as it was before 2026-11-30, one ``_Series.add`` call per record,
  kept here as the yardstick.

Two regimes: ``filling`` (fresh sinks each repeat: each name's reservoir is still filling) and
``full`` (sinks already fed 20 x ``RESERVOIR`` records a name: values enter the reservoir at
drawn counts). The figure is the consuming thread's CPU time per record
(``time.thread_time_ns``), median and interquartile range across repeats. The exit status is 0
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

from metrics_cost import stats
from overhead import clean_environment, fill_counts, machine_info, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "summary_cost.json"
VARIANTS = {
    "compiled": "the summary sink, its pass in C (_fastpath.host_times)",
    "python": "the summary sink, its pass in Python",
    "one_add_each": "before 2026-11-30: one _Series.add call a record",
}
REGIMES = {"filling": "fresh sinks: the reservoirs fill",
           "full": "sinks fed 20 x RESERVOIR records a name before"}
BATCH = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repeats and records (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--repeats", type=int, help="repeats per variant (default 9; quick 2)")
    p.add_argument("--steps", type=int,
                   help="training steps recorded, 4 records each (default 4000; quick 200)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("repeats", 9, 2), ("steps", 4_000, 200)))
    return args


def sink_classes() -> dict[str, Any]:
    """A SummarySink class per variant (None where the compiled module is not built)."""
    from perfsdk.export import summary
    from perfsdk.record import ATTRS, DEVICE_MS, ERROR, SPEC, T0, T1

    try:
        import perfsdk._fastpath as fastpath

        compiled = fastpath.host_times
    except ImportError:
        compiled = None

    def with_pass(host_times: Any) -> Any:
        class Sink(summary.SummarySink):
            def consume(self, records: list[Any]) -> None:
                saved = summary.host_times
                summary.host_times = host_times
                try:
                    super().consume(records)
                finally:
                    summary.host_times = saved
        return Sink

    class OneAddEach(summary.SummarySink):
        def consume(self, records: list[Any]) -> None:  # perfsdk's consume until 2026-11-30
            with self._lock:
                by_spec = self._by_spec
                for rec in records:
                    acc = by_spec.get(rec[SPEC])
                    if acc is None:
                        acc = self._acc_of(rec[SPEC])
                    acc.host.add((rec[T1] - rec[T0]) / 1e6)
                    if rec[DEVICE_MS] is not None or rec[ERROR] is not None or rec[ATTRS]:
                        self._add_more(acc, rec)  # what it did inline

    return {"compiled": None if compiled is None else with_pass(compiled),
            "python": with_pass(summary._host_times_python), "one_add_each": OneAddEach}


def step_records(steps: int) -> list[Any]:
    """The records of ``steps`` training steps, a ``perfsdk.step(samples=8)`` and its three
    phases each, taken from the pipeline (also ``trace_flush.py``'s)."""
    import perfsdk
    from perfsdk.testing import capture

    forward, backward, optimizer = (perfsdk.phase(n) for n in ("forward", "backward",
                                                                "optimizer"))
    with capture() as captured:
        for i in range(steps):
            if i % 5_000 == 0:
                perfsdk.flush()  # within the pipeline's pending bound (65,536 regions)
            with perfsdk.step(samples=8):
                with forward:
                    pass
                with backward:
                    pass
                with optimizer:
                    pass
        perfsdk.auto.end_step()
    records = list(captured.records)
    if len(records) != 4 * steps:
        raise RuntimeError(f"captured {len(records):,} records of {4 * steps:,}")
    return records


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's perfsdk
    from perfsdk.export.summary import RESERVOIR

    records = step_records(args.steps)
    classes = {name: cls for name, cls in sink_classes().items() if cls is not None}
    feed = records * max(1, -(-20 * RESERVOIR * 4 // len(records)))  # 20 x RESERVOIR a name

    def consume_all(sink: Any, batch: list[Any]) -> None:
        for i in range(0, len(batch), BATCH):
            sink.consume(batch[i:i + BATCH])

    full_sinks = {}
    for name, cls in classes.items():
        full_sinks[name] = sink = cls()
        consume_all(sink, feed)
    cpu: dict[str, dict[str, list[float]]] = {r: {n: [] for n in classes} for r in REGIMES}
    order = list(classes)
    for rep in range(args.repeats):
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            for regime, sink in (("filling", classes[name]()), ("full", full_sinks[name])):
                gc.collect()
                t0 = time.thread_time_ns()
                consume_all(sink, records)
                cpu[regime][name].append((time.thread_time_ns() - t0) / len(records))
    counts = {name: sum(acc.host.count for acc in sink._acc.values())
              for name, sink in full_sinks.items()}
    results = {regime: {name: {"label": VARIANTS[name], "cpu_ns_per_record": stats(values)}
                        for name, values in by_name.items()} for regime, by_name in cpu.items()}
    ratios = {regime: {name: (by_name["one_add_each"]["cpu_ns_per_record"]["median"]
                              / by_name[name]["cpu_ns_per_record"]["median"])
                       for name in by_name if name != "one_add_each"}
              for regime, by_name in results.items()}
    return {
        "benchmark": "perfsdk summary cost",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "repeats": args.repeats, "records": len(records),
                     "batch": BATCH, "reservoir": RESERVOIR,
                     "order": "variants rotate each repeat"},
        "machine": machine_info(),
        "versions": versions(),
        "regimes": REGIMES,
        "results": results,
        "before_over_now": ratios,
        "records_in_full_sinks": counts,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    clean_environment()
    result = measure(args)
    s = result["settings"]
    print(f"\nperfsdk's summary per region record on the pipeline thread: {s['repeats']} repeats "
          f"x {s['records']:,} records (steps with three phases), batches of {s['batch']}, "
          "interleaved")
    print("CPU ns per record: median [p25-p75]\n")
    head = f"{'variant':<54}{'median':>9}{'[p25-p75]':>18}{'before/now':>12}"
    print(head)
    print("-" * len(head))
    for regime, label in REGIMES.items():
        print(f"{regime} ({label}):")
        for name, v in result["results"][regime].items():
            c = v["cpu_ns_per_record"]
            spread = f"[{c['p25']:,.0f}-{c['p75']:,.0f}]"
            ratio = result["before_over_now"][regime].get(name)
            print(f"  {v['label']:<52}{c['median']:>9,.0f}{spread:>18}"
                  f"{'' if ratio is None else f'{ratio:.2f}x':>12}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
