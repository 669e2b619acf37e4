"""``apply_channels_last``: NHWC memory format for a model's 4-D weights and inputs.

Convolutions on CPU (oneDNN) and on tensor-core GPUs run fastest on channels-last (NHWC)
tensors. The model's 4-D parameters and buffers are converted in place (the values and the
``state_dict()`` keys are unchanged: a state dict saved from the model loads into an
untransformed copy and back), and a forward pre-hook converts each 4-D tensor passed
positionally to the model, so users keep feeding ordinary NCHW tensors.

Channels-last is not always faster: some layers are much slower in it (pytorch#34977: a grouped
convolution took 143 ms instead of 4 ms), which is why ``optimize()`` measures before keeping
it. 3-D convolutions (``channels_last_3d``) are not handled here.

Example:
    >>> import torch
    >>> from perfsdk.optimize.channels_last import apply_channels_last
    >>> conv = apply_channels_last(torch.nn.Conv2d(3, 8, 3))
    >>> conv.weight.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch import nn

from perfsdk.errors import NoEffectWarning
from perfsdk.optimize._marks import applied, mark

__all__ = ["apply_channels_last"]


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: 4-D tensor positional arguments as channels-last (others as they are).
    Module-level, so the hook survives ``copy.deepcopy`` and pickling."""
    return tuple(arg.contiguous(memory_format=torch.channels_last)
                 if isinstance(arg, torch.Tensor) and arg.dim() == 4 else arg
                 for arg in args)


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model`` to the channels-last memory format, in place.

    Every 4-D parameter and buffer becomes channels-last contiguous, and a forward pre-hook
    converts 4-D tensors passed positionally to ``model`` (keyword arguments and tensors inside
    containers pass unchanged).

    Args:
        model: The module; modified in place and returned.

    Returns:
        The same module object. Without any ``nn.Conv2d`` the model is returned unchanged with a
        :class:`NoEffectWarning`; so is a second application.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch
        >>> net = apply_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)))
        >>> net(torch.ones(1, 3, 2, 2)).is_contiguous(memory_format=torch.channels_last)
        True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_channels_last: model={type(model).__name__} is not an "
                         "nn.Module")
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
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dim() == 4:  # in place: optimizers keep their references to the parameters
            tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_to_channels_last)
    mark(model, "channels_last", conv2d=convs)
    return model
