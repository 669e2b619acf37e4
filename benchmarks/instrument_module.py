#!/usr/bin/env python
"""What ``perfsdk.auto.instrument_module`` costs per module, against hand-written NVTX hooks.

Usage::

    python benchmarks/instrument_module.py                  # full run (about two minutes)
    python benchmarks/instrument_module.py --quick          # a few calls, for a smoke test
    python benchmarks/instrument_module.py --output x.json  # default: benchmarks/results/
    python benchmarks/instrument_module.py --only per_module --rounds 40   # the targets only
    python benchmarks/instrument_module.py --callgrind      # the same in instructions (valgrind)
    python benchmarks/instrument_module.py --pure-python    # without perfsdk's compiled module

The script builds the NVTX recording injection library (``tests/nvtx_injection/recorder.c``)
and re-executes itself with ``NVTX_INJECTION64_PATH`` pointing at it, as
``benchmarks/overhead.py`` does, so every NVTX push and pop (perfsdk's and the hand-written
hooks') goes through a tool's callbacks, as under Nsight Systems.

``per_module`` (the targets of issue 16): a model of 24 x (``Linear(64, 64)``, ``ReLU``), batch
8, one torch thread, 49 modules with the ``Sequential``; one training step is ``zero_grad``,
forward, ``.sum().backward()`` and ``SGD.step()``. Variants, each its own copy of the model:
``bare``; ``nvtx_hooks_fwd``: a forward pre-hook and a forward hook on every module doing an
NVTX domain push and pop with attributes built once (what one would write by hand);
``nvtx_hooks_fwd_bwd``: the same plus ``register_full_backward_pre_hook`` / ``_hook`` push and
pop; ``instrumented_fwd``: ``instrument_module(backward=False)``; ``instrumented``:
``instrument_module()``. Each round runs every variant once (the order rotating), a block of
``--steps`` steps then ``perfsdk.flush()``, both inside the timing, so the regions' background
work counts. Per round, a variant's added cost per module is (its step time - the bare step's
time in the same round) / 49; the table gives the median and the interquartile range (p25-p75)
across rounds, and the targets' ratios likewise, computed per round. ``--callgrind`` runs
the same variants under valgrind's callgrind and reports instructions per step of the calling
thread instead (repeatable on a shared machine, but without perfsdk's background thread).

The other workloads run on the CPU, each timed with ``perfsdk.bench.compare`` (all variants in
this one process, interleaved round by round on the same inputs; each variant a deep copy of
the same model, so weights are equal):

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
perfsdk's in-process summary only (``PERFSDK_EXPORTER=none``). The exit status is 0 whether or
not a target is met: this is a measurement; the table says PASS or FAIL. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead import clean_environment, fill_counts, machine_info, percentile, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "instrument_module.json"
CALLGRIND_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "instrument_module_callgrind.json"
CHILD_FLAG = "PERFSDK_BENCH_MODULE_CHILD"
CALLGRIND_DIR = "PERFSDK_BENCH_CALLGRIND_DIR"
CALLGRIND_BLOCKS = (4, 24)  # steps per block (quick: 1, 3); per step = difference / 20
NVTX_ERROR = "PERFSDK_BENCH_NVTX_ERROR"
FAST_OP = "aten::_transformer_encoder_layer_fwd"
WORKLOADS = {
    "simplenet_infer": "SimpleNet inference (eval, no_grad), batch 4, 32x32",
    "simplenet_train": "SimpleNet forward + backward, batch 4, 32x32",
    "encoder_infer": "4-layer TransformerEncoder inference (eval, no_grad), batch 2 x 16 tokens",
}
PARTS = ("per_module", "workloads")

# per_module: the model and the targets of issue 16
LAYERS, WIDTH, BATCH = 24, 64, 8
PER_MODULE_VARIANTS = {
    "bare": "no hooks",
    "nvtx_hooks_fwd": "hand-written NVTX forward pre/post hooks",
    "nvtx_hooks_fwd_bwd": "hand-written NVTX forward + full backward pre/post hooks",
    "instrumented_fwd": "instrument_module(backward=False)",
    "instrumented": "instrument_module() (forward and backward regions)",
}
FWD_VS_HOOKS_MAX = 1.5
FWD_BWD_VS_HOOKS_MAX = 3.0
STEP_VS_BARE_MAX = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    p.add_argument("--only", choices=PARTS, help="run only the per-module targets or only the "
                   "SimpleNet / encoder workloads (default: both)")
    p.add_argument("--iters", type=int, help="workloads: timed calls per variant (default 200; "
                   "quick 6)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 10, per_module 25; "
                   "quick 2)")
    p.add_argument("--steps", type=int, help="per_module: training steps per variant per round "
                   "(default 40; quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--callgrind", action="store_true", help="per_module only, as instruction "
                   "counts of the calling thread under valgrind's callgrind (repeatable on a "
                   "busy machine; about 10 minutes); JSON default: "
                   "benchmarks/results/instrument_module_callgrind.json")
    p.add_argument("--pure-python", action="store_true", help="measure perfsdk without its "
                   "compiled module (PERFSDK_DISABLE_EXTENSIONS=1): the pure-Python twins")
    args = p.parse_args(argv)
    rounds_given = args.rounds is not None
    fill_counts(p, args, (("iters", 200, 6), ("rounds", 10, 2), ("steps", 40, 3)))
    args.module_rounds = args.rounds if rounds_given or args.quick else 25
    if args.callgrind and args.output == DEFAULT_OUTPUT:
        args.output = CALLGRIND_OUTPUT
    return args


# ---------------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Build the NVTX injection library, then measure in a child process that loads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTX_")}
    env[CHILD_FLAG] = "1"
    sys.path.insert(0, str(REPO_ROOT))
    with tempfile.TemporaryDirectory(prefix="perfsdk-bench-") as tmp:
        try:
            from tests.nvtx_injection.recorder import build_library

            env["NVTX_INJECTION64_PATH"] = str(build_library(Path(tmp) / "nvtx"))
        except Exception as exc:  # measure without injection, and say so
            env[NVTX_ERROR] = f"{type(exc).__name__}: {exc}"
            print(f"warning: NVTX injection library unavailable ({exc}); NVTX calls will be "
                  "near no-ops and the table says so.", file=sys.stderr)
        command = [sys.executable, str(Path(__file__).resolve()), *argv]
        if not args.callgrind:
            return subprocess.run(command, env=env, check=False).returncode
        return callgrind(args, command, env, Path(tmp))


# -------------------------------------------------------------------------------- callgrind
def callgrind(args: argparse.Namespace, command: list[str], env: dict[str, str],
              tmp: Path) -> int:
    """Run the per-module variants under callgrind, collecting only inside blocks of steps.

    The child runs each block inside ``itertools.starmap``; ``--toggle-collect=starmap_next``
    counts instructions only there, on the calling thread (perfsdk's background thread is not
    counted: the wall-clock run includes it), and ``--dump-after`` writes one file per block.
    Per step = (count of the long block - the short one) / their difference in steps, so
    warm-up, the flush after each block and the rest of the process cancel out.
    """
    import shutil

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("error: --callgrind needs valgrind on PATH", file=sys.stderr)
        return 2
    out = tmp / "callgrind"
    out.mkdir()
    env[CALLGRIND_DIR] = str(out)
    proc = subprocess.run(
        [valgrind, "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=starmap_next",
         "--dump-after=starmap_next", f"--callgrind-out-file={out / 'cg.out'}", *command],
        env=env, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout, proc.stderr, sep="\n", file=sys.stderr)
        return proc.returncode
    plan = json.loads((out / "plan.json").read_text())
    counts = []
    for f in sorted(out.glob("cg.out.*"), key=lambda f: int(f.suffix[1:])):
        total = next((int(line.split()[1]) for line in f.read_text().splitlines()
                      if line.startswith(("summary:", "totals:"))), 0)
        if total > 10_000:  # a block (starmap's last, empty call dumps a few hundred)
            counts.append(total)
    if len(counts) != len(plan["blocks"]):
        print(f"error: {len(counts)} callgrind dumps for {len(plan['blocks'])} blocks",
              file=sys.stderr)
        return 1
    by: dict[str, dict[int, int]] = {}
    for (name, n), total in zip(plan["blocks"], counts, strict=True):
        by.setdefault(name, {})[n] = total
    modules = plan["modules"]
    per_step = {}
    for name, blocks in by.items():
        (n1, c1), (n2, c2) = sorted(blocks.items())
        per_step[name] = (c2 - c1) / (n2 - n1)
    bare, hooks = per_step["bare"], per_step["nvtx_hooks_fwd"] - per_step["bare"]
    variants = {name: {
        "label": PER_MODULE_VARIANTS[name], "instructions_per_step": v,
        "added_per_module": (v - bare) / modules, "vs_bare_step": v / bare,
        "vs_nvtx_hooks_fwd_added": _div(v - bare, hooks)} for name, v in per_step.items()}
    one = {"median": 0.0, "p25": 0.0, "p75": 0.0}
    targets = [
        target("fwd_vs_hooks", f"forward regions <= {FWD_VS_HOOKS_MAX:g}x the hand-written "
               "forward hooks' added instructions per module",
               {**one, "median": variants["instrumented_fwd"]["vs_nvtx_hooks_fwd_added"]},
               "<=", FWD_VS_HOOKS_MAX),
        target("fwd_bwd_vs_hooks", f"forward + backward regions <= {FWD_BWD_VS_HOOKS_MAX:g}x "
               "the hand-written forward hooks' added instructions per module",
               {**one, "median": variants["instrumented"]["vs_nvtx_hooks_fwd_added"]},
               "<=", FWD_BWD_VS_HOOKS_MAX),
        target("step_vs_bare", f"instrumented step <= {STEP_VS_BARE_MAX:g}x the bare step's "
               "instructions", {**one, "median": variants["instrumented"]["vs_bare_step"]},
               "<=", STEP_VS_BARE_MAX),
    ]
    result = {
        "benchmark": "perfsdk.auto.instrument_module per-module instructions (callgrind)",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "blocks": plan["blocks"],
                     "extensions": not args.pure_python,
                     "counted": "instructions of the calling thread inside the blocks of "
                                "steps (perfsdk.flush() after each block included, the "
                                "pipeline thread's work not)"},
        "nvtx_injection": {"attached": NVTX_ERROR not in env, "error": env.get(NVTX_ERROR)},
        "machine": machine_info(), "versions": versions(),
        "per_module": {"model": plan["model"], "modules": modules, "variants": variants},
        "targets": targets,
    }
    print(f"\ninstructions (callgrind, calling thread): {plan['model']}, {modules} modules; "
          f"{'pure Python (no compiled module)' if args.pure_python else 'compiled module'}")
    print(f"  {'variant':<20} {'per step':>14} {'added/module':>14} {'x hooks fwd':>12}")
    for name, v in variants.items():
        print(f"  {name:<20} {v['instructions_per_step']:>14,.0f} "
              f"{v['added_per_module']:>14,.0f} {v['vs_nvtx_hooks_fwd_added']:>12.2f}")
    print("\ntargets (issue 16), in instructions")
    for t in targets:
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['definition']}: {t['value']:.2f} "
              f"{t['op']} {t['threshold']:g}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def use_extensions(args: argparse.Namespace) -> None:
    """``--pure-python``: perfsdk without its compiled module (set before perfsdk is imported)."""
    if args.pure_python:
        os.environ["PERFSDK_DISABLE_EXTENSIONS"] = "1"


def callgrind_child(args: argparse.Namespace) -> int:
    """Under callgrind: each variant's blocks of steps, each inside ``itertools.starmap``."""
    import itertools

    out = Path(os.environ[CALLGRIND_DIR])
    clean_environment()
    use_extensions(args)
    import torch

    import perfsdk

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    steps, handles, modules = build_steps()
    for step in steps.values():
        for _ in range(3):
            step()
    perfsdk.flush()
    sizes = (1, 3) if args.quick else CALLGRIND_BLOCKS
    blocks = []
    for name, step in steps.items():
        for n in sizes:
            def block(step: Callable[[], None] = step, n: int = n) -> None:
                for _ in range(n):
                    step()
                perfsdk.flush()

            for _ in itertools.starmap(block, [()]):
                pass
            blocks.append((name, n))
    for h in handles:
        h.remove()
    (out / "plan.json").write_text(json.dumps({
        "blocks": blocks, "modules": modules,
        "model": f"{LAYERS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}"}))
    return 0


# ------------------------------------------------------------------------------ measurement
def measure(args: argparse.Namespace) -> int:
    nvtx_lib = os.environ.get("NVTX_INJECTION64_PATH")
    nvtx_info: dict[str, Any] = {"library": nvtx_lib, "attached": False,
                                 "error": os.environ.get(NVTX_ERROR)}
    clean_environment()
    use_extensions(args)
    import torch

    import perfsdk

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": "perfsdk.auto.instrument_module overhead",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "iters": args.iters, "rounds": args.rounds,
                     "per_module_rounds": args.module_rounds, "steps": args.steps,
                     "only": args.only, "torch_threads": torch.get_num_threads(),
                     "extensions": not args.pure_python,
                     "order": "variants interleaved, the order rotating each round"},
        "nvtx_injection": nvtx_info,
        "machine": machine_info(),
        "versions": versions(),
    }
    if args.only in (None, "per_module"):
        result["per_module"] = per_module(args)
        result["targets"] = result["per_module"].pop("targets")
    if args.only in (None, "workloads"):
        result["workloads"] = workloads(args)
        result["headline"] = headline(result["workloads"])
    perfsdk.flush()
    result["perfsdk_diagnostics"] = perfsdk.diagnostics()
    maps = Path("/proc/self/maps")  # NVTX loads the library at its first call, long done
    nvtx_info["attached"] = bool(nvtx_lib and maps.exists() and nvtx_lib in maps.read_text())
    if "per_module" in result:
        print_per_module(result)
    if "headline" in result:
        print_headline(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def mlp() -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def nvtx_hooks(model: Any, backward: bool) -> list[Any]:
    """What one writes by hand: NVTX push in a forward pre-hook, pop in a forward hook (and in
    full backward pre-hooks / hooks), one domain, attributes built once per module."""
    import nvtx

    dom = nvtx.get_domain("bench")
    push, pop = dom.push_range, dom.pop_range
    handles = []
    for name, module in model.named_modules():
        fwd = dom.get_event_attributes(message=name or "model", color=0xFF4E79A7)

        def pre(m: Any, args: Any, attrs: Any = fwd) -> None:
            push(attrs)

        def post(m: Any, args: Any, output: Any) -> None:
            pop()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        if backward:
            bwd = dom.get_event_attributes(message=f"{name or 'model'}.backward",
                                           color=0xFFF28E2B)

            def bpre(m: Any, grad_output: Any, attrs: Any = bwd) -> None:
                push(attrs)

            def bpost(m: Any, grad_input: Any, grad_output: Any) -> None:
                pop()

            handles += [module.register_full_backward_pre_hook(bpre),
                        module.register_full_backward_hook(bpost)]
    return handles


def build_steps(variants: Any = PER_MODULE_VARIANTS
                ) -> tuple[dict[str, Callable[[], None]], list[Any], int]:
    """One training step per variant, each on its own copy of the model; the hook handles to
    remove afterwards; how many modules the model has."""
    import torch

    from perfsdk.auto import instrument_module

    base = mlp()
    x = torch.randn(BATCH, WIDTH)
    modules = len(list(base.modules()))
    steps: dict[str, Callable[[], None]] = {}
    handles: list[Any] = []
    for name in variants:
        model = copy.deepcopy(base)
        if name.startswith("nvtx_hooks"):
            handles += nvtx_hooks(model, backward=name.endswith("bwd"))
        elif name.startswith("instrumented"):
            handle = instrument_module(model, backward=name == "instrumented")
            assert len(handle.regions) == modules, handle
            handles.append(handle)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()

        steps[name] = step
    return steps, handles, modules


def per_module(args: argparse.Namespace) -> dict[str, Any]:
    import perfsdk

    steps, handles, modules = build_steps()
    names = list(steps)
    ms: dict[str, list[float]] = {k: [] for k in names}
    thread_ms: dict[str, list[float]] = {k: [] for k in names}  # the calling thread's CPU
    print(f"\nper module: {LAYERS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}, "
          f"{modules} modules, SGD training step; {args.module_rounds} rounds x {args.steps} "
          "steps per variant", flush=True)
    for step in steps.values():  # warm up: first calls, lazy state, the pipeline thread
        for _ in range(3):
            step()
    perfsdk.flush()
    for r in range(args.module_rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            step = steps[name]
            step()
            perfsdk.flush()
            gc.collect()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            for _ in range(args.steps):
                step()
            perfsdk.flush()
            ms[name].append((time.perf_counter_ns() - t0) / args.steps / 1e6)
            thread_ms[name].append((time.thread_time_ns() - c0) / args.steps / 1e6)
    for h in handles:
        h.remove()

    bare = ms["bare"]
    hooks = [(a - b) / modules * 1e3 for a, b in zip(ms["nvtx_hooks_fwd"], bare, strict=True)]
    variants: dict[str, Any] = {}
    for name in names:
        added = [(a - b) / modules * 1e3 for a, b in zip(ms[name], bare, strict=True)]
        thread_added = [(a - b) / modules * 1e3 for a, b in
                        zip(thread_ms[name], thread_ms["bare"], strict=True)]
        variants[name] = {
            "label": PER_MODULE_VARIANTS[name],
            "step_ms": spread(ms[name]),
            "added_us_per_module": spread(added),
            "thread_cpu_step_ms": spread(thread_ms[name]),
            "thread_cpu_added_us_per_module": spread(thread_added),
            "vs_bare_step": spread([a / b for a, b in zip(ms[name], bare, strict=True)]),
            "vs_nvtx_hooks_fwd_added": spread([_div(a, h) for a, h in
                                               zip(added, hooks, strict=True)]),
        }
    hooks_median = variants["nvtx_hooks_fwd"]["added_us_per_module"]["median"]
    for name in names:
        v = variants[name]
        v["vs_nvtx_hooks_fwd_added"]["of_medians"] = _div(v["added_us_per_module"]["median"],
                                                          hooks_median)
    v = variants
    targets = [
        target("fwd_vs_hooks", "instrument_module forward regions add <= "
               f"{FWD_VS_HOOKS_MAX:g}x the hand-written NVTX forward hooks' cost per module "
               "(median instrumented_fwd added / median nvtx_hooks_fwd added)",
               v["instrumented_fwd"]["vs_nvtx_hooks_fwd_added"], "<=", FWD_VS_HOOKS_MAX),
        target("fwd_bwd_vs_hooks", "forward + backward regions add <= "
               f"{FWD_BWD_VS_HOOKS_MAX:g}x the hand-written NVTX forward hooks' cost per module "
               "(median instrumented added / median nvtx_hooks_fwd added)",
               v["instrumented"]["vs_nvtx_hooks_fwd_added"], "<=", FWD_BWD_VS_HOOKS_MAX),
        target("step_vs_bare", "training step with every module instrumented (forward + "
               f"backward) <= {STEP_VS_BARE_MAX:g}x the bare step (instrumented / bare, per "
               "round)", v["instrumented"]["vs_bare_step"], "<=", STEP_VS_BARE_MAX),
    ]
    return {"model": f"{LAYERS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}",
            "modules": modules, "rounds": args.module_rounds, "steps": args.steps,
            "step": "zero_grad(set_to_none=True); model(x).sum().backward(); SGD.step()",
            "timing": "each block of steps and the perfsdk.flush() after it, per step; "
                      "thread_cpu_*: the calling thread's CPU time (time.thread_time_ns) "
                      "over the same block, without perfsdk's background thread and without "
                      "time the machine gave to other processes",
            "variants": variants, "targets": targets}


def spread(values: list[float]) -> dict[str, Any]:
    """Median and interquartile range of per-round values (a ratio whose denominator was not
    positive in a round, inf, is left out and counted)."""
    finite = [v for v in values if math.isfinite(v)] or [math.nan]
    return {"median": percentile(finite, 50), "p25": percentile(finite, 25),
            "p75": percentile(finite, 75), "samples": [round(v, 4) for v in values],
            "left_out": len(values) - len([v for v in values if math.isfinite(v)])}


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def target(name: str, definition: str, value: dict[str, Any], op: str,
           threshold: float) -> dict[str, Any]:
    """A target judged on ``value["of_medians"]`` where there is one (the ratio of the median
    added costs, steadier than the per-round ratios, whose median and IQR ride along), else on
    ``value["median"]``."""
    judged = value.get("of_medians", value["median"])
    passed = bool(judged <= threshold if op == "<=" else judged >= threshold)
    return {"name": name, "definition": definition, "value": judged,
            "per_round_median": value["median"], "p25": value["p25"], "p75": value["p75"],
            "op": op, "threshold": threshold, "passed": passed}


def print_per_module(result: dict[str, Any]) -> None:
    pm = result["per_module"]
    nvtx = result["nvtx_injection"]
    print(f"\nper-module cost: {pm['model']}, {pm['modules']} modules; median [p25-p75] of "
          f"{pm['rounds']} rounds; NVTX injection "
          f"{'attached' if nvtx['attached'] else 'NOT attached: ' + str(nvtx['error'])}; "
          f"{'compiled module' if result['settings']['extensions'] else 'pure Python'}")
    print(f"  {'variant':<20} {'step ms':>22} {'added us/module':>22} {'x hooks fwd':>19} "
          f"{'thread cpu us/module':>22}")

    def fmt(s: dict[str, Any], digits: int) -> str:
        return f"{s['median']:.{digits}f} [{s['p25']:.{digits}f}-{s['p75']:.{digits}f}]"

    for name, v in pm["variants"].items():
        rel = "" if name == "bare" else fmt(v["vs_nvtx_hooks_fwd_added"], 2)
        added = "" if name == "bare" else fmt(v["added_us_per_module"], 2)
        cpu = "" if name == "bare" else fmt(v["thread_cpu_added_us_per_module"], 2)
        print(f"  {name:<20} {fmt(v['step_ms'], 3):>22} {added:>22} {rel:>19} {cpu:>22}")
    print("  (added: wall time over the bare step's in the same round, perfsdk.flush() included; "
          "thread cpu: the calling thread's CPU time, the same way)")
    print("\ntargets (issue 16); [p25-p75] of the per-round ratios")
    for t in result["targets"]:
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['definition']}: {t['value']:.2f} "
              f"[{t['p25']:.2f}-{t['p75']:.2f}] {t['op']} {t['threshold']:g}")


def workloads(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    from perfsdk.auto import instrument_module
    from perfsdk.bench import compare
    from perfsdk.testing.models import SimpleNet, encoder

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

    out: dict[str, Any] = {}
    for name, (fns, x, _) in plans.items():
        print(f"\n{WORKLOADS[name]}")
        comparison = compare(fns, x, warmup=3, iters=args.iters, rounds=args.rounds,
                             rotate=1, device="cpu", show=True)
        base = comparison.results["bare"].median_ms
        out[name] = {"label": WORKLOADS[name], "variants": {
            key: {**r.as_dict(), "added_ms": r.median_ms - base,
                  "ratio_vs_bare": r.median_ms / base}
            for key, r in comparison.results.items()}}
    out["encoder_infer"]["fast_path_calls_per_forward"] = fast_path
    for h in handles:
        h.remove()
    return out


def fast_path_calls(torch: Any, model: Any, x: Any) -> int:
    """How many fused encoder-layer kernels one inference call runs (layers, or 0)."""
    with torch.no_grad(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    return sum(1 for e in prof.events() if e.name == FAST_OP)


def headline(results: dict[str, Any]) -> dict[str, Any]:
    def v(workload: str, variant: str, key: str) -> float:
        return float(results[workload]["variants"][variant][key])

    fast = results["encoder_infer"]["fast_path_calls_per_forward"]
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
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(CHILD_FLAG) == "1":
        return callgrind_child(args) if args.callgrind else measure(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
