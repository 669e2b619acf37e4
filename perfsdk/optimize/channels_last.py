"""``apply_channels_last``: NHWC memory format for a model's 4-D weights and inputs.

Convolutions on CPU (oneDNN) and on tensor-core GPUs run fastest on channels-last (NHWC)
tensors. The model's 4-D parameters and buffers are converted in place (the values and the
``state_dict()`` keys are unchanged: a state dict saved from the model loads into an
untransformed copy and back), and a forward pre-hook converts each 4-D tensor passed
positionally to the model, so users keep feeding ordinary NCHW tensors.

Channels-last is not always faster: some layers are much slower in it (pytorch#34977: a grouped
convolution took 143 ms instead of 4 ms), which is why ``optimize()`` measures before keeping
it, and why ``apply_channels_last(model, inputs=x)`` does too: a quick interleaved A/B
(:func:`perfsdk.bench.compare`, on copies, under ``torch.no_grad()``) of channels-last against
contiguous on those inputs, keeping channels-last only when it is at least :data:`KEEP_ABOVE`
times as fast. 3-D convolutions (``channels_last_3d``) are not handled here.

Example:
    >>> import torch
    >>> from perfsdk.optimize.channels_last import apply_channels_last
    >>> conv = apply_channels_last(torch.nn.Conv2d(3, 8, 3))
    >>> conv.weight.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
from torch import nn

from perfsdk import bench
from perfsdk.errors import NoEffectWarning
from perfsdk.optimize._marks import applied, mark

__all__ = ["KEEP_ABOVE", "apply_channels_last"]

KEEP_ABOVE = 1.03
"""With ``inputs``, channels-last is kept only when it runs at least this many times as fast as
contiguous (smaller gains are within the noise of a quick A/B; optimize() uses the same 3%)."""
_AB_MIN_TIME = 0.5  # the quick A/B: seconds per variant, at least (and 10 calls at least)


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: 4-D tensor positional arguments as channels-last (others as they are).
    Module-level, so the hook survives ``copy.deepcopy`` and pickling."""
    return tuple(arg.contiguous(memory_format=torch.channels_last)
                 if isinstance(arg, torch.Tensor) and arg.dim() == 4 else arg
                 for arg in args)


def apply_channels_last(model: nn.Module, *, inputs: Any = None,
                        example_inputs: Any = None) -> nn.Module:
    """Convert ``model`` to the channels-last memory format, in place.

    Every 4-D parameter and buffer becomes channels-last contiguous, and a forward pre-hook
    converts 4-D tensors passed positionally to ``model`` (keyword arguments and tensors inside
    containers pass unchanged).

    Args:
        model: The module; modified in place and returned.
        inputs: Optional: a tensor or a tuple of positional inputs shaped like real batches.
            Given, channels-last is first measured against contiguous on them (a quick
            interleaved A/B on copies of the model, under ``torch.no_grad()``, about a second
            or ten calls per variant) and kept only when it is at least :data:`KEEP_ABOVE`
            times as fast; otherwise a :class:`NoEffectWarning` gives the measured ratio and
            the model is returned unchanged (contiguous).
        example_inputs: The former name of ``inputs``; still accepted.

    Returns:
        The same module object. Without any ``nn.Conv2d`` the model is returned unchanged with a
        :class:`NoEffectWarning`; so is a second application, and (with ``inputs``) one that
        measured no faster.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``, or ``inputs`` holds no tensor.

    Example:
        >>> import torch
        >>> net = apply_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)))
        >>> net(torch.ones(1, 3, 2, 2)).is_contiguous(memory_format=torch.channels_last)
        True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_channels_last: model={type(model).__name__} is not an "
                         "nn.Module")
    if inputs is not None and example_inputs is not None:
        raise ValueError("apply_channels_last: give inputs= (example_inputs= is its former "
                         "name), not both")
    inputs = example_inputs if inputs is None else inputs
    args: tuple[Any, ...] | None = None
    if inputs is not None:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        if not any(isinstance(a, torch.Tensor) for a in args):
            raise ValueError("apply_channels_last: inputs must be a tensor or a tuple holding "
                             f"tensors, got {type(inputs).__name__}")
    label = type(model).__name__
    if "channels_last" in applied(model):
        warnings.warn(f"apply_channels_last: {label} is already channels-last; returned "
                      "unchanged.", NoEffectWarning, stacklevel=2)
        return model
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    if not convs:
        warnings.warn(f"apply_channels_last: {label} has no nn.Conv2d, so channels-last "
                      "cannot help it; returned unchanged.", NoEffectWarning, stacklevel=2)
        return model
    if args is not None:
        ratio = _measure(model, args)
        if ratio < KEEP_ABOVE:
            warnings.warn(f"apply_channels_last: channels-last measured {ratio:.2f}x the speed "
                          f"of contiguous for {label} on these inputs (kept only from "
                          f"{KEEP_ABOVE:.2f}x); returned unchanged.", NoEffectWarning,
                          stacklevel=2)
            return model
    _convert(model)
    mark(model, "channels_last", conv2d=convs)
    return model


def _convert(model: nn.Module) -> None:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dim() == 4:  # in place: optimizers keep their references to the parameters
            tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_to_channels_last)


def _measure(model: nn.Module, args: tuple[Any, ...]) -> float:
    """Channels-last speed over contiguous speed (median latencies, interleaved) on copies of
    ``model``, so the model's own state (BatchNorm statistics, gradients) is not touched."""
    contiguous, trial = copy.deepcopy(model), copy.deepcopy(model)
    _convert(trial)

    def call(module: nn.Module) -> Any:
        def run(*batch: Any) -> Any:
            with torch.no_grad():
                return module(*batch)
        return run

    first = bench.benchmark(call(contiguous), *args, warmup=1, iters=1)
    result = bench.compare({"contiguous": call(contiguous), "channels_last": call(trial)},
                           *args, baseline="contiguous", warmup=2, rounds=5,
                           min_time=max(_AB_MIN_TIME, 10 * first.median_ms / 1e3))
    return result.speedup("channels_last")
