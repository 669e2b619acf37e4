"""``instrument_dataloader``: the loop's wait for each batch as a ``data_wait`` region.

:class:`InstrumentedLoader` is a transparent proxy for the loader; its iterators are
:class:`DataWaitIterator`, which ``perfsdk run``'s DataLoader patch uses as well.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import wrapt

from perfsdk.config import state as _state
from perfsdk.context import current_span
from perfsdk.region import Region, RegionSpec

__all__ = ["DataWaitIterator", "InstrumentedLoader", "instrument_dataloader"]

T = TypeVar("T")


@functools.cache
def _data_spec() -> RegionSpec:
    return RegionSpec.create("data_wait", category="data", where="instrument_dataloader")


def _in_data_wait() -> bool:
    current = current_span()
    return isinstance(current, Region) and current.name == "data_wait"


class DataWaitIterator(Generic[T]):
    """Each ``next()`` inside a ``data_wait`` region with ``perfsdk.batch``; a ``next()`` made
    inside a ``data_wait`` region already open (a framework's integration, e.g. the Lightning
    profiler, times the same wait) is passed through, so the wait is counted once."""

    __slots__ = ("_batch", "_inner", "_length")

    def __init__(self, inner: Iterator[T], length: int | None) -> None:
        self._inner = inner
        self._batch = 0
        self._length = length

    def __iter__(self) -> DataWaitIterator[T]:
        return self

    def __next__(self) -> T:
        batch = self._batch
        if (not _state.enabled or (self._length is not None and batch >= self._length)
                or _in_data_wait()):
            item = next(self._inner)  # the wait for the end is not a batch's
            self._batch = batch + 1
            return item
        region = _data_spec().open({"perfsdk.batch": batch})  # unused by the null region
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
        return DataWaitIterator(inner, length)

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
