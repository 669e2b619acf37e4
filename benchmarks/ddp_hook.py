#!/usr/bin/env python
"""What ``perfsdk.distributed.instrument_ddp`` costs a DDP backward, per gradient bucket.

Usage::

    python benchmarks/ddp_hook.py                  # full run (about a minute)
    python benchmarks/ddp_hook.py --quick          # a few calls, for a smoke test
    python benchmarks/ddp_hook.py --output x.json  # default: benchmarks/results/

One process, a one-rank gloo group (a FileStore in a temporary directory), so the all-reduce
itself is nearly free and what is left is the hook's own cost: the worst case for its share of
a step. The model is ``--layers`` Linear(64, 64) layers, DDP's buckets capped so that each
layer's gradients are a bucket of their own; the work timed is forward + backward of a batch of
8 (no optimizer). Variants, each a DDP model with the same weights, timed with
``perfsdk.bench.compare`` (interleaved round by round, the order rotating):

- ``ddp``: DDP as it is (its C++ all-reduce, no communication hook),
- ``ddp_allreduce_hook``: DDP with ``torch``'s own Python ``allreduce_hook`` registered, the
  price of any Python communication hook,
- ``instrument_ddp``: perfsdk's hook, a ``ddp.all_reduce`` region per bucket,
- ``instrument_ddp_disabled``: the same with perfsdk disabled at run time (its hook still
  reduces, records nothing).

``added_us_per_bucket`` is a variant's median less ``ddp``'s, over the buckets of one backward.
Regions go to perfsdk's in-process summary only (``PERFSDK_EXPORTER=none``). The exit status is
0: this is a measurement. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from overhead import clean_environment, fill_counts, machine_info, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "ddp_hook.json"
VARIANTS = ("ddp", "ddp_allreduce_hook", "instrument_ddp", "instrument_ddp_disabled")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--iters", type=int, help="timed calls per variant (default 2000; quick 8)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 20; quick 2)")
    p.add_argument("--layers", type=int, help="layers, one bucket each (default 20; quick 4)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("iters", 2000, 8), ("rounds", 20, 2), ("layers", 20, 4)))
    return args


def measure(args: argparse.Namespace) -> int:
    clean_environment()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import perfsdk
    from perfsdk.bench import compare
    from perfsdk.config import state
    from perfsdk.distributed import instrument_ddp

    torch.set_num_threads(args.threads)
    store = Path(tempfile.mkdtemp(prefix="perfsdk-ddp-bench-")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        def make() -> nn.parallel.DistributedDataParallel:
            torch.manual_seed(0)
            layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(args.layers)])
            return nn.parallel.DistributedDataParallel(layers, bucket_cap_mb=0.01)

        hooked = make()
        hooked.register_comm_hook(hooked.process_group, allreduce_hook)
        instrumented = instrument_ddp(make())
        models = {"ddp": make(), "ddp_allreduce_hook": hooked, "instrument_ddp": instrumented}

        def step(model: nn.Module) -> Callable[[torch.Tensor], None]:
            def run(x: torch.Tensor) -> None:
                model(x).sum().backward()
            return run

        def disabled(x: torch.Tensor) -> None:
            state.enabled = False  # the run-time switch configure(enabled=False) flips
            try:
                instrumented(x).sum().backward()
            finally:
                state.enabled = True

        fns: dict[str, Callable[[torch.Tensor], None]] = {k: step(m) for k, m in models.items()}
        fns["instrument_ddp_disabled"] = disabled
        x = torch.randn(8, 64)
        for fn in fns.values():  # DDP sizes its buckets after the first backward
            fn(x)
            fn(x)
        buckets = {k: len(m.reducer._get_zeros_like_grad_buckets()) for k, m in models.items()}
        print(f"\nforward + backward, {args.layers} Linear(64, 64) layers, "
              f"{buckets['ddp']} buckets, one-rank gloo group")
        comparison = compare(fns, x, warmup=3, iters=args.iters, rounds=args.rounds, rotate=1,
                             device="cpu", show=True)
    finally:
        dist.destroy_process_group()
    base = comparison.results["ddp"].median_ms
    n = buckets["ddp"]
    variants = {key: {**r.as_dict(), "added_ms": r.median_ms - base,
                      "added_us_per_bucket": (r.median_ms - base) * 1000 / n,
                      "ratio_vs_ddp": r.median_ms / base}
                for key, r in comparison.results.items()}
    perfsdk.flush()
    regions = {row.name: row.count for row in perfsdk.summary(show=False).rows}
    result = {
        "benchmark": "perfsdk.distributed.instrument_ddp overhead",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "iters": args.iters, "rounds": args.rounds,
                     "layers": args.layers, "buckets": buckets,
                     "torch_threads": torch.get_num_threads(),
                     "order": "perfsdk.bench.compare: variants interleaved, the order rotating "
                              "each round"},
        "machine": machine_info(),
        "versions": versions(),
        "variants": variants,
        "ddp_all_reduce_regions": regions.get("ddp.all_reduce", 0),
        "perfsdk_diagnostics": perfsdk.diagnostics(),
    }
    print("\nadded per bucket, over DDP's C++ all-reduce")
    for key in VARIANTS[1:]:
        print(f"  {key:26s} {variants[key]['added_us_per_bucket']:+8.1f} us")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())

