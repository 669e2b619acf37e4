"""``apply_checkpointing``: activation checkpointing around chosen submodules.

A checkpointed module keeps only its inputs for the backward pass and runs its forward a second
time during backward to rebuild the rest: less memory held between forward and backward, for
about one extra forward of that module. :func:`torch.utils.checkpoint.checkpoint` is used with
``use_reentrant=False`` (keyword arguments, nested checkpoints, and inputs that do not require
grad all work; RNG state is restored, so dropout masks match).

Checkpointing is active only while it can matter: when the model is in training mode and
gradients are enabled. In ``eval()`` mode or under ``torch.no_grad()`` the plain forward runs.
Outputs and gradients are the same as without it. Only modules holding several operations
save memory (a Transformer layer, a residual block, a group of layers): checkpointing a single
layer (one convolution, one activation) keeps its input alive anyway, so it saves nothing and
can even add a little (the recomputed output during backward) — measure, as ``optimize`` does.

Modules are changed by wrapping their ``forward`` (an instance attribute), so parameters and
``state_dict()`` keys are untouched.

Example:
    >>> import torch
    >>> from perfsdk.optimize.checkpoint import apply_checkpointing
    >>> from perfsdk.testing.models import encoder
    >>> model = apply_checkpointing(encoder(64, 2), modules=torch.nn.TransformerEncoderLayer)
    >>> model(torch.randn(2, 8, 64)).sum().backward()  # layers recomputed during backward
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from perfsdk.errors import NoEffectWarning
from perfsdk.optimize._marks import applied, mark

__all__ = ["apply_checkpointing"]


def _active(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class _CheckpointForward:
    """Stands in a module's ``forward``: the previous forward (``inner``; None: the class's)
    under ``checkpoint`` while training."""

    _perfsdk_forward = True

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module = module
        self.inner = inner

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.inner(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _active(self.module):
            return checkpoint(self.run, *args, use_reentrant=False, **kwargs)
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<perfsdk checkpointed forward of {type(self.module).__name__}>"


def _run_blocks(blocks: list[nn.Module], value: Any) -> Any:
    for block in blocks:
        value = block(value)
    return value


def _bounds(count: int, segments: int) -> list[tuple[int, int]]:
    """``segments`` contiguous, nearly equal ``[start, end)`` ranges covering ``count`` items."""
    size, extra = divmod(count, segments)
    bounds, start = [], 0
    for index in range(segments):
        end = start + size + (index < extra)
        bounds.append((start, end))
        start = end
    return bounds


class _SegmentedForward:
    """Stands in the forward of a plain ``nn.Sequential``: its children in ``segments``
    contiguous groups, each group under one ``checkpoint`` while training."""

    _perfsdk_forward = True
    inner = None

    def __init__(self, module: nn.Sequential, segments: int) -> None:
        self.module = module
        self.segments = segments

    def __call__(self, value: Any) -> Any:
        blocks = list(self.module)
        if not _active(self.module):
            return _run_blocks(blocks, value)
        for start, end in _bounds(len(blocks), min(self.segments, len(blocks))):
            value = checkpoint(_run_blocks, blocks[start:end], value, use_reentrant=False)
        return value

    def __repr__(self) -> str:
        return f"<perfsdk nn.Sequential forward in {self.segments} checkpointed segments>"


def _chain(module: nn.Module) -> list[Any]:
    """The perfsdk forward wrappers on ``module``, outermost first, then whatever they end on."""
    node, chain = module.__dict__.get("forward"), []
    while node is not None:
        chain.append(node)
        node = node.inner if getattr(node, "_perfsdk_forward", False) else None
    return chain


def _checkpointed(module: nn.Module) -> bool:
    return any(isinstance(node, (_CheckpointForward, _SegmentedForward))
               for node in _chain(module))


def _segment_sequential(model: nn.Module, segments: int) -> bool:
    """Install grouped checkpointing on a plain ``nn.Sequential``: innermost, under any perfsdk
    forward wrappers already there (``apply_amp``). False where its forward is not Sequential's
    own."""
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        return False
    chain = _chain(model)
    segmented = _SegmentedForward(model, segments)
    if not chain:
        model.forward = segmented  # type: ignore[method-assign]
        return True
    innermost = chain[-1]
    if not getattr(innermost, "_perfsdk_forward", False):
        return False  # someone else's forward: leave it and checkpoint the children instead
    innermost.inner = segmented
    return True


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The top-level children in order, a ``ModuleList``/``ModuleDict`` replaced by its items."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            blocks.extend((f"{name}.{sub}", grandchild)
                          for sub, grandchild in child.named_children())
        else:
            blocks.append((name, child))
    return blocks


def _select(model: nn.Module, modules: Sequence[str] | type) -> list[tuple[str, nn.Module]]:
    if isinstance(modules, type):
        if not issubclass(modules, nn.Module):
            raise ValueError(f"apply_checkpointing: modules={modules.__name__} is not an "
                             "nn.Module subclass; accepted values are qualified submodule names "
                             "or an nn.Module subclass")
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            inside = any(not outer or name.startswith(outer + ".") for outer, _ in chosen)
            if isinstance(module, modules) and not inside:  # outermost instances only
                chosen.append((name, module))
        return chosen
    names = [modules] if isinstance(modules, str) else modules
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"apply_checkpointing: modules={modules!r}; accepted values are a list "
                         "of qualified submodule names (e.g. 'layers.0') or an nn.Module subclass")
    known = dict(model.named_modules())
    missing = [name for name in names if name not in known]
    if missing:
        valid = [name for name in known if name][:8]
        raise ValueError(f"apply_checkpointing: modules={list(names)!r}: no submodule named "
                         f"{', '.join(map(repr, missing))}; valid names include "
                         f"{', '.join(map(repr, valid))}")
    return [(name, known[name]) for name in dict.fromkeys(names)]


def apply_checkpointing(model: nn.Module, *, segments: int | None = None,
                        modules: Sequence[str] | type | None = None) -> nn.Module:
    """Checkpoint activations of parts of ``model``, in place.

    Args:
        model: The module; modified in place and returned.
        segments: Split the model into this many checkpointed segments. For a plain
            ``nn.Sequential`` its children run in ``segments`` contiguous groups, each group
            under one checkpoint. Any other model calls its children itself, so they cannot be
            regrouped: each of its top-level children (the items of a top-level ``ModuleList``,
            e.g. a ``TransformerEncoder``'s layers) is checkpointed on its own, and ``segments``
            only has to be between 1 and that number of blocks.
        modules: Which submodules to checkpoint: qualified names as in ``named_modules()``
            (``["layers.0", "layers.1"]``; one string is one name), or an ``nn.Module`` subclass
            (its outermost instances).

    Returns:
        The same module object. When nothing is selected, or everything selected is already
        checkpointed, it is returned unchanged with a :class:`NoEffectWarning`.

    Raises:
        ValueError: Not exactly one of ``segments`` and ``modules``, a ``segments`` out of range,
            or an unknown module name (the message lists valid ones).

    Example:
        >>> import torch
        >>> seq = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> seq = apply_checkpointing(seq, segments=2)  # two checkpoints of two layers each
        >>> seq(torch.randn(3, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_checkpointing: model={type(model).__name__} is not an nn.Module")
    if (segments is None) == (modules is None):
        raise ValueError("apply_checkpointing: pass exactly one of segments= (a number of "
                         "segments) or modules= (submodule names or an nn.Module subclass); got "
                         f"segments={segments!r}, modules={modules!r}")
    label = type(model).__name__
    wrapped: list[str] = []
    selected: list[tuple[str, nn.Module]] = []
    if modules is not None:
        selected = _select(model, modules)
    elif isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"apply_checkpointing: segments={segments!r}; accepted values are "
                         "integers >= 1")
    elif _checkpointed(model):
        selected = [("", model)]  # already segmented (or checkpointed as a whole)
    else:
        plain = isinstance(model, nn.Sequential)
        count = len(model._modules) if plain else len(_blocks(model))
        if count and segments > count:
            raise ValueError(f"apply_checkpointing: segments={segments} but {label} has "
                             f"{count} blocks; accepted values are 1 to {count}")
        if plain and count and _segment_sequential(model, segments):
            wrapped.append("")
        else:
            selected = _blocks(model)
    for name, module in selected:
        if not _checkpointed(module):
            module.forward = _CheckpointForward(
                module, module.__dict__.get("forward"))
            wrapped.append(name)
    if not wrapped:
        what = (f"nothing was selected to checkpoint in {label}" if not selected else
                f"everything selected in {label} is already checkpointed")
        warnings.warn(f"apply_checkpointing: {what} (segments={segments!r}, "
                      f"modules={modules!r}); returned unchanged.", NoEffectWarning, stacklevel=2)
        return model
    before = applied(model).get("checkpointing", {}).get("modules", [])
    mark(model, "checkpointing", segments=segments,
         modules=list(dict.fromkeys([*before, *wrapped])))
    return model
