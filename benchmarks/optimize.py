#!/usr/bin/env python
"""What ``optimize(auto=True)`` finds against the best combination found by hand (issue 5).

Usage::

    python benchmarks/optimize.py                  # full run (tens of minutes on 2 CPU cores)
    python benchmarks/optimize.py --quick          # tiny shapes, dynamo's "eager" backend (smoke)
    python benchmarks/optimize.py --output x.json  # default: benchmarks/results/optimize.json
    python benchmarks/optimize.py --quick --device cuda --budget 120  # on a GPU (.ci/gpu runs it)

Four workloads, as in the issue's Targets table: the lab's SimpleNet (3x112x112, batch 16) for
inference and for one training step, and a TransformerEncoder (d=256, 4 layers, 16x128 tokens)
for inference and for one training step. A training step is forward, loss, backward (no
optimizer step), the same step ``optimize(mode="train")`` times.

For each workload, in one process:

1. ``optimize(model, inputs, auto=True, budget_s=...)`` on a fresh copy: its choice, its own
   report, and the search's wall time (inductor's cache directory is a fresh temporary one, so
   compilation is paid in full, unless ``--warm-cache``).
2. The returned model timed again on its own with :func:`perfsdk.bench.benchmark`, right away,
   against the median its report gave.
3. Every combination of the issue's table done *by hand* with plain torch (``torch.autocast``,
   ``.to(memory_format=torch.channels_last)``, ``torch.compile``, inductor ``freezing``), each
   on its own copy of the model, plus the model ``optimize`` returned, timed together with
   :func:`perfsdk.bench.compare`: interleaved rounds, the same inputs, medians; eager fp32 = 1.0.

With ``--device cuda`` the models and inputs live on the GPU, the reduced precision is float16
(what ``optimize`` picks there; the variants are named ``fp16`` instead of ``bf16``), timings
come from CUDA events (:mod:`perfsdk.bench`) and ``optimize`` also tries CUDA graphs.

Targets: optimize's pick reaches >= 95% of the best by-hand speedup, is never slower than eager,
and its report's median is within 10% of the independent re-timing. The exit status is 0 whether
or not they are met: this is a measurement; the table says PASS or FAIL. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead import clean_environment, machine_info, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "optimize.json"
BEST_FRACTION_MIN = 0.95  # optimize's speedup / best by hand
RETIME_TOLERANCE = 0.10  # |report median / independent median - 1|
MIN_CALLS = 10  # the comparison by hand and the re-timing time at least this many eager calls

# name -> (channels_last, bf16 autocast, torch.compile, inductor freezing, bf16 weights); "bf16
# weights" is the plain-torch inference idiom: model.to(torch.bfloat16), inputs cast to bf16,
# outputs back to float32, no autocast
HAND: dict[str, tuple[bool, bool, bool, bool, bool]] = {
    "eager fp32": (False, False, False, False, False),
    "bf16": (False, True, False, False, False),
    "bf16 weights": (False, False, False, False, True),
    "channels-last": (True, False, False, False, False),
    "channels-last + bf16": (True, True, False, False, False),
    "channels-last + bf16 weights": (True, False, False, False, True),
    "compile": (False, False, True, False, False),
    "compile + bf16": (False, True, True, False, False),
    "compile + channels-last + bf16": (True, True, True, False, False),
    "compile + bf16 + freezing": (False, True, True, True, False),
    "compile + channels-last + bf16 + freezing": (True, True, True, True, False),
    "compile + bf16 weights + freezing": (False, False, True, True, True),
    "compile + channels-last + bf16 weights + freezing": (True, False, True, True, True),
}
WORKLOADS = {  # name -> (model kind, mode)
    "simplenet_inference": ("cnn", "inference"),
    "simplenet_train": ("cnn", "train"),
    "encoder_inference": ("encoder", "inference"),
    "encoder_train": ("encoder", "train"),
}
SHAPES = {  # full, quick
    "cnn": ({"image_size": 112, "batch": 16}, {"image_size": 16, "batch": 2}),
    "encoder": ({"d_model": 256, "layers": 4, "heads": 8, "batch": 16, "tokens": 128},
                {"d_model": 32, "layers": 1, "heads": 4, "batch": 2, "tokens": 8}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, compile with backend='eager', short timings (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--min-time", type=float,
                   help="seconds of timed calls per variant (default 4; quick 0.05)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5; quick 2)")
    p.add_argument("--warmup", type=int, help="untimed calls per variant (default 2; quick 1)")
    p.add_argument("--budget", type=float,
                   help="optimize's budget_s (default 120, optimize's own; quick 60)")
    p.add_argument("--backend", help="torch.compile backend (default inductor; quick eager)")
    p.add_argument("--warm-cache", action="store_true",
                   help="keep inductor's usual cache directory (default: a fresh one)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the models run (default cpu; cuda: float16 instead of bf16)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("min_time", 4.0, 0.05), ("rounds", 5, 2), ("warmup", 2, 1),
                              ("budget", 120.0, 60.0), ("backend", "inductor", "eager")):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.min_time <= 0 or args.rounds < 1 or args.warmup < 0 or args.budget <= 0:
        p.error("--min-time and --budget must be > 0, --rounds >= 1, --warmup >= 0")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device cuda: torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}, CUDA build {torch.version.cuda})")
    return args


def low_precision(device: str) -> Any:
    """The reduced-precision dtype of the variants: bfloat16 on the CPU, float16 on a GPU."""
    import torch

    return torch.float16 if device == "cuda" else torch.bfloat16


def shown(variant: str, device: str) -> str:
    """A variant's name as printed and saved: ``bf16`` reads ``fp16`` on a GPU."""
    return variant.replace("bf16", "fp16") if device == "cuda" else variant


# ------------------------------------------------------------------------------- workloads
def build(kind: str, mode: str, quick: bool, device: str = "cpu"
          ) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """(model, inputs, target, loss_fn) for a workload, on ``device``."""
    import torch
    from torch.nn import functional

    from perfsdk.testing.models import SimpleNet, encoder, simplenet_inputs

    shape = SHAPES[kind][quick]
    torch.manual_seed(0)
    if kind == "cnn":
        model = SimpleNet(shape["image_size"])
        images, labels = simplenet_inputs(shape["batch"], shape["image_size"])
        inputs, target, loss_fn = (images,), labels, functional.cross_entropy
    else:
        model = encoder(shape["d_model"], shape["layers"], shape["heads"])
        tokens = torch.randn(shape["batch"], shape["tokens"], shape["d_model"])
        inputs, target, loss_fn = (tokens,), torch.randn_like(tokens), functional.mse_loss
    model.train(mode == "train")
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    return model, inputs, target.to(device), loss_fn


def describe(kind: str, mode: str, quick: bool) -> str:
    s = SHAPES[kind][quick]
    what = "inference" if mode == "inference" else "one training step"
    if kind == "cnn":
        return f"SimpleNet 3x{s['image_size']}x{s['image_size']}, batch {s['batch']}, {what}"
    return (f"Encoder d={s['d_model']}, {s['layers']} layers, {s['batch']}x{s['tokens']} tokens, "
            f"{what}")


def hand_variants(kind: str, mode: str, args: argparse.Namespace) -> list[str]:
    """The issue's combinations for this workload (freezing only with inductor, inference)."""
    cnn, infer = kind == "cnn", mode == "inference"
    names = ["eager fp32", "bf16"] + (["bf16 weights"] if infer else [])
    names += ["channels-last", "channels-last + bf16"] if cnn else []
    names += ["channels-last + bf16 weights"] if cnn and infer else []
    names += ["compile", "compile + bf16"]
    if not infer:
        names += ["compile + channels-last + bf16"] if cnn else []
    elif args.backend == "inductor":
        names += (["compile + channels-last + bf16 + freezing",
                   "compile + channels-last + bf16 weights + freezing"] if cnn
                  else ["compile + bf16 + freezing", "compile + bf16 weights + freezing"])
    return names


def step_fn(model: Any, mode: str, loss_fn: Any,
            forward: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """One inference call (no grad) or one training step (zero_grad, forward, loss, backward)."""
    import torch

    call = forward or model
    if mode == "inference":
        def infer(x: Any, target: Any) -> Any:
            with torch.no_grad():
                return call(x)
        return infer

    def train(x: Any, target: Any) -> Any:
        model.zero_grad(set_to_none=True)
        out = call(x)
        loss_fn(out, target).backward()
        return out
    return train


def by_hand(base: Any, spec: tuple[bool, bool, bool, bool, bool], mode: str, loss_fn: Any,
            backend: str, device: str = "cpu") -> tuple[Any, Callable[..., Any]]:
    """A copy of ``base`` with the combination done by hand, and its step function."""
    import torch

    channels_last, bf16, comp, freezing, weights = spec
    low = low_precision(device)
    model = copy.deepcopy(base)
    if weights:
        model = model.to(low)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    runner = model
    if comp:
        options = {"freezing": True} if freezing else None
        runner = torch.compile(model, backend=backend, options=options)

    def forward(x: Any) -> Any:
        if weights:
            x = x.to(low)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device, low, enabled=bf16):
            out = runner(x)
        return out.float()
    return model, step_fn(model, mode, loss_fn, forward)


def probe(model: Any, fn: Callable[..., Any], mode: str, x: Any, target: Any
          ) -> tuple[Any, list[Any]]:
    """One call: the output, and (training) every parameter's gradient."""
    out = fn(x, target).detach().float()
    grads = [p.grad.detach().float() for p in model.parameters()] if mode == "train" else []
    return out, grads


def errors(got: tuple[Any, list[Any]], ref: tuple[Any, list[Any]]) -> tuple[float, float]:
    """(output max error / max |reference|, largest relative L2 error of a gradient): the
    measures optimize() checks."""
    out = float((got[0] - ref[0]).abs().max() / ref[0].abs().max())
    grad = max((float((g - r).norm() / r.norm()) for g, r in zip(got[1], ref[1], strict=True)),
               default=0.0)
    return out, grad


def within_tolerance(variant: str, out_error: float, grad_error: float) -> bool:
    """optimize()'s default tolerances (perfsdk.optimize.search) applied to a by-hand variant."""
    from perfsdk.optimize.search import AMP_GRAD_RTOL, AMP_RTOL, FP32_GRAD_RTOL, FP32_RTOL

    amp = HAND[variant][1] or HAND[variant][4]  # reduced precision: autocast or bf16 weights
    return (out_error <= (AMP_RTOL if amp else FP32_RTOL)
            and grad_error <= (AMP_GRAD_RTOL if amp else FP32_GRAD_RTOL))


# ------------------------------------------------------------------------------ measurement
def run_workload(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from perfsdk import bench
    from perfsdk.optimize.search import optimize

    kind, mode = WORKLOADS[name]
    label = describe(kind, mode, args.quick)
    base, inputs, target, loss_fn = build(kind, mode, args.quick, args.device)
    x = inputs[0]
    batch = int(x.shape[0])
    timing: dict[str, Any] = {"min_time": args.min_time, "warmup": args.warmup,
                              "batch_size": batch}
    print(f"\n== {label}", flush=True)

    # 1. optimize() on its own copy, first, so its compilations are not served from the ones
    #    done by hand below.
    compile_opts = None if args.backend == "inductor" else {"backend": args.backend}
    t0 = time.perf_counter()
    opt_model, report = optimize(copy.deepcopy(base), x, mode=mode, auto=True,
                                 budget_s=args.budget, loss_fn=loss_fn,
                                 target=target if mode == "train" else None,
                                 compile=compile_opts, min_time=args.min_time)
    search_wall = time.perf_counter() - t0
    print(report.table(), flush=True)
    # at least MIN_CALLS eager calls per variant from here on (a 1 s training step would get 4)
    eager_s = (report.steps[0].median_ms or 0.0) / 1e3
    timing["min_time"] = max(args.min_time, MIN_CALLS * eager_s)

    # 2. the returned model timed again, on its own, as its user would right away
    independent = bench.benchmark(step_fn(opt_model, mode, loss_fn), x, target,
                                  name="optimize() again", **timing)
    print(f"{independent}\n", flush=True)

    # 3. by hand, and optimize's result, interleaved in one comparison
    reference = probe(base, step_fn(base, mode, loss_fn), mode, x, target)
    fns: dict[str, Callable[..., Any]] = {}
    hand: dict[str, dict[str, Any]] = {}
    keep: list[Any] = []
    for variant in hand_variants(kind, mode, args):
        model, fn = by_hand(base, HAND[variant], mode, loss_fn, args.backend, args.device)
        t1 = time.perf_counter()
        got = probe(model, fn, mode, x, target)  # the first call: compilation happens here
        setup = time.perf_counter() - t1
        out_error, grad_error = errors(got, reference)
        name_shown = shown(variant, args.device)
        hand[name_shown] = {"setup_s": setup, "output_error": out_error,
                            "grad_error": grad_error,
                            "within_tolerance": within_tolerance(variant, out_error, grad_error)}
        fns[name_shown] = fn
        keep.append(model)
    fns["optimize()"] = step_fn(opt_model, mode, loss_fn)
    comparison = bench.compare(fns, x, target, rounds=args.rounds, baseline="eager fp32",
                               **timing)
    print(comparison.table(), flush=True)
    for variant, info in hand.items():
        r = comparison.results[variant]
        info.update(median_ms=r.median_ms, p95_ms=r.p95_ms, spread=r.spread,
                    speedup=comparison.speedup(variant))
    passing = [v for v in hand if hand[v]["within_tolerance"]]
    best = max(passing, key=lambda v: hand[v]["speedup"])
    opt_speedup = comparison.speedup("optimize()")

    reported = report.best.median_ms or float("nan")
    ratio = reported / independent.median_ms
    fraction = opt_speedup / hand[best]["speedup"]
    never_slower = report.chosen == report.steps[0].name or opt_speedup >= 1.0
    del keep
    torch._dynamo.reset()  # the next workload starts from empty compile caches
    return {
        "label": label, "mode": mode, "shape": SHAPES[kind][args.quick],
        "hand": hand, "best_by_hand": best, "best_by_hand_speedup": hand[best]["speedup"],
        "optimize": {
            "chosen": report.chosen, "report_speedup": report.speedup,
            "speedup_in_comparison": opt_speedup,
            "median_ms_in_comparison": comparison.results["optimize()"].median_ms,
            "search_s": report.search_s, "call_wall_s": search_wall, "budget_s": args.budget,
            "steps": report.as_dicts(),
        },
        "min_time_s_by_hand": timing["min_time"],
        "retime": {"report_median_ms": reported, "independent_median_ms": independent.median_ms,
                   "independent_p95_ms": independent.p95_ms, "ratio": ratio},
        "targets": {
            "fraction_of_best": {"value": fraction, "target": f">= {BEST_FRACTION_MIN}",
                                 "pass": fraction >= BEST_FRACTION_MIN},
            "never_slower_than_eager": {"value": opt_speedup, "target": ">= 1.0 or eager kept",
                                        "pass": never_slower},
            "report_matches_retime": {"value": ratio, "target": f"within {RETIME_TOLERANCE:.0%}",
                                      "pass": abs(ratio - 1.0) <= RETIME_TOLERANCE},
        },
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    clean_environment()
    cache = None
    if not args.warm_cache:  # before torch is imported: inductor reads it then
        cache = tempfile.TemporaryDirectory(prefix="perfsdk-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    started = time.perf_counter()
    workloads = {name: run_workload(name, args) for name in args.workloads}
    if cache is not None:
        cache.cleanup()
    result = {
        "benchmark": "perfsdk optimize(auto=True) vs the best combination by hand",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_info(args.device),
        "settings": {"quick": args.quick, "min_time_s": args.min_time, "rounds": args.rounds,
                     "warmup": args.warmup, "budget_s": args.budget, "backend": args.backend,
                     "fresh_inductor_cache": not args.warm_cache,
                     "torch_threads": torch.get_num_threads(),
                     "bf16_cpu_flags": _bf16_flags()},
        "machine": machine_info(),
        "versions": versions(),
        "wall_s": time.perf_counter() - started,
        "workloads": workloads,
        "notes": [
            "speedup = eager fp32 median / median, all variants of a workload (by hand and "
            "optimize's pick) interleaved in one perfsdk.bench.compare",
            f"the comparison by hand and the re-timing run each variant for max(--min-time, "
            f"{MIN_CALLS} x eager median) seconds; optimize() itself gets --min-time",
            "a training step is zero_grad + forward + loss + backward (no optimizer step), as "
            "optimize(mode='train') times it",
            "by-hand variants are compiled after optimize's search, so inductor may serve them "
            "from its cache: their setup_s is not a compile time",
        ],
    }
    print_table(result)
    return result


def _device_info(device: str) -> dict[str, Any]:
    """Where the workloads ran: ``type`` (cpu or cuda), and on a GPU its name, capability and
    torch's CUDA version."""
    import torch

    info: dict[str, Any] = {"type": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    low_precision="float16")
    else:
        info["low_precision"] = "bfloat16"
    return info


def _bf16_flags() -> list[str]:
    """The CPU's bfloat16 instruction-set flags (avx512_bf16, amx_bf16) from /proc/cpuinfo."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(words & {"avx512_bf16", "amx_bf16", "amx_tile"})


def print_table(result: dict[str, Any]) -> None:
    width = max(len(w["label"]) for w in result["workloads"].values()) + 2
    head = (f"{'workload':<{width}}{'best by hand':<44}{'x':>7}  {'optimize() chose':<48}"
            f"{'x':>7}{'% best':>8}{'>= eager':>9}{'re-time':>9}{'search s':>10}")
    device = result["device"]
    where = device.get("name", device["type"])
    print(f"\noptimize(auto=True) against the best by hand on {where}; eager fp32 = 1.0 "
          f"(median)\n\n{head}")
    print("-" * len(head))
    for w in result["workloads"].values():
        o, t = w["optimize"], w["targets"]
        print(f"{w['label']:<{width}}{w['best_by_hand']:<44}{w['best_by_hand_speedup']:>6.2f}x  "
              f"{o['chosen']:<48}{o['speedup_in_comparison']:>6.2f}x"
              f"{t['fraction_of_best']['value']:>7.0%}{_pf(t['fraction_of_best']):>1}"
              f"{_pf(t['never_slower_than_eager']):>9}"
              f"{t['report_matches_retime']['value']:>8.2f}{_pf(t['report_matches_retime'])}"
              f"{o['search_s']:>10.1f}")
    print("\ntargets: % best >= 95 (P/F after the number), never slower than eager, report "
          "median / independent re-timing within 10%")
    for name, w in result["workloads"].items():
        others = ", ".join(
            f"{v} {h['speedup']:.2f}x (err {h['output_error']:.1e}"
            + (f", grad {h['grad_error']:.1e}" if w["mode"] == "train" else "")
            + ("" if h["within_tolerance"] else ", OUT OF TOLERANCE") + ")"
            for v, h in w["hand"].items() if v != "eager fp32")
        print(f"  {name}: {others}")


def _pf(target: dict[str, Any]) -> str:
    return "P" if target["pass"] else "F"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
