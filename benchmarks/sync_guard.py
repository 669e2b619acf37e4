#!/usr/bin/env python
"""What ``no_sync_guard`` costs: per tensor operation, per detected sync, per training step.

Usage::

    python benchmarks/sync_guard.py                  # full run (about 30 s)
    python benchmarks/sync_guard.py --quick          # a few repeats, for a smoke test
    python benchmarks/sync_guard.py --output x.json  # default: benchmarks/results/sync_guard.json

Three workloads on the CPU, each run without a guard and under the guard's modes:

- ``tensor_ops``: a loop of ``x = x * 1.0001 + 0.5`` on a 16-element tensor (two ATen
  operators per iteration, none of them a sync), so the per-operator cost of the guard's two
  torch modes shows; reported in ns per operator.
- ``item_sync``: a loop of ``x.sum().item()``: one detected sync per iteration under
  ``count`` with ``assume_device=True`` (on a CPU-only run only ``assume_device`` makes
  ``.item()`` a sync); reported in ns per iteration, and the cost of recording one sync.
- ``mlp_step``: a training step of a small MLP (forward, backward, SGD step; batch 32, 256
  hidden), the guard entered and left once per step as a decorator would; in ms per step.

Everything runs in this one process. Each of the ``--repeats`` rounds runs every (workload,
variant) pair once, the workloads and the variants within each in an order rotated each round,
so drift (and the slower first loop after a change of workload) falls on all of them alike; each
timed loop follows a short untimed warm-up of the same variant. The table reports medians
across rounds, with p10/p90. Each guarded loop checks that the guard saw exactly the syncs it
should (0, or one per ``.item()``). The exit status is 0: this is a measurement. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead import (
    BUSY_RATIO,
    clean_environment,
    fill_counts,
    machine_info,
    percentile,
    stats,
    versions,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "sync_guard.json"
OPS_PER_ITERATION = 2  # x * 1.0001 (aten::mul) and + 0.5 (aten::add)
MLP = {"batch": 32, "inputs": 64, "hidden": 256, "classes": 10, "layers": 3, "lr": 0.01}

# name, label, no_sync_guard arguments (None: no guard; "modes": the reference below)
GUARDS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("none", "no guard", None),
    ("off", 'no_sync_guard("off")', {"mode": "off"}),
    ("count", 'no_sync_guard("count")', {"mode": "count"}),
    ("warn", 'no_sync_guard("warn")', {"mode": "warn"}),
    ("count_assume", 'no_sync_guard("count", assume_device=True)',
     {"mode": "count", "assume_device": True}),
    ("modes", "reference: empty TorchFunctionMode + TorchDispatchMode", None),
]
ITEM_GUARDS = ("none", "count_assume")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repeats and iterations (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--repeats", type=int, help="rounds of every variant (default 15; quick 3)")
    p.add_argument("--ops", type=int,
                   help="tensor_ops iterations per loop, 2 operators each (default 20000; "
                        "quick 300)")
    p.add_argument("--syncs", type=int,
                   help="item_sync iterations per loop (default 5000; quick 100)")
    p.add_argument("--steps", type=int, help="mlp_step steps per loop (default 50; quick 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the guard's cost is on the calling "
                        "thread, and idle OpenMP threads on a shared machine add noise)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("repeats", 15, 3), ("ops", 20_000, 300), ("syncs", 5_000, 100),
                          ("steps", 50, 3)))
    return args


@dataclasses.dataclass
class Case:
    """One (workload, guard variant) pair and what its timed loops measured."""

    workload: str
    variant: str
    label: str
    run: Callable[[], tuple[float, float, int]]  # -> (wall ns, thread CPU ns, syncs seen)
    per: int  # units (operators, iterations, steps) in one timed loop
    expected_syncs: int
    wall: list[float] = dataclasses.field(default_factory=list)  # per unit
    cpu: list[float] = dataclasses.field(default_factory=list)
    syncs: list[int] = dataclasses.field(default_factory=list)  # per timed loop



# ------------------------------------------------------------------------------ measurement
def measure(args: argparse.Namespace) -> int:
    clean_environment()
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import perfsdk
    from perfsdk import no_sync_guard
    from perfsdk import sync as sync_module

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    class FunctionMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class DispatchMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class EmptyModes:
        """The floor of this way of watching operators: two modes that only run the operator,
        pushed afresh at each entry (as the guard pushes its own)."""

        def __enter__(self) -> None:
            self.stack = contextlib.ExitStack()
            self.stack.enter_context(FunctionMode())
            self.stack.enter_context(DispatchMode())

        def __exit__(self, *exc: object) -> None:
            self.stack.close()

    def guard_for(variant: str) -> no_sync_guard | None:
        kwargs = dict(next(g for g in GUARDS if g[0] == variant)[2] or {})
        return None if not kwargs else no_sync_guard(kwargs.pop("mode"), **kwargs)

    def scope_for(variant: str, guard: no_sync_guard | None
                  ) -> contextlib.AbstractContextManager[Any]:
        if guard is not None:
            return guard
        return EmptyModes() if variant == "modes" else contextlib.nullcontext()

    def timed(variant: str, body: Callable[[int], None], n: int, per_step: bool
              ) -> tuple[float, float, int]:
        """Wall and CPU ns of ``body(n)`` inside the variant's guard, and the syncs it saw.

        The guard is entered once around the loop, or (``per_step``) once per step, as a
        decorator would. A fresh guard per timed loop: its report is this loop's. A short
        warm-up of the same variant runs first, outside the timing."""
        results = []
        for count in (max(1, n // 10), n):  # warm-up, then the timed loop
            guard = guard_for(variant)
            scope = scope_for(variant, guard)
            gc.collect()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            if per_step:
                for _ in range(count):
                    with scope:
                        body(1)
            else:
                with scope:
                    body(count)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            results.append((t1 - t0, c1 - c0, 0 if guard is None else guard.report.total))
        return results[-1]

    # -- workload 1: small tensor operations, no syncs ----------------------------------------
    x0 = torch.ones(16)

    def ops_loop(n: int) -> None:
        x = x0
        for _ in range(n):
            x = x * 1.0001 + 0.5

    # -- workload 2: one .item() per iteration ------------------------------------------------
    def item_loop(n: int) -> None:
        for _ in range(n):
            x0.sum().item()

    # -- workload 3: a small MLP training step, the guard entered per step --------------------
    model = torch.nn.Sequential(
        torch.nn.Linear(MLP["inputs"], MLP["hidden"]), torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["hidden"]), torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["classes"]))
    opt = torch.optim.SGD(model.parameters(), lr=MLP["lr"])
    inputs = torch.randn(MLP["batch"], MLP["inputs"])
    targets = torch.randint(0, MLP["classes"], (MLP["batch"],))

    def train_steps(n: int) -> None:
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    def make_case(workload: str, variant: str) -> Case:
        label = next(g[1] for g in GUARDS if g[0] == variant)

        def run() -> tuple[float, float, int]:
            if workload == "tensor_ops":
                return timed(variant, ops_loop, args.ops, per_step=False)
            if workload == "item_sync":
                return timed(variant, item_loop, args.syncs, per_step=False)
            return timed(variant, train_steps, args.steps, per_step=True)

        per = {"tensor_ops": args.ops * OPS_PER_ITERATION, "item_sync": args.syncs,
               "mlp_step": args.steps}[workload]
        expected = args.syncs if (workload, variant) == ("item_sync", "count_assume") else 0
        return Case(workload, variant, label, run, per, expected)

    cases = [make_case(w, v) for w in WORKLOADS
             for v in (ITEM_GUARDS if w == "item_sync" else [g[0] for g in GUARDS])]

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    for case in cases:  # first use of every operator, mode and code path
        case.run()
    gc.collect()
    gc.freeze()  # torch's import leaves ~10^6 objects; collecting them each time takes 0.2 s
    groups = [[c for c in cases if c.workload == w] for w in WORKLOADS]
    for rep in range(args.repeats):
        # Rotate the workloads, and the variants within each: the first loop after a change of
        # workload runs slower, and that must not always fall on the same variant.
        order = [g[rep % len(g):] + g[:rep % len(g)] for g in groups]
        k = rep % len(order)
        for case in itertools.chain.from_iterable(order[k:] + order[:k]):
            wall, cpu, syncs = case.run()
            case.wall.append(wall / case.per)
            case.cpu.append(cpu / case.per)
            case.syncs.append(syncs)
    load = {"start": load_start, "end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    sync_module.reset()

    result = report(args, cases, load, torch)
    result["perfsdk_diagnostics"] = perfsdk.diagnostics()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


# ---------------------------------------------------------------------------------- report
WORKLOADS = {
    "tensor_ops": ("x = x * 1.0001 + 0.5 on a 16-element tensor", "ns per operator", 1.0),
    "item_sync": ("x.sum().item(): one sync per iteration", "ns per iteration", 1.0),
    "mlp_step": ("MLP training step (fwd + bwd + SGD), batch 32, 256 hidden, guard per step",
                 "ms per step", 1e-6),
}


def report(args: argparse.Namespace, cases: list[Case], load: dict[str, Any], torch: Any
           ) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for name, (label, unit, scale) in WORKLOADS.items():
        mine = [c for c in cases if c.workload == name]
        base = percentile(next(c for c in mine if c.variant == "none").wall, 50)
        variants = {}
        for c in mine:
            med = percentile(c.wall, 50)
            variants[c.variant] = {
                "label": c.label, "repeats": len(c.wall), "units_per_loop": c.per,
                "wall_ns": stats(c.wall), "thread_cpu_ns": stats(c.cpu),
                "added_ns": med - base, "ratio_vs_none": med / base,
                "syncs_detected": c.syncs, "syncs_expected": c.expected_syncs,
                "detected_as_expected": all(s == c.expected_syncs for s in c.syncs),
            }
        workloads[name] = {"label": label, "unit": unit, "scale_from_ns": scale,
                           "variants": variants}

    ops = workloads["tensor_ops"]["variants"]
    item = workloads["item_sync"]["variants"]
    mlp = workloads["mlp_step"]["variants"]
    # .item() under the guard pays the modes for its two operators (sum, _local_scalar_dense)
    # like any operator, plus the recording of the sync.
    per_sync = item["count_assume"]["added_ns"]
    record = per_sync - OPS_PER_ITERATION * ops["count_assume"]["added_ns"]
    headline = {
        "count_added_ns_per_op": ops["count"]["added_ns"],
        "warn_added_ns_per_op": ops["warn"]["added_ns"],
        "count_assume_added_ns_per_op": ops["count_assume"]["added_ns"],
        "off_added_ns_per_op": ops["off"]["added_ns"],
        "empty_modes_added_ns_per_op": ops["modes"]["added_ns"],
        "added_ns_per_detected_item": per_sync,
        "recording_ns_per_sync": record,
        "mlp_none_ms_per_step": mlp["none"]["wall_ns"]["median"] * 1e-6,
        "mlp_count_ms_per_step": mlp["count"]["wall_ns"]["median"] * 1e-6,
        "mlp_count_vs_none": mlp["count"]["ratio_vs_none"],
        "mlp_count_assume_vs_none": mlp["count_assume"]["ratio_vs_none"],
    }

    notes = [
        "tensor_ops and item_sync: one guard around the whole timed loop; mlp_step: the guard "
        "used as a decorator, entered and left once per step (its enter/exit is included)",
        "added = variant median - no-guard median of the same workload; a fresh guard per "
        "timed loop, whose report.total must equal the expected syncs (checked)",
        f"recording one sync: the .item() iteration's added cost minus {OPS_PER_ITERATION} x "
        "the per-operator cost (count, assume_device): the call-site lookup, the counts and "
        "the source line",
        "reference: a TorchFunctionMode and a TorchDispatchMode that only call the operator, "
        "pushed the same way (the floor of watching operators from Python)",
        f"torch intra-op threads: {torch.get_num_threads()}",
    ]
    quiet = [c for c in cases if c.variant == "none"]
    busy = percentile([percentile(c.wall, 50) / percentile(c.cpu, 50) for c in quiet], 50)
    if busy > BUSY_RATIO:
        notes.insert(0, f"WARNING: the machine was busy: wall time was {busy:.2f}x the calling "
                     "thread's CPU time without a guard; wall-time numbers are inflated")
    wrong = [f"{c.workload}/{c.variant}" for c in cases
             if any(s != c.expected_syncs for s in c.syncs)]
    if wrong:
        notes.insert(0, f"WARNING: the guard did not see the expected syncs in {wrong}")

    result = {
        "benchmark": "perfsdk no_sync_guard overhead",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "repeats": args.repeats, "ops_iterations": args.ops,
                     "ops_per_iteration": OPS_PER_ITERATION, "sync_iterations": args.syncs,
                     "mlp_steps": args.steps, "mlp": MLP,
                     "torch_threads": torch.get_num_threads(),
                     "order": "every (workload, variant) once per repeat; the workloads, and "
                              "the variants within each, rotated each repeat",
                     "gc": "enabled; objects from set-up frozen (gc.freeze()), gc.collect() "
                           "before every timed loop"},
        "machine": {**machine_info(), "load_average": load, "wall_over_cpu": busy,
                    "busy": busy > BUSY_RATIO},
        "versions": versions(),
        "workloads": workloads,
        "headline": headline,
        "notes": notes,
    }
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"\nperfsdk no_sync_guard cost: {s['repeats']} repeats, interleaved; medians and "
          "p10/p90 across repeats; added = median - no guard\n")
    for workload in result["workloads"].values():
        scale = workload["scale_from_ns"]
        digits = 3 if scale < 1 else 0
        print(f"{workload['label']} ({workload['unit']})")
        head = (f"{'variant':<56}{'median':>10}{'p10':>10}{'p90':>10}{'added':>10}"
                f"{'x none':>8}{'syncs':>7}")
        print(head)
        print("-" * len(head))
        for v in workload["variants"].values():
            ns = v["wall_ns"]
            syncs = v["syncs_detected"][0] if v["detected_as_expected"] else "WRONG"
            print(f"{v['label']:<56}{ns['median'] * scale:>10.{digits}f}"
                  f"{ns['p10'] * scale:>10.{digits}f}{ns['p90'] * scale:>10.{digits}f}"
                  f"{v['added_ns'] * scale:>10.{digits}f}{v['ratio_vs_none']:>8.2f}"
                  f"{syncs!s:>7}")
        print()
    h = result["headline"]
    print("headline")
    print(f"  count mode adds {h['count_added_ns_per_op']:,.0f} ns per tensor operator "
          f"({h['count_assume_added_ns_per_op']:,.0f} with assume_device, "
          f"{h['warn_added_ns_per_op']:,.0f} in warn mode, {h['off_added_ns_per_op']:,.0f} off; "
          f"two empty torch modes: {h['empty_modes_added_ns_per_op']:,.0f})")
    print(f"  one detected .item() costs {h['added_ns_per_detected_item']:,.0f} ns more, of "
          f"which about {h['recording_ns_per_sync']:,.0f} ns record the sync")
    print(f"  MLP step: {h['mlp_none_ms_per_step']:.3f} ms without a guard, "
          f"{h['mlp_count_ms_per_step']:.3f} ms under count mode "
          f"({h['mlp_count_vs_none']:.2f}x; {h['mlp_count_assume_vs_none']:.2f}x with "
          "assume_device)")
    print("\nnotes")
    for note in result["notes"]:
        print(f"  - {note}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
