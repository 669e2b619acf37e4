"""``apply_amp``: run a model's forward under ``torch.autocast`` (automatic mixed precision).

The model's ``forward`` is wrapped (an instance attribute, as ``functools.wraps``-style
monkeypatching does), so parameters, buffers and ``state_dict()`` keys are untouched: weights stay
float32, and a state dict saved from the model loads into an untransformed copy and back. The
wrapper is a plain object that ``copy.deepcopy`` and pickling handle, and ``torch.compile``
traces through it (Dynamo supports ``torch.autocast`` inside a compiled region), so
``apply_compile`` may come before or after.

For training, the backward of an autocast forward needs no change with bfloat16; with float16
use a ``torch.amp.GradScaler`` (``TrainStep(amp="fp16")`` does it).

Example:
    >>> import torch
    >>> from perfsdk.optimize.amp import apply_amp
    >>> model = apply_amp(torch.nn.Linear(4, 2), dtype="bf16")
    >>> model(torch.ones(1, 4)).dtype  # computed in bfloat16, cast back to the input's dtype
    torch.float32
    >>> sorted(model.state_dict())
    ['bias', 'weight']
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch import nn

from perfsdk.errors import NoEffectWarning
from perfsdk.optimize._marks import applied, mark

__all__ = ["apply_amp"]

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
_ACCEPTED = ("None, torch.bfloat16, torch.float16, 'bf16', 'bfloat16', 'fp16', 'float16'")


def _dtype(dtype: torch.dtype | str | None, device_type: str) -> torch.dtype:
    if dtype is None:
        return torch.float16 if device_type == "cuda" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in (torch.bfloat16, torch.float16):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _NAMES:
        return _NAMES[dtype.lower()]
    raise ValueError(f"apply_amp: dtype={dtype!r} is not supported; accepted values are "
                     f"{_ACCEPTED}")


def _device_type(model: nn.Module) -> str:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device.type
    return "cpu"


def _autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)  # torch >= 2.4
    if check is None:
        return device_type in ("cpu", "cuda")
    return bool(check(device_type))


def _first_float_dtype(values: Any) -> torch.dtype | None:
    """The dtype of the first floating-point tensor in ``values`` (nested tuples/lists/dicts)."""
    if isinstance(values, torch.Tensor):
        return values.dtype if values.is_floating_point() else None
    if isinstance(values, (tuple, list)):
        items: Any = values
    elif isinstance(values, dict):
        items = values.values()
    else:
        return None
    for value in items:
        found = _first_float_dtype(value)
        if found is not None:
            return found
    return None


def _cast(out: Any, low: torch.dtype, target: torch.dtype) -> Any:
    """``out`` with every ``low``-precision tensor cast to ``target``, through tuples
    (namedtuples too), lists and dicts; anything else is returned as it is."""
    if isinstance(out, torch.Tensor):
        return out.to(target) if out.dtype == low else out
    if isinstance(out, tuple):
        items = [_cast(value, low, target) for value in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_cast(value, low, target) for value in out]
    if type(out) is dict:
        return {key: _cast(value, low, target) for key, value in out.items()}
    return out


class _AmpForward:
    """Stands in the module's ``forward``: the original forward under ``torch.autocast``.

    ``inner`` is a forward the instance had before (another wrapper), None for the class's."""

    _perfsdk_forward = True  # a perfsdk forward wrapper with an ``inner`` (see checkpoint.py)

    def __init__(self, module: nn.Module, inner: Any, device_type: str, dtype: torch.dtype,
                 cast_output: bool, fallback: torch.dtype) -> None:
        self.module = module
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype
        self.cast_output = cast_output
        self.fallback = fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            if self.inner is None:
                out = type(self.module).forward(self.module, *args, **kwargs)
            else:
                out = self.inner(*args, **kwargs)
        if not self.cast_output:
            return out
        target = _first_float_dtype(args)
        if target is None:
            target = _first_float_dtype(kwargs)
        if target is None:
            target = self.fallback
        if target == self.dtype:
            return out
        return _cast(out, self.dtype, target)

    def __repr__(self) -> str:
        return f"<perfsdk amp forward: autocast({self.device_type!r}, {self.dtype})>"


_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
          *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
"""Normalization layers keep float32 weights with ``weights=True`` (autocast runs them in float32
or accepts mixed dtypes; their statistics need the range)."""


def _store_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Floating parameters and buffers of every non-normalization module to ``dtype``, in place
    (the Parameter objects stay the same); returns how many tensors changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, _NORMS):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                changed += 1
        for key, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[key] = buf.to(dtype)
                changed += 1
    return changed


def apply_amp(model: nn.Module, *, dtype: torch.dtype | str | None = None,
              cast_output: bool = True, weights: bool = False) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast``, in place.

    The autocast device is that of the model's first parameter or buffer (CPU when it has none).

    Args:
        model: The module; modified in place and returned.
        dtype: The autocast dtype: ``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` or
            ``torch.float16`` / ``"fp16"`` / ``"float16"``. None: float16 on CUDA, bfloat16
            elsewhere. float16 is refused on CPU (slow there); use bfloat16.
        cast_output: Cast the forward's ``dtype`` outputs (tensors, also inside tuples,
            namedtuples, lists and plain dicts) back to the dtype of the first floating-point
            input (the first floating parameter's dtype when no input is floating). False: the
            outputs stay in reduced precision.
        weights: Inference only (the model must be in eval mode): also *store* the floating
            parameters and buffers in ``dtype`` (normalization layers keep float32), instead of
            letting autocast cast every weight again on every call. For a model with large
            Linear layers that cast is most of the time bf16 takes (SimpleNet's 103-million
            weight ``fc1``), and stored bf16 weights let ``apply_compile(freezing=True)`` fold
            them into the compiled code. Half the weight memory; ``state_dict()`` keeps its keys
            and loads into a float32 copy (values rounded to ``dtype``). Do not train such a
            model: the optimizer would update ``dtype`` weights.

    Returns:
        The same module object. Applying it twice warns (:class:`NoEffectWarning`) and changes
        nothing; so does a device without autocast support.

    Raises:
        ValueError: ``dtype`` or ``cast_output`` outside the accepted values (the message
            names the argument), or float16 for a model on the CPU.

    Example:
        >>> import torch
        >>> net = apply_amp(torch.nn.Linear(4, 2), cast_output=False)
        >>> net(torch.ones(1, 4)).dtype
        torch.bfloat16
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_amp: model={type(model).__name__} is not an nn.Module")
    for arg, value in (("cast_output", cast_output), ("weights", weights)):
        if not isinstance(value, bool):
            raise ValueError(f"apply_amp: {arg}={value!r}; accepted values are True, False")
    if weights and model.training:
        raise ValueError("apply_amp: weights=True is for inference only and the model is in "
                         "training mode; call model.eval() first (accepted: weights=True on an "
                         "eval-mode model, weights=False otherwise)")
    device_type = _device_type(model)
    chosen = _dtype(dtype, device_type)
    if chosen == torch.float16 and device_type == "cpu":
        raise ValueError(f"apply_amp: dtype={dtype!r} (float16) on the CPU: CPU autocast in "
                         "float16 is slow or unsupported here; use dtype=torch.bfloat16 ('bf16') "
                         "for a CPU model (float16 is for CUDA)")
    label = type(model).__name__
    previous = applied(model).get("amp")
    if previous is not None:
        warnings.warn(f"apply_amp: autocast is already applied to {label} "
                      f"(dtype={previous['dtype']}); returned unchanged.", NoEffectWarning,
                      stacklevel=2)
        return model
    if not _autocast_available(device_type):
        warnings.warn(f"apply_amp: torch.autocast does not support device type "
                      f"{device_type!r} ({label}); returned unchanged.", NoEffectWarning,
                      stacklevel=2)
        return model
    fallback = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                    torch.get_default_dtype())
    inner = model.__dict__.get("forward")
    model.forward = _AmpForward(model, inner, device_type, chosen, cast_output, fallback)
    stored = _store_weights(model, chosen) if weights else 0
    mark(model, "amp", dtype=str(chosen).removeprefix("torch."), device_type=device_type,
         cast_output=cast_output, weights=weights, stored=stored)
    return model
