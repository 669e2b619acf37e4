"""The check ``optimize()`` runs on every candidate: outputs, and in training every parameter's
gradient, against the eager fp32 reference, each within a tolerance that depends on whether the
candidate computes in reduced precision (autocast)."""

from __future__ import annotations

import math

import torch

__all__ = ["AMP_GRAD_RTOL", "AMP_RTOL", "FP32_GRAD_RTOL", "FP32_RTOL", "Probe", "check",
           "tolerance"]

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

Probe = list[tuple[str, "torch.Tensor | None", bool]]
"""What one seeded call gave: (name, tensor, is a gradient) for each floating output, then (in
training) each parameter's gradient (None where it has none)."""


def tolerance(amp: bool, rtol: float | None, atol: float | None) -> tuple[float, float, float]:
    """(output rtol, gradient rtol, atol) for a candidate with or without autocast; an explicit
    ``rtol`` / ``atol`` overrides the defaults."""
    out, grad = (AMP_RTOL, AMP_GRAD_RTOL) if amp else (FP32_RTOL, FP32_GRAD_RTOL)
    if rtol is not None:
        out = grad = rtol
    return out, grad, atol or 0.0


def check(got: Probe, ref: Probe, tol: tuple[float, float, float]) -> tuple[float, str | None]:
    """(the largest relative error, why ``got`` is out of tolerance or None).

    Outputs pass when ``max|out - ref| <= atol + rtol * max|ref|`` (their error is
    ``max|out - ref| / max|ref|``); gradients when ``||g - ref|| <= rtol * ||ref|| + atol *
    sqrt(numel)`` (relative L2). The reason names the worst offender.
    """
    out_rtol, grad_rtol, atol = tol
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
