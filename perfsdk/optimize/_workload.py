"""What ``optimize()`` runs and checks: one inference call or one training step (forward, loss,
backward) of a model on its inputs, and a seeded probe of its outputs and gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from perfsdk.optimize._tolerance import Probe

__all__ = ["MODES", "Work"]

MODES = ("inference", "train")


class Work:
    def __init__(self, mode: str, inputs: Any, loss_fn: Any, target: Any,
                 model: nn.Module) -> None:
        if mode not in MODES:
            raise ValueError(f"optimize: mode={mode!r}; accepted values are 'inference', 'train'")
        if not isinstance(model, nn.Module):
            raise ValueError(f"optimize: model={type(model).__name__} is not an nn.Module")
        if mode == "train" and not callable(loss_fn):
            raise ValueError(f"optimize: mode='train' needs loss_fn, a callable "
                             f"loss_fn(output, target) -> scalar tensor; got {loss_fn!r}")
        self.mode, self.loss_fn, self.target = mode, loss_fn, target
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        tensors = [t for t in tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError("optimize: inputs must be a tensor or a tuple holding tensors; "
                             f"got {type(inputs).__name__}")
        first = tensors[0]
        self.batch_size = int(first.shape[0]) if first.dim() and first.shape[0] else None
        params = [p.device for p in model.parameters()]
        self.device_type = (params[0] if params else first.device).type
        self.rng_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.args = self.inputs + (() if target is None else (target,))
        (model.train if mode == "train" else model.eval)()

    def fn(self, model: nn.Module) -> Callable[..., Any]:
        """What is timed: one inference call, or one training step without the optimizer."""
        n = len(self.inputs)
        if self.mode == "inference":
            def call(*args: Any) -> Any:
                with torch.no_grad():
                    return model(*args)
            return call

        def step(*args: Any) -> Any:
            model.zero_grad(set_to_none=True)
            out = model(*args[:n])
            loss = self.loss_fn(out, args[n]) if len(args) > n else self.loss_fn(out)
            loss.backward()
            return loss
        return step

    def probe(self, model: nn.Module) -> Probe:
        """One seeded call: the floating outputs, then (training) each parameter's gradient."""
        with torch.random.fork_rng(devices=self.rng_devices):
            torch.manual_seed(0)
            if self.mode == "inference":
                with torch.no_grad():
                    out = model(*self.inputs)
            else:
                model.zero_grad(set_to_none=True)
                out = model(*self.inputs)
                loss = self.loss_fn(out, self.target) if self.target is not None \
                    else self.loss_fn(out)
                loss.backward()
        found: Probe = [(f"output {i}", t.detach(), False) for i, t in enumerate(tree_leaves(out))
                        if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if self.mode == "train":
            found += [(name, None if p.grad is None else p.grad.detach(), True)
                      for name, p in model.named_parameters()]
        return found
