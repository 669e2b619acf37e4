"""perfsdk regions for Lightning training: one Callback, or :func:`instrument` for every Trainer.

:class:`PerfsdkCallback` maps Lightning's hooks onto perfsdk's regions (no measurement of its own):

- ``step`` (category ``step``): each training batch, ``on_train_batch_start`` to
  ``on_train_batch_end``, through :data:`perfsdk.auto.STEPS` (``perfsdk.samples``, and
  ``perfsdk.samples_per_s`` at its end);
- inside it ``forward`` (``compute``: the ``training_step``, up to ``zero_grad`` or backward),
  ``backward`` (``compute``: ``on_before_backward`` to ``on_after_backward``) and ``optimizer``
  (``update``: ``on_before_optimizer_step`` to the end of the batch: gradient clipping, the
  optimizer's update and any per-step LR scheduler);
- ``validation`` (``eval``): each validation run, ``on_validation_start`` to ``on_validation_end``;
  Lightning's sanity check (the validation batches it runs before training) is a region of its
  own, ``sanity_check`` (``eval``), so that ``validation`` counts the real runs alone;
- ``epoch`` (``epoch``): each training epoch.

At the end of ``fit`` it prints perfsdk's summary of the fit's regions and the advisor's
findings (``report=False`` turns that off; only the global rank 0 prints, and nothing is printed
while perfsdk is disabled).

Every region open when training raises is closed in ``on_exception`` with the error set, and the
user's exception reaches the caller unchanged. Timings, memory (``memory=True``, or
``PERFSDK_MEMORY=1``), NVML readings and export are perfsdk's own.

Example:
    >>> import lightning as L
    >>> from perfsdk_lightning import PerfsdkCallback
    >>> trainer = L.Trainer(callbacks=[PerfsdkCallback()], logger=False)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from perfsdk.auto import STEPS
from perfsdk.auto import Step as _Step
from perfsdk.cli.run import print_report
from perfsdk.cli.runfile import RunRecorder
from perfsdk.config import get_config
from perfsdk.config import state as _state
from perfsdk.errors import warn_once
from perfsdk.region import Region, RegionSpec
from perfsdk_lightning.version import __version__

__all__ = ("PerfsdkCallback", "__version__", "instrument", "uninstrument")

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_CATEGORIES = {"forward": "compute", "backward": "compute", "optimizer": "update",
               "validation": "eval", "sanity_check": "eval", "epoch": "epoch"}


@functools.cache
def _spec(name: str, memory: bool | None) -> RegionSpec:
    return RegionSpec.create(name, category=_CATEGORIES[name], memory=memory,
                             where="PerfsdkCallback")


def _failed(exc: Exception) -> None:
    """perfsdk's own failure: warn once, never into the training loop."""
    warn_once(f"perfsdk_lightning:{type(exc).__name__}",
              f"perfsdk_lightning: recording a region failed ({exc!r}); training goes on")


def _leading_dim(batch: Any) -> int | None:
    """The first dimension of the first tensor in a (nested) batch; None if there is none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, (list, tuple)):
        return None
    for item in batch:
        size = _leading_dim(item)
        if size is not None:
            return size
    return None


class PerfsdkCallback(Callback):
    """Regions for Lightning's training batches, their phases, validation runs and epochs.

    Args:
        batch_size: ``perfsdk.samples`` of each step: a fixed int, a function of the batch, or
            None (default) for the first dimension of the first tensor in the batch.
        memory: Record memory in these regions (None: perfsdk's configured default).
        report: Print perfsdk's summary of the fit and the advisor's findings when ``fit``
            ends (True, the default), or not (False).

    Raises:
        ValueError: ``batch_size``, ``memory`` or ``report`` has a value outside those
            accepted.

    Example:
        >>> import lightning as L
        >>> from perfsdk_lightning import PerfsdkCallback
        >>> trainer = L.Trainer(callbacks=[PerfsdkCallback(memory=True)])  # doctest: +SKIP
    """

    def __init__(self, *, batch_size: int | Callable[[Any], int] | None = None,
                 memory: bool | None = None, report: bool = True) -> None:
        if not (batch_size is None or callable(batch_size) or (
                isinstance(batch_size, int) and not isinstance(batch_size, bool)
                and batch_size >= 1)):
            raise ValueError(f"PerfsdkCallback: batch_size={batch_size!r}; accepted values are "
                             "None (inferred from the batch), an integer >= 1 or a function of "
                             "the batch")
        if memory is not None and not isinstance(memory, bool):
            raise ValueError(f"PerfsdkCallback: memory={memory!r}; accepted values are None (the "
                             "configured default), True or False")
        if not isinstance(report, bool):
            raise ValueError(f"PerfsdkCallback: report={report!r}; accepted values are True "
                             "(print the summary and advice when fit ends) or False")
        self.batch_size = batch_size
        self.memory = memory
        self.report = report
        self._recorder: RunRecorder | None = None
        self._started = 0.0
        self._specs = {name: _spec(name, memory) for name in _CATEGORIES}
        self._step: _Step | None = None
        self._phase: Region | None = None  # forward, backward or optimizer: one at a time
        self._validation: Region | None = None
        self._epoch: Region | None = None

    # -- opening and closing (inner regions always close before outer ones) ----------------
    def _open(self, name: str, attributes: dict[str, Any] | None = None,
              sampled: bool = False) -> Region | None:
        if not _state.enabled:  # disabled, or a step outside the schedule's active phase
            return None
        spec = self._specs[name]
        n = _state.sample_every
        if sampled and n != 1 and next(spec.calls) % n:
            return None
        region = Region(spec, attributes)
        region.enter()
        return region

    def _close_phase(self, error: BaseException | None = None) -> None:
        region, self._phase = self._phase, None
        if region is not None:
            region.exit(error)

    def _close_step(self, error: BaseException | None = None) -> None:
        self._close_phase(error)
        step, self._step = self._step, None
        if step is not None:
            step.end(error)

    def _close_validation(self, error: BaseException | None = None) -> None:
        self._close_step(error)
        region, self._validation = self._validation, None
        if region is not None:
            region.exit(error)

    def _close_all(self, error: BaseException | None = None) -> None:
        self._close_validation(error)
        region, self._epoch = self._epoch, None
        if region is not None:
            region.exit(error)

    def _samples(self, batch: Any) -> int | None:
        size = self.batch_size
        if size is None:
            size = _leading_dim(batch)
        elif callable(size):
            size = size(batch)
        return size or None  # an empty batch: no samples/s

    # -- the report at the end of fit -------------------------------------------------------
    def _stop_recording(self) -> RunRecorder | None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        return recorder

    def _print_report(self, trainer: pl.Trainer) -> None:
        recorder = self._stop_recording()
        if recorder is None:
            return
        seconds = time.perf_counter() - self._started
        counts = {name: len([r for r in recorder.regions if r.name == name])
                  for name in ("step", "validation", "sanity_check")}
        runs = counts["validation"]
        runs_text = f", {runs} validation run{'s' * (runs != 1)}" if runs else ""
        sanity = " (and the sanity check)" if counts["sanity_check"] else ""
        print_report(recorder, sys.stdout, title=(
            f"perfsdk: Lightning fit ended after {seconds:.2f} s: {trainer.global_step} "
            f"optimizer steps, {counts['step']} batches recorded{runs_text}{sanity}"))

    # -- Lightning's hooks ------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._stop_recording()  # a fit that raised never reached its end
            if self.report and trainer.is_global_zero and get_config().enabled:
                self._recorder = RunRecorder().__enter__()
                self._started = time.perf_counter()
        except Exception as exc:
            _failed(exc)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._close_all()
            self._epoch = self._open("epoch", {"perfsdk.epoch": trainer.current_epoch})
        except Exception as exc:
            _failed(exc)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._close_all()
        except Exception as exc:
            _failed(exc)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        try:
            self._close_step()
            self._step = step = STEPS.step(self._samples(batch))
            if step.region is not None:
                step.region.set_attribute("perfsdk.batch", batch_idx)
            self._phase = self._open("forward", sampled=True)
        except Exception as exc:
            _failed(exc)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                            optimizer: torch.optim.Optimizer) -> None:
        phase = self._phase
        if phase is not None and phase.spec.name == "forward":  # training_step has returned
            try:
                self._close_phase()
            except Exception as exc:
                _failed(exc)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        try:
            self._close_phase()
            self._phase = self._open("backward", sampled=True)
        except Exception as exc:
            _failed(exc)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        phase = self._phase
        if phase is not None and phase.spec.name == "backward":
            try:
                self._close_phase()
            except Exception as exc:
                _failed(exc)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        try:
            self._close_phase()
            self._phase = self._open("optimizer", sampled=True)
        except Exception as exc:
            _failed(exc)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        try:
            self._close_step()
        except Exception as exc:
            _failed(exc)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._close_validation()
            name = "sanity_check" if trainer.sanity_checking else "validation"
            self._validation = self._open(name, {"perfsdk.epoch": trainer.current_epoch})
        except Exception as exc:
            _failed(exc)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._close_validation()
        except Exception as exc:
            _failed(exc)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        try:
            self._close_all(exception)
            self._stop_recording()  # the user's traceback follows: no report
        except Exception as exc:
            _failed(exc)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._close_all()  # anything a hook that never came left open
            if stage == "fit":
                self._print_report(trainer)
        except Exception as exc:
            _failed(exc)


_original_init: Callable[..., None] | None = None


def instrument(*, batch_size: int | Callable[[Any], int] | None = None,
               memory: bool | None = None, report: bool = True) -> None:
    """Give every ``lightning.Trainer`` created from now on a :class:`PerfsdkCallback`.

    A Trainer that already has one keeps its own. Idempotent: while instrumented, a second call
    changes nothing. The arguments are :class:`PerfsdkCallback`'s.

    Raises:
        ValueError: An argument has a value outside those accepted.
    """
    global _original_init
    PerfsdkCallback(batch_size=batch_size, memory=memory, report=report)  # a bad one raises
    if _original_init is not None:
        logger.debug("perfsdk_lightning: already instrumented")
        return
    original = pl.Trainer.__init__

    @functools.wraps(original)
    def __init__(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        original(trainer, *args, **kwargs)
        try:
            callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
            if not any(isinstance(cb, PerfsdkCallback) for cb in callbacks):
                callbacks.append(PerfsdkCallback(batch_size=batch_size, memory=memory,
                                                 report=report))
        except Exception as exc:
            _failed(exc)

    pl.Trainer.__init__ = __init__  # type: ignore[method-assign, assignment]
    _original_init = original


def uninstrument() -> None:
    """Trainers created from now on get no callback from :func:`instrument`; idempotent."""
    global _original_init
    if _original_init is not None:
        pl.Trainer.__init__ = _original_init  # type: ignore[method-assign]
        _original_init = None
