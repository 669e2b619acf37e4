"""``optimize()``: apply the transforms asked for, or search for the fastest combination that
still computes the same thing, and report what each candidate bought.

Every candidate is built on a fresh deep copy of the model as given, checked against the eager
fp32 reference on the example inputs (outputs, and gradients in training), and timed against
the eager baseline with :func:`perfsdk.bench.compare` (interleaved, same inputs). The winner's
transforms are then applied to the caller's model in place.

Example:
    >>> import torch
    >>> from perfsdk.optimize.search import optimize
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> model, report = optimize(model, torch.randn(4, 8), compile={"backend": "eager"},
    ...                          iters=5, progress=False)
    >>> report.chosen, [step.name for step in report.steps]
    ('compile[eager]', ['eager fp32 (baseline)', 'compile[eager]'])
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from perfsdk import bench
from perfsdk._progress import Progress
from perfsdk.errors import NoEffectWarning, PerfSDKWarning
from perfsdk.optimize.amp import apply_amp
from perfsdk.optimize.channels_last import apply_channels_last
from perfsdk.optimize.compile import _CompileGuard, apply_compile
from perfsdk.optimize.cuda_graphs import apply_cuda_graphs
from perfsdk.optimize.report import OptimizationReport, StepResult

__all__ = ["AMP_GRAD_RTOL", "AMP_RTOL", "BASELINE", "FINAL", "FP32_GRAD_RTOL", "FP32_RTOL",
           "MIN_GAIN", "NEAR", "optimize"]

FP32_RTOL = 1e-4
"""Default output tolerance of candidates without autocast."""
FP32_GRAD_RTOL = 1e-2
"""Default gradient tolerance of candidates without autocast: a float32 bias gradient summed
over a batch of feature maps in another order (channels-last kernels, compiled reductions)
differs by about 1e-3 (relative L2) on the lab's SimpleNet."""
AMP_RTOL = 5e-2
"""Default output tolerance of candidates with autocast (bf16 / fp16 keep 8 / 11 bits)."""
AMP_GRAD_RTOL = 0.25
"""Default gradient tolerance of candidates with autocast. One bf16 step's gradients differ from
fp32 by up to 12% (relative L2) on the lab's SimpleNet, 4% on the encoder; SGD's own noise is
far larger, and a broken gradient (missing, wrongly scaled, sign-flipped) is off by 50% or more."""
MIN_GAIN = 1.03
"""A candidate must beat eager by this factor to be kept: smaller gains are within noise."""
NEAR = 1.03
"""Candidates within this factor of the fastest count as tied; the one with fewer transforms
(no compilation first) wins the tie."""
FINAL = 3
"""The fastest candidates kept for the final comparison, timed together with eager."""
BASELINE = "eager fp32 (baseline)"
_ORDER = ("channels_last", "amp", "compile", "cuda_graphs")  # the order transforms are applied
_WARMUP = 2
_MODES = ("inference", "train")

Options = dict[str, Any]
Candidate = tuple[tuple[str, Options], ...]  # (transform, its options), in _ORDER
Probe = list[tuple[str, "torch.Tensor | None", bool]]  # (name, tensor, is a gradient)


def optimize(model: nn.Module, example_inputs: Any, *, mode: str = "inference",
             amp: Any = None, compile: Any = None, channels_last: Any = None,
             cuda_graphs: Any = None, auto: bool = False, rtol: float | None = None,
             atol: float | None = None, budget_s: float | None = None,
             loss_fn: Callable[..., torch.Tensor] | None = None, target: Any = None,
             iters: int | None = None, min_time: float | None = 0.5,
             progress: bool = True) -> tuple[nn.Module, OptimizationReport]:
    """Make ``model`` faster with the transforms asked for, or the fastest that pass a check.

    Explicit flags apply exactly what is asked (it is still checked and timed for the report).
    With ``auto=True`` the candidates are: ``amp``; ``channels_last`` and ``channels_last +
    amp`` (only with an ``nn.Conv2d``); ``compile``, ``compile + amp``, ``compile +
    channels_last + amp`` (the last with inductor freezing in inference); ``cuda_graphs`` and
    ``amp + cuda_graphs`` for inference on CUDA. A flag set to False removes that transform from
    the candidates; options given for a flag are used by every candidate with it.

    Each candidate is built on a fresh deep copy of ``model``, run once (compilation happens
    here: ``setup_s``), checked against the eager fp32 reference, and timed against eager with
    :func:`perfsdk.bench.compare`. The check compares every floating output, passing when
    ``max|out - ref| <= atol + rtol * max|ref|`` (the max error is ``max|out - ref| / max|ref|``),
    and in training every parameter's gradient, by relative L2 error:
    ``||g - ref|| <= rtol * ||ref|| + atol * sqrt(numel)``. Default tolerances: without
    autocast ``rtol=1e-4`` for outputs (:data:`FP32_RTOL`) and ``1e-2`` for gradients
    (:data:`FP32_GRAD_RTOL`); with autocast ``5e-2`` (:data:`AMP_RTOL`) and ``0.25``
    (:data:`AMP_GRAD_RTOL`); ``atol=0``. ``rtol`` and ``atol`` override them all.

    The (up to) three fastest candidates that passed are then timed once more, together with
    eager in one interleaved comparison, so that the choice and the reported numbers do not
    rest on comparisons made minutes apart. The fastest wins if it beats eager by
    :data:`MIN_GAIN` (3%); among candidates within 3% of it, the one with fewer transforms.
    Otherwise the model is returned as it was, and the report says why: the result is never
    slower than eager.

    Args:
        model: The module; the chosen transforms are applied to it in place. Inference puts it
            in eval mode (``model.eval()``), training in train mode.
        example_inputs: A tensor, or a tuple of positional inputs, shaped like real batches.
        mode: ``"inference"`` (calls under ``torch.no_grad()``) or ``"train"`` (a step is
            forward, ``loss_fn``, backward; copies are used, so the search never moves the
            model's parameters or gradients).
        amp: True, a dtype (``"bf16"``, ``torch.float16``, ...) or :func:`apply_amp` options.
        compile: True, a mode string or :func:`apply_compile` options (e.g. ``{"backend":
            "aot_eager"}``, ``{"freezing": True}``).
        channels_last: True to apply :func:`apply_channels_last`.
        cuda_graphs: True or :func:`apply_cuda_graphs` options (inference only).
        auto: Search the candidates above.
        rtol: Relative tolerance for every candidate (default: per candidate, see above).
        atol: Absolute tolerance (default 0).
        budget_s: Seconds the search may take (compilation and timing); candidates not started
            when it has run out are reported as skipped (``"budget"``). One already started
            finishes, and the winner is then applied to ``model`` (compiled again) after it.
        loss_fn: Training only, required: ``loss_fn(output, target)`` (``loss_fn(output)``
            when ``target`` is None).
        target: Training targets for ``loss_fn``.
        iters: Timed calls per candidate and per baseline (instead of ``min_time``).
        min_time: Seconds of timed calls per candidate and per baseline.
        progress: Show a progress bar on stderr (only when it is a terminal).

    Returns:
        ``(model, report)``: the same module object, and the :class:`OptimizationReport`.

    Raises:
        ValueError: An argument outside the accepted values (the message names it).
    """
    started = time.perf_counter()
    work = _Work(mode, example_inputs, loss_fn, target, model)
    flags = {"amp": _flag("amp", amp, (str, torch.dtype), "dtype"),
             "compile": _flag("compile", compile, (str,), "mode"),
             "channels_last": _flag("channels_last", channels_last, (), ""),
             "cuda_graphs": _flag("cuda_graphs", cuda_graphs, (), "")}
    for name, value in (("rtol", rtol), ("atol", atol), ("budget_s", budget_s)):
        if value is not None and not (isinstance(value, (int, float)) and value >= 0
                                      and not isinstance(value, bool)):
            raise ValueError(f"optimize: {name}={value!r}; accepted values are None or a "
                             "number >= 0")
    if mode == "train" and isinstance(flags["cuda_graphs"], dict):
        raise ValueError("optimize: cuda_graphs is for mode='inference'; accepted in training: "
                         "cuda_graphs=None/False (see torch.cuda.make_graphed_callables)")
    if auto:
        candidates = _auto_candidates(model, work, flags)
    else:
        asked = tuple((n, o) for n in _ORDER if isinstance(o := flags[n], dict))
        candidates = [asked] if asked else []
    if not candidates:
        warnings.warn("optimize: nothing to try (no transform asked for and auto=False); the "
                      "model is returned unchanged.", NoEffectWarning, stacklevel=2)
        return model, OptimizationReport(mode, (_row(BASELINE, True, "nothing asked"),),
                                         BASELINE, budget_s, time.perf_counter() - started)
    search = _Search(model, work, rtol, atol, iters, min_time)
    deadline = math.inf if budget_s is None else started + budget_s
    rows: dict[str, StepResult] = {}
    steps = len(candidates) + bool(auto)
    with Progress(steps, label="optimize", force=None if progress else False) as bar:
        for cand in candidates:
            name = _name(cand, work.device_type)
            bar.start(name)
            if time.perf_counter() >= deadline:
                rows[name] = _row(name, False, "budget")
            elif auto:
                rows[name] = search.candidate(name, cand)
            else:
                rows[name] = search.explicit(name, cand)
            bar.advance()
        if auto and time.perf_counter() < deadline:
            bar.start("final comparison")
            rows = search.confirm(rows)
            bar.advance()
    chosen = _choose(rows, candidates, work.device_type) if auto else next(iter(rows))
    rows = {BASELINE: search.baseline_row(chosen, rows), **rows}
    if auto:
        rows = _reasons(rows, chosen)
        if chosen != BASELINE:
            search.apply_final(dict(next(c for c in candidates
                                         if _name(c, work.device_type) == chosen)))
    return model, OptimizationReport(mode, tuple(rows.values()), chosen, budget_s,
                                     time.perf_counter() - started)


# -- the workload: what one call or one training step is -------------------------------------
class _Work:
    def __init__(self, mode: str, example_inputs: Any, loss_fn: Any, target: Any,
                 model: nn.Module) -> None:
        if mode not in _MODES:
            raise ValueError(f"optimize: mode={mode!r}; accepted values are 'inference', 'train'")
        if not isinstance(model, nn.Module):
            raise ValueError(f"optimize: model={type(model).__name__} is not an nn.Module")
        if mode == "train" and not callable(loss_fn):
            raise ValueError(f"optimize: mode='train' needs loss_fn, a callable "
                             f"loss_fn(output, target) -> scalar tensor; got {loss_fn!r}")
        self.mode, self.loss_fn, self.target = mode, loss_fn, target
        self.inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        tensors = [t for t in tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError("optimize: example_inputs must be a tensor or a tuple holding "
                             f"tensors; got {type(example_inputs).__name__}")
        first = tensors[0]
        self.batch_size = int(first.shape[0]) if first.dim() and first.shape[0] else None
        params = [p.device for p in model.parameters()]
        self.device_type = (params[0] if params else first.device).type
        self.rng_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.args = self.inputs + (() if target is None else (target,))
        (model.train if mode == "train" else model.eval)()

    def fn(self, model: nn.Module) -> Callable[..., Any]:
        """What is timed: one inference call, or one training step without the optimizer."""
        n = len(self.inputs)
        if self.mode == "inference":
            def call(*args: Any) -> Any:
                with torch.no_grad():
                    return model(*args)
            return call

        def step(*args: Any) -> Any:
            model.zero_grad(set_to_none=True)
            out = model(*args[:n])
            loss = self.loss_fn(out, args[n]) if len(args) > n else self.loss_fn(out)
            loss.backward()
            return loss
        return step

    def probe(self, model: nn.Module) -> Probe:
        """One seeded call: the floating outputs, then (training) each parameter's gradient."""
        with torch.random.fork_rng(devices=self.rng_devices):
            torch.manual_seed(0)
            if self.mode == "inference":
                with torch.no_grad():
                    out = model(*self.inputs)
            else:
                model.zero_grad(set_to_none=True)
                out = model(*self.inputs)
                loss = self.loss_fn(out, self.target) if self.target is not None \
                    else self.loss_fn(out)
                loss.backward()
        found: Probe = [(f"output {i}", t.detach(), False) for i, t in enumerate(tree_leaves(out))
                        if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if self.mode == "train":
            found += [(name, None if p.grad is None else p.grad.detach(), True)
                      for name, p in model.named_parameters()]
        return found


# -- the search ---------------------------------------------------------------------------------
class _Search:
    def __init__(self, model: nn.Module, work: _Work, rtol: float | None, atol: float | None,
                 iters: int | None, min_time: float | None) -> None:
        self.model, self.work, self.rtol, self.atol = model, work, rtol, atol
        self.timing: dict[str, Any] = {"iters": iters, "min_time": None if iters else min_time,
                                       "batch_size": work.batch_size, "warmup": _WARMUP}
        self.baseline = copy.deepcopy(model)
        self.reference = work.probe(self.baseline)
        self.comparisons: dict[str, bench.Comparison] = {}
        self.kept: dict[str, nn.Module] = {}  # the fastest passing candidates, for confirm()

    def tolerance(self, cand: Candidate) -> tuple[float, float, float]:
        """(output rtol, gradient rtol, atol) for ``cand``."""
        amp = any(n == "amp" for n, _ in cand)
        out, grad = (AMP_RTOL, AMP_GRAD_RTOL) if amp else (FP32_RTOL, FP32_GRAD_RTOL)
        if self.rtol is not None:
            out = grad = self.rtol
        return out, grad, self.atol or 0.0

    def candidate(self, name: str, cand: Candidate) -> StepResult:
        """Build ``cand`` on a copy, check it, time it; warnings go to the report."""
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = copy.deepcopy(self.model)
            try:
                for transform, options in cand:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        _transform(transform)(model, **options)
                    no_effect = [w for w in caught if issubclass(w.category, NoEffectWarning)]
                    if no_effect:
                        return _row(name, False, _short_reason(transform, no_effect[0]),
                                    setup_s=time.perf_counter() - t0)
                got = self.work.probe(model)
            except Exception as exc:
                return _row(name, False, f"failed: {_error(exc)}", setup_s=time.perf_counter() - t0)
            row = self.measure(name, cand, model, got, time.perf_counter() - t0)
        if row.reason == "passed" and (row.speedup or 0.0) >= 1.0:
            self.kept[name] = model
            rank = {n: self.comparisons[n].speedup(n) for n in self.kept}
            for slower in sorted(rank, key=rank.__getitem__)[:-FINAL]:
                del self.kept[slower]  # frees the copy
        return row

    def confirm(self, rows: dict[str, StepResult]) -> dict[str, StepResult]:
        """Time the kept candidates again, together with eager; their rows take these numbers."""
        if not self.kept:
            return rows
        fns = {BASELINE: self.work.fn(self.baseline),
               **{name: self.work.fn(model) for name, model in self.kept.items()}}
        final = bench.compare(fns, *self.work.args, baseline=BASELINE, **self.timing)
        self.kept.clear()
        self.comparisons = {name: final for name in fns}
        out = dict(rows)
        for name, result in final.results.items():
            if name in out:
                out[name] = dataclasses.replace(
                    out[name], median_ms=result.median_ms, p95_ms=result.p95_ms,
                    samples_per_s=result.samples_per_s, speedup=final.speedup(name),
                    peak_memory_bytes=result.peak_memory_bytes)
        return out

    def explicit(self, name: str, cand: Candidate) -> StepResult:
        """Apply ``cand`` to the caller's model itself, then check and time it there."""
        t0 = time.perf_counter()
        for transform, options in cand:
            _transform(transform)(self.model, **options)
        with _preserved(self.model):
            got = self.work.probe(self.model)
            row = self.measure(name, cand, self.model, got, time.perf_counter() - t0,
                               always_time=True)
        notes = ["applied as asked"]
        if row.reason.startswith("out of tolerance"):
            warnings.warn(f"optimize: {name} was applied as asked but is {row.reason} of the "
                          "eager fp32 reference", PerfSDKWarning, stacklevel=3)
        if row.reason != "passed":
            notes.append(row.reason)
        if row.speedup is not None and row.speedup < 1.0:
            notes.append(f"slower than baseline ({row.speedup:.2f}x)")
        return dataclasses.replace(row, applied=True, reason="; ".join(notes))

    def measure(self, name: str, cand: Candidate, model: nn.Module,
                got: Probe, setup_s: float, *, always_time: bool = False) -> StepResult:
        """Check ``model``'s probe ``got`` against the reference; time it if it passed."""
        error, failure = _check(got, self.reference, self.tolerance(cand))
        reason = _compile_failure(model) or failure or "passed"
        if reason != "passed" and not always_time:
            return _row(name, False, reason, max_error=error, setup_s=setup_s)
        fns = {BASELINE: self.work.fn(self.baseline), name: self.work.fn(model)}
        comparison = bench.compare(fns, *self.work.args, baseline=BASELINE, **self.timing)
        self.comparisons[name] = comparison
        result = comparison.results[name]
        return StepResult(name, False, reason, result.median_ms, result.p95_ms,
                          result.samples_per_s, comparison.speedup(name),
                          result.peak_memory_bytes, error, setup_s)

    def baseline_row(self, chosen: str, rows: dict[str, StepResult]) -> StepResult:
        """The baseline's numbers, from the comparison with the chosen row when there is one."""
        comparison = self.comparisons.get(chosen) or next(iter(self.comparisons.values()), None)
        if comparison is None:
            base = bench.benchmark(self.work.fn(self.baseline), *self.work.args, name=BASELINE,
                                   **self.timing)
        else:
            base = comparison.results[BASELINE]
        return StepResult(BASELINE, chosen == BASELINE, "reference", base.median_ms,
                          base.p95_ms, base.samples_per_s, 1.0, base.peak_memory_bytes, 0.0, 0.0)

    def apply_final(self, cand: dict[str, Options]) -> None:
        """Apply the winner to the caller's model and run it once (compile it now, not later)."""
        for transform in _ORDER:
            if transform in cand:
                _transform(transform)(self.model, **cand[transform])
        with _preserved(self.model):
            got = self.work.probe(self.model)
        _, failure = _check(got, self.reference, self.tolerance(tuple(cand.items())))
        if failure:  # the same transforms passed on a copy: something in the model differs
            warnings.warn(f"optimize: the chosen transforms, applied to the model, are "
                          f"{failure} against the eager fp32 reference", PerfSDKWarning,
                          stacklevel=3)


# -- candidates ---------------------------------------------------------------------------------
def _flag(arg: str, value: Any, shorthand: tuple[type, ...], key: str) -> Options | bool | None:
    """None: not asked; False: excluded; a dict: asked, with these options."""
    if value is None or value is False:
        return value
    if value is True:
        return {}
    if shorthand and isinstance(value, shorthand):
        return {key: value}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return dict(value)
    accepted = "None, True, False" + (f", a {key}" if shorthand else "") + " or a dict of " \
        f"apply_{arg} options"
    raise ValueError(f"optimize: {arg}={value!r}; accepted values are {accepted}")


def _auto_candidates(model: nn.Module, work: _Work, flags: dict[str, Any]) -> list[Candidate]:
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    combos: list[tuple[str, ...]] = [("amp",)]
    if has_conv:
        combos += [("channels_last",), ("channels_last", "amp")]
    combos += [("compile",), ("compile", "amp"), ("channels_last", "amp", "compile")]
    if work.mode == "inference" and work.device_type == "cuda":
        combos += [("cuda_graphs",), ("amp", "cuda_graphs")]
    kept = [tuple(n for n in _ORDER if n in combo and flags[n] is not False
                  and (n != "channels_last" or has_conv)) for combo in combos]
    kept = [combo for combo in kept if combo]
    last_compile = max((i for i, combo in enumerate(kept) if "compile" in combo), default=-1)
    out: list[Candidate] = []
    for i, combo in enumerate(kept):
        cand = tuple((n, dict(flags[n] or {})) for n in combo)
        options = dict(cand).get("compile")
        if (i == last_compile and options is not None and work.mode == "inference"
                and "freezing" not in options
                and options.get("backend", "inductor") == "inductor"):
            options["freezing"] = True  # inductor freezing: worth most on the fullest combo
        if cand not in out:
            out.append(cand)
    return out


def _name(cand: Candidate, device_type: str) -> str:
    parts: list[str] = []
    for transform, options in cand:
        if transform == "amp":
            parts.append(f"amp({_amp_label(options.get('dtype'), device_type)})")
        elif transform == "compile":
            extra = [str(getattr(options[k], "__name__", options[k])) for k in ("backend", "mode")
                     if options.get(k) and options[k] != "inductor"]
            parts.append("compile" + (f"[{','.join(extra)}]" if extra else ""))
        else:
            parts.append(transform)
    if any(t == "compile" and o.get("freezing") for t, o in cand):
        parts.append("freezing")
    first = [p for p in parts if p.startswith("compile")]  # read as "compile + what it sees"
    return " + ".join(first + [p for p in parts if not p.startswith("compile")])


def _amp_label(dtype: Any, device_type: str) -> str:
    if dtype is None:
        return "bf16" if device_type == "cpu" else "fp16"
    text = str(dtype).lower().removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(text, text)


def _choose(rows: dict[str, StepResult], candidates: list[Candidate], device_type: str) -> str:
    cost = {_name(c, device_type): (any(t == "compile" for t, _ in c), len(c))
            for c in candidates}
    timed = {n: r.speedup for n, r in rows.items() if r.speedup is not None}
    if not timed or max(timed.values()) < MIN_GAIN:
        return BASELINE
    best = max(timed.values())
    tied = [n for n, s in timed.items() if s * NEAR >= best and s >= MIN_GAIN]
    return min(tied, key=lambda n: (cost[n], -timed[n]))


def _reasons(rows: dict[str, StepResult], chosen: str) -> dict[str, StepResult]:
    top = rows[chosen].speedup or 1.0
    out: dict[str, StepResult] = {}
    for name, row in rows.items():
        reason, s = row.reason, row.speedup
        if name == chosen:
            reason = "chosen" if name != BASELINE else "chosen: no candidate beat eager"
        elif reason == "passed" and s is not None:
            reason = ("slower than baseline" if s < 1.0 else
                      f"not faster than baseline ({s:.2f}x < {MIN_GAIN:.2f}x)" if s < MIN_GAIN
                      else f"slower than chosen ({s:.2f}x < {top:.2f}x)" if s <= top
                      else f"within {NEAR - 1:.0%} of the fastest; chosen has fewer transforms")
        out[name] = dataclasses.replace(row, applied=name == chosen, reason=reason)
    return out


# -- helpers ------------------------------------------------------------------------------------
def _transform(name: str) -> Callable[..., nn.Module]:
    table: dict[str, Callable[..., nn.Module]] = {  # looked up per call, so tests can patch
        "amp": apply_amp, "channels_last": apply_channels_last, "compile": apply_compile,
        "cuda_graphs": apply_cuda_graphs}
    return table[name]


def _row(name: str, applied: bool, reason: str, *, max_error: float | None = None,
         setup_s: float = 0.0) -> StepResult:
    return StepResult(name, applied, reason, None, None, None, None, None, max_error, setup_s)


def _short_reason(transform: str, caught: warnings.WarningMessage) -> str:
    text = str(caught.message)
    if transform == "channels_last" and "Conv2d" in text:
        return "no Conv2d"
    return f"{transform}: no effect ({text.split(';')[0].strip()})"


def _error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}".rstrip(": ")[:200]


def _compile_failure(model: nn.Module) -> str | None:
    guard = getattr(model, "_compiled_call_impl", None)
    if isinstance(guard, _CompileGuard) and guard.failed is not None:
        return f"compile failed: {_error(guard.failed)}"
    return None


def _check(got: Probe, ref: Probe, tolerance: tuple[float, float, float]
           ) -> tuple[float, str | None]:
    """(the largest relative error, why ``got`` is out of tolerance or None)."""
    out_rtol, grad_rtol, atol = tolerance
    if [(n, g) for n, _, g in got] != [(n, g) for n, _, g in ref]:
        return math.inf, "out of tolerance: outputs differ in number or kind from the reference"
    worst, failure, excess = 0.0, None, 1.0
    for (name, g, grad), (_, r, _) in zip(got, ref, strict=True):
        if g is None or r is None:
            if g is not r:
                return math.inf, f"out of tolerance: gradient of {name} missing or extra"
            continue
        if g.shape != r.shape:
            return math.inf, f"out of tolerance: {name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        delta, r32 = g.float().to(r.device) - r.float(), r.float()
        if grad:  # relative L2 error
            diff, scale = float(delta.norm()), float(r32.norm())
            limit, rtol = grad_rtol * scale + atol * math.sqrt(r.numel()), grad_rtol
        else:  # max error relative to the reference's max magnitude
            diff = float(delta.abs().max()) if r.numel() else 0.0
            scale = float(r32.abs().max()) if r.numel() else 0.0
            limit, rtol = out_rtol * scale + atol, out_rtol
        if not math.isfinite(diff):
            return math.inf, f"out of tolerance: {name} is not finite"
        error = diff / scale if scale > 0 else diff
        worst = max(worst, error)
        if diff > limit and diff / max(limit, 1e-30) > excess:
            excess = diff / max(limit, 1e-30)
            what = f"gradient error {error:.3g} > {rtol:g} ({name})" if grad \
                else f"max error {error:.3g} > {rtol:g}"
            failure = f"out of tolerance: {what}" + (f" (+ atol {atol:g})" if atol else "")
    return worst, failure


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Leave gradients and buffers (e.g. BatchNorm statistics) as they were."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, g in grads:
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
