"""``PerfsdkCallback``: Lightning's hooks mapped onto perfsdk regions.

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

From ``setup`` to ``teardown`` (or ``on_exception``) it holds
:data:`perfsdk.instrumentor.FRAMEWORK_STEPS`: Lightning draws the steps, and ``perfsdk run``'s own
step, backward and optimizer regions step aside.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from perfsdk import Region, RegionResult, get_config, phase, timed_region
from perfsdk.auto import STEPS, Step
from perfsdk.errors import warn_once
from perfsdk.instrumentor import FRAMEWORK_STEPS, RunReport
from perfsdk_lightning.options import check_options

__all__ = ("PerfsdkCallback", "report_title")

_CATEGORIES = {"forward": "compute", "backward": "compute", "optimizer": "update",
               "validation": "eval", "sanity_check": "eval", "epoch": "epoch"}
_PHASES = ("forward", "backward", "optimizer")  # of each step: perfsdk.phase, cheaper


class _Open:
    """One open region: a phase's entry (forward, backward, optimizer: riding on the step's
    region, see ``perfsdk.phase``), or a ``timed_region`` entered (with its attributes)."""

    __slots__ = ("block", "entry", "name")

    def __init__(self, name: str, block: timed_region | phase,
                 attributes: dict[str, Any] | None) -> None:
        self.name = name
        if isinstance(block, phase):
            self.block: timed_region | None = None
            self.entry: Any = block.open()
        else:
            self.block = block
            region: Region = block.__enter__()
            if attributes and region.recorded:
                for key, value in attributes.items():
                    region.set_attribute(key, value)

    def close(self, error: BaseException | None) -> None:
        if self.block is None:
            self.entry.exit(error)
        else:
            self.block.__exit__(None if error is None else type(error), error, None)


def _failed(exc: Exception) -> None:
    """perfsdk's own failure: warn once, never into the training loop."""
    warn_once(f"perfsdk_lightning:{type(exc).__name__}",
              f"perfsdk_lightning: recording a region failed ({exc!r}); training goes on")


def report_title(stage: str, optimizer_steps: int | None, regions: Sequence[RegionResult],
                 seconds: float) -> str:
    """The title of the report printed when a Lightning ``stage`` (``fit``) ends: its wall
    time, the optimizer steps (None: not known) and the regions it recorded."""
    counts = {name: len([r for r in regions if r.name == name])
              for name in ("step", "validation", "sanity_check")}
    runs = counts["validation"]
    runs_text = f", {runs} validation run{'s' * (runs != 1)}" if runs else ""
    sanity = " (and the sanity check)" if counts["sanity_check"] else ""
    steps = "" if optimizer_steps is None else f"{optimizer_steps} optimizer steps, "
    return (f"perfsdk: Lightning {stage} ended after {seconds:.2f} s: {steps}"
            f"{counts['step']} batches recorded{runs_text}{sanity}")


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
        check_options("PerfsdkCallback", batch_size=batch_size, memory=memory, report=report)
        self.batch_size = batch_size
        self.memory = memory
        self.report = report
        self._report = RunReport()
        self._blocks: dict[str, timed_region | phase] = {
            name: (phase if name in _PHASES else timed_region)(
                name, category=category, memory=memory)
            for name, category in _CATEGORIES.items()}
        self._step: Step | None = None
        self._phase: _Open | None = None  # forward, backward or optimizer: one at a time
        self._validation: _Open | None = None
        self._epoch: _Open | None = None

    # -- opening and closing (inner regions always close before outer ones) ----------------
    def _open(self, name: str, attributes: dict[str, Any] | None = None) -> _Open:
        """Enter ``name``'s region (perfsdk's gate decides: disabled, outside the step
        schedule's active phase or not sampled, it records nothing)."""
        return _Open(name, self._blocks[name], attributes)

    def _close_phase(self, error: BaseException | None = None) -> None:
        entry, self._phase = self._phase, None
        if entry is not None:
            entry.close(error)

    def _close_step(self, error: BaseException | None = None) -> None:
        self._close_phase(error)
        step, self._step = self._step, None
        if step is not None:
            step.end(error)

    def _close_validation(self, error: BaseException | None = None) -> None:
        self._close_step(error)
        entry, self._validation = self._validation, None
        if entry is not None:
            entry.close(error)

    def _close_all(self, error: BaseException | None = None) -> None:
        self._close_validation(error)
        entry, self._epoch = self._epoch, None
        if entry is not None:
            entry.close(error)

    def _samples(self, batch: Any) -> int | None:
        size = self.batch_size
        if size is None:
            size = _leading_dim(batch)
        elif callable(size):
            size = size(batch)
        return size or None  # an empty batch: no samples/s

    # -- the report at the end of fit -------------------------------------------------------
    def _print_report(self, trainer: pl.Trainer) -> None:
        self._report.finish(functools.partial(report_title, "fit", trainer.global_step))

    # -- Lightning's hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        FRAMEWORK_STEPS.begin(self)  # Lightning draws the steps: `perfsdk run` steps aside

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._report.stop()  # a fit that raised never reached its end
            if self.report and trainer.is_global_zero and get_config().enabled:
                self._report.start()
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
            self._phase = self._open("forward")
        except Exception as exc:
            _failed(exc)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                            optimizer: torch.optim.Optimizer) -> None:
        phase = self._phase
        if phase is not None and phase.name == "forward":  # training_step has returned
            try:
                self._close_phase()
            except Exception as exc:
                _failed(exc)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        try:
            self._close_phase()
            self._phase = self._open("backward")
        except Exception as exc:
            _failed(exc)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        phase = self._phase
        if phase is not None and phase.name == "backward":
            try:
                self._close_phase()
            except Exception as exc:
                _failed(exc)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        try:
            self._close_phase()
            self._phase = self._open("optimizer")
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
            self._report.stop()  # the user's traceback follows: no report
            FRAMEWORK_STEPS.end(self)
        except Exception as exc:
            _failed(exc)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._close_all()  # anything a hook that never came left open
            if stage == "fit":
                self._print_report(trainer)
        except Exception as exc:
            _failed(exc)
        finally:
            FRAMEWORK_STEPS.end(self)

