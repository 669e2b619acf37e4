"""``instrument_module``: a region per submodule, for forward and backward.

Forward: a forward pre-hook enters the module's region and a forward hook registered with
``always_call=True`` exits it, so the region closes also when ``forward`` raises. Open regions
sit on a per-thread stack; a hook exits only the region its own pre-hook opened. Each module's
region specs (names, NVTX attributes, ``perfsdk.module``) are built once, when it is
instrumented.

Backward: see :mod:`perfsdk.auto.backward` (autograd sequence numbers and node pre-hooks: no
graph walk, no tensor wrapped). The pre-hook reads the autograd node counter and its inputs'
``grad_fn``; the forward hook hands both and the output to :func:`perfsdk.auto.backward.track`.

Transformer fast path: ``nn.TransformerEncoderLayer`` takes its fused inference kernel
(``aten::_transformer_encoder_layer_fwd``) only while no forward hook is attached to it or to any
of its submodules. ``TransformerEncoder`` and ``TransformerEncoderLayer`` are therefore timed by
a wrapper of that one module's ``forward`` (an instance attribute, no hook) and the layers'
submodules (``self_attn``, ``linear1`` ...) get nothing: each layer is one region.

The model's own region also records what it runs with: ``perfsdk.transforms`` and
``perfsdk.amp`` from ``perfsdk.optimize.applied(model)`` at the time of the call, and
``perfsdk.amp`` when the caller's ``torch.autocast`` is on at its forward.

``torch.compile``: every hook and wrapper starts with ``torch.compiler.is_dynamo_compiling()``,
which dynamo folds to True, so a compiled model traces to one graph with nothing recorded inside
it (time it from outside, e.g. with a step region).
"""

from __future__ import annotations

import fnmatch
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from perfsdk.auto import backward as _bwd
from perfsdk.auto.steps import autocast_dtype
from perfsdk.config import state as _state
from perfsdk.errors import warn_once
from perfsdk.region import NULL_REGION, RegionSpec

__all__ = ["FAST_PATH_TYPES", "ModuleInstrumentation", "instrument_module"]

FAST_PATH_TYPES: tuple[type[nn.Module], ...] = (nn.TransformerEncoder, nn.TransformerEncoderLayer)
"""Modules timed by a ``forward`` wrapper instead of hooks, so their fused inference path stays
on. The submodules of a ``TransformerEncoderLayer`` are not instrumented."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
_first_node = _bwd.first_node
_input_nodes = _bwd.input_nodes
_Tensor = torch.Tensor

Pattern = str | type[nn.Module]


@functools.lru_cache(maxsize=8192)
def _spec(name: str, category: str, path: str, state: tuple[tuple[str, Any], ...] = ()
          ) -> RegionSpec:
    backward = category == "module.backward"  # entered only for a recorded forward call
    return RegionSpec.create(name, category=category,
                             attributes={"perfsdk.module": path, **dict(state)},
                             asynchronous=backward, every=1 if backward else None,
                             where="instrument_module")


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[_Probe, Any, int, Any]] = []
        """The open forward regions on this thread: (probe, region, the call's first autograd
        node number or -1 when its backward is not tracked, its inputs' ``grad_fn``)."""


_tls = _State()


class _Probe:
    """The regions of one instrumented module: enter before its forward, exit after."""

    __slots__ = ("bwd", "root", "spec")

    def __init__(self, name: str, path: str, backward: bool, root: bool,
                 state: tuple[tuple[str, Any], ...] = ()) -> None:
        self.spec = _spec(name, "module", path, state)
        self.bwd = _spec(f"{name}.backward", "module.backward", path) if backward else None
        self.root = root

    def pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Enter the module's region (a forward pre-hook, ``with_kwargs=True``)."""
        if _is_compiling() or not _state.enabled:
            return
        spec = self.spec
        if self.root:
            if not spec.sampled():
                return
            _bwd.close_stale()  # before entering: stale backward regions sit below the new one
            region = spec.enter()
            amp = autocast_dtype()
            if amp is not None:  # the model runs under the caller's autocast
                region.set_attribute("perfsdk.amp", amp)
        else:
            region = spec.open()  # NULL_REGION when sampled out: exited all the same
        first = -1
        inputs: Any = None
        if self.bwd is not None and region is not NULL_REGION and _grad_enabled():
            try:
                if not kwargs and len(args) == 1 and isinstance(args[0], _Tensor):
                    inputs = args[0].grad_fn  # the common case, without a call
                else:
                    inputs = _input_nodes(args, kwargs)
                first = _first_node()
            except Exception as exc:  # our bookkeeping must never break the model
                warn_once(f"auto-backward:{type(exc).__name__}",
                          f"perfsdk: no backward region for {spec.name!r}: {exc!r}")
        _tls.stack.append((self, region, first, inputs))

    def hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Exit the region the pre-hook entered (a forward hook, ``always_call=True``: torch
        calls it from its ``except Exception`` block when forward raised, with output None,
        and the exception being handled is the forward's)."""
        if _is_compiling():
            return
        stack = _tls.stack
        if not stack or stack[-1][0] is not self:  # not entered (disabled, sampled out)
            return
        _, region, first, inputs = stack.pop()
        error = sys.exc_info()[1] if output is None else None
        region.exit(error)
        if first >= 0 and error is None:
            try:
                _bwd.track(self.bwd, first, inputs, output)  # type: ignore[arg-type]
            except Exception as exc:  # our bookkeeping must never break the model
                warn_once(f"auto-backward:{type(exc).__name__}",
                          f"perfsdk: no backward region for {self.spec.name!r}: {exc!r}")
        if not stack:
            _bwd.forward_done()


def _wrapped_forward(probe: _Probe, inner: Callable[..., Any] | None) -> Callable[..., Any]:
    """A ``forward`` for a fast-path module (bound to it as an instance attribute).

    ``inner`` is an instance ``forward`` that was already there, else the class's is used (found
    through ``type(self)``, so a deep copy of the module calls its own).
    """

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            if inner is not None:
                return inner(*args, **kwargs)
            return type(self).forward(self, *args, **kwargs)
        probe.pre_hook(self, args, kwargs)
        try:
            if inner is not None:
                output = inner(*args, **kwargs)
            else:
                output = type(self).forward(self, *args, **kwargs)
        except BaseException:
            probe.hook(self, args, kwargs, None)  # sees the exception being handled
            raise
        probe.hook(self, args, kwargs, output)
        return output

    forward.__perfsdk_probe__ = probe  # type: ignore[attr-defined]
    return forward


class ModuleInstrumentation:
    """What :func:`instrument_module` did, and the way to undo it.

    Attributes:
        regions: The forward region name of every instrumented module, in ``named_modules()``
            order (``SimpleNet``, ``SimpleNet.conv1`` ...).
        hooked: The subset timed by module hooks.
        wrapped: The subset timed by a ``forward`` wrapper (Transformer fast-path modules).
        skipped: Submodules left alone to keep a fast path (children of a
            ``TransformerEncoderLayer``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.regions: list[str] = []
        self.hooked: list[str] = []
        self.wrapped: list[str] = []
        self.skipped: list[str] = []
        self._handles: list[Any] = []
        self._wrappers: list[tuple[nn.Module, Any]] = []

    def remove(self) -> None:
        """Remove every hook and wrapper; idempotent."""
        while self._handles:
            self._handles.pop().remove()
        while self._wrappers:
            module, previous = self._wrappers.pop()
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous

    def __enter__(self) -> ModuleInstrumentation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"<ModuleInstrumentation of {type(self.model).__name__}: {len(self.hooked)} "
                f"hooked, {len(self.wrapped)} wrapped, {len(self.skipped)} skipped>")


def _patterns(arg: str, value: Any) -> tuple[Pattern, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(items, Sequence) or isinstance(items, str):
        items = tuple(items) if isinstance(items, (set, frozenset)) else None
    ok = items is not None and all(
        isinstance(p, str) or (isinstance(p, type) and issubclass(p, nn.Module)) for p in items)
    if not ok:
        raise ValueError(f"instrument_module: {arg}={value!r}; accepted values are None, a glob "
                         "pattern (str) or an nn.Module subclass, or a list of those")
    return tuple(items)  # type: ignore[arg-type]


def _matches(patterns: tuple[Pattern, ...], module: nn.Module, path: str, name: str) -> bool:
    for p in patterns:
        if isinstance(p, str):
            if fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(name, p):
                return True
        elif isinstance(module, p):
            return True
    return False


def _walk(module: nn.Module, path: str, level: int, depth: int | None, seen: set[int],
          skipped: list[str], prefix: str) -> Iterator[tuple[str, nn.Module, int]]:
    if id(module) in seen:
        return
    seen.add(id(module))
    yield path, module, level
    if depth is not None and level >= depth:
        return
    fused = isinstance(module, nn.TransformerEncoderLayer)
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        if fused:
            skipped.extend(f"{prefix}.{p}" for p, _ in child.named_modules(prefix=child_path))
            continue
        yield from _walk(child, child_path, level + 1, depth, seen, skipped, prefix)


def instrument_module(
    model: nn.Module,
    *,
    depth: int | None = None,
    include: Pattern | Sequence[Pattern] | None = None,
    exclude: Pattern | Sequence[Pattern] | None = None,
    backward: bool = True,
) -> ModuleInstrumentation:
    """Time every submodule's forward (and backward) as a region, named by its path.

    Regions are named ``<RootClass>.<path>`` (``SimpleNet.conv1``; the root alone is
    ``SimpleNet``), category ``module``, with attribute ``perfsdk.module`` = the path
    (``conv1``; ``""`` for the root). With ``backward=True`` each module whose forward built an
    autograd graph also gets ``<name>.backward`` (category ``module.backward``) from autograd
    node hooks. Regions nest like the modules, so Nsight Systems and trace viewers show the
    model's structure. ``TransformerEncoder`` and ``TransformerEncoderLayer`` keep their fused
    inference path: they are timed by a ``forward`` wrapper, not hooks, and a layer's
    submodules are not instrumented. Under ``torch.compile`` nothing is recorded inside the
    compiled graph and nothing breaks it.

    Args:
        model: The model (any ``nn.Module``); it is changed in place (hooks) until ``remove()``.
        depth: Instrument modules at most this deep (0: the model only; None: all).
        include: Only modules matching one of these: glob patterns, matched against the path
            (``"layers.*"``) and the region name (``"SimpleNet.conv*"``), or module classes.
        exclude: Leave out modules matching one of these (same forms). Children of an excluded
            module are still visited.
        backward: Also record each module's backward.

    Returns:
        A :class:`ModuleInstrumentation`; ``remove()`` (or leaving its ``with`` block) takes
        every hook and wrapper out again.

    Raises:
        ValueError: An argument has a value outside those accepted.

    Example:
        >>> import torch
        >>> from perfsdk.auto import instrument_module
        >>> from perfsdk.testing import capture
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with capture() as cap, instrument_module(model):
        ...     model(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> sorted(r.name for r in cap.regions)  # doctest: +NORMALIZE_WHITESPACE
        ['Sequential', 'Sequential.0', 'Sequential.0.backward', 'Sequential.1',
         'Sequential.1.backward', 'Sequential.backward']
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"instrument_module: model={model!r}; accepted values are "
                         "torch.nn.Module instances")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(f"instrument_module: depth={depth!r}; accepted values are None (all "
                         "levels) or an integer >= 0 (0: the model only)")
    if not isinstance(backward, bool):
        raise ValueError(f"instrument_module: backward={backward!r}; accepted values are True "
                         "or False")
    wanted = _patterns("include", include)
    unwanted = _patterns("exclude", exclude)
    root_name = type(getattr(model, "_orig_mod", model)).__name__
    from perfsdk.optimize import region_attributes

    # what perfsdk.optimize applied to the model, on its root region ("already on" in advice)
    state = tuple(region_attributes(model).items())
    done = ModuleInstrumentation(model)
    found = list(_walk(model, "", 0, depth, set(), done.skipped, root_name))
    try:
        for path, module, level in found:
            name = f"{root_name}.{path}" if path else root_name
            if isinstance(module, _CONTAINERS) and type(module).forward is nn.Module.forward:
                continue  # never called: a hook there would never fire
            if wanted is not None and not _matches(wanted, module, path, name):
                continue
            if unwanted is not None and _matches(unwanted, module, path, name):
                continue
            probe = _Probe(name, path, backward, root=level == 0,
                           state=state if level == 0 else ())
            done.regions.append(name)
            if isinstance(module, FAST_PATH_TYPES):
                previous = module.__dict__.get("forward")
                wrapper = _wrapped_forward(probe, previous)
                module.__dict__["forward"] = types.MethodType(wrapper, module)
                done._wrappers.append((module, previous))
                done.wrapped.append(name)
            else:
                done._handles.append(module.register_forward_pre_hook(probe.pre_hook,
                                                                      with_kwargs=True))
                done._handles.append(module.register_forward_hook(
                    probe.hook, with_kwargs=True, always_call=True))
                done.hooked.append(name)
    except BaseException:
        done.remove()
        raise
    return done
