"""``PerfsdkCallback``: the Hugging Face Trainer's callback events mapped onto perfsdk regions.

What each region times, in terms of ``transformers.Trainer``'s events (transformers >= 4.44):

- ``epoch`` (category ``epoch``, attribute ``perfsdk.epoch``): ``on_epoch_begin`` to
  ``on_epoch_end``.
- ``step`` (category ``step``, through ``perfsdk.auto.STEPS``): one per optimizer step, from
  ``on_step_begin`` to ``on_step_end``; ``perfsdk.samples`` is
  ``per_device_train_batch_size * gradient_accumulation_steps`` and ``perfsdk.samples_per_s``
  follows from it. The Trainer fetches a step's batches *before* ``on_step_begin``, so data
  loading falls between steps, not inside them.
- ``microbatch`` (category ``compute``, attribute ``perfsdk.microbatch``): forward and backward of
  one gradient-accumulation micro-batch, from ``on_step_begin`` or the previous
  ``on_substep_end`` to the next ``on_substep_end`` or ``on_pre_optimizer_step``; the last one of a
  step also holds gradient clipping. The Trainer has no event between forward and backward, so
  they are not separate regions.
- ``optimizer`` (category ``update``): ``on_pre_optimizer_step`` to ``on_optimizer_step``, i.e.
  ``optimizer.step()`` alone (not the LR scheduler or ``zero_grad``); one per optimizer update,
  not per micro-batch. Where the installed transformers' ``TrainerCallback`` lacks those two
  events (:func:`has_optimizer_events`; they came in transformers 4.45), the callback bounds the
  same call with torch's optimizer step hooks instead (``register_step_pre_hook`` /
  ``register_step_post_hook`` on the optimizer the Trainer hands its callbacks, from
  ``on_train_begin`` to ``on_train_end``); without an optimizer there, the step's last
  ``microbatch`` holds its optimizer update and ends at ``on_step_end``.
- ``validation`` (category ``eval``, attribute ``perfsdk.batches`` at its end): an evaluation the
  Trainer runs during ``train()``. It opens at ``on_step_end`` / ``on_epoch_end`` when the
  Trainer's flow has set ``control.should_evaluate`` (or at ``on_train_begin`` with
  ``eval_on_start``) and closes at ``on_evaluate``, so it also holds the Trainer's logging of
  that same step, if any. A standalone ``trainer.evaluate()`` has no event before its first
  batch and gets no region.

Regions stay balanced: each event first closes whatever a previous run left open above the
region it opens (a ``train()`` that raised never reaches ``on_train_end``); such regions get
``perfsdk.unfinished=True``. perfsdk's own failures warn once and never stop training.

From ``on_train_begin`` to ``on_train_end`` (or :meth:`PerfsdkCallback.close`) it holds
:data:`perfsdk.instrumentor.FRAMEWORK_STEPS`: the Trainer draws the steps, and ``perfsdk run``'s
own step, backward and optimizer regions step aside.

At ``on_train_end`` it prints perfsdk's summary of the training run's regions and the advisor's
findings (``PerfsdkCallback(report=False)`` turns that off; only the world's process 0 prints,
and nothing is printed while perfsdk is disabled).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import perfsdk
from perfsdk import RegionResult
from perfsdk.auto import STEPS
from perfsdk.errors import warn_once
from perfsdk.instrumentor import FRAMEWORK_STEPS, RunReport

__all__ = ["OPTIMIZER_EVENTS", "PerfsdkCallback", "has_optimizer_events"]

F = TypeVar("F", bound=Callable[..., Any])

_CATEGORIES = {"epoch": "epoch", "microbatch": "compute", "optimizer": "update",
               "validation": "eval"}

OPTIMIZER_EVENTS = ("on_pre_optimizer_step", "on_optimizer_step")
"""The ``TrainerCallback`` events around ``optimizer.step()`` (transformers 4.45 and later)."""


def has_optimizer_events() -> bool:
    """Whether the installed transformers' ``TrainerCallback`` has :data:`OPTIMIZER_EVENTS`:
    then they bound the ``optimizer`` region, else torch's optimizer step hooks do."""
    return all(hasattr(TrainerCallback, name) for name in OPTIMIZER_EVENTS)


def _guarded(fn: F) -> F:
    """Run a callback event; perfsdk's own failure warns once and training goes on."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            warn_once(f"perfsdk-transformers:{type(exc).__name__}",
                      f"perfsdk-transformers: {fn.__name__} failed ({exc!r}); training goes on "
                      "without some regions")

    return wrapper  # type: ignore[return-value]


class _Open:
    """One open region: a ``timed_region`` entered, or a ``perfsdk.auto`` step."""

    __slots__ = ("handle", "name", "region")

    def __init__(self, name: str, handle: Any, region: Any) -> None:
        self.name = name
        self.handle = handle
        self.region = region  # the perfsdk Region, for attributes (None when not recorded)

    def close(self, unfinished: bool) -> None:
        if unfinished and self.region is not None:
            self.region.set_attribute("perfsdk.unfinished", True)
        if self.name == "step":
            self.handle.end()
        else:
            self.handle.__exit__(None, None, None)


class PerfsdkCallback(TrainerCallback):
    """perfsdk regions for ``transformers.Trainer``: epoch, step, microbatch, optimizer and
    validation (see the module docstring for exactly what each one times).

    Args:
        report: Print perfsdk's summary of the training run and the advisor's findings when
            training ends (True, the default), or not (False).

    Raises:
        ValueError: ``report`` is not a bool.

    Example:
        >>> from transformers import Trainer
        >>> from perfsdk_transformers import PerfsdkCallback
        >>> # trainer = Trainer(model=model, args=args, train_dataset=ds,
        >>> #                   callbacks=[PerfsdkCallback()])
    """

    def __init__(self, *, report: bool = True) -> None:
        if not isinstance(report, bool):
            raise ValueError(f"PerfsdkCallback: report={report!r}; accepted values are True "
                             "(print the summary and advice when training ends) or False")
        self.report = report
        self._stack: list[_Open] = []
        self._microbatch = 0
        self._batches = 0
        self._report = RunReport()
        self._optimizer_events = has_optimizer_events()
        self._step_hooks: list[Any] = []  # torch's hook handles, without the events
        self._optimizer_depth = 0  # optimizer.step() calls under way, as the hooks saw them

    # -- the open regions, innermost last --------------------------------------------------
    def _open(self, name: str, **attributes: Any) -> None:
        cm = perfsdk.timed_region(name, category=_CATEGORIES[name], attributes=attributes)
        self._stack.append(_Open(name, cm, cm.__enter__()))

    def _open_step(self, samples: int | None) -> None:
        step = STEPS.step(samples=samples)
        self._stack.append(_Open("step", step, step.region))

    def _close(self, name: str) -> bool:
        """Close ``name`` and whatever is still open inside it; False if it was not open."""
        if not any(entry.name == name for entry in self._stack):
            return False
        while self._stack:
            entry = self._stack.pop()
            entry.close(unfinished=entry.name != name)
            if entry.name == name:
                return True
        return False

    def _unwind(self, keep: tuple[str, ...] = ()) -> None:
        """Close open regions (left by a run that raised) down to the innermost ``keep`` one."""
        while self._stack and self._stack[-1].name not in keep:
            self._stack.pop().close(unfinished=True)

    def close(self) -> None:
        """Close every region still open, e.g. after ``trainer.train()`` raised (no report is
        printed for that run)."""
        FRAMEWORK_STEPS.end(self)
        self._unhook_optimizer()
        self._unwind()
        self._report.stop()

    # -- the optimizer region ----------------------------------------------------------------
    def _optimizer_starts(self) -> None:
        """``optimizer.step()`` is called: the step's last micro-batch ends, its update
        begins (inside a step only). The hooks of a subclass's ``step()`` that calls its
        base's fire again inside it: the outermost call alone is the region."""
        self._optimizer_depth += 1
        if self._optimizer_depth == 1 and any(entry.name == "step" for entry in self._stack):
            self._close("microbatch")
            self._open("optimizer")

    def _optimizer_ends(self) -> None:
        self._optimizer_depth = max(self._optimizer_depth - 1, 0)
        if self._optimizer_depth == 0:
            self._close("optimizer")

    def _hook_optimizer(self, optimizer: Any) -> None:
        """Without the optimizer events: torch's step hooks on the optimizer the Trainer hands
        its callbacks (the innermost one, under accelerate's wrapper) bound the region."""
        self._unhook_optimizer()
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer and the like
        if not isinstance(optimizer, torch.optim.Optimizer):
            return  # none: the last micro-batch holds the update, to on_step_end

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            self._in_hook(self._optimizer_starts)

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            self._in_hook(self._optimizer_ends)

        self._step_hooks = [optimizer.register_step_pre_hook(before),
                            optimizer.register_step_post_hook(after)]

    def _unhook_optimizer(self) -> None:
        self._optimizer_depth = 0
        hooks, self._step_hooks = self._step_hooks, []
        for handle in hooks:
            handle.remove()

    @staticmethod
    def _in_hook(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:
            warn_once(f"perfsdk-transformers:{type(exc).__name__}",
                      f"perfsdk-transformers: an optimizer step hook failed ({exc!r}); "
                      "training goes on without some regions")

    # -- the report at the end of training ---------------------------------------------------
    def _print_report(self, state: TrainerState) -> None:
        def title(regions: Sequence[RegionResult], seconds: float) -> str:
            steps = len([r for r in regions if r.name == "step"])
            runs = len([r for r in regions if r.name == "validation"])
            runs_text = f", {runs} evaluation{'s' * (runs != 1)}" if runs else ""
            return (f"perfsdk: Hugging Face training ended after {seconds:.2f} s: "
                    f"{state.global_step} optimizer steps, {steps} recorded{runs_text}")

        self._report.finish(title)

    # -- Trainer events ----------------------------------------------------------------------
    @_guarded
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        FRAMEWORK_STEPS.begin(self)  # the Trainer draws the steps: `perfsdk run` steps aside
        self._unwind()
        self._report.stop()  # a run that raised never reached on_train_end
        if not self._optimizer_events:
            self._hook_optimizer(kwargs.get("optimizer"))
        if self.report and state.is_world_process_zero and perfsdk.get_config().enabled:
            self._report.start()
        if getattr(args, "eval_on_start", False):
            self._open_validation()

    @_guarded
    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._unwind()
        self._open("epoch", **{"perfsdk.epoch": math.floor((state.epoch or 0.0) + 1e-6)})

    @_guarded
    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._unwind(keep=("epoch",))
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self._open_step(samples if samples >= 1 else None)
        self._microbatch = 0
        self._open("microbatch", **{"perfsdk.microbatch": 0})

    @_guarded
    def on_substep_end(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if self._close("microbatch"):
            self._microbatch += 1
            self._open("microbatch", **{"perfsdk.microbatch": self._microbatch})

    @_guarded
    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        if self._optimizer_events:  # else torch's step hooks bound the region
            self._close("microbatch")
            self._open("optimizer")

    @_guarded
    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                          control: TrainerControl, **kwargs: Any) -> None:
        if self._optimizer_events:
            self._close("optimizer")

    @_guarded
    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if not self._optimizer_events and self._stack and self._stack[-1].name == "microbatch":
            self._close("microbatch")  # no optimizer hooks: it held the update, and ends here
        self._close("step")
        if control.should_evaluate:
            self._open_validation()

    @_guarded
    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._close("epoch")
        if control.should_evaluate:
            self._open_validation()

    @_guarded
    def on_prediction_step(self, args: TrainingArguments, state: TrainerState,
                           control: TrainerControl, **kwargs: Any) -> None:
        self._batches += 1

    @_guarded
    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        top = self._stack[-1] if self._stack else None
        if top is not None and top.name == "validation" and top.region is not None:
            top.region.set_attribute("perfsdk.batches", self._batches)
        self._close("validation")

    @_guarded
    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        FRAMEWORK_STEPS.end(self)
        self._unhook_optimizer()
        self._unwind()
        self._print_report(state)

    def _open_validation(self) -> None:
        self._unwind(keep=("epoch",))
        self._batches = 0
        self._open("validation")
