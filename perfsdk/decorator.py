"""``@profiled``: a thin shell over :class:`~perfsdk.region.Region`.

Names, NVTX attributes and code location are resolved once, at decoration. Each call gets a
fresh Region, so calls nest, recurse and run on many threads. Disabled at decoration time
(``PERFSDK_ENABLED=0``), the function itself is returned; disabled at run time, a call costs one
flag test. Inside ``torch.compile``d code the wrapper steps aside, so it causes no graph break.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from perfsdk.config import state as _state
from perfsdk.region import Region, RegionSpec, validate_attributes, validate_options

__all__ = ["Profiler", "profiled"]

P = ParamSpec("P")
R = TypeVar("R")

_is_compiling = torch.compiler.is_dynamo_compiling  # 18 ns; dynamo folds it to True


@dataclasses.dataclass(frozen=True)
class Profiler:
    """The options of ``@profiled(...)``; calling it with a function decorates that function."""

    name: str | None = None
    domain: str = "perfsdk"
    color: str | int | None = None
    category: str | None = None
    payload: int | None = None
    attributes: Mapping[str, Any] | None = None
    every: int | None = None
    sync: bool = False
    memory: bool | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(
                f"profiled: name={self.name!r}; accepted values are a non-empty string or None "
                "(use the function's __qualname__)"
            )
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(
                f"profiled: every={self.every!r}; accepted values are None or an integer >= 1"
            )
        validate_attributes(self.attributes, "profiled")
        # The rest now, at decoration time, with the rules the spec uses.
        validate_options(self.name or "profiled", domain=self.domain, color=self.color,
                         category=self.category, payload=self.payload, sync=self.sync,
                         memory=self.memory, where="profiled")

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        return cast("Callable[P, R]", _wrap(fn, self))


@overload
def profiled(fn: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def profiled(
    name: str | None = None,
    /,
    *,
    domain: str = "perfsdk",
    color: str | int | None = None,
    category: str | None = None,
    payload: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    every: int | None = None,
    sync: bool = False,
    memory: bool | None = None,
) -> Profiler: ...


def profiled(fn_or_name: Any = None, /, **options: Any) -> Any:
    """Profile every call of a function: NVTX range, host/device time, span, summary row.

    Use it bare (``@profiled``), with options (``@profiled("fwd", color="green", every=10)``), or
    as a function (``profiled(fn)``). Works on functions, methods, classmethods and staticmethods
    (either decorator order), async functions (the region covers the awaited call), generator
    and async-generator functions (one region per resumption) and any callable.

    Args:
        name: the region's name; default ``fn.__qualname__``.
        domain: the NVTX domain (Nsight Systems groups ranges by it).
        color: a color name, ``#RRGGBB`` or ``0xAARRGGBB``; default: a stable color per name.
        category: an NVTX category name, registered in the domain.
        payload: an integer NVTX payload.
        attributes: constant span attributes.
        every: record every N-th call (default ``PERFSDK_SAMPLE_EVERY``, 1).
        sync: wait for the GPU at exit so ``device_ms`` is known at once (adds a sync).
        memory: record memory for this region (None: the configured default, PERFSDK_MEMORY).

    Example:
        >>> import perfsdk
        >>> @perfsdk.profiled
        ... def step(x):
        ...     return x * 2
        >>> step(21)
        42
    """
    if isinstance(fn_or_name, (classmethod, staticmethod)) or (
        callable(fn_or_name) and not isinstance(fn_or_name, str)
    ):
        if options:
            raise TypeError(
                "profiled: options go with a name, as @profiled('name', ...) or "
                "@profiled(color=...) - not together with the function"
            )
        return _wrap(fn_or_name, Profiler())
    if fn_or_name is not None and not isinstance(fn_or_name, str):
        raise ValueError(
            f"profiled: name={fn_or_name!r}; accepted values are a non-empty string, None, or "
            "the function to decorate"
        )
    if fn_or_name is None and "name" in options:  # @profiled(name="fwd")
        fn_or_name = options.pop("name")
    return Profiler(fn_or_name, **options)


def _code_attributes(fn: Any) -> dict[str, Any]:
    target = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(target, "__code__", None)
    attrs: dict[str, Any] = {
        "code.function": getattr(target, "__qualname__", None) or type(target).__qualname__
    }
    if code is not None:
        attrs["code.filepath"] = code.co_filename
        attrs["code.lineno"] = code.co_firstlineno
    module = getattr(target, "__module__", None)
    if module:
        attrs["code.namespace"] = module
    return attrs


def _wrap(fn: Any, opts: Profiler) -> Any:
    if not callable(fn) and not isinstance(fn, (classmethod, staticmethod)):
        raise TypeError(f"profiled: expected a callable, got {type(fn).__name__} {fn!r}")
    if not _state.enabled:
        return fn  # disabled at decoration: nothing added (a later configure() won't reach it)
    if isinstance(fn, classmethod):
        return classmethod(_wrap(fn.__func__, opts))
    if isinstance(fn, staticmethod):
        return staticmethod(_wrap(fn.__func__, opts))
    name = (opts.name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
            or type(fn).__qualname__)
    # A callable object is as async (or generating) as its __call__.
    probe = (fn if inspect.isroutine(fn) or isinstance(fn, (type, functools.partial))
             else type(fn).__call__)  # unbound: same code flags
    if inspect.isasyncgenfunction(probe):
        kind = "asyncgen"
    elif inspect.isgeneratorfunction(probe):
        kind = "gen"
    elif inspect.iscoroutinefunction(probe):
        kind = "async"
    else:
        kind = "sync"
    spec = RegionSpec.create(
        name, domain=opts.domain, color=opts.color, category=opts.category,
        payload=opts.payload, attributes=opts.attributes, code=_code_attributes(fn),
        sync=opts.sync, asynchronous=kind in ("async", "asyncgen"), memory=opts.memory,
        where="profiled",
    )
    maker = {"sync": _sync, "async": _async, "gen": _gen, "asyncgen": _asyncgen}[kind]
    wrapper = maker(fn, spec, opts.every, itertools.count())
    try:
        functools.update_wrapper(wrapper, fn)
    except (AttributeError, TypeError):  # callables without the usual attributes
        wrapper.__wrapped__ = fn
    wrapper.__perfsdk_spec__ = spec
    return wrapper


def _sync(fn: Callable[..., Any], spec: RegionSpec, every: int | None,
          counter: itertools.count[int]) -> Any:
    domain, attributes = spec.nvtx.domain, spec.nvtx.attributes

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state.enabled or _is_compiling():
            return fn(*args, **kwargs)
        if not _state.timing:  # NVTX-only: push, call, pop; nothing else
            if domain is None or not _state.nvtx:
                return fn(*args, **kwargs)
            domain.push_range(attributes)
            try:
                return fn(*args, **kwargs)
            finally:
                domain.pop_range()
        n = every or _state.sample_every
        if n != 1 and next(counter) % n:
            return fn(*args, **kwargs)
        region = Region(spec)
        region.enter()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            region.exit(exc)
            raise
        region.exit(None)
        return result

    return wrapper


def _async(fn: Callable[..., Any], spec: RegionSpec, every: int | None,
           counter: itertools.count[int]) -> Any:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state.enabled:
            return await fn(*args, **kwargs)
        n = every or _state.sample_every
        if n != 1 and next(counter) % n:
            return await fn(*args, **kwargs)
        region = Region(spec)
        region.enter()
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            region.exit(exc)
            raise
        region.exit(None)
        return result

    return wrapper


def _gen(fn: Callable[..., Any], spec: RegionSpec, every: int | None,
         counter: itertools.count[int]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gen = fn(*args, **kwargs)
        n = every or _state.sample_every
        if not _state.enabled or (n != 1 and next(counter) % n):
            return (yield from gen)
        method: Any = gen.send
        value: Any = None
        while True:
            region = Region(spec)
            region.enter()
            try:
                item = method(value)
            except StopIteration as stop:
                region.exit(None)
                return stop.value
            except BaseException as exc:
                region.exit(exc)
                raise
            region.exit(None)
            try:
                value = yield item
                method = gen.send
            except GeneratorExit:
                gen.close()  # closed early or collected: no region is open here
                raise
            except BaseException as exc:
                method, value = gen.throw, exc

    return wrapper


def _asyncgen(fn: Callable[..., Any], spec: RegionSpec, every: int | None,
              counter: itertools.count[int]) -> Any:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen = fn(*args, **kwargs)
        n = every or _state.sample_every
        skip = not _state.enabled or (n != 1 and next(counter) % n)
        method: Any = agen.asend
        value: Any = None
        while True:
            region = None if skip else Region(spec)
            if region is not None:
                region.enter()
            try:
                item = await method(value)
            except StopAsyncIteration:
                if region is not None:
                    region.exit(None)
                return
            except BaseException as exc:
                if region is not None:
                    region.exit(exc)
                raise
            if region is not None:
                region.exit(None)
            try:
                value = yield item
                method = agen.asend
            except GeneratorExit:
                await agen.aclose()
                raise
            except BaseException as exc:
                method, value = agen.athrow, exc

    return wrapper
