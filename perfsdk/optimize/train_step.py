"""``TrainStep``: one call per batch does forward, backward and (every N calls) the optimizer step.

It does what a hand-written loop gets subtly wrong: the forward under autocast, the backward
through a GradScaler for float16, gradient accumulation that skips DDP's all-reduce on all but the
last micro-batch (``model.no_sync()``; without it accumulation costs a full all-reduce per
micro-batch), clipping of the *unscaled* gradients, ``zero_grad(set_to_none=True)``, and regions
``train.forward`` / ``train.backward`` / ``train.optimizer``. It never calls ``.item()`` on the
hot path: losses stay on the device and are read every ``read_every`` steps or on demand.

Example:
    >>> import torch
    >>> from perfsdk.optimize.train_step import TrainStep
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> step = TrainStep(model, opt, torch.nn.functional.mse_loss, accumulate=2)
    >>> for _ in range(4):
    ...     loss = step(torch.randn(8, 4), target=torch.zeros(8, 1))
    >>> step.step_count, step.micro_step, len(step.loss_history())
    (2, 4, 2)
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from perfsdk.errors import PerfSDKWarning, warn_once
from perfsdk.optimize._marks import region_attributes
from perfsdk.timing import timed_region

__all__ = ["TrainStep"]

_AMP_NAMES: dict[str, torch.dtype | None] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": None, "float32": None,
}
_ACCEPTED = ("None, 'bf16'/'bfloat16'/torch.bfloat16, 'fp16'/'float16'/torch.float16 "
             "(CUDA), 'fp32'/torch.float32 (no autocast)")


def _amp_dtype(amp: torch.dtype | str | None) -> torch.dtype | None:
    if amp is None or amp is torch.float32:
        return None
    if isinstance(amp, torch.dtype) and amp in (torch.bfloat16, torch.float16):
        return amp
    if isinstance(amp, str) and amp.lower() in _AMP_NAMES:
        return _AMP_NAMES[amp.lower()]
    raise ValueError(f"TrainStep: amp={amp!r} is not supported; accepted values: {_ACCEPTED}")


def _device_type(model: nn.Module) -> str:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device.type
    return "cpu"


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TrainStep: {name} must be an int >= {minimum}, got {value!r}")
    return value


class TrainStep:
    """One training step per call: ``loss = step(*inputs, target=y)``.

    Args:
        model: the module to train (a ``DistributedDataParallel`` wrapper too: its ``no_sync()``
            is used on the micro-batches that do not step).
        optimizer: the optimizer over the model's parameters.
        loss_fn: ``loss_fn(model(*inputs), target) -> scalar tensor`` (mean-reduced, so that
            accumulation over N micro-batches equals one batch N times larger).
        amp: autocast dtype for the forward and the loss: None (float32), ``"bf16"`` (no
            scaler needed) or ``"fp16"`` (CUDA; a ``torch.amp.GradScaler`` is created unless
            ``scaler`` is given). On CPU, float16 needs an explicit ``scaler`` (it is slow and
            meant for testing); use ``"bf16"`` there.
        accumulate: micro-batches per optimizer step. Each loss is divided by ``accumulate``
            and back-propagated at once; the optimizer steps on every ``accumulate``-th call.
        clip_grad: max gradient norm (``clip_grad_norm_``), applied after unscaling; None: off.
        scaler: a GradScaler-like object (``scale``, ``unscale_``, ``step``, ``update``) to use
            instead of the default one.
        read_every: every ``read_every`` optimizer steps, read the mean loss of those steps
            to the host once (appended to :attr:`logged`, passed to ``on_log``); 0: never.
        regions: time ``train.forward``, ``train.backward`` and ``train.optimizer`` as regions.
        on_log: called as ``on_log(step_count, mean_loss)`` after each read.

    Attributes:
        step_count: optimizer steps taken.
        micro_step: calls so far (micro-batches); the optimizer steps when it reaches a
            multiple of ``accumulate``.
        logged: the losses read every ``read_every`` steps, as floats.

    Note:
        With float16 the GradScaler itself reads one value per optimizer step (whether the
        gradients were finite): that sync is torch's, not this class's. bfloat16 has none.
        Leftover micro-batches at the end of an epoch carry into the next step.
    """

    max_history = 1000  # per-step losses kept on the device for loss_history()

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor], *, amp: torch.dtype | str | None = None,
                 accumulate: int = 1, clip_grad: float | None = None, scaler: Any = None,
                 read_every: int = 0, regions: bool = True,
                 on_log: Callable[[int, float], Any] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"TrainStep: model must be a torch.nn.Module, got "
                             f"{type(model).__name__}")
        if not callable(loss_fn):
            raise ValueError("TrainStep: loss_fn must be callable: loss_fn(output, target)")
        self.accumulate = _positive_int("accumulate", accumulate, 1)
        self.read_every = _positive_int("read_every", read_every, 0)
        if clip_grad is not None:
            if (isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float))
                    or not math.isfinite(clip_grad) or clip_grad <= 0):
                raise ValueError(f"TrainStep: clip_grad must be a finite number > 0 or None, "
                                 f"got {clip_grad!r}")
            clip_grad = float(clip_grad)
        if on_log is not None and not callable(on_log):
            raise ValueError("TrainStep: on_log must be callable: on_log(step_count, loss)")
        self.device_type = _device_type(model)
        self.dtype = _amp_dtype(amp)
        if self.dtype is torch.float16 and self.device_type == "cpu":
            if scaler is None:
                raise ValueError(
                    f"TrainStep: amp={amp!r} (float16) needs a CUDA model; this model is on "
                    f"the CPU. Use amp='bf16' there (accepted values: {_ACCEPTED}), or pass "
                    f"scaler=torch.amp.GradScaler('cpu') to force float16 on CPU (slow).")
            warn_once("train_step.fp16_cpu",
                      "TrainStep: float16 autocast on CPU is slow (emulated); "
                      "amp='bf16' is the fast CPU choice.", PerfSDKWarning)
        if scaler is None and self.dtype is torch.float16:
            scaler = torch.amp.GradScaler(self.device_type)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.clip_grad: float | None = clip_grad
        self.scaler = scaler
        self.regions = regions
        self.on_log = on_log
        self.step_count = 0
        self.micro_step = 0
        self.logged: list[float] = []
        self._losses: deque[torch.Tensor] = deque(maxlen=self.max_history)
        self._pending: torch.Tensor | None = None  # this step's loss, summed over micro-batches
        self._no_sync = getattr(model, "no_sync", None)
        if not callable(self._no_sync):
            self._no_sync = None
        # what the step runs with, on its regions (the advisor says "already on" from them)
        state = region_attributes(model)
        if self.dtype is not None:
            state["perfsdk.amp"] = str(self.dtype).removeprefix("torch.")
        self._fwd = timed_region("train.forward", attributes=state)
        self._bwd = timed_region("train.backward", attributes=state)
        self._opt = timed_region("train.optimizer", attributes=state)

    def _region(self, region: timed_region) -> contextlib.AbstractContextManager[Any]:
        return region if self.regions else contextlib.nullcontext()

    def __call__(self, *inputs: Any, target: Any) -> torch.Tensor:
        """Run one micro-batch; step the optimizer on every ``accumulate``-th call.

        Returns:
            This micro-batch's loss (as ``loss_fn`` returned it, undivided), detached, on the
            device: reading it (``float(loss)``) is a sync, so do that only when needed.
        """
        stepping = (self.micro_step + 1) % self.accumulate == 0
        skip_sync = (self._no_sync() if not stepping and self._no_sync is not None
                     else contextlib.nullcontext())
        with skip_sync:
            with self._region(self._fwd):
                if self.dtype is None:
                    loss = self.loss_fn(self.model(*inputs), target)
                else:
                    with torch.autocast(self.device_type, dtype=self.dtype):
                        loss = self.loss_fn(self.model(*inputs), target)
            scaled = loss / self.accumulate if self.accumulate > 1 else loss
            with self._region(self._bwd):
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()  # type: ignore[no-untyped-call]
        self.micro_step += 1  # counted once forward and backward went through
        part = scaled.detach().float()
        self._pending = part if self._pending is None else self._pending + part
        if stepping:
            with self._region(self._opt):
                self._step()
        return loss.detach()

    def _step(self) -> None:
        optimizer, scaler = self.optimizer, self.scaler
        if self.clip_grad is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            # error_if_nonfinite=False (the default): no read of the norm, so no sync
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if self._pending is not None:
            self._losses.append(self._pending)
            self._pending = None
        k = self.read_every
        if k and self.step_count % k == 0:
            recent = list(self._losses)[-k:]
            value = float(torch.stack(recent).mean().item())  # the one read per K steps
            self.logged.append(value)
            if self.on_log is not None:
                self.on_log(self.step_count, value)

    def loss_history(self) -> list[float]:
        """The loss of each optimizer step (mean over its micro-batches), oldest first, for the
        last :attr:`max_history` steps. Reads them from the device in one transfer (one sync)."""
        if not self._losses:
            return []
        values: list[float] = torch.stack(list(self._losses)).cpu().tolist()
        return values

    def __repr__(self) -> str:
        amp = "fp32" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        return (f"TrainStep(amp={amp}, accumulate={self.accumulate}, clip_grad={self.clip_grad}, "
                f"steps={self.step_count}, micro_steps={self.micro_step})")
