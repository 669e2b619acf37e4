"""``instrument_module``: a region per submodule, for forward and backward.

Forward: each instrumented module's ``forward`` is replaced, on the instance, by a wrapper that
enters the module's region, calls the module's own ``forward`` and exits the region, also when
it raises. Not forward hooks: a module with any hook takes ``nn.Module.__call__``'s slow path on
every call, which costs more than a region (so hand-written NVTX hooks cost more than the
range); a wrapper keeps the fast path and holds its region in its own locals. Each module's
region specs (names, NVTX attributes, ``perfsdk.module``) are built once, when it is
instrumented. A submodule's region rides on its model's (``RegionSpec.open_inner``: no Region
object, the model's region stands for it as the current span), so a model of many small modules
pays little more per module than the NVTX range.

Backward: see :mod:`perfsdk.auto.backward` (autograd sequence numbers and tensor / node hooks:
no graph walk, no tensor wrapped). The wrapper reads the autograd node counter and its inputs'
``grad_fn`` before the forward, and hands both and the output to
:func:`perfsdk.auto.backward.track` after it.

Transformer fast path: ``nn.TransformerEncoderLayer`` takes its fused inference kernel
(``aten::_transformer_encoder_layer_fwd``) only while no forward hook is attached to it or to any
of its submodules; wrappers are no hooks, and a layer's submodules (``self_attn``, ``linear1``
...) get nothing, so each layer is one region, as the fused kernel runs it.

The model's own region also records what it runs with: ``perfsdk.transforms`` and
``perfsdk.amp`` from ``perfsdk.optimize.applied(model)`` at the time of the call, and
``perfsdk.amp`` when the caller's ``torch.autocast`` is on at its forward.

Where perfsdk's compiled module is built, the wrapper's body past its ``torch.compile`` check
runs in C (``perfsdk._fastpath.ModuleCall``, statement for statement the Python wrapper's).

``torch.compile``: every wrapper starts with ``torch.compiler.is_dynamo_compiling()``, which
dynamo folds to True, so a compiled model traces to one graph with nothing recorded inside it
(time it from outside, e.g. with a step region).
"""

from __future__ import annotations

import fnmatch
import functools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from perfsdk import region as _region
from perfsdk.auto import backward as _bwd
from perfsdk.auto.steps import autocast_dtype
from perfsdk.config import state as _state
from perfsdk.errors import warn_once
from perfsdk.region import NULL_REGION, RegionSpec

__all__ = ["FAST_PATH_TYPES", "ModuleInstrumentation", "instrument_module"]

FAST_PATH_TYPES: tuple[type[nn.Module], ...] = (nn.TransformerEncoder, nn.TransformerEncoderLayer)
"""Modules with a fused inference path (one kernel per layer): the submodules of a
``TransformerEncoderLayer`` are not instrumented, so the layer is one region."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_ScriptModule = torch.jit.ScriptModule  # TorchScript runs its submodules itself: no wrapper
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
_first_node = _bwd.first_node
_input_nodes = _bwd.input_nodes
_track = _bwd.track
_forward_done = _bwd.forward_done
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
        self.depth = 0
        """Instrumented forward calls open on this thread whose backward is tracked: at 0
        again the outermost returned, and the autograd nodes hooked in it are forgotten."""


_tls = _State()


class _Probe:
    """The regions of one instrumented module: built once, when it is instrumented."""

    __slots__ = ("bwd_open", "live", "open", "root", "spec")

    def __init__(self, name: str, path: str, backward: bool, root: bool,
                 state: tuple[tuple[str, Any], ...] = ()) -> None:
        self.spec = _spec(name, "module", path, state)
        # open() is spec.open_inner(), compiled where perfsdk._fastpath is (region.inner_gate);
        # bwd_open() the same for the module's backward region (None: backward not tracked)
        self.open = _region.inner_gate(self.spec)
        self.bwd_open = (_region.inner_gate(_spec(f"{name}.backward", "module.backward", path))
                         if backward else None)
        self.root = root
        self.live = True
        """False once removed: a wrapper left in someone else's chain only passes through."""

    def enter_root(self) -> Any:
        """The model's own region (NULL_REGION when sampled out): stale backward regions
        closed first, the caller's autocast noted."""
        spec = self.spec
        if not spec.sampled():
            return NULL_REGION
        _bwd.close_stale()  # before entering: stale backward regions sit below the new one
        region = spec.enter()
        amp = autocast_dtype()
        if amp is not None:  # the model runs under the caller's autocast
            region.set_attribute("perfsdk.amp", amp)
        return region


def _no_backward(spec: RegionSpec, exc: Exception) -> None:
    """Our backward bookkeeping failed for one call: say so once, never break the model."""
    warn_once(f"auto-backward:{type(exc).__name__}",
              f"perfsdk: no backward region for {spec.name!r}: {exc!r}")


def _leave(first: int) -> None:
    """A tracked call returned or raised: the outermost one forgets its hooked nodes."""
    if first >= 0:
        tls = _tls
        tls.depth -= 1
        if not tls.depth:
            _forward_done()


def _wrapped_forward(probe: _Probe, inner: Callable[..., Any] | None,
                     declared: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` that times a module (bound to it as an instance attribute).

    ``inner`` is an instance ``forward`` that was already there, else the class's is used (found
    through ``type(self)``, so a deep copy of the module calls its own); ``declared`` is the
    class's, for ``inspect.signature`` (``__wrapped__``). A wrapper, not hooks:
    a module without hooks keeps ``nn.Module.__call__``'s fast path (hooks send every call of
    the module through its slow path, which costs more than the region), and the region is in
    the wrapper's locals, with no stack to pair hooks. A submodule's region is usually an
    :class:`~perfsdk.region.InnerRegion` riding on its model's (``RegionSpec.open_inner``).
    """
    if _module_call is not None:
        return _wrapped_forward_compiled(probe, inner, declared)
    spec = probe.spec
    open_ = probe.open
    bwd = probe.bwd_open
    enter_root = probe.enter_root if probe.root else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or not _state.enabled or not probe.live:
            if inner is not None:
                return inner(*args, **kwargs)
            return type(self).forward(self, *args, **kwargs)
        region = open_() if enter_root is None else enter_root()
        first = -1
        inputs: Any = None
        if bwd is not None and region is not NULL_REGION and _grad_enabled():
            try:  # where this call's backward starts and ends (see perfsdk.auto.backward)
                if not kwargs and len(args) == 1 and isinstance(args[0], _Tensor):
                    inputs = args[0].grad_fn  # the common case, without a call
                else:
                    inputs = _input_nodes(args, kwargs)
                first = _first_node()
            except Exception as exc:  # our bookkeeping must never break the model
                _no_backward(spec, exc)
            else:
                _tls.depth += 1
        try:
            if inner is not None:
                output = inner(*args, **kwargs)
            else:
                output = type(self).forward(self, *args, **kwargs)
        except BaseException as exc:
            region.exit(exc)
            _leave(first)
            raise
        try:
            region.exit(None)
        except BaseException:  # the call is over all the same: its count too
            _leave(first)
            raise
        if first >= 0:
            try:
                _track(bwd, first, inputs, output)  # type: ignore[arg-type]
            except Exception as exc:  # our bookkeeping must never break the model
                _no_backward(spec, exc)
            tls = _tls  # _leave(first), written out
            tls.depth -= 1
            if not tls.depth:
                _forward_done()
        return output

    forward.__perfsdk_probe__ = probe  # type: ignore[attr-defined]
    if inner is None:  # the signature of the module's forward, for code that inspects it
        forward.__wrapped__ = declared  # type: ignore[attr-defined]
    return forward


def _wrapped_forward_compiled(probe: _Probe, inner: Callable[..., Any] | None,
                              declared: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_wrapped_forward` where perfsdk's compiled module is built: the wrapper keeps
    only the ``torch.compile`` check, which dynamo must see, and hands the call to
    ``perfsdk._fastpath.ModuleCall`` (the body of the Python wrapper, the same code)."""
    call = _module_call(probe, inner)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            if inner is not None:
                return inner(*args, **kwargs)
            return type(self).forward(self, *args, **kwargs)
        return call(self, args, kwargs)

    forward.__perfsdk_probe__ = probe  # type: ignore[attr-defined]
    if inner is None:
        forward.__wrapped__ = declared  # type: ignore[attr-defined]
    return forward


def _replicate(wrapper: Callable[..., Any], module: nn.Module) -> nn.Module:
    """``module._replicate_for_data_parallel()`` while instrumented. ``nn.DataParallel`` makes
    its replicas with a copy of the module's ``__dict__``, where the wrapper bound to the
    original would run the original (its parameters, on its device): the replica gets the
    wrapper bound to itself."""
    replica: nn.Module = type(module)._replicate_for_data_parallel(module)  # type: ignore[no-untyped-call]
    replica.__dict__.pop("_replicate_for_data_parallel", None)
    replica.__dict__["forward"] = types.MethodType(wrapper, replica)
    return replica


class ModuleInstrumentation:
    """What :func:`instrument_module` did, and the way to undo it.

    Attributes:
        regions: The forward region name of every instrumented module, in ``named_modules()``
            order (``SimpleNet``, ``SimpleNet.conv1`` ...).
        hooked: Empty: kept for code written when modules were timed by hooks.
        wrapped: The modules timed by a ``forward`` wrapper: all of them.
        skipped: Submodules left alone: children of a ``TransformerEncoderLayer`` (to keep
            its fast path) and TorchScript submodules with their children (scripted code
            calls them itself, past any Python wrapper).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.regions: list[str] = []
        self.hooked: list[str] = []
        self.wrapped: list[str] = []
        self.skipped: list[str] = []
        self._wrappers: list[tuple[nn.Module, Any, Any]] = []

    def remove(self) -> None:
        """Remove every wrapper; idempotent. A wrapper that other code has wrapped in turn
        since (``module.forward`` replaced again, as accelerate's hooks do) is left in their
        chain, where it only passes calls through from now on."""
        while self._wrappers:
            module, previous, wrapper = self._wrappers.pop()
            wrapper.__func__.__perfsdk_probe__.live = False
            module.__dict__.pop("_replicate_for_data_parallel", None)
            if module.__dict__.get("forward") is not wrapper:
                continue  # someone else's forward now: theirs stays, ours passes through
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
        return (f"<ModuleInstrumentation of {type(self.model).__name__}: {len(self.wrapped)} "
                f"wrapped, {len(self.skipped)} skipped>")


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
        if fused or isinstance(child, _ScriptModule):
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
    inference path: modules are timed by ``forward`` wrappers, not hooks, and a layer's
    submodules are not instrumented. Under ``torch.compile`` nothing is recorded inside the
    compiled graph and nothing breaks it.

    Args:
        model: The model (any ``nn.Module``); it is changed in place (each module's ``forward``
            is wrapped, as an instance attribute) until ``remove()``.
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
    if not isinstance(model, nn.Module) or isinstance(model, _ScriptModule):
        raise ValueError(f"instrument_module: model={model!r}; accepted values are "
                         "torch.nn.Module instances that are not TorchScript modules (time a "
                         "scripted model from outside, e.g. with perfsdk.timed_region)")
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
            previous = module.__dict__.get("forward")
            wrapper = _wrapped_forward(probe, previous, type(module).forward)
            bound = types.MethodType(wrapper, module)
            module.__dict__["forward"] = bound
            module.__dict__["_replicate_for_data_parallel"] = types.MethodType(
                functools.partial(_replicate, wrapper), module)
            done._wrappers.append((module, previous, bound))
            done.wrapped.append(name)
    except BaseException:
        done.remove()
        raise
    return done


_module_call: Any = None
"""``perfsdk._fastpath.ModuleCall`` where perfsdk's compiled twins are in use (see
:mod:`perfsdk.auto.backward`), else None: the wrapper's body in Python."""
if _bwd.track is not _bwd.track_python and hasattr(_region._fastpath, "ModuleCall"):
    _region._fastpath.bind_module(globals())  # (a compiled module built before it has none)
    _module_call = _region._fastpath.ModuleCall
