"""``optimize()``: apply the transforms asked for, or search for the fastest combination that
still computes the same thing, and report what each candidate bought.

Every candidate is built on a fresh deep copy of the model as given, checked against the eager
fp32 reference on the inputs (outputs, and gradients in training); those that pass are timed
together with eager in one interleaved :func:`perfsdk.bench.compare`, within a time budget. The
winner's transforms are then applied to the caller's model in place.

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
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from perfsdk import bench
from perfsdk._progress import Progress
from perfsdk.compare import FASTER, TOO_FEW, compare_samples
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
from perfsdk.optimize.probe import PRUNE_BELOW, autocast_speedup
from perfsdk.optimize.report import OptimizationReport, StepResult

__all__ = ["AMP_GRAD_RTOL", "AMP_RTOL", "BASELINE", "DEFAULT_BUDGET_S", "FINAL_CALLS",
           "FP32_GRAD_RTOL", "FP32_RTOL", "MIN_FINAL_CALLS", "MIN_GAIN", "NEAR", "optimize"]

_now = time.perf_counter  # the host clock for the budget and setup times (tests swap it)

DEFAULT_BUDGET_S = 120.0
"""The default ``budget_s`` of :func:`optimize`: seconds for the whole search."""
FINAL_CALLS = 20
"""With ``min_time``, the final comparison times every variant for at least this many eager
calls: it decides, so a 0.5 s step still gets enough calls for a median."""
MIN_FINAL_CALLS = 5
"""The fewest timed calls a variant gets in the final comparison when the budget is tight: a
candidate is started only if that comparison, with it included, still fits."""
_WARMUP = 2


def optimize(model: nn.Module, inputs: Any = None, *, mode: str = "inference",
             amp: Any = None, compile: Any = None, channels_last: Any = None,
             cuda_graphs: Any = None, auto: bool = False, rtol: float | None = None,
             atol: float | None = None, budget_s: float | None = DEFAULT_BUDGET_S,
             loss_fn: Callable[..., torch.Tensor] | None = None, target: Any = None,
             iters: int | None = None, min_time: float | None = 0.5,
             progress: bool = True, example_inputs: Any = None
             ) -> tuple[nn.Module, OptimizationReport]:
    """Make ``model`` faster with the transforms asked for, or the fastest that pass a check.

    Explicit flags apply exactly what is asked (it is still checked and timed for the report);
    a transform that cannot act on this model or device (channels-last without ``nn.Conv2d``,
    CUDA Graphs on the CPU) warns :class:`~perfsdk.errors.NoEffectWarning` and is reported as
    "no change", never as chosen. With ``auto=True`` the candidates are: ``amp``;
    ``channels_last`` and ``channels_last + amp`` (only with an ``nn.Conv2d``); ``compile``,
    ``compile + amp``, ``compile + channels_last + amp`` (the last with inductor freezing in
    inference); ``cuda_graphs`` and ``amp + cuda_graphs`` for inference on CUDA. A flag set to
    False removes that transform from the candidates; options given for a flag are used by every
    candidate with it.

    Pruning (``auto=True``): autocast candidates are tried only where a small probe
    (:func:`perfsdk.optimize.probe.autocast_speedup`, measured once per process) runs autocast
    at least :data:`~perfsdk.optimize.probe.PRUNE_BELOW` of fp32's speed; otherwise they are
    reported as pruned with the probe's ratio, and the combinations are tried without autocast.
    Within ``budget_s``, a candidate is started only when its setup (for compiled ones, the
    first compilation measured), the final comparison and applying the winner still fit.

    Each candidate is built on a fresh deep copy of ``model``, run once (compilation happens
    here: ``setup_s``) and checked against the eager fp32 reference. The check compares every
    floating output, passing when ``max|out - ref| <= atol + rtol * max|ref|`` (the max error is
    ``max|out - ref| / max|ref|``), and in training every parameter's gradient, by relative L2
    error: ``||g - ref|| <= rtol * ||ref|| + atol * sqrt(numel)``. Default tolerances: without
    autocast ``rtol=1e-4`` for outputs (:data:`FP32_RTOL`) and ``1e-2`` for gradients
    (:data:`FP32_GRAD_RTOL`); with autocast ``5e-2`` (:data:`AMP_RTOL`) and ``0.25``
    (:data:`AMP_GRAD_RTOL`); ``atol=0``. ``rtol`` and ``atol`` override them all.

    Every candidate that passed is then timed together with eager in ONE interleaved
    :func:`perfsdk.bench.compare`, so every row's speedup shares one baseline. The fastest wins
    if it beats eager by :data:`MIN_GAIN` (3%); among candidates within 3% of it, the one with
    fewer transforms. Otherwise the model is returned as it was, and the report says why: the
    result is never slower than eager.

    Args:
        model: The module; the chosen transforms are applied to it in place. Inference puts it
            in eval mode (``model.eval()``), training in train mode.
        inputs: A tensor, or a tuple of positional inputs, shaped like real batches.
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
        budget_s: Seconds the search may take (default :data:`DEFAULT_BUDGET_S`, 120; None: no
            limit). Candidates that would not fit are reported as skipped (``"budget"``), and
            the final comparison is shortened to fit what is left (at least 3 calls each).
        loss_fn: Training only, required: ``loss_fn(output, target)`` (``loss_fn(output)``
            when ``target`` is None).
        target: Training targets for ``loss_fn``.
        iters: Timed calls per variant in the comparison (instead of ``min_time``).
        min_time: Seconds of timed calls per variant in the comparison, at least: it times at
            least :data:`FINAL_CALLS` eager calls (a first, 3-call look at eager sets the
            scale), so slow steps get enough calls for a median.
        progress: A progress bar on stderr when it is a terminal; otherwise one summary line
            there at the end. False: neither.
        example_inputs: The former name of ``inputs``; still accepted.

    Returns:
        ``(model, report)``: the same module object, and the :class:`OptimizationReport`.

    Raises:
        ValueError: An argument outside the accepted values (the message names it).
    """
    started = _now()
    if inputs is not None and example_inputs is not None:
        raise ValueError("optimize: give inputs= (example_inputs= is its former name), not both")
    if inputs is None:
        inputs = example_inputs
    if inputs is None:
        raise ValueError("optimize: inputs is required: a tensor, or a tuple of positional "
                         "inputs shaped like real batches")
    work = Work(mode, inputs, loss_fn, target, model)
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
    pruned: dict[str, str] = {}
    if auto:
        candidates = auto_candidates(model, mode, work.device_type, flags)
        candidates, pruned = _prune(candidates, model, mode, work.device_type, flags)
    else:
        asked = tuple((n, o) for n in ORDER if isinstance(o := flags[n], dict))
        candidates = [asked] if asked else []
    if not candidates and not pruned:
        warnings.warn("optimize: nothing to try (no transform asked for and auto=False); the "
                      "model is returned unchanged.", NoEffectWarning, stacklevel=2)
        return model, OptimizationReport(mode, (_row(BASELINE, True, "nothing asked"),),
                                         BASELINE, budget_s, _now() - started)
    search = _Search(model, work, rtol, atol, iters, min_time)
    deadline = math.inf if budget_s is None else started + budget_s
    rows: dict[str, StepResult] = {}
    unchanged: list[str] = []
    # Under a budget, compiled candidates are tried fullest first: when only one compilation
    # fits, it is the one that usually wins (compile + channels_last + amp + freezing). The
    # table keeps the candidates' order.
    compiled = [c for c in candidates if any(t == "compile" for t, _ in c)]
    tried = [c for c in candidates if c not in compiled] + compiled[::-1] if auto else candidates
    with Progress(len(candidates) + bool(auto), label="optimize",
                  force=None if progress else False) as bar:
        for cand in tried:
            label = candidate_name(cand, work.device_type)
            bar.start(label)
            if auto:
                why = search.no_room(cand, deadline - _now())
                rows[label] = _row(label, False, why) if why else search.candidate(label, cand)
            else:
                row, unchanged = search.explicit(label, cand)
                rows[row.name] = row
            bar.advance()
        if auto:
            bar.start("final comparison")
            rows = search.confirm(rows, deadline - _now())
            bar.advance()
        drawn = bar.enabled
    if auto:
        rows = {name: rows[name] for name in
                (candidate_name(c, work.device_type) for c in candidates)}
    rows.update({name: _row(name, False, why) for name, why in pruned.items()})
    uncertain = search.within_noise(rows) if auto else {}
    if auto:
        chosen = choose(rows, candidates, work.device_type, uncertain)
    else:
        chosen = next(iter(rows)) if rows[next(iter(rows))].applied else BASELINE
    rows = {BASELINE: search.baseline_row(chosen), **rows}
    if auto:
        rows = reasons(rows, chosen, uncertain)
        if chosen != BASELINE:
            search.apply_final(dict(next(c for c in candidates
                                         if candidate_name(c, work.device_type) == chosen)))
    report = OptimizationReport(mode, tuple(rows.values()), chosen, budget_s, _now() - started,
                                tuple(unchanged))
    if progress and not drawn:  # not a terminal: one line instead of a bar
        _summary_line(report.headline())
    return model, report


def _summary_line(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
    except (AttributeError, OSError, ValueError):  # a closed or missing stderr: say nothing
        pass


def _prune(candidates: list[Candidate], model: nn.Module, mode: str, device_type: str,
           flags: dict[str, Any]) -> tuple[list[Candidate], dict[str, str]]:
    """Drop autocast candidates whose dtype the probe measured slow here; the same combinations
    are tried without autocast. Returns (candidates to try, {pruned name: reason})."""
    amp = next((o for c in candidates for t, o in c if t == "amp"), None)
    if amp is None:
        return candidates, {}
    label = _amp_dtype_label(amp, device_type)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(label)
    if dtype is None:
        return candidates, {}
    ratio = autocast_speedup(dtype, device_type)
    if ratio >= PRUNE_BELOW:
        return candidates, {}
    why = (f"pruned: autocast {label} ran at {ratio:.2f}x fp32 in the probe on this "
           f"{device_type} (< {PRUNE_BELOW:g}x)")
    pruned = {candidate_name(c, device_type): why for c in candidates
              if any(t == "amp" for t, _ in c)}
    kept = auto_candidates(model, mode, device_type, {**flags, "amp": False})
    return kept, pruned


def _amp_dtype_label(options: Options, device_type: str) -> str:
    name = candidate_name((("amp", {"dtype": options.get("dtype")}),), device_type)
    return name.removeprefix("amp(").removesuffix(")")


# -- the search ---------------------------------------------------------------------------------
class _Search:
    def __init__(self, model: nn.Module, work: Work, rtol: float | None, atol: float | None,
                 iters: int | None, min_time: float | None) -> None:
        self.model, self.work, self.rtol, self.atol = model, work, rtol, atol
        self.baseline = copy.deepcopy(model)
        self.reference = work.probe(self.baseline)
        base = {"batch_size": work.batch_size, "warmup": _WARMUP}
        self.eager_s = self._eager_seconds()
        self.calls: int | None = iters
        if iters is not None:
            self.timing: dict[str, Any] = {**base, "iters": iters}
        else:  # at least FINAL_CALLS calls of eager, however slow a call is
            self.timing = {**base, "min_time": max(min_time or 0.0,
                                                   FINAL_CALLS * self.eager_s)}
        self.comparisons: dict[str, bench.Comparison] = {}
        self.kept: dict[str, nn.Module] = {}  # every candidate that passed, for confirm()
        self.compile_s: float | None = None  # the longest compile seen (estimates the next)

    def _eager_seconds(self) -> float:
        """A first, short look at how long one eager call takes."""
        first = bench.benchmark(self.work.fn(self.baseline), *self.work.args, warmup=1, iters=3,
                                name=BASELINE)
        return first.median_ms / 1e3

    def variant_s(self, calls: int | None = None) -> float:
        """Seconds one variant takes in the final comparison (warm-up included), at eager's
        speed: with ``calls`` timed calls, or as many as the timing asks for."""
        if calls is None and self.calls is None:
            return float(self.timing["min_time"]) + _WARMUP * self.eager_s
        return ((calls if calls is not None else self.calls or 0) + _WARMUP) * self.eager_s

    def no_room(self, cand: Candidate, left: float) -> str | None:
        """Why ``cand`` is not started with ``left`` seconds of budget, or None to start it.
        It must leave room for its setup (a compiled one: as long as the longest compilation
        seen so far, and half that again for compiling the winner at the end, which inductor's
        graph cache makes short; none seen yet: it is tried) and for the shortest final
        comparison with it included (:data:`MIN_FINAL_CALLS` calls a variant)."""
        if left <= 0:
            return "budget"
        compiles = any(t == "compile" for t, _ in cand)
        setup = 3 * self.eager_s + (1.5 * self.compile_s if compiles and self.compile_s else 0.0)
        final = (len(self.kept) + 2) * self.variant_s(MIN_FINAL_CALLS)
        if setup + final > left:
            if compiles and self.compile_s:
                return (f"budget: compiling took {self.compile_s:.0f} s, {left:.0f} s left "
                        f"(and {final:.0f} s for the final comparison)")
            return f"budget: {left:.0f} s left, the final comparison needs {final:.0f} s"
        return None

    def tolerance(self, cand: Candidate) -> tuple[float, float, float]:
        """(output rtol, gradient rtol, atol) for ``cand``."""
        return tolerance(any(n == "amp" for n, _ in cand), self.rtol, self.atol)

    def candidate(self, name: str, cand: Candidate) -> StepResult:
        """Build ``cand`` on a copy and check it; one that passes is kept for :meth:`confirm`."""
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
        setup_s = _now() - t0
        if any(t == "compile" for t, _ in cand):
            self.compile_s = max(self.compile_s or 0.0, setup_s)
        error, failure = check(got, self.reference, self.tolerance(cand))
        reason = _fallback(model) or failure or "passed"
        if reason == "passed":
            self.kept[name] = model
        return _row(name, False, reason, max_error=error, setup_s=setup_s)

    def confirm(self, rows: dict[str, StepResult], left: float) -> dict[str, StepResult]:
        """Time every kept candidate and eager in one interleaved comparison; their rows take
        these numbers. With a budget, each variant gets its share of what is ``left``."""
        if not self.kept:
            return rows
        fns = {BASELINE: self.work.fn(self.baseline),
               **{name: self.work.fn(model) for name, model in self.kept.items()}}
        timing = dict(self.timing)
        if math.isfinite(left) and self.variant_s() * len(fns) > left:
            # a fixed number of calls that fits what is left (min_time could overrun by a call
            # per round and variant), keeping one call for applying the winner at the end
            fit = int((left - self.eager_s) / len(fns) / max(self.eager_s, 1e-9)) - _WARMUP
            timing.pop("min_time", None)
            timing["iters"] = max(3, fit)
        final = bench.compare(fns, *self.work.args, baseline=BASELINE, **timing)
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

    def explicit(self, name: str, cand: Candidate) -> tuple[StepResult, list[str]]:
        """Apply ``cand`` to the caller's model itself, then check and time it there. A transform
        that warns :class:`NoEffectWarning` (the warning still reaches the caller) is "no
        change", left out of the row's name; returns the row and those "no change" notes."""
        t0 = _now()
        effective: list[tuple[str, Options]] = []
        unchanged: list[str] = []
        for transform, options in cand:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _transform(transform)(self.model, **options)
            for w in caught:  # the caller sees every warning, as without optimize()
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            no_effect = [w for w in caught if issubclass(w.category, NoEffectWarning)]
            if no_effect:
                unchanged.append(_no_effect(transform, no_effect[0]))
            else:
                effective.append((transform, options))
        if not effective:
            return _row(name, False, "no change: " + "; ".join(unchanged),
                        setup_s=_now() - t0), unchanged
        cand = tuple(effective)
        name = candidate_name(cand, self.work.device_type)
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
        notes += [f"no change from {note}" for note in unchanged]
        return dataclasses.replace(row, applied=True, reason="; ".join(notes)), unchanged

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

    def within_noise(self, rows: dict[str, StepResult]) -> dict[str, str]:
        """The rows whose gain over eager (at least :data:`MIN_GAIN` by the medians) the
        timings do not bear out: the bootstrap interval of their time ratio to eager reaches
        1 (:func:`perfsdk.compare.compare_samples`, the regression gate's test), each with its
        reason. On an H200, a 1.06x that re-timing read as 0.93x was kept. Rows timed in too
        few calls to tell are judged by their medians, as before."""
        out: dict[str, str] = {}
        for name, row in rows.items():
            comparison = self.comparisons.get(name)
            if (row.speedup is None or row.speedup < MIN_GAIN or comparison is None
                    or name not in comparison.results):
                continue
            test = compare_samples(comparison.results[BASELINE].times_ms,
                                   comparison.results[name].times_ms, name=name)
            if test.verdict in (TOO_FEW, FASTER) or test.low is None or test.high is None:
                continue
            out[name] = (f"not faster than baseline beyond the noise ({row.speedup:.2f}x by "
                         f"the medians; 95% interval of the time ratio {test.low:.2f} to "
                         f"{test.high:.2f})")
        return out

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
        """Apply the winner to the caller's model and run it once (compile it now, not later).

        The caller's model is compiled afresh here, on the same inputs, with the same options,
        and so runs as fast as the winner's copy: :func:`apply_compile` gives every model its
        own dynamo code object, so the candidates compiled before (other layouts, dtypes,
        freezing) cannot leave it dynamic shapes or a spent recompile limit (the cause of a
        returned model slower than the candidate it was chosen for); no backend flag is set by
        any candidate; inductor's graph cache makes this second compilation short."""
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
        return "no change: no Conv2d"
    return f"no change: {_no_effect(transform, caught)}"


def _no_effect(transform: str, caught: warnings.WarningMessage) -> str:
    """``"channels_last: no Conv2d"``, or the transform and the first part of its warning."""
    text = str(caught.message)
    if transform == "channels_last" and "Conv2d" in text:
        return "channels_last: no Conv2d"
    detail = text.split(";")[0].strip().removeprefix(f"apply_{transform}: ")
    return f"{transform}: {detail}"


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
