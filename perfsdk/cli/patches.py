"""What ``perfsdk run`` patches into an unmodified training script, and takes out again.

While :class:`RunPatches` is installed:

- every ``DataLoader`` batch starts a ``step`` region (samples = the batch's first dimension),
  and the wait for it is a ``data_wait`` region inside it,
- ``Tensor.backward()`` runs inside a ``backward`` region,
- every optimizer's ``step()`` runs inside an ``optimizer`` region,
- the outermost module call (the model, not its layers) runs inside a ``<Class>.forward``
  region (these three are :class:`perfsdk.phase` blocks: inside a step each rides on the
  step's region, at a fraction of a ``timed_region``'s cost), and a
  ``DistributedDataParallel`` model seen there gets :func:`perfsdk.distributed.instrument_ddp`
  once (its gradient all-reduces become regions),
- step :data:`FLOPS_STEP` (after warm-up) runs its forward and backward calls inside
  :class:`perfsdk.flops.ModelFlops` (torch's ``FlopCounterMode``, which observes without
  changing results): that step gets ``perfsdk.flops``, and every later step the same FLOPs per
  sample (its batch size times the counted step's FLOPs over its batch size), so its
  ``perfsdk.flops_per_s`` and ``perfsdk.mfu``. The counted step itself has no rate: the counter
  slows it down.

While a framework integration's callback draws the steps (Lightning's, the Hugging Face
Trainer's: :data:`perfsdk.instrumentor.FRAMEWORK_STEPS`), the batches start no step and
``backward()`` and ``step()`` run unrecorded: the callback's own regions time the steps and their
phases, each once. The ``data_wait`` and module regions stay.

The first three are wrapt wrappers on the classes (``FunctionWrapper``), restored by
:meth:`RunPatches.remove`. The module call is patched with a plain Python function instead:
``torch.compile`` inlines a Python function through ``Module.__call__`` and steps over it
(:func:`torch.compiler.is_compiling`), while a C-level wrapt wrapper there would break the graph
at every layer of a compiled model.

Example:
    >>> import torch
    >>> from perfsdk.testing import capture
    >>> model = torch.nn.Linear(4, 2)
    >>> with capture() as cap, RunPatches():
    ...     model(torch.ones(1, 4)).sum().backward()
    >>> sorted(r.name for r in cap.regions)
    ['Linear.forward', 'backward']
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
import wrapt
from torch import nn
from torch.utils._pytree import tree_leaves

from perfsdk.auto.dataloader import DataWaitIterator
from perfsdk.auto.steps import STEPS
from perfsdk.context import current_span
from perfsdk.distributed import instrument_ddp
from perfsdk.errors import warn_once
from perfsdk.flops import ModelFlops
from perfsdk.instrumentor import FRAMEWORK_STEPS
from perfsdk.phases import open_here, phase
from perfsdk.region import Region

__all__ = ["FLOPS_STEP", "RunPatches"]

FLOPS_STEP = 2
"""The step whose forward and backward ``perfsdk run`` counts the FLOPs of (0-based: after the
first steps' warm-up, compilation included)."""

_in_forward: contextvars.ContextVar[bool] = contextvars.ContextVar("perfsdk_run_forward",
                                                                  default=False)
_lock = threading.Lock()
# Phases of the step (perfsdk.phase): each records its span riding on the step's region, at
# a fraction of a timed_region's cost; outside a step each is a region of its own.
_BACKWARD = phase("backward", category="compute")
_OPTIMIZER = phase("optimizer", category="update")
_FORWARD: dict[str, phase] = {}
_DDP = torch.nn.parallel.DistributedDataParallel
_seen_ddp: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _StepFlops:
    """The FLOPs of step :data:`FLOPS_STEP`, counted while it runs, then given to later steps."""

    def __init__(self) -> None:
        self.counting: Any = None  # the Step being counted
        self.counted: ModelFlops | None = None
        self.per_step: float | None = None
        self.per_sample: float | None = None

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def wanted(self) -> ModelFlops | None:
        """The counter for this forward or backward call, when it belongs to the counted step
        (steps drawn by the patches, not by the script or a framework)."""
        if self.per_step is not None or STEPS.explicit or FRAMEWORK_STEPS.active:
            return None
        step = STEPS.current
        if step is None or step.index != FLOPS_STEP:
            return None
        if self.counting is not step:
            self.counting, self.counted = step, ModelFlops()
        return self.counted

    def finish(self) -> None:
        """Before the open step ends: the counted step gets its FLOPs; a later one the FLOPs of
        its samples."""
        step = STEPS.current
        if step is None:
            return
        if step is self.counting and self.counted is not None:
            total = self.counted.total
            self.counting = self.counted = None
            if total > 0:
                self.per_step = float(total)
                self.per_sample = total / step.samples if step.samples else None
                if step.region is not None:
                    step.region.set_attribute("perfsdk.flops", total)

    def give(self, step: Any) -> None:
        """A new step's FLOPs, once a step was counted (set before it ends, with its samples)."""
        if self.per_step is None:
            return
        if self.per_sample is not None and step.samples:
            step.flops = self.per_sample * step.samples
        else:
            step.flops = self.per_step


_FLOPS = _StepFlops()


def _counted(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, its FLOPs counted when it belongs to the counted step."""
    counter = _FLOPS.wanted()
    if counter is None:
        return call(*args, **kwargs)
    with counter:
        return call(*args, **kwargs)


class _Batches:
    """A DataLoader iterator for ``perfsdk run``: each batch starts a step (``perfsdk.auto``'s
    steps, ended by the next batch or by :meth:`RunPatches.remove`), and the wait for it is a
    ``data_wait`` region inside that step (``perfsdk.auto.instrument_dataloader``'s)."""

    __slots__ = ("_inner", "_length", "_seen")
    _perfsdk_data_wait = True  # instrument_dataloader(loader) over it adds no second wait

    def __init__(self, inner: Iterator[Any], length: int | None) -> None:
        self._inner = DataWaitIterator(inner, length)
        self._length = length
        self._seen = 0

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        if STEPS.explicit or FRAMEWORK_STEPS.active:  # the script or a framework draws the
            return next(self._inner)                   # steps: leave them to it
        _FLOPS.finish()
        if self._length is not None and self._seen >= self._length:
            STEPS.end()  # the end of the epoch: no step of its own
            return next(self._inner)
        step = STEPS.step(implicit=True)
        try:
            item = next(self._inner)
        except StopIteration:
            step.end()
            raise
        self._seen += 1
        samples = _batch_size(item)
        if samples is not None:
            step.samples = samples
            if step.region is not None:
                step.region.set_attribute("perfsdk.samples", samples)
        _FLOPS.give(step)
        return item

    def __getattr__(self, name: str) -> Any:  # _MultiProcessingDataLoaderIter's own API
        return getattr(self._inner, name)


def _batch_size(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (through tuples, lists and dicts)."""
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim():  # the common batches, without pytree
        return int(first.shape[0]) or None
    leaves = tree_leaves(batch)
    first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim()), None)
    return None if first is None else int(first.shape[0]) or None


def _forward_region(module: nn.Module) -> phase:
    inner = getattr(module, "_orig_mod", module)  # torch.compile(model): name the model
    name = f"{type(inner).__name__}.forward"
    region = _FORWARD.get(name)
    if region is None:
        region = _FORWARD.setdefault(name, phase(name, category="forward"))
    return region


class RunPatches:
    """Install the patches (``install()`` or ``with``); ``remove()`` restores every class.

    Installing twice, or while another :class:`RunPatches` is installed, raises RuntimeError:
    the patches are process-wide.
    """

    _installed: RunPatches | None = None

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self._wrapped_steps: set[type] = set()

    def install(self) -> RunPatches:
        with _lock:
            if RunPatches._installed is not None:
                raise RuntimeError("perfsdk: run patches are already installed in this process")
            RunPatches._installed = self
        STEPS.set_schedule(STEPS.schedule)  # the run's steps count from 0
        _FLOPS.reset()
        loader = torch.utils.data.DataLoader
        self._patch(loader, "__iter__", wrapt.FunctionWrapper(loader.__iter__, _iter_wrapper))
        self._patch(torch.Tensor, "backward",
                    wrapt.FunctionWrapper(torch.Tensor.backward,
                                          _region_wrapper(_BACKWARD, "backward", count=True)))
        self._patch(torch.optim.Optimizer, "__init__",
                    wrapt.FunctionWrapper(torch.optim.Optimizer.__init__, self._init_wrapper))
        original_call = nn.Module.__call__
        self._patch(nn.Module, "__call__", _module_call(original_call))
        return self

    def remove(self) -> None:
        """End the open step and restore every patched class attribute (in reverse order);
        idempotent."""
        if RunPatches._installed is self:
            _FLOPS.finish()
            STEPS.end()
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)
        self._wrapped_steps.clear()
        with _lock:
            if RunPatches._installed is self:
                RunPatches._installed = None

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    def _init_wrapper(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """Optimizer construction: wrap its class's ``step`` once (user classes included)."""
        result = wrapped(*args, **kwargs)
        cls = type(instance)
        with _lock:
            if cls not in self._wrapped_steps and "step" in cls.__dict__:
                self._wrapped_steps.add(cls)
                step = wrapt.FunctionWrapper(cls.__dict__["step"],
                                             _region_wrapper(_OPTIMIZER, "optimizer"))
                self._patch(cls, "step", step)
        return result

    def __enter__(self) -> RunPatches:
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


def _iter_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    try:
        length: int | None = len(instance)
    except TypeError:  # an IterableDataset without __len__
        length = None
    return _Batches(iter(wrapped(*args, **kwargs)), length)


def _region_wrapper(region: phase, name: str, count: bool = False) -> Callable[..., Any]:
    """A wrapt wrapper running the call in ``region`` (named ``name``), once: a call inside the
    same wrapper (``Tensor.backward`` calls itself again through ``__torch_function__`` while a
    torch function mode is on, e.g. a ``no_sync_guard``), inside a region or a ``perfsdk.phase``
    of the same name that the script or an integration opened around it, or while a framework's
    callback draws the steps, runs as it is. With ``count``, the FLOPs of the counted step's
    call are counted."""
    inside: contextvars.ContextVar[bool] = contextvars.ContextVar(f"perfsdk_run_{region!r}",
                                                                  default=False)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if FRAMEWORK_STEPS.active or inside.get():
            return wrapped(*args, **kwargs)
        current = current_span()
        if (isinstance(current, Region) and current.name == name) or open_here(name):
            return wrapped(*args, **kwargs)
        token = inside.set(True)
        try:
            with region:
                return _counted(wrapped, *args, **kwargs) if count else wrapped(*args, **kwargs)
        finally:
            inside.reset(token)
    return wrapper


def _module_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _in_forward.get():
            return original(self, *args, **kwargs)
        if isinstance(self, _DDP) and self not in _seen_ddp:
            _instrument_ddp(self)
        token = _in_forward.set(True)
        try:
            with _forward_region(self):
                return _counted(original, self, *args, **kwargs)
        finally:
            _in_forward.reset(token)
    return __call__


def _instrument_ddp(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Record a DDP model's gradient all-reduces (once per model); a model whose own hook
    perfsdk cannot wrap runs as it is, with one warning."""
    with _lock:
        if model in _seen_ddp:
            return
        _seen_ddp.add(model)
    try:
        instrument_ddp(model)
    except Exception as exc:
        warn_once("run-ddp", f"perfsdk run: the DDP model's gradient all-reduces are not "
                  f"recorded: {exc}")
