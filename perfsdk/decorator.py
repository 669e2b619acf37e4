"""``@profiled``: a thin shell over :class:`~perfsdk.region.Region`.

Names, NVTX attributes and code location are resolved once, at decoration. Each call gets a
fresh Region, so calls nest, recurse and run on many threads. Disabled at decoration time
(``PERFSDK_ENABLED=0``), the function itself is returned; disabled at run time, a call costs one
flag test. Inside ``torch.compile``d code the wrapper steps aside, so it causes no graph break.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import linecache
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from perfsdk import region as _region
from perfsdk.config import state as _state
from perfsdk.region import NULL_REGION, RegionSpec, validate_attributes, validate_options

__all__ = ["Profiler", "profiled"]

P = ParamSpec("P")
R = TypeVar("R")

_is_compiling = torch.compiler.is_dynamo_compiling  # 18 ns; dynamo folds it to True
_MAX_DECORATOR_LINES = 200  # how far below co_firstlineno the def line is looked for


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
        name: the region's name; default ``fn.__qualname__``, ``module.name`` for a builtin
            (``torch.relu``, ``math.sqrt``) and ``partial(f)`` for ``functools.partial(f, ...)``.
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


def _unpartial(fn: Any) -> tuple[Any, int]:
    """The function under any ``functools.partial`` layers, and how many layers there were."""
    depth = 0
    while isinstance(fn, functools.partial):
        fn, depth = fn.func, depth + 1
    return fn, depth


def _builtin_parts(fn: Any) -> tuple[str, str] | None:
    """(module, name) for a C function defined at module level (``torch.relu``, ``math.sqrt``);
    None for anything else. Its ``__qualname__`` can be a class-internal name
    (``_VariableFunctionsClass.relu``); methods of builtin types (``str.upper``) have no
    ``__module__`` and keep their qualified name."""
    if not isinstance(fn, types.BuiltinFunctionType):
        return None
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if not isinstance(module, str) or not module or not isinstance(name, str):
        return None
    if module.startswith("_"):  # _operator.add -> operator.add, where that is the same object
        public = sys.modules.get(module[1:])
        if public is not None and getattr(public, name, None) is fn:
            module = module[1:]
    return module, name


def _default_name(fn: Any) -> str:
    """The region name when none is given: the ``__qualname__`` of a function;
    ``module.name`` of a builtin (``torch.relu``, ``math.sqrt``; ``builtins`` left out);
    ``partial(<name of the wrapped function>)`` of a ``functools.partial``; the class name of
    another callable object."""
    inner, depth = _unpartial(fn)
    if depth:
        return f"partial({_default_name(inner)})"
    parts = _builtin_parts(fn)
    if parts is not None:
        return parts[1] if parts[0] == "builtins" else f"{parts[0]}.{parts[1]}"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else type(fn).__qualname__


def _def_lineno(code: types.CodeType) -> int:
    """The line of the ``def`` itself. ``co_firstlineno`` is the first decorator's line; skip
    the decorators with the source (linecache: read once per file) and fall back to
    ``co_firstlineno`` when the source is not available or does not match."""
    first = code.co_firstlineno
    try:
        if not linecache.getline(code.co_filename, first).lstrip().startswith("@"):
            return first
        pattern = re.compile(rf"\s*(?:async\s+)?def\s+{re.escape(code.co_name)}\b")
        for lineno in range(first + 1, first + _MAX_DECORATOR_LINES):
            line = linecache.getline(code.co_filename, lineno)
            if not line:
                break
            if pattern.match(line):
                return lineno
    except Exception:  # an unreadable or odd source file: the decorator's line will do
        pass
    return first


def _code_attributes(fn: Any) -> dict[str, Any]:
    target, _ = _unpartial(fn)
    target = inspect.unwrap(target) if callable(target) else target
    target, _ = _unpartial(target)
    parts = _builtin_parts(target)
    if parts is not None:
        return {"code.function": parts[1], "code.namespace": parts[0]}
    code = getattr(target, "__code__", None)
    attrs: dict[str, Any] = {
        "code.function": getattr(target, "__qualname__", None) or type(target).__qualname__
    }
    if isinstance(code, types.CodeType):
        attrs["code.filepath"] = code.co_filename
        attrs["code.lineno"] = _def_lineno(code)
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
    name = opts.name or _default_name(fn)
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
        every=opts.every, where="profiled",
    )
    maker = {"sync": _sync, "async": _async, "gen": _gen, "asyncgen": _asyncgen}[kind]
    wrapper = maker(fn, spec)
    try:
        functools.update_wrapper(wrapper, fn)
    except (AttributeError, TypeError):  # callables without the usual attributes
        wrapper.__wrapped__ = fn
    wrapper.__perfsdk_spec__ = spec
    return wrapper


# The wrappers: the gate (spec.open) decides and enters; each wrapper only exits what it got,
# also on exceptions. A call of a disabled perfsdk costs the one flag test before the gate.


def _sync(fn: Callable[..., Any], spec: RegionSpec) -> Any:
    open_ = _region.region_opener(spec)  # spec.open, compiled where built
    exit_ = _region.exit_compiled  # exit_(region, None, 0) is region.exit(None), compiled
    # NVTX-only mode (PERFSDK_TIMING=0) skips the gate: every entry of a spec without its own
    # sampling is a push, the call and a pop, done in one C call where perfsdk's compiled
    # module is built (markers.NvtxMarker.call), else inline. Whatever else (sampling, no
    # NVTX domain, timing on) goes through the gate.
    push: Any = None
    pop: Any = None
    attrs: Any = None
    call: Any = None
    if spec.nvtx_range is not None and spec.every in (None, 1):  # push/pop ranges, unsampled
        push, pop = spec.nvtx.domain.push_range, spec.nvtx.domain.pop_range
        attrs, call = spec.nvtx.attributes, spec.nvtx.call

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state.enabled or _is_compiling():
            return fn(*args, **kwargs)
        if _state.nvtx_only and push is not None:
            if call is not None:
                return call(fn, args, kwargs)
            push(attrs)
            try:
                return fn(*args, **kwargs)
            finally:
                pop()
        region = open_()
        if region is NULL_REGION:  # sampled out: no try, no exit call
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            region.exit(exc)
            raise
        if exit_ is None:
            region.exit(None)
        else:
            exit_(region, None, 0)
        return result

    return wrapper


def _async(fn: Callable[..., Any], spec: RegionSpec) -> Any:
    open_ = spec.open

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state.enabled:
            return await fn(*args, **kwargs)
        region = open_()
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            region.exit(exc)
            raise
        region.exit(None)
        return result

    return wrapper


def _gen(fn: Callable[..., Any], spec: RegionSpec) -> Any:
    enter = spec.enter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gen = fn(*args, **kwargs)
        region = spec.open()  # one decision per call; one region per resumption
        if region is NULL_REGION:
            return (yield from gen)
        method: Any = gen.send
        value: Any = None
        while True:
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
            region = enter()

    return wrapper


def _asyncgen(fn: Callable[..., Any], spec: RegionSpec) -> Any:
    enter = spec.enter

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen = fn(*args, **kwargs)
        skip = not spec.sampled()  # one decision per call; one region per resumption
        method: Any = agen.asend
        value: Any = None
        closing = False  # resuming only to pass a cancellation in: not a measured resumption
        while True:
            region = NULL_REGION if skip or closing else enter()
            try:
                item = await method(value)
            except StopAsyncIteration:
                region.exit(None)
                return
            except BaseException as exc:
                region.exit(exc)
                raise
            region.exit(None)
            try:
                value = yield item
                method, closing = agen.asend, False
            except GeneratorExit:
                await agen.aclose()
                raise
            except asyncio.CancelledError as exc:
                # Suspended at a yield, the generator awaits nothing: a cancellation arriving
                # here is the loop closing an abandoned generator (asyncio.run cancels the
                # finalizer's aclose() task at shutdown). Pass it on unrecorded, like aclose().
                method, value, closing = agen.athrow, exc, True
            except BaseException as exc:
                method, value, closing = agen.athrow, exc, False

    return wrapper
