"""Model FLOPs of one call, counted by torch's own ``torch.utils.flop_counter.FlopCounterMode``.

What is counted is what ``FlopCounterMode`` has a formula for: matrix multiplies
(``mm``, ``addmm``, ``bmm``, ``baddbmm``), convolutions and their backward, and the fused
attention kernels (``scaled_dot_product_attention``'s flash, efficient and cuDNN variants);
element-wise ops, normalizations, softmax and reductions count 0. A multiply-add is 2 FLOPs.

These are *model* FLOPs: an op that runs inside a backward pass with grad mode on -- the
recomputation of activation checkpointing (``torch.utils.checkpoint``, reentrant or not), or a
double backward (``create_graph=True``) -- is not credited, so a checkpointed model counts what
the same model without checkpointing would.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from perfsdk.errors import warn_once

__all__ = ["ModelFlops", "count_flops"]

_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _recomputing() -> bool:
    """Inside a backward pass (an autograd node is running) with grad mode on: the backward
    formulas themselves run with grad mode off, recomputation turns it on."""
    return _current_node() is not None and torch.is_grad_enabled()


def _model_only(op: Any, formula: Callable[..., int]) -> Callable[..., int]:
    def count(*args: Any, **kwargs: Any) -> int:
        if _recomputing():
            return 0
        try:
            return formula(*args, **kwargs)
        except Exception as exc:  # a formula that fails must not fail the user's op
            warn_once(f"flop-formula:{op}", f"perfsdk: torch's FLOP formula for {op} failed "
                      f"({exc!r}); its calls count 0 FLOPs")
            return 0

    count._get_raw = True  # type: ignore[attr-defined]  # formula already takes raw arguments
    return count


@functools.cache
def _mapping() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    return {op: _model_only(op, formula) for op, formula in flop_registry.items()}


_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class ModelFlops:
    """Counts model FLOPs inside its ``with`` blocks; :attr:`total` adds up every block.

    One ``torch.utils.flop_counter.FlopCounterMode`` per block (it observes the ops, the results
    are the same), with recomputation left out (see the module's docstring). torch's warning
    that a compiled module runs while global module hooks exist (the counter's module tracker)
    is silenced inside the block.

    Example:
        >>> import torch
        >>> from perfsdk.flops import ModelFlops
        >>> layer = torch.nn.Linear(64, 32)
        >>> with ModelFlops() as counted:
        ...     out = layer(torch.ones(8, 64))
        >>> counted.total == 2 * 8 * 64 * 32
        True
    """

    def __init__(self) -> None:
        self.total = 0
        """FLOPs counted so far, in all blocks."""
        self._counter: Any = None
        self._warnings: Any = None

    def __enter__(self) -> ModelFlops:
        from torch.utils.flop_counter import FlopCounterMode

        if self._counter is not None:
            raise RuntimeError("ModelFlops is not reentrant: one block at a time")
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=_HOOKS_WARNING)
        self._counter = FlopCounterMode(display=False, custom_mapping=_mapping())
        try:
            self._counter.__enter__()
        except BaseException:
            self._counter = None
            self._warnings.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        counter, self._counter = self._counter, None
        try:
            counter.__exit__(exc_type, exc, tb)
            self.total += int(counter.get_total_flops())
        finally:
            self._warnings.__exit__(exc_type, exc, tb)


def _module_of(fn: Any) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)  # model.forward, model.generate ...
    return owner if isinstance(owner, nn.Module) else None


def _save_buffers(module: nn.Module | None) -> list[tuple[nn.Module, str, torch.Tensor,
                                                          torch.Tensor]]:
    if module is None:
        return []
    saved = []
    for name, buffer in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        saved.append((module.get_submodule(owner_name), attr, buffer, buffer.detach().clone()))
    return saved


def _restore_buffers(saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for owner, attr, buffer, copy in saved:
            if getattr(owner, attr, None) is not buffer:  # replaced, not updated in place
                setattr(owner, attr, buffer)
            buffer.copy_(copy)


def _graph_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (parameters, inputs) whose gradients ``roots``' backward computes."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack: list[Any] = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def count_flops(fn_or_module: Callable[..., Any], /, *args: Any, backward: bool = False,
                **kwargs: Any) -> int:
    """The model FLOPs of one call ``fn_or_module(*args, **kwargs)``, forward only or forward
    and backward, counted by ``torch.utils.flop_counter.FlopCounterMode``.

    The call really runs (on the arguments' device, in the current grad and autocast modes).
    With ``backward=True`` the backward is that of ``out.sum()`` -- for a tuple, list or dict
    output, of the sum of ``.sum()`` of every floating-point tensor in it that requires grad --
    and every ``.grad`` it reaches (parameters, inputs) is put back as it was: the same tensor,
    or None (hooks on gradient accumulation run, as in any backward). A module's buffers
    (BatchNorm's running statistics, counters) are put back as they were, also when
    ``fn_or_module`` is a bound method of a module (``model.forward``); a plain function's
    state is its own. Random number generators advance as in any call.
    Only the ops ``FlopCounterMode`` knows count (matmuls, convolutions, attention), and
    recomputation from activation checkpointing is not credited (docs/flops.md).

    Example:
        >>> import torch
        >>> import perfsdk
        >>> layer = torch.nn.Linear(64, 32)
        >>> x = torch.ones(8, 64, requires_grad=True)
        >>> perfsdk.count_flops(layer, x)  # 2 * batch * in * out
        32768
        >>> perfsdk.count_flops(layer, x, backward=True)  # + grad input + grad weight
        98304
        >>> layer.weight.grad is None
        True

    Raises:
        ValueError: ``fn_or_module`` is not callable, ``backward`` is not a bool, or
            ``backward=True`` and the output holds no tensor that requires grad.
    """
    if not callable(fn_or_module):
        raise ValueError(f"count_flops: fn_or_module={fn_or_module!r}; accepted values are an "
                         "nn.Module or a callable")
    if not isinstance(backward, bool):
        raise ValueError(f"count_flops: backward={backward!r}; accepted values are True or "
                         "False")
    saved = _save_buffers(_module_of(fn_or_module))
    try:
        with ModelFlops() as counted:
            out = fn_or_module(*args, **kwargs)
            if backward:
                roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                         and t.requires_grad and t.is_floating_point()]
                if not roots:
                    raise ValueError(
                        "count_flops(backward=True): the output holds no floating-point tensor "
                        "that requires grad (is grad mode off, or the model frozen?)")
                leaves = _graph_leaves(roots)
                grads = [leaf.grad for leaf in leaves]
                try:
                    for leaf in leaves:
                        leaf.grad = None  # the backward writes fresh tensors, not into these
                    torch.autograd.backward([r.sum() for r in roots])
                finally:
                    for leaf, grad in zip(leaves, grads, strict=True):
                        leaf.grad = grad
            del out
    finally:
        _restore_buffers(saved)
    return counted.total
