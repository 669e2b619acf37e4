"""``PerfsdkProfiler``: Lightning's profiler slot, ``Trainer(profiler=PerfsdkProfiler())``.

Lightning calls a profiler's ``start(action)`` and ``stop(action)`` around its loops, steps and
hooks. :class:`PerfsdkProfiler` maps the actions that bound a training batch and its phases onto
the regions :class:`~perfsdk_lightning.PerfsdkCallback` records (no measurement of its own; one
dict lookup per call, the regions built once):

- ``epoch`` (category ``epoch``, ``perfsdk.epoch``): ``run_training_epoch``, the epoch's batches
  and the validation runs inside it;
- ``step`` (category ``step``, through :data:`perfsdk.auto.STEPS`, ``perfsdk.batch``):
  ``run_training_batch``, one per training batch; inside it ``forward`` (``compute``:
  ``[Strategy]<S>.training_step``), ``backward`` (``compute``: ``[Strategy]<S>.backward``) and
  ``optimizer`` (``update``: from the end of the backward to the end of
  ``[LightningModule]<M>.optimizer_step``, i.e. ``on_before_optimizer_step``, gradient clipping
  and the optimizer's update; with manual optimization, Lightning's ``optimizer_step`` action
  around each ``optimizer.step()``);
- ``data_wait`` (category ``data``): ``[_TrainingEpochLoop].train_dataloader_next``, each fetch of a
  training batch, between the steps (Lightning fetches one batch ahead);
- ``validation`` (``eval``, ``perfsdk.epoch``): ``[Strategy]<S>.on_validation_start`` to
  ``[Strategy]<S>.on_validation_end``; Lightning's sanity check is ``sanity_check`` (``eval``).

``perfsdk.samples`` of each step is ``batch_size`` when given, else the training DataLoader's
``batch_size`` (the epoch's last batch: what is left of its sampler's length) when the Trainer
has one DataLoader with a batch size; a profiler sees action names, never the batch.

Every other action (hooks, ``[_EvaluationLoop].val_next``, ``save_checkpoint`` ...) is ignored,
or with ``all_actions=True`` recorded as a region named after it (category ``lightning``).

From ``setup`` to ``teardown`` the profiler holds :data:`perfsdk.instrumentor.FRAMEWORK_STEPS`, as
the callback does: ``perfsdk run``'s own step, backward and optimizer regions step aside. A
Trainer that also has a :class:`~perfsdk_lightning.PerfsdkCallback` would record every region
twice: the profiler then records nothing, and warns.

``summary()`` returns perfsdk's summary of the run's regions and the advisor's findings (Lightning
logs it when ``fit`` ends, or writes it to ``dirpath/filename``); ``report=False``, a rank other
than 0 or a disabled perfsdk give "".

An exception leaving an action closes the regions it ends with the error set (Lightning stops
its actions in ``finally``); the fit's own exception reaches the caller unchanged.

Example:
    >>> import lightning as L
    >>> from perfsdk_lightning import PerfsdkProfiler
    >>> trainer = L.Trainer(profiler=PerfsdkProfiler(), logger=False)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.profilers import Profiler
from torch.utils.data import DataLoader

from perfsdk import Region, get_config, timed_region
from perfsdk.auto import STEPS, Step
from perfsdk.errors import warn_once
from perfsdk.instrumentor import FRAMEWORK_STEPS, RunReport
from perfsdk_lightning.callback import PerfsdkCallback, report_title
from perfsdk_lightning.options import check_options

__all__ = ("PerfsdkProfiler", "action_kind")

# What an action is to the profiler: learned once per action name.
(OTHER, EPOCH, STEP, FORWARD, BACKWARD, CLOSURE, OPTIMIZER, DATA, VALIDATION_START,
 VALIDATION_END, VALIDATION) = range(11)

_LOOP_ACTIONS = {"run_training_epoch": EPOCH, "run_training_batch": STEP,
                 "optimizer_step": OPTIMIZER}  # the last: manual optimization's
_STRATEGY_HOOKS = {"training_step": FORWARD, "backward": BACKWARD,
                   "on_validation_start": VALIDATION_START, "on_validation_end": VALIDATION_END}
_CATEGORIES = {"epoch": "epoch", "forward": "compute", "backward": "compute",
               "optimizer": "update", "data_wait": "data", "validation": "eval",
               "sanity_check": "eval"}
_NOT_ERRORS = (StopIteration, StopAsyncIteration, GeneratorExit)  # a loop's end, not a failure


def _exc_info_exception() -> BaseException | None:
    return sys.exc_info()[1]


_exception: Callable[[], BaseException | None] = getattr(sys, "exception", _exc_info_exception)
"""The exception being handled (``sys.exception``, Python 3.11+; no tuple to build)."""
_KNOWN_ACTIONS = 4096  # action names remembered (a bound, should a program make names)


def action_kind(action: str) -> int:
    """What ``action`` (a name Lightning passes to ``start`` / ``stop``) is to the profiler:
    ``EPOCH``, ``STEP``, ``FORWARD``, ``BACKWARD``, ``CLOSURE`` (automatic optimization's
    ``optimizer_step``, which runs the closure), ``OPTIMIZER``, ``DATA``,
    ``VALIDATION_START``, ``VALIDATION_END`` or ``OTHER``."""
    kind = _LOOP_ACTIONS.get(action)
    if kind is not None:
        return kind
    owner, _, hook = action.rpartition(".")
    if owner.startswith("[Strategy]"):
        return _STRATEGY_HOOKS.get(hook, OTHER)
    if hook == "optimizer_step" and owner.startswith("[LightningModule]"):
        return CLOSURE
    if hook == "train_dataloader_next" and owner.startswith("["):
        return DATA
    return OTHER


def _failed(exc: Exception) -> None:
    """perfsdk's own failure: warn once, never into the training loop."""
    warn_once(f"perfsdk_lightning:{type(exc).__name__}",
              f"perfsdk_lightning: recording a region failed ({exc!r}); training goes on")


class _Entry:
    """One open action: the region it entered (a ``timed_region``'s or a step's), or none (the
    closure marker). ``action`` is the action whose ``stop`` closes it; None for a region that
    another action's ``stop`` closes (``validation``, automatic optimization's ``optimizer``)."""

    __slots__ = ("action", "block", "kind", "step")

    def __init__(self, kind: int, action: str | None, block: timed_region | None = None,
                 step: Step | None = None, attributes: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.action = action
        self.block = block
        self.step = step
        if block is not None:
            region: Region = block.__enter__()
            if attributes and region.recorded:
                region.set_attributes(attributes)

    def close(self, error: BaseException | None) -> None:
        if self.block is not None:
            self.block.__exit__(None if error is None else type(error), error, None)
        elif self.step is not None:
            self.step.end(error)


class PerfsdkProfiler(Profiler):
    """perfsdk regions from Lightning's profiler calls: ``step`` per training batch with
    ``forward``, ``backward`` and ``optimizer`` inside, ``data_wait``, ``validation``,
    ``sanity_check`` and ``epoch`` (see the module docstring for the actions behind each).

    Args:
        dirpath: Where Lightning writes :meth:`summary` at the end (with ``filename``; the
            Trainer's log directory when only ``filename`` is given). None: Lightning logs it.
        filename: The file's name (Lightning adds the stage and ``.txt``).
        batch_size: ``perfsdk.samples`` of each step: an int, or None (default) for the
            training DataLoader's batch size, when it has one.
        memory: Record memory in these regions (None: perfsdk's configured default).
        report: :meth:`summary` gives perfsdk's summary of the run and the advisor's findings
            (True, the default), or "" (False).
        all_actions: Also record every other action Lightning profiles (its hooks, the
            validation step, checkpoint saving) as a region named after it, category
            ``lightning`` (default False: ignored).

    Raises:
        ValueError: An argument has a value outside those accepted.

    Example:
        >>> import lightning as L
        >>> from perfsdk_lightning import PerfsdkProfiler
        >>> trainer = L.Trainer(profiler=PerfsdkProfiler(batch_size=32))  # doctest: +SKIP
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, *,
                 batch_size: int | None = None, memory: bool | None = None,
                 report: bool = True, all_actions: bool = False) -> None:
        if callable(batch_size):
            raise ValueError(f"PerfsdkProfiler: batch_size={batch_size!r}; accepted values are "
                             "None (the training DataLoader's batch size) or an integer >= 1: "
                             "a profiler never sees the batch (PerfsdkCallback takes a function "
                             "of it)")
        check_options("PerfsdkProfiler", batch_size=batch_size, memory=memory, report=report)
        if not isinstance(all_actions, bool):
            raise ValueError(f"PerfsdkProfiler: all_actions={all_actions!r}; accepted values "
                             "are False (ignore the other actions) or True (a region each)")
        super().__init__(dirpath=dirpath, filename=filename)
        self.batch_size = batch_size
        self.memory = memory
        self.report = report
        self.all_actions = all_actions
        self._blocks = {name: timed_region(name, category=category, memory=memory)
                        for name, category in _CATEGORIES.items()}
        self._others: dict[str, timed_region] = {}
        self._kinds: dict[str, int] = {}
        self._stack: list[_Entry] = []
        self._active = True  # False: a PerfsdkCallback records this Trainer's regions
        self._running = False  # from setup to teardown, or to the failure that ends the run
        self._report = RunReport()
        self._summary = ""
        self._epochs = 0  # epochs seen, when the Trainer is out of reach
        self._batches = 0  # batches seen in this epoch, likewise
        self._batching: tuple[int, int | None] | None = None
        self._batching_read = False

    # -- Lightning's profiler interface ----------------------------------------------------
    def setup(self, stage: str, local_rank: int | None = None,
              log_dir: str | None = None) -> None:
        super().setup(stage, local_rank=local_rank, log_dir=log_dir)
        try:
            self._end_run()  # a run that raised where nothing told us
            self._summary = ""
            trainer = self._trainer()
            callbacks = getattr(trainer, "callbacks", None) or ()
            if any(isinstance(cb, PerfsdkCallback) for cb in callbacks):
                self._active = False
                warn_once("perfsdk_lightning:profiler-and-callback",
                          "perfsdk_lightning: this Trainer has both a PerfsdkProfiler and a "
                          "PerfsdkCallback, which record the same regions: the profiler steps "
                          "aside and records nothing (give the Trainer one of them)")
                return
            self._active = True
            self._running = True
            FRAMEWORK_STEPS.begin(self)  # Lightning draws the steps: `perfsdk run` steps aside
            zero = trainer.is_global_zero if trainer is not None else self.local_rank == 0
            if self.report and zero and get_config().enabled:
                self._report.start()
        except Exception as exc:
            _failed(exc)

    def start(self, action_name: str) -> None:
        kind = self._kinds.get(action_name)
        if kind is None:
            kind = self._learn(action_name)
        if (kind == OTHER and not self.all_actions) or not self._active:
            return
        try:
            self._start(kind, action_name)
        except Exception as exc:
            _failed(exc)

    def stop(self, action_name: str) -> None:
        stack = self._stack
        if not (stack or self._running) or not self._active:
            return
        kind = self._kinds.get(action_name)
        if kind is None:
            kind = self._learn(action_name)
        if kind == OTHER and not self.all_actions and stack and stack[-1].action is not None:
            return  # ignored, inside a region whose own stop sees any exception that leaves it
        error = _exception()  # set while an exception leaves the action (Lightning's `finally`)
        if error is not None and isinstance(error, _NOT_ERRORS):
            error = None
        if error is None and kind == OTHER and not self.all_actions:
            return
        try:
            self._stop(kind, action_name, error)
        except Exception as exc:
            _failed(exc)

    def summary(self) -> str:
        """perfsdk's summary of the run's regions and the advisor's findings, with a title
        (the stage, its wall time, the optimizer steps, the batches and validation runs
        recorded); "" with ``report=False``, on a rank other than 0, while perfsdk is disabled
        and after a run that raised. Lightning calls it when the run ends; later calls return
        the same text."""
        if self._report.recording:
            try:
                trainer = self._trainer()
                out = io.StringIO()
                stage = str(getattr(self._stage, "value", self._stage) or "fit")  # a TrainerFn
                steps = trainer.global_step if trainer is not None and stage == "fit" else None
                self._report.finish(functools.partial(report_title, stage, steps), out=out)
                self._summary = out.getvalue().strip("\n")
            except Exception as exc:
                _failed(exc)
        return self._summary

    def teardown(self, stage: str | None) -> None:
        try:
            self._end_run()
        except Exception as exc:
            _failed(exc)
        super().teardown(stage)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to tell
            self.teardown(stage=self._stage)

    # -- the regions -----------------------------------------------------------------------
    def _learn(self, action: str) -> int:
        kind = action_kind(action)
        if len(self._kinds) < _KNOWN_ACTIONS:
            self._kinds[action] = kind
        return kind

    def _trainer(self) -> pl.Trainer | None:
        """The Trainer running this profiler (Lightning hands the profiler its module before
        ``setup``), or None."""
        module = getattr(self, "_lightning_module", None)
        if module is None:
            return None
        try:
            trainer = module.trainer
        except Exception:  # not attached, or already collected
            return None
        return trainer if isinstance(trainer, pl.Trainer) else None

    def _start(self, kind: int, action: str) -> None:
        stack = self._stack
        if kind == STEP:
            index = self._batch_index()
            step = STEPS.step(self._samples(index))
            if step.region is not None:
                step.region.set_attribute("perfsdk.batch", index)
            stack.append(_Entry(STEP, action, step=step))
        elif kind in (FORWARD, BACKWARD):
            top = stack[-1] if stack else None
            if top is not None and top.kind == OPTIMIZER and top.action is None:
                stack.pop().close(None)  # the closure runs again (LBFGS)
            name = "forward" if kind == FORWARD else "backward"
            stack.append(_Entry(kind, action, self._blocks[name]))
        elif kind == DATA:
            stack.append(_Entry(DATA, action, self._blocks["data_wait"]))
        elif kind == CLOSURE:
            stack.append(_Entry(CLOSURE, action))  # a marker: its optimizer opens at backward's end
        elif kind == OPTIMIZER:
            stack.append(_Entry(OPTIMIZER, action, self._blocks["optimizer"]))
        elif kind == EPOCH:
            trainer = self._trainer()
            epoch = trainer.current_epoch if trainer is not None else self._epochs
            self._epochs += 1
            self._batches = 0
            self._batching_read = False
            stack.append(_Entry(EPOCH, action, self._blocks["epoch"],
                                attributes={"perfsdk.epoch": epoch}))
        elif kind == VALIDATION_START:
            self._close_kind(VALIDATION, None)  # one left open by a run that raised
            trainer = self._trainer()
            if trainer is not None:
                sanity, epoch = trainer.sanity_checking, trainer.current_epoch
            else:
                sanity = self._stage == "fit" and not any(e.kind == EPOCH for e in stack)
                epoch = max(self._epochs - 1, 0)
            name = "sanity_check" if sanity else "validation"
            stack.append(_Entry(VALIDATION, None, self._blocks[name],
                                attributes={"perfsdk.epoch": epoch}))
        elif kind == OTHER:
            block = self._others.get(action)
            if block is None:
                block = timed_region(action, category="lightning", memory=self.memory)
                if len(self._others) < _KNOWN_ACTIONS:
                    self._others[action] = block
            stack.append(_Entry(OTHER, action, block))

    def _stop(self, kind: int, action: str, error: BaseException | None) -> None:
        stack = self._stack
        if kind == VALIDATION_END:
            self._close_kind(VALIDATION, error)
        else:
            target = next((i for i in range(len(stack) - 1, -1, -1)
                           if stack[i].action == action), None)
            if target is not None:
                while len(stack) > target:  # what it holds first, then itself
                    stack.pop().close(error)
                if kind == BACKWARD and error is None and stack and stack[-1].kind == CLOSURE:
                    stack.append(_Entry(OPTIMIZER, None, self._blocks["optimizer"]))
            elif error is not None:  # an action of no region of ours raised: the regions that
                while stack and stack[-1].action is None:  # end without an action end with it
                    stack.pop().close(error)
        if error is not None and not stack and self._running:
            self._end_run()  # the run failed: no report, `perfsdk run`'s patches come back

    def _close_kind(self, kind: int, error: BaseException | None) -> None:
        """Close the innermost open region of ``kind`` and what it holds."""
        stack = self._stack
        target = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].kind == kind), None)
        if target is not None:
            while len(stack) > target:
                stack.pop().close(error)

    def _end_run(self) -> None:
        """Close every region still open, stop the report (unless :meth:`summary` took it) and
        let go of FRAMEWORK_STEPS; idempotent."""
        stack = self._stack
        while stack:
            stack.pop().close(None)
        self._running = False
        self._report.stop()
        FRAMEWORK_STEPS.end(self)

    # -- the step's attributes ---------------------------------------------------------------
    def _batch_index(self) -> int:
        """The batch's index in its epoch: the Trainer's (right after a restart too), else
        counted here."""
        index = self._batches
        self._batches += 1
        trainer = self._trainer()
        if trainer is not None:
            try:
                return int(trainer.fit_loop.epoch_loop.batch_idx)
            except Exception:  # another loop than fit's
                pass
        return index

    def _samples(self, index: int) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        if not self._batching_read:
            self._batching_read = True
            self._batching = self._read_batching()
        if self._batching is None:
            return None
        size, total = self._batching
        if total is None:
            return size
        left = total - index * size
        return left if 0 < left < size else size

    def _read_batching(self) -> tuple[int, int | None] | None:
        """The training DataLoader's batch size and, when its last batch may be short, the
        samples in an epoch (its sampler's length); None when there is no such DataLoader."""
        trainer = self._trainer()
        loader = trainer.train_dataloader if trainer is not None else None
        if not isinstance(loader, DataLoader) or not isinstance(loader.batch_size, int):
            return None
        if loader.drop_last:
            return loader.batch_size, None
        try:
            total = len(loader.sampler)  # type: ignore[arg-type]
        except TypeError:  # an IterableDataset: as many as it yields
            total = None
        return loader.batch_size, total
