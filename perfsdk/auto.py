"""Auto-instrumentation of a training loop: per-module regions, data wait, steps, capture ranges.

- :func:`instrument_module`: a region per submodule, forward and backward, named by its path
  (``SimpleNet.conv1``, ``SimpleNet.conv1.backward``); Transformer encoders keep their fast path.
- :func:`instrument_dataloader`: a ``data_wait`` region around each batch the loop waits for.
- :func:`step` and :func:`schedule`: step regions (samples/s) parenting everything inside them;
  steps outside the schedule's active phase record nothing.
- :func:`capture` and :func:`torch_profile`: an Nsight Systems capture range and a
  ``torch.profiler`` trace over chosen steps.

Example:
    >>> import torch
    >>> import perfsdk.auto as auto
    >>> from perfsdk.testing import capture
    >>> model = torch.nn.Linear(4, 2)
    >>> loader = auto.instrument_dataloader([torch.ones(8, 4)] * 3)
    >>> with capture() as cap, auto.instrument_module(model, backward=False):
    ...     for batch in loader:
    ...         with auto.step(samples=8):
    ...             _ = model(batch)
    >>> sorted({r.name for r in cap.regions})
    ['Linear', 'data_wait', 'step']
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import wrapt

from perfsdk._auto_capture import CaptureRange, TorchProfileRange, nsys_command
from perfsdk._auto_module import FAST_PATH_TYPES, ModuleInstrumentation, instrument_module
from perfsdk._auto_steps import PHASES, Schedule, Step, Steps, schedule
from perfsdk.config import state as _state
from perfsdk.region import RegionSpec

__all__ = [
    "FAST_PATH_TYPES",
    "PHASES",
    "STEPS",
    "CaptureRange",
    "InstrumentedLoader",
    "ModuleInstrumentation",
    "Schedule",
    "Step",
    "Steps",
    "TorchProfileRange",
    "capture",
    "end_step",
    "instrument_dataloader",
    "instrument_module",
    "nsys_command",
    "schedule",
    "set_schedule",
    "step",
    "torch_profile",
]

T = TypeVar("T")

STEPS = Steps()
"""The process-wide step boundaries behind :func:`step`, :func:`capture` and
:func:`torch_profile`."""


def step(samples: int | None = None) -> Step:
    """Start the next step (ending the open one): ``with auto.step(samples=64): ...``, or call
    ``auto.step(samples=64)`` at the top of every iteration and :func:`end_step` after the loop.

    The step region is named ``step`` (category ``step``) with ``perfsdk.step`` (0-based index),
    ``perfsdk.samples`` and, at its end, ``perfsdk.samples_per_s``. Regions inside the step nest
    under it. With a schedule (:func:`set_schedule`), a step outside its active phase records
    nothing, neither itself nor any region inside it.

    Raises:
        ValueError: ``samples`` is not None or an integer >= 1.
    """
    return STEPS.step(samples)


def end_step() -> None:
    """End the open step (after a loop that calls :func:`step` plainly); idempotent."""
    STEPS.end()


def set_schedule(schedule: Schedule | None) -> None:
    """Record only the steps ``schedule`` makes active (None: every step); counts from step 0.

    Example:
        >>> import perfsdk.auto as auto
        >>> auto.set_schedule(auto.schedule(wait=2, warmup=1, active=3, repeat=1))
        >>> auto.set_schedule(None)
    """
    STEPS.set_schedule(schedule)


def capture(steps: range | int, *, tracker: Steps | None = None) -> CaptureRange:
    """Call ``cudaProfilerStart`` before the chosen steps and ``cudaProfilerStop`` after them.

    Logs (at INFO, logger ``perfsdk.auto``) and returns in ``.command`` the matching
    ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx ...``
    command. Without an initialized CUDA device nothing is called (one NoEffectWarning).

    Args:
        steps: The step indices to capture, e.g. ``range(10, 20)`` (or one index).
        tracker: The :class:`Steps` to follow; default the process-wide :data:`STEPS`.

    Raises:
        ValueError: ``steps`` is not an index or a non-empty range with step 1.
    """
    return CaptureRange(steps, tracker=tracker)


def torch_profile(steps: range | int, *, output_dir: str | os.PathLike[str] | None = None,
                  record_shapes: bool = False, with_stack: bool = False,
                  tracker: Steps | None = None) -> TorchProfileRange:
    """Run ``torch.profiler.profile`` over the chosen steps and save its Chrome trace.

    The trace goes to ``<output_dir>/torch-trace-<pid>-steps-<first>-<last>.json`` (default:
    the configured output directory, next to perfsdk's own files). perfsdk's regions inside
    those steps appear in it as ``record_function`` annotations.

    Raises:
        ValueError: An argument has a value outside those accepted.
    """
    return TorchProfileRange(steps, output_dir=output_dir, record_shapes=record_shapes,
                             with_stack=with_stack, tracker=tracker)


@functools.cache
def _data_spec() -> RegionSpec:
    return RegionSpec.create("data_wait", category="data", where="instrument_dataloader")


class _DataWaitIterator(Generic[T]):
    """Each ``next()`` inside a ``data_wait`` region with ``perfsdk.batch``."""

    __slots__ = ("_batch", "_inner", "_length")

    def __init__(self, inner: Iterator[T], length: int | None) -> None:
        self._inner = inner
        self._batch = 0
        self._length = length

    def __iter__(self) -> _DataWaitIterator[T]:
        return self

    def __next__(self) -> T:
        batch = self._batch
        if not _state.enabled or (self._length is not None and batch >= self._length):
            item = next(self._inner)  # the wait for the end is not a batch's
            self._batch = batch + 1
            return item
        region = _data_spec().open()
        region.set_attribute("perfsdk.batch", batch)  # ignored by the null region
        try:
            item = next(self._inner)
        except StopIteration:
            region.exit(None)  # an iterable without len(): the last wait is recorded too
            raise
        except BaseException as exc:
            region.exit(exc)
            raise
        region.exit(None)
        self._batch = batch + 1
        return item

    def __getattr__(self, name: str) -> Any:  # the DataLoader iterator's own API
        return getattr(self._inner, name)


class InstrumentedLoader(wrapt.ObjectProxy, Generic[T]):  # type: ignore[type-arg]
    """A transparent proxy for the loader whose iterators wait for each batch inside a
    ``data_wait`` region.

    It passes ``isinstance(x, DataLoader)`` (a wrapt ``ObjectProxy``: ``__class__`` is the
    loader's), so code that checks the type (Lightning, Hugging Face, the user's own) takes it
    for the loader. ``len()``, every attribute (``dataset``, ``batch_size``, ``sampler`` ...),
    reads and writes alike, are the loader's own; ``.loader`` is the loader itself, never
    changed. It pickles and copies as a new proxy for a pickled or copied loader.
    """

    def __init__(self, loader: Iterable[T]) -> None:
        super().__init__(loader)

    @property
    def loader(self) -> Iterable[T]:
        """The wrapped loader."""
        return self.__wrapped__  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[T]:
        loader = self.__wrapped__
        try:
            length: int | None = len(loader)
        except TypeError:
            length = None
        inner = iter(loader)
        if getattr(inner, "_perfsdk_data_wait", False):  # already one (under `perfsdk run`)
            return inner  # type: ignore[no-any-return]
        return _DataWaitIterator(inner, length)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return InstrumentedLoader, (self.__wrapped__,)

    def __reduce__(self) -> tuple[Any, ...]:
        return InstrumentedLoader, (self.__wrapped__,)

    def __copy__(self) -> InstrumentedLoader[T]:
        return InstrumentedLoader(copy.copy(self.__wrapped__))

    def __deepcopy__(self, memo: dict[int, Any]) -> InstrumentedLoader[T]:
        return InstrumentedLoader(copy.deepcopy(self.__wrapped__, memo))

    def __repr__(self) -> str:
        return f"InstrumentedLoader({self.__wrapped__!r})"


def instrument_dataloader(loader: Iterable[T]) -> InstrumentedLoader[T]:
    """Wrap a DataLoader (or any iterable) so the loop's wait for each batch is a region.

    Each ``next()`` runs inside a region named ``data_wait`` (category ``data``) with the
    attribute ``perfsdk.batch``, the batch's 0-based index in the epoch: its host time is how
    long the loop waited for that batch (with ``num_workers > 0``, only the part the workers
    had not prepared in advance). When the loader has a ``len()``, the final ``next()`` that
    ends the epoch is not recorded, so there is one ``data_wait`` per batch. The result is an
    ``isinstance`` of the loader's class (``torch.utils.data.DataLoader``); the loader itself
    is not changed.

    Raises:
        ValueError: ``loader`` is not iterable.

    Example:
        >>> from perfsdk.auto import instrument_dataloader
        >>> loader = instrument_dataloader([[1, 2], [3, 4]])
        >>> len(loader), [sum(b) for b in loader]
        (2, [3, 7])
    """
    if isinstance(loader, InstrumentedLoader):
        return loader
    if not hasattr(loader, "__iter__"):
        raise ValueError(f"instrument_dataloader: loader={loader!r}; accepted values are a "
                         "DataLoader or any iterable")
    return InstrumentedLoader(loader)
