"""Which combinations ``optimize()`` tries, what they are called, and which one it keeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from perfsdk.optimize.report import StepResult

__all__ = ["BASELINE", "MIN_GAIN", "NEAR", "ORDER", "Candidate", "Options", "auto_candidates",
           "candidate_name", "choose", "flag", "reasons"]

MIN_GAIN = 1.03
"""A candidate must beat eager by this factor to be kept: smaller gains are within noise."""
NEAR = 1.03
"""Candidates within this factor of the fastest count as tied; the one with fewer transforms
(no compilation first) wins the tie."""
BASELINE = "eager fp32 (baseline)"
ORDER = ("channels_last", "amp", "compile", "cuda_graphs")
"""The order transforms are applied in."""

Options = dict[str, Any]
Candidate = tuple[tuple[str, Options], ...]
"""(transform, its options) pairs, in :data:`ORDER`."""


def flag(arg: str, value: Any, shorthand: tuple[type, ...], key: str) -> Options | bool | None:
    """An ``optimize()`` flag as None (not asked), False (excluded) or a dict (asked, with these
    options); ``shorthand`` values stand for ``{key: value}``."""
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


def auto_candidates(model: nn.Module, mode: str, device_type: str,
                    flags: dict[str, Any]) -> list[Candidate]:
    """The candidates of ``optimize(auto=True)``, cheapest first. In inference, autocast also
    stores the weights in its dtype (``apply_amp(weights=True)``: no per-call weight casts, same
    rounding) unless the ``amp`` options say otherwise, and inductor freezing goes on the
    fullest compiled combination."""
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    combos: list[tuple[str, ...]] = [("amp",)]
    if has_conv:
        combos += [("channels_last",), ("channels_last", "amp")]
    combos += [("compile",), ("compile", "amp"), ("channels_last", "amp", "compile")]
    if mode == "inference" and device_type == "cuda":
        combos += [("cuda_graphs",), ("amp", "cuda_graphs")]
    kept = [tuple(n for n in ORDER if n in combo and flags[n] is not False
                  and (n != "channels_last" or has_conv)) for combo in combos]
    kept = [combo for combo in kept if combo]
    last_compile = max((i for i, combo in enumerate(kept) if "compile" in combo), default=-1)
    out: list[Candidate] = []
    for i, combo in enumerate(kept):
        cand = tuple((n, dict(flags[n] or {})) for n in combo)
        amp = dict(cand).get("amp")
        if amp is not None and mode == "inference":
            amp.setdefault("weights", True)
        options = dict(cand).get("compile")
        if (i == last_compile and options is not None and mode == "inference"
                and "freezing" not in options
                and options.get("backend", "inductor") == "inductor"):
            options["freezing"] = True  # inductor freezing: worth most on the fullest combo
        if cand not in out:
            out.append(cand)
    return out


def candidate_name(cand: Candidate, device_type: str) -> str:
    """The row name, e.g. ``"compile + channels_last + amp(bf16) + freezing"``."""
    parts: list[str] = []
    for transform, options in cand:
        if transform == "amp":
            weights = " weights" if options.get("weights") else ""
            parts.append(f"amp({_amp_label(options.get('dtype'), device_type)}{weights})")
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


def choose(rows: dict[str, StepResult], candidates: list[Candidate], device_type: str,
           uncertain: Mapping[str, str] | None = None) -> str:
    """The fastest timed row if it beats eager by :data:`MIN_GAIN`; among rows within
    :data:`NEAR` of it, the one without compilation and with fewer transforms. Otherwise
    :data:`BASELINE`. Rows in ``uncertain`` (their gain is within the timings' noise) are not
    kept, whatever their median says."""
    cost = {candidate_name(c, device_type): (any(t == "compile" for t, _ in c), len(c))
            for c in candidates}
    timed = {n: r.speedup for n, r in rows.items()
             if r.speedup is not None and n not in (uncertain or {})}
    if not timed or max(timed.values()) < MIN_GAIN:
        return BASELINE
    best = max(timed.values())
    tied = [n for n, s in timed.items() if s * NEAR >= best and s >= MIN_GAIN]
    return min(tied, key=lambda n: (cost[n], -timed[n]))


def reasons(rows: dict[str, StepResult], chosen: str,
            uncertain: Mapping[str, str] | None = None) -> dict[str, StepResult]:
    """Each row with ``applied`` set and a reason saying why it was or was not kept."""
    top = rows[chosen].speedup or 1.0
    out: dict[str, StepResult] = {}
    for row_name, row in rows.items():
        reason, s = row.reason, row.speedup
        if row_name == chosen:
            reason = "chosen" if row_name != BASELINE else "chosen: no candidate beat eager"
        elif reason == "passed" and uncertain and row_name in uncertain:
            reason = uncertain[row_name]
        elif reason == "passed" and s is not None:
            reason = ("slower than baseline" if s < 1.0 else
                      f"not faster than baseline ({s:.2f}x < {MIN_GAIN:.2f}x)" if s < MIN_GAIN
                      else f"slower than chosen ({s:.2f}x < {top:.2f}x)" if s <= top
                      else f"within {NEAR - 1:.0%} of the fastest; chosen has fewer transforms")
        out[row_name] = dataclasses.replace(row, applied=row_name == chosen, reason=reason)
    return out
