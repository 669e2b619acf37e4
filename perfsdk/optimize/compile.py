"""``apply_compile``: ``torch.compile`` in place, with a fallback to eager when compiling fails.

The model is compiled the way :meth:`torch.nn.Module.compile` does it, by compiling the module's
call and keeping the module itself: ``state_dict()`` keys stay the original ones (no
``_orig_mod.`` prefix, pytorch#101107), and a state dict saved from it loads into an uncompiled
copy and back.

torch compiles lazily, at the first call (and again at each recompilation, e.g. a new input
shape). A failure there — no C compiler, an unsupported operator, a backend bug — would crash the
user's program at its first forward. Here, when a compiled call raises, the same call is run
eagerly: if eager succeeds, compilation was the problem, so a
:class:`~perfsdk.errors.PerfSDKWarning` names the error, the model runs eagerly from then on, and
the eager result is returned; if eager raises too, the error is the user's own and that (eager)
exception propagates unchanged (so a failing call runs twice: compiled, then eagerly).

``freezing=True`` turns on inductor's freezing (weights folded into the compiled graph as
constants, conv/linear weights pre-packed) for this model's compilations only: it travels as an
inductor option with this model's backend, so the global ``torch._inductor.config`` is never
changed and every recompilation of this model gets it too. Inductor freezes only calls made with
gradients off (``torch.no_grad()`` / ``torch.inference_mode()``); the weights are read once, at
compile time, so load them *before* the first call — later in-place changes to them are not seen
by the frozen graph.

Example:
    >>> import torch
    >>> from perfsdk.optimize.compile import apply_compile
    >>> model = apply_compile(torch.nn.Linear(4, 2), backend="eager")
    >>> sorted(model.state_dict())
    ['bias', 'weight']
    >>> model(torch.ones(1, 4)).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from perfsdk.errors import NoEffectWarning, warn_once
from perfsdk.optimize._marks import mark

__all__ = ["MODES", "apply_compile"]

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""Accepted values of ``mode=`` (those of :func:`torch.compile`)."""


_entries = itertools.count(1)


def _entry(call: Callable[..., Any], label: str) -> Callable[..., Any]:
    """A frame of our own around the module's call for dynamo to start from, with a code object
    of its own for each compiled model.

    ``nn.Module.compile()`` compiles ``module._call_impl`` itself, whose frame (in ``torch.nn``)
    dynamo skips: it then compiles only the frames called from there that are not torch's own,
    so a ``torch.nn`` module (``Linear``, ``Sequential``, ...) is not compiled at all, and forward
    hooks become graphs of their own. Starting from this frame, dynamo traces the whole call,
    hooks included, as ``torch.compile(module)`` does (its ``wrap_inline``).

    Why one code object per model: dynamo keeps its compiled graphs, its recompile count and its
    "automatic dynamic" record of the sizes it has seen per code object (``pgo.CodeId``: file,
    line, name). With one shared ``compiled_call`` every model compiled by perfsdk in a process
    shared them: after a model with other input shapes (an earlier ``optimize()``, a docs
    example, the demo), the next model's first compilation was already *dynamic* (symbolic
    sizes; slower inductor kernels: the issue's 333 ms returned model against 230 ms for
    ``torch.compile(model)``), and past ``recompile_limit`` (8) graphs on that code, later models
    silently ran eagerly. A fresh code object, named after the model, gives each model its own
    cache, limit and size record, as ``torch.compile(model)`` does with the model's own
    ``forward``."""

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    name = f"perfsdk_compiled_{label}_{next(_entries)}"
    code = compiled_call.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=name)
    compiled_call.__code__ = code
    compiled_call.__name__ = compiled_call.__qualname__ = name
    return compiled_call


class _CompileGuard:
    """Stands in ``module._compiled_call_impl``: runs the compiled call and, if compilation
    fails, the eager one for good. Not an ``nn.Module``, so nothing is registered on the model."""

    __slots__ = ("compiled", "eager", "failed", "freezing", "label")
    transform = "compile"  # its name in fallbacks()

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any], label: str,
                 freezing: bool) -> None:
        self.compiled = compiled
        self.eager = eager
        self.label = label
        self.freezing = freezing
        self.failed: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.eager(*args, **kwargs)
        if self.freezing and torch.is_grad_enabled():
            warn_once("compile-freezing-grad",
                      f"perfsdk: apply_compile(freezing=True) on {self.label}: inductor freezes "
                      "only calls made under torch.no_grad() or torch.inference_mode(); this "
                      "call was compiled without freezing.")
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:  # decided below, outside this handler (no chained context)
            error = exc
        # Compiled and eager disagree only if compiling was the problem: run the call eagerly.
        # If eager raises too, that exception is the user's, and it propagates as it is.
        result = self.eager(*args, **kwargs)
        self.failed = error
        self.compiled = self.eager  # drop the compiled callable and its caches
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = " ".join([type(error).__name__ + ":", *lines[:2]])[:300].rstrip(":")
        warn_once(f"compile-fallback:{self.label}:{type(error).__name__}",
                  f"perfsdk: torch.compile failed for {self.label} ({detail}); running eagerly "
                  "from now on.")
        return result


def _check(model: nn.Module, mode: str | None, backend: str | Callable[..., Any],
           freezing: bool | None, options: dict[str, Any]) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_compile: model={type(model).__name__} is not an nn.Module")
    if mode not in MODES:
        raise ValueError(f"apply_compile: mode={mode!r} is not supported; accepted values are "
                         f"{', '.join(repr(m) for m in MODES)}")
    if not (isinstance(backend, str) or callable(backend)):
        raise ValueError(f"apply_compile: backend={backend!r} is not supported; accepted values "
                         "are a backend name (str, e.g. 'inductor', 'aot_eager', 'eager') or a "
                         "callable backend")
    if freezing not in (None, True, False):
        raise ValueError(f"apply_compile: freezing={freezing!r}; accepted values are None, True, "
                         "False")
    if freezing and backend != "inductor":
        raise ValueError(f"apply_compile: freezing=True needs backend='inductor' "
                         f"(got backend={backend!r}); accepted values: freezing=None/False with "
                         "any backend")
    if freezing and model.training:
        raise ValueError("apply_compile: freezing=True is for inference only and the model is in "
                         "training mode; call model.eval() first (accepted: freezing=True on an "
                         "eval-mode model, freezing=None/False otherwise)")
    if freezing and "freezing" in options:
        raise ValueError("apply_compile: pass freezing= once (as the keyword, not in **options)")


def apply_compile(model: nn.Module, *, mode: str | None = None,
                  backend: str | Callable[..., Any] = "inductor", fullgraph: bool = False,
                  dynamic: bool | None = None, freezing: bool | None = None,
                  **options: Any) -> nn.Module:
    """Compile ``model`` in place with ``torch.compile``; fall back to eager if compiling fails.

    Args:
        model: The module to compile. It is modified in place and returned.
        mode: ``torch.compile`` mode: None (``"default"``), ``"default"``, ``"reduce-overhead"``
            (CUDA graphs), ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"``.
        backend: A ``torch.compile`` backend name or callable.
        fullgraph: Error on graph breaks instead of splitting the graph (such an error falls
            back to eager like any compile failure).
        dynamic: ``torch.compile``'s ``dynamic`` (None: dynamic shapes after a recompilation).
        freezing: Inductor freezing for this model (inference only: the model must be in eval
            mode, and only calls under ``torch.no_grad()``/``torch.inference_mode()`` are
            frozen). Needs ``backend="inductor"``. None and False leave inductor's global setting.
        **options: Backend options, passed as ``torch.compile(options=...)`` (inductor config
            keys for inductor, e.g. ``epilogue_fusion=False``). Combined with ``mode`` for
            inductor; torch itself accepts only one of the two.

    Returns:
        The same module object, compiled. Calling ``apply_compile`` again warns
        (:class:`NoEffectWarning`) and changes nothing.

    Raises:
        ValueError: An argument outside the accepted values (the message names it).
    """
    _check(model, mode, backend, freezing, options)
    label = type(model).__name__
    if model._compiled_call_impl is not None or isinstance(model,
                                                           torch._dynamo.eval_frame.OptimizedModule):
        warnings.warn(f"apply_compile: {label} is already compiled (or wrapped, e.g. by "
                      "apply_cuda_graphs); returned unchanged.", NoEffectWarning, stacklevel=2)
        return model

    compile_mode, compile_options = mode, dict(options)
    if freezing:
        compile_options["freezing"] = True
    if compile_options and mode not in (None, "default"):
        if backend == "inductor":  # torch.compile takes mode or options: merge them
            from torch._inductor import list_mode_options

            compile_options = {**list_mode_options(mode, dynamic), **compile_options}
            compile_mode = None
        else:
            raise ValueError(f"apply_compile: mode={mode!r} and backend options "
                             f"{sorted(compile_options)} together need backend='inductor'; "
                             "accepted: one of mode= or **options for other backends")
    eager = model._call_impl
    try:
        compiled = torch.compile(_entry(eager, label), mode=compile_mode, backend=backend,
                                 fullgraph=fullgraph, dynamic=dynamic,
                                 options=compile_options or None)
    except RuntimeError as exc:  # torch checks options (names, types) here, not lazily
        first = (str(exc).splitlines() or [""])[0].split(", known options")[0][:200]
        raise ValueError(f"apply_compile: options {sorted(options)} not accepted by "
                         f"torch.compile with backend={backend!r}: {first}") from exc
    # what nn.Module.compile() does, through a frame dynamo traces for any module
    model._compiled_call_impl = _CompileGuard(compiled, eager, label, bool(freezing))
    backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__",
                                                                    repr(backend))
    mark(model, "compile", mode=mode, backend=backend_name, fullgraph=fullgraph,
         dynamic=dynamic, freezing=bool(freezing), **options)
    return model
