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

from perfsdk import bench
from perfsdk._progress import Progress
from perfsdk.errors import NoEffectWarning, PerfSDKWarning
from perfsdk.optimize._candidates import (
    BASELINE,
    MIN_GAIN,
    NEAR,
    ORDER,
    Candidate,
    Options,
    auto_candidates,
    candidate_name,
    choose,
    flag,
    reasons,
)
from perfsdk.optimize._marks import fallbacks
from perfsdk.optimize._tolerance import (
    AMP_GRAD_RTOL,
    AMP_RTOL,
    FP32_GRAD_RTOL,
    FP32_RTOL,
    Probe,
    check,
    tolerance,
)
from perfsdk.optimize._workload import Work
from perfsdk.optimize.amp import apply_amp
from perfsdk.optimize.channels_last import apply_channels_last
from perfsdk.optimize.compile import apply_compile
from perfsdk.optimize.cuda_graphs import apply_cuda_graphs
from perfsdk.optimize.report import OptimizationReport, StepResult

__all__ = ["AMP_GRAD_RTOL", "AMP_RTOL", "BASELINE", "FINAL", "FINAL_CALLS", "FP32_GRAD_RTOL",
           "FP32_RTOL", "MIN_GAIN", "NEAR", "SCREEN_CALLS", "optimize"]

_now = time.perf_counter  # the host clock for the budget and setup times (tests swap it)

FINAL = 3
"""The fastest candidates kept for the final comparison, timed together with eager."""
SCREEN_CALLS = 10
"""With ``min_time``, each candidate's comparison with eager times at least this many eager
calls (a 0.5 s training step would otherwise get a single call per round)."""
FINAL_CALLS = 20
"""With ``min_time``, the final comparison times every variant for at least this many eager
calls, and for at least twice the screening time: it decides, so it gets the longest look."""
_WARMUP = 2


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
        iters: Timed calls per candidate and per baseline in each comparison (instead of
            ``min_time``).
        min_time: Seconds of timed calls per candidate and per baseline in each comparison, at
            least: a comparison times at least :data:`SCREEN_CALLS` eager calls, and the final
            one twice as long and at least :data:`FINAL_CALLS` eager calls (a first, 3-call look
            at eager sets the scale), so slow steps get enough calls for a median.
        progress: Show a progress bar on stderr (only when it is a terminal).

    Returns:
        ``(model, report)``: the same module object, and the :class:`OptimizationReport`.

    Raises:
        ValueError: An argument outside the accepted values (the message names it).
    """
    started = _now()
    work = Work(mode, example_inputs, loss_fn, target, model)
    flags = {"amp": flag("amp", amp, (str, torch.dtype), "dtype"),
             "compile": flag("compile", compile, (str,), "mode"),
             "channels_last": flag("channels_last", channels_last, (), ""),
             "cuda_graphs": flag("cuda_graphs", cuda_graphs, (), "")}
    for name, value in (("rtol", rtol), ("atol", atol), ("budget_s", budget_s)):
        if value is not None and not (isinstance(value, (int, float)) and value >= 0
                                      and not isinstance(value, bool)):
            raise ValueError(f"optimize: {name}={value!r}; accepted values are None or a "
                             "number >= 0")
    if mode == "train" and isinstance(flags["cuda_graphs"], dict):
        raise ValueError("optimize: cuda_graphs is for mode='inference'; accepted in training: "
                         "cuda_graphs=None/False (see torch.cuda.make_graphed_callables)")
    if auto:
        candidates = auto_candidates(model, mode, work.device_type, flags)
    else:
        asked = tuple((n, o) for n in ORDER if isinstance(o := flags[n], dict))
        candidates = [asked] if asked else []
    if not candidates:
        warnings.warn("optimize: nothing to try (no transform asked for and auto=False); the "
                      "model is returned unchanged.", NoEffectWarning, stacklevel=2)
        return model, OptimizationReport(mode, (_row(BASELINE, True, "nothing asked"),),
                                         BASELINE, budget_s, _now() - started)
    search = _Search(model, work, rtol, atol, iters, min_time)
    deadline = math.inf if budget_s is None else started + budget_s
    rows: dict[str, StepResult] = {}
    steps = len(candidates) + bool(auto)
    with Progress(steps, label="optimize", force=None if progress else False) as bar:
        for cand in candidates:
            label = candidate_name(cand, work.device_type)
            bar.start(label)
            if _now() >= deadline:
                rows[label] = _row(label, False, "budget")
            elif auto:
                rows[label] = search.candidate(label, cand)
            else:
                rows[label] = search.explicit(label, cand)
            bar.advance()
        if auto and _now() < deadline:
            bar.start("final comparison")
            rows = search.confirm(rows)
            bar.advance()
    chosen = choose(rows, candidates, work.device_type) if auto else next(iter(rows))
    rows = {BASELINE: search.baseline_row(chosen), **rows}
    if auto:
        rows = reasons(rows, chosen)
        if chosen != BASELINE:
            search.apply_final(dict(next(c for c in candidates
                                         if candidate_name(c, work.device_type) == chosen)))
    return model, OptimizationReport(mode, tuple(rows.values()), chosen, budget_s,
                                     _now() - started)


# -- the search ---------------------------------------------------------------------------------
class _Search:
    def __init__(self, model: nn.Module, work: Work, rtol: float | None, atol: float | None,
                 iters: int | None, min_time: float | None) -> None:
        self.model, self.work, self.rtol, self.atol = model, work, rtol, atol
        self.baseline = copy.deepcopy(model)
        self.reference = work.probe(self.baseline)
        base = {"batch_size": work.batch_size, "warmup": _WARMUP}
        if iters is not None:
            self.timing: dict[str, Any] = {**base, "iters": iters}
            self.final_timing = self.timing
        else:  # at least SCREEN_CALLS / FINAL_CALLS calls of eager, however slow a call is
            eager_s = self._eager_seconds()
            screen = max(min_time or 0.0, SCREEN_CALLS * eager_s)
            self.timing = {**base, "min_time": screen}
            self.final_timing = {**base, "min_time": max(2 * screen, FINAL_CALLS * eager_s)}
        self.comparisons: dict[str, bench.Comparison] = {}
        self.kept: dict[str, nn.Module] = {}  # the fastest passing candidates, for confirm()

    def _eager_seconds(self) -> float:
        """A first, short look at how long one eager call takes."""
        first = bench.benchmark(self.work.fn(self.baseline), *self.work.args, warmup=1, iters=3,
                                name=BASELINE)
        return first.median_ms / 1e3

    def tolerance(self, cand: Candidate) -> tuple[float, float, float]:
        """(output rtol, gradient rtol, atol) for ``cand``."""
        return tolerance(any(n == "amp" for n, _ in cand), self.rtol, self.atol)

    def candidate(self, name: str, cand: Candidate) -> StepResult:
        """Build ``cand`` on a copy, check it, time it; warnings go to the report."""
        t0 = _now()
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
                                    setup_s=_now() - t0)
                got = self.work.probe(model)
            except Exception as exc:
                return _row(name, False, f"failed: {_error(exc)}", setup_s=_now() - t0)
            row = self.measure(name, cand, model, got, _now() - t0)
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
        final = bench.compare(fns, *self.work.args, baseline=BASELINE, **self.final_timing)
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
        t0 = _now()
        for transform, options in cand:
            _transform(transform)(self.model, **options)
        with _preserved(self.model):
            got = self.work.probe(self.model)
            row = self.measure(name, cand, self.model, got, _now() - t0,
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
        error, failure = check(got, self.reference, self.tolerance(cand))
        reason = _fallback(model) or failure or "passed"
        if reason != "passed" and not always_time:
            return _row(name, False, reason, max_error=error, setup_s=setup_s)
        fns = {BASELINE: self.work.fn(self.baseline), name: self.work.fn(model)}
        comparison = bench.compare(fns, *self.work.args, baseline=BASELINE, **self.timing)
        self.comparisons[name] = comparison
        result = comparison.results[name]
        return StepResult(name, False, reason, result.median_ms, result.p95_ms,
                          result.samples_per_s, comparison.speedup(name),
                          result.peak_memory_bytes, error, setup_s)

    def baseline_row(self, chosen: str) -> StepResult:
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
        for transform in ORDER:
            if transform in cand:
                _transform(transform)(self.model, **cand[transform])
        with _preserved(self.model):
            got = self.work.probe(self.model)
        _, failure = check(got, self.reference, self.tolerance(tuple(cand.items())))
        if failure:  # the same transforms passed on a copy: something in the model differs
            warnings.warn(f"optimize: the chosen transforms, applied to the model, are "
                          f"{failure} against the eager fp32 reference", PerfSDKWarning,
                          stacklevel=3)


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


def _fallback(model: nn.Module) -> str | None:
    """Why ``model`` runs eagerly although compiled or graphed (see :func:`fallbacks`)."""
    what = {"compile": "compile", "cuda_graphs": "CUDA graph capture"}
    failed = fallbacks(model)
    return "; ".join(f"{what.get(t, t)} failed: {_error(e)}" for t, e in failed.items()) or None


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
