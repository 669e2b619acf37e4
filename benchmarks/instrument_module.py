#!/usr/bin/env python
"""What ``perfsdk.auto.instrument_module`` costs on SimpleNet and a 4-layer Transformer encoder.

Usage::

    python benchmarks/instrument_module.py                  # full run (about a minute)
    python benchmarks/instrument_module.py --quick          # a few calls, for a smoke test
    python benchmarks/instrument_module.py --output x.json  # default: benchmarks/results/

Workloads on the CPU, each timed with ``perfsdk.bench.compare`` (all variants in this one
process, interleaved round by round on the same inputs; each variant a deep copy of the same
model, so weights are equal):

- ``simplenet_infer``: SimpleNet (32x32 images, batch 4), eval, no_grad. Variants ``bare`` and
  ``instrumented`` (a region per module).
- ``simplenet_train``: SimpleNet forward + backward (no optimizer). ``bare``,
  ``instrumented_fwd`` (``backward=False``) and ``instrumented`` (forward and backward regions).
- ``encoder_infer``: ``perfsdk.testing.models.encoder()`` (4 layers, d_model 256), batch
  2 x 16 tokens, eval, no_grad: where the issue measured 6.3 -> 22 ms from forward hooks.
  ``bare``, ``instrumented`` (fast path kept) and ``hooks_everywhere`` (an empty forward
  pre-hook and hook on every module: what a naive per-module instrumentation does).

Each encoder variant's calls to ``aten::_transformer_encoder_layer_fwd`` (the fused fast path)
are counted once with torch.profiler, so the JSON says which variants kept it. Regions go to
perfsdk's in-process summary only (``PERFSDK_EXPORTER=none``). The exit status is 0: this is a
measurement. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead import clean_environment, fill_counts, machine_info, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "instrument_module.json"
FAST_OP = "aten::_transformer_encoder_layer_fwd"
WORKLOADS = {
    "simplenet_infer": "SimpleNet inference (eval, no_grad), batch 4, 32x32",
    "simplenet_train": "SimpleNet forward + backward, batch 4, 32x32",
    "encoder_infer": "4-layer TransformerEncoder inference (eval, no_grad), batch 2 x 16 tokens",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--iters", type=int, help="timed calls per variant (default 200; quick 6)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 10; quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    fill_counts(p, args, (("iters", 200, 6), ("rounds", 10, 2)))
    return args



def measure(args: argparse.Namespace) -> int:
    clean_environment()
    import torch
    from torch import nn

    import perfsdk
    from perfsdk.auto import instrument_module
    from perfsdk.bench import compare
    from perfsdk.testing.models import SimpleNet, encoder

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    handles: list[Any] = []

    def instrumented(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = copy.deepcopy(model)
        handles.append(instrument_module(model, **kwargs))
        return model

    def hooks_everywhere(model: nn.Module) -> nn.Module:
        model = copy.deepcopy(model)
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(lambda *a: None))
            handles.append(m.register_forward_hook(lambda *a: None))
        return model

    def infer(model: nn.Module) -> Callable[[torch.Tensor], Any]:
        def run(x: torch.Tensor) -> Any:
            with torch.no_grad():
                return model(x)
        return run

    def train(model: nn.Module) -> Callable[[torch.Tensor], Any]:
        def run(x: torch.Tensor) -> None:
            model(x).sum().backward()
        return run

    net = SimpleNet(image_size=32)
    images = torch.randn(4, 3, 32, 32)
    enc = encoder().eval()
    tokens = torch.randn(2, 16, 256)
    plans: dict[str, tuple[dict[str, Callable[..., Any]], torch.Tensor, nn.Module | None]] = {
        "simplenet_infer": ({"bare": infer(copy.deepcopy(net).eval()),
                             "instrumented": infer(instrumented(net).eval())}, images, None),
        "simplenet_train": ({"bare": train(copy.deepcopy(net)),
                             "instrumented_fwd": train(instrumented(net, backward=False)),
                             "instrumented": train(instrumented(net))}, images, None),
        "encoder_infer": ({}, tokens, enc),
    }
    enc_models = {"bare": copy.deepcopy(enc), "instrumented": instrumented(enc),
                  "hooks_everywhere": hooks_everywhere(enc)}
    plans["encoder_infer"][0].update({k: infer(m) for k, m in enc_models.items()})
    fast_path = {k: fast_path_calls(torch, m, tokens) for k, m in enc_models.items()}

    workloads: dict[str, Any] = {}
    for name, (fns, x, _) in plans.items():
        print(f"\n{WORKLOADS[name]}")
        comparison = compare(fns, x, warmup=3, iters=args.iters, rounds=args.rounds,
                             rotate=1, device="cpu", show=True)
        base = comparison.results["bare"].median_ms
        workloads[name] = {"label": WORKLOADS[name], "variants": {
            key: {**r.as_dict(), "added_ms": r.median_ms - base,
                  "ratio_vs_bare": r.median_ms / base}
            for key, r in comparison.results.items()}}
    workloads["encoder_infer"]["fast_path_calls_per_forward"] = fast_path
    for h in handles:
        h.remove()
    perfsdk.flush()
    result = {
        "benchmark": "perfsdk.auto.instrument_module overhead",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "iters": args.iters, "rounds": args.rounds,
                     "torch_threads": torch.get_num_threads(),
                     "order": "perfsdk.bench.compare: variants interleaved, the order rotating "
                              "each round"},
        "machine": machine_info(),
        "versions": versions(),
        "workloads": workloads,
        "headline": headline(workloads),
        "perfsdk_diagnostics": perfsdk.diagnostics(),
    }
    print_headline(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def fast_path_calls(torch: Any, model: Any, x: Any) -> int:
    """How many fused encoder-layer kernels one inference call runs (layers, or 0)."""
    with torch.no_grad(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    return sum(1 for e in prof.events() if e.name == FAST_OP)


def headline(workloads: dict[str, Any]) -> dict[str, Any]:
    def v(workload: str, variant: str, key: str) -> float:
        return float(workloads[workload]["variants"][variant][key])

    fast = workloads["encoder_infer"]["fast_path_calls_per_forward"]
    return {
        "simplenet_infer_added_ms": v("simplenet_infer", "instrumented", "added_ms"),
        "simplenet_infer_ratio": v("simplenet_infer", "instrumented", "ratio_vs_bare"),
        "simplenet_train_added_ms": v("simplenet_train", "instrumented", "added_ms"),
        "simplenet_train_ratio": v("simplenet_train", "instrumented", "ratio_vs_bare"),
        "encoder_instrumented_ratio": v("encoder_infer", "instrumented", "ratio_vs_bare"),
        "encoder_hooks_everywhere_ratio": v("encoder_infer", "hooks_everywhere",
                                            "ratio_vs_bare"),
        "encoder_fast_path_kept": fast["instrumented"] == fast["bare"] > 0,
    }


def print_headline(result: dict[str, Any]) -> None:
    h = result["headline"]
    fast = result["workloads"]["encoder_infer"]["fast_path_calls_per_forward"]
    print("\nheadline")
    print(f"  SimpleNet inference: +{h['simplenet_infer_added_ms']:.3f} ms per call "
          f"({h['simplenet_infer_ratio']:.2f}x); training step +"
          f"{h['simplenet_train_added_ms']:.3f} ms ({h['simplenet_train_ratio']:.2f}x)")
    print(f"  encoder inference: instrumented {h['encoder_instrumented_ratio']:.2f}x, hooks on "
          f"every module {h['encoder_hooks_everywhere_ratio']:.2f}x; fused layer kernels per "
          f"call: {fast}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
