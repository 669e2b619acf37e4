"""What the ``apply_*`` transforms did to a module, recorded on the module itself.

Each transform calls :func:`mark` once it changed the model; :func:`applied` reads the record.
The record lives in the module's ``__dict__`` (not a registered attribute), so it travels with
``copy.deepcopy`` and pickling and never appears in ``state_dict()``. :func:`fallbacks` tells
which of them gave up at run time (a compilation or a CUDA graph capture that failed, after
which the model runs eagerly).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> mark(model, "amp", dtype="bfloat16")
    >>> applied(model)
    {'amp': {'dtype': 'bfloat16'}}
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["applied", "fallbacks", "mark", "region_attributes"]

_KEY = "_perfsdk_applied"


def mark(model: nn.Module, name: str, **options: Any) -> None:
    """Record that transform ``name`` was applied to ``model`` with ``options`` (replacing an
    earlier record of the same name)."""
    model.__dict__.setdefault(_KEY, {})[name] = dict(options)


def applied(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The transforms applied to ``model``, by name, with their options (a copy; ``{}`` when
    none)."""
    record: dict[str, dict[str, Any]] = model.__dict__.get(_KEY, {})
    return {name: dict(options) for name, options in record.items()}


def region_attributes(model: nn.Module) -> dict[str, Any]:
    """Span attributes that say what ``model`` runs with, for the regions that time it:
    ``perfsdk.transforms`` (the transforms applied, sorted; ``compile`` also for the module
    ``torch.compile(model)`` returns) and ``perfsdk.amp`` (the autocast dtype of
    ``apply_amp``). ``{}`` for a plain model. The advisor reads them to say "already on" instead of
    recommending a transform again.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> mark(model, "amp", dtype="bfloat16")
        >>> region_attributes(model)
        {'perfsdk.transforms': ('amp',), 'perfsdk.amp': 'bfloat16'}
    """
    record = applied(model)
    inner = getattr(model, "module", None)  # DistributedDataParallel, DataParallel
    if isinstance(inner, nn.Module):
        record = {**applied(inner), **record}
    names = set(record)
    if hasattr(model, "_orig_mod"):  # torch.compile(model): an OptimizedModule
        names.add("compile")
    attrs: dict[str, Any] = {}
    if names:
        attrs["perfsdk.transforms"] = tuple(sorted(names))
    dtype = record.get("amp", {}).get("dtype")
    if isinstance(dtype, str):
        attrs["perfsdk.amp"] = dtype
    return attrs


def fallbacks(model: nn.Module) -> dict[str, BaseException]:
    """The transforms on ``model`` that fell back to eager at run time, with the error that made
    them: ``{"compile": ...}`` when compiling failed, ``{"cuda_graphs": ...}`` when a capture
    failed; ``{}`` while they all run as applied.

    Example:
        >>> import torch
        >>> fallbacks(torch.nn.Linear(2, 2))
        {}
    """
    found: dict[str, BaseException] = {}
    call = getattr(model, "_compiled_call_impl", None)  # the wrappers apply_compile and
    while call is not None:  # apply_cuda_graphs put there, outermost first
        failed = getattr(call, "failed", None)
        if isinstance(failed, BaseException):
            found[str(getattr(call, "transform", type(call).__name__))] = failed
        call = getattr(call, "inner", None)
    return found
