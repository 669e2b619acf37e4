"""``timed_region``: a ``with`` / ``async with`` block or decorator over one Region."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import torch
from typing_extensions import ParamSpec

from perfsdk import region as _region
from perfsdk.config import state as _state
from perfsdk.context import CURRENT as _CURRENT
from perfsdk.context import SPAN_KEY as _SPAN_KEY
from perfsdk.context import current_span as _current_span
from perfsdk.decorator import Profiler
from perfsdk.region import Region, RegionSpec, validate_attributes, validate_options

__all__ = ["timed_region"]

P = ParamSpec("P")
R = TypeVar("R")

_is_compiling = torch.compiler.is_dynamo_compiling  # 18 ns; dynamo folds it to True


@functools.lru_cache(maxsize=4096, typed=True)  # memory=1 is not memory=True (nor sync=1)
def _spec(name: str, domain: str, color: str | int | None, category: str | None,
          payload: int | None, sync: bool, memory: bool | None, function: str, filepath: str,
          lineno: int, asynchronous: bool = False) -> RegionSpec:
    return RegionSpec.create(
        name, domain=domain, color=color, category=category, payload=payload, sync=sync,
        code={"code.function": function, "code.filepath": filepath, "code.lineno": lineno},
        asynchronous=asynchronous, memory=memory, where="timed_region",
    )


class timed_region:
    """Time a block: ``with timed_region("load", batch=3) as r: ...``.

    The handle it yields is the :class:`~perfsdk.region.Region`: after the block, ``r.host_ms``
    is set, ``r.device_ms`` once the GPU has finished (None without a GPU), ``r.attributes``
    holds the attributes and ``r.result()`` waits for this one region only. Also works as
    ``async with`` and as a decorator (``@timed_region("load")``).

    Keyword arguments other than ``domain``, ``color``, ``category``, ``payload``, ``sync`` and
    ``memory`` become span attributes; pass ``attributes={...}`` for attributes with those names.

    Inside ``torch.compile``d code the block runs uninstrumented, so it causes no graph break,
    and ``as`` gives None there.

    Example:
        >>> import perfsdk
        >>> with perfsdk.timed_region("load", batch=3) as r:
        ...     total = sum(range(1000))
        >>> r.host_ms >= 0 and r.attributes["batch"]
        3
    """

    __slots__ = ("_active", "_args", "_attributes", "_key", "_spec")

    def __init__(
        self,
        name: str,
        /,
        *,
        domain: str = "perfsdk",
        color: str | int | None = None,
        category: str | None = None,
        payload: int | None = None,
        sync: bool = False,
        memory: bool | None = None,
        attributes: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        self._args = (name, domain, color, category, payload, sync, memory)
        self._active: list[Region] = []
        if _is_compiling():  # inside torch.compile'd code: step aside (no graph break)
            self._attributes = None
            return
        attrs = dict(attributes or {})
        attrs.update(extra)
        self._attributes = validate_attributes(attrs, "timed_region") if attrs else None
        frame = sys._getframe(1)
        code = frame.f_code
        function = getattr(code, "co_qualname", code.co_name)
        self._key = (name, domain, color, category, payload, sync, memory, function,
                     code.co_filename, frame.f_lineno)
        try:
            self._spec = _spec(*self._key)
        except TypeError:  # an unhashable argument: let the validation name it
            validate_options(name, domain=domain, color=color, category=category,
                             payload=payload, sync=sync, memory=memory, where="timed_region")
            raise

    def __enter__(self) -> Region:
        if _is_compiling():
            return None  # type: ignore[return-value]  # no handle inside compiled code
        # _enter(self._spec), written out (a loop runs this for every phase of every step):
        # the gate of RegionSpec.open_handle, then the entry.
        spec = self._spec
        attributes = self._attributes
        if _state.enabled:
            n = spec.every or _state.sample_every
            if n == 1 or not next(spec.calls) % n:  # the entry: compiled where built
                region = (spec.starter or _region.spec_starter(spec))(
                    dict(attributes) if attributes else None)
                self._active.append(region)
                return region
        region = Region(spec, dict(attributes) if attributes else None)  # a skipped handle
        self._active.append(region)
        return region

    def _enter(self, spec: RegionSpec) -> Region:
        # The gate, in its handle form: a skipped block's handle is a Region of its own (never
        # the shared null region), so it still has its name, attributes and result().
        region = spec.open_handle(dict(self._attributes) if self._attributes else None)
        self._active.append(region)
        return region

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if _is_compiling():
            return
        # One object may be active in several tasks or threads at once (a module-level
        # ``LOAD = timed_region("load")`` used in concurrent tasks): exit the region that is
        # current here, not the one entered last anywhere.
        active = self._active
        if len(active) == 1:  # the usual case: entered once, so that entry is this one
            region = active.pop()
        else:
            # What get_current_span() reads, without its frames (as a region's enter reads it).
            region = (_CURRENT.get().get(_SPAN_KEY)  # type: ignore[union-attr]
                      if _SPAN_KEY is not None else _current_span())
            try:
                active.remove(region)
            except ValueError:  # not current: an entry that never was (disabled at entry, or
                # NVTX-only mode), and any such one will do; never another thread's live one
                region = active.pop(_last_unrecorded(active))
        if region.entered:
            _region.exit_region(region, exc, 0)  # region.exit(exc), compiled where built

    async def __aenter__(self) -> Region:
        if _is_compiling():
            return None  # type: ignore[return-value]
        # NVTX start/end ranges: push/pop would interleave with other tasks across awaits.
        return self._enter(_spec(*self._key, asynchronous=True))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        name, domain, color, category, payload, sync, memory = self._args
        return Profiler(name, domain=domain, color=color, category=category, payload=payload,
                        attributes=self._attributes, sync=sync, memory=memory)(fn)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (*self._args, self._attributes))

    def __repr__(self) -> str:
        return f"timed_region({self._args[0]!r})"


def _last_unrecorded(active: list[Region]) -> int:
    """The index of the last entry that was never made current (else the last one)."""
    for i in range(len(active) - 1, -1, -1):
        if not active[i].recorded:
            return i
    return -1


def _rebuild(name: str, domain: str, color: Any, category: Any, payload: Any, sync: bool,
             memory: bool | None, attributes: Mapping[str, Any] | None) -> timed_region:
    return timed_region(name, domain=domain, color=color, category=category, payload=payload,
                        sync=sync, memory=memory, attributes=attributes)
