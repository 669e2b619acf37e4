"""``apply_cuda_graphs``: replay the model's inference call as a CUDA graph.

A CUDA graph launches a whole forward pass with one call, removing the per-kernel launch cost
that dominates small batches. It replays exactly the kernels captured, on exactly the memory
they used, so the module keeps, per input signature (shapes, dtypes, non-tensor arguments,
autocast and inference mode), a captured graph with *static* input buffers:

- the first call with a new signature clones the inputs into static buffers, runs ``warmup``
  eager iterations on a side stream (lazy initialization, cuBLAS workspaces, autotuning must not
  happen during capture), and captures one call — under ``torch.autocast(...,
  cache_enabled=False)`` when autocast is on, since autocast's cache of cast weights does not
  survive a capture;
- every call copies its inputs into the static buffers, replays the graph inside an NVTX range
  (the ``cuda_graph.replay`` region) and returns the static outputs. The graph writes into the
  same output memory at every replay, so by default (``clone_outputs=True``) the outputs are
  cloned; with ``clone_outputs=False`` they are returned as they are and **overwritten by the
  next call**: use them (or ``.clone()`` them) before calling the model again.

Graphs are kept in a least-recently-used cache of at most ``max_shapes`` signatures, each graph
with its own memory pool. When inputs keep changing shape the cache evicts again and again,
every new shape pays a warm-up and a capture, and a warning says so once (pytorch#119640): pad
inputs to a few fixed shapes or raise ``max_shapes``.

Only inference is captured: calls with gradients on that need them (parameters or inputs that
require grad) run eagerly, with a warning once. For training, graph the forward and backward of
(parts of) the model with ``torch.cuda.make_graphed_callables``::

    model = torch.cuda.make_graphed_callables(model, (sample_input,))

Inputs that are not CUDA tensors on the model's device run eagerly (a CPU tensor's values would
be frozen into the graph). If the capture itself fails (an operation not allowed in a graph: a
host sync such as ``.item()``, a CPU tensor computed from inputs, data-dependent shapes), a
:class:`~perfsdk.errors.PerfSDKWarning` names the error and the model runs eagerly from then on;
errors of the model itself (raised by the eager warm-up) propagate unchanged.

The captures use ``capture_error_mode="thread_local"``, so other threads (perfsdk's event
poller, DataLoader pin-memory threads) may keep making CUDA calls during a capture. The graphs
read parameters from their memory, so in-place updates (``load_state_dict``, an optimizer step)
are seen by later replays; moving or replacing parameters after the first call is not (apply
this after ``model.to("cuda")``). Calls are serialized with a lock. All device calls go through
:mod:`perfsdk._device`, so the logic runs on :class:`perfsdk.testing.FakeCuda` in tests.

Example (on a GPU)::

    model = apply_cuda_graphs(model.cuda().eval())
    with torch.no_grad():
        out = model(x.cuda())  # the first call with this shape captures, later ones replay
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from perfsdk._device import Graph, get_backend
from perfsdk.errors import NoEffectWarning, warn_once
from perfsdk.optimize._marks import applied, mark
from perfsdk.sync.debug import DEBUG_MESSAGE, set_debug_mode
from perfsdk.timing import timed_region

__all__ = ["apply_cuda_graphs"]

# Tensor.copy_'s operator, without the Python binding's device guard (same kernel; this way the
# copy also runs on perfsdk.testing.FakeCudaTensor in a CPU-only build)
_copy = torch.ops.aten.copy_.default


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device_type`` here, and its dtype."""
    try:
        if torch.is_autocast_enabled(device_type):
            return True, torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: CUDA-only spellings
        if torch.is_autocast_enabled():
            return True, torch.get_autocast_gpu_dtype()
    return False, None


def _capture_autocast(device_type: str, dtype: torch.dtype | None
                      ) -> contextlib.AbstractContextManager[Any]:
    """The autocast the capture runs under: the caller's, with the cast cache off."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def _describe(exc: BaseException) -> str:
    """The error, after the one it was raised while handling (a failed capture's first error
    is usually the cause; ending the capture then raises again)."""
    chain: list[str] = []
    error: BaseException | None = exc
    while error is not None and len(chain) < 3:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        chain.append(f"{type(error).__name__}: {' '.join(lines[:2])[:200]}")
        error = error.__context__
    return "; then ".join(reversed(chain))


class _Entry:
    __slots__ = ("graph", "inputs", "output")

    def __init__(self, graph: Graph, inputs: list[torch.Tensor], output: Any) -> None:
        self.graph = graph
        self.inputs = inputs
        self.output = output


class _GraphRunner:
    """Stands in ``module._compiled_call_impl``: replays a captured graph per input signature,
    running the previous call (compiled or eager) to warm up, to capture and as the fallback."""

    transform = "cuda_graphs"  # its name in fallbacks()

    def __init__(self, model: nn.Module, inner: Callable[..., Any], device: torch.device,
                 max_shapes: int, warmup: int, clone_outputs: bool) -> None:
        self.model = model
        self.inner = inner
        self.device = device
        self.max_shapes = max_shapes
        self.warmup = warmup
        self.clone_outputs = clone_outputs
        self.label = type(model).__name__
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.evictions = 0
        self.failed: BaseException | None = None
        self._lock = threading.Lock()
        self._region = timed_region("cuda_graph.replay")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.inner(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        if torch.is_grad_enabled() and self._needs_grad(leaves):
            warn_once(f"cuda-graphs-grad:{self.label}",
                      f"perfsdk: apply_cuda_graphs on {self.label}: CUDA graphs are captured for "
                      "inference only; calls that need gradients run eagerly. Call the model "
                      "under torch.no_grad() / torch.inference_mode(), or for training use "
                      "torch.cuda.make_graphed_callables.")
            return self.inner(*args, **kwargs)
        amp = _autocast_state(self.device.type)
        key = self._key(leaves, spec, amp)
        if key is None:
            return self.inner(*args, **kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                entry = self._capture(key, leaves, spec, amp[1])
                if entry is None:  # the capture failed: eager from now on
                    return self.inner(*args, **kwargs)
            else:
                self.entries.move_to_end(key)
                for static, x in zip(entry.inputs, tensors, strict=True):
                    _copy(static, x)
            with self._region:
                entry.graph.replay()
            self.replays += 1
            if not self.clone_outputs:
                return entry.output
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                            entry.output)

    def _fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.entries.clear()
        warn_once(f"cuda-graphs-capture:{self.label}",
                  f"perfsdk: apply_cuda_graphs: capturing {self.label} failed "
                  f"({_describe(exc)}); running eagerly from now on.")

    def _needs_grad(self, leaves: list[Any]) -> bool:
        return (any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
                or any(p.requires_grad for p in self.model.parameters()))

    def _key(self, leaves: list[Any], spec: Any,
             amp: tuple[bool, torch.dtype | None]) -> Hashable | None:
        parts: list[Hashable] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.device.type != self.device.type or (
                        self.device.index is not None and x.device.index != self.device.index):
                    warn_once(f"cuda-graphs-device:{self.label}",
                              f"perfsdk: apply_cuda_graphs on {self.label}: an input is on "
                              f"{x.device}, not {self.device}; such calls run eagerly (a host "
                              "tensor's values would be frozen into the graph).")
                    return None
                parts.append((tuple(x.shape), x.dtype))
            else:
                try:
                    hash(x)
                except TypeError:
                    warn_once(f"cuda-graphs-unhashable:{self.label}",
                              f"perfsdk: apply_cuda_graphs on {self.label}: calls with a "
                              f"non-tensor argument of type {type(x).__name__} (unhashable, so "
                              "it cannot select a graph) run eagerly.")
                    return None
                parts.append((type(x), x))
        return (spec, tuple(parts), torch.is_inference_mode_enabled(), amp)

    def _capture(self, key: Hashable, leaves: list[Any], spec: Any,
                 autocast_dtype: torch.dtype | None) -> _Entry | None:
        if len(self.entries) >= self.max_shapes:  # free the oldest graph's memory first
            self.entries.popitem(last=False)
            self.evictions += 1
            if self.evictions >= max(2, self.max_shapes):
                warn_once(f"cuda-graphs-shapes:{self.label}",
                          f"perfsdk: apply_cuda_graphs on {self.label}: input shapes keep "
                          f"changing ({self.captures + 1} graphs captured, {self.evictions} "
                          f"evicted from max_shapes={self.max_shapes}); every new shape costs a "
                          "warm-up and a capture, likely more than the graphs save. Pad inputs "
                          "to a few fixed shapes or raise max_shapes (pytorch#119640).")
        backend = get_backend()
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(static, spec)
        device_type = self.device.type
        syncs = 0
        if self.warmup:  # on a side stream, as torch's graph recipe does
            side = backend.Stream()
            side.wait_stream(backend.current_stream())
            with backend.stream(side):
                for i in range(self.warmup):
                    with _capture_autocast(device_type, autocast_dtype):
                        if i == self.warmup - 1:
                            syncs = _counting_syncs(backend, self.inner, args, kwargs)
                        else:
                            self.inner(*args, **kwargs)
            backend.current_stream().wait_stream(side)
        if syncs:  # a capture would fail, and a failed capture can leave torch broken
            self._fail(RuntimeError(
                f"the call synchronizes with the host ({syncs} time(s) in its last warm-up "
                "call, seen by torch's sync debug mode), which a CUDA graph cannot capture; "
                "perfsdk.no_sync_guard() names the lines"))
            return None
        graph = backend.CUDAGraph()
        before = backend.current_stream()
        try:
            # the outer stream context: a failed capture's exit leaves its own stream current
            with backend.stream(before), \
                    backend.graph(graph, capture_error_mode="thread_local"), \
                    _capture_autocast(device_type, autocast_dtype):
                output = self.inner(*args, **kwargs)
        except Exception as exc:
            _settle_failed_capture(backend)
            self._fail(exc)
            return None
        self.captures += 1
        entry = _Entry(graph, [x for x in static if isinstance(x, torch.Tensor)], output)
        self.entries[key] = entry
        return entry


def _counting_syncs(backend: Any, inner: Callable[..., Any], args: Any, kwargs: Any) -> int:
    """Run ``inner`` once with torch's sync debug mode on ``warn``; how many syncs it made
    (None of the program's own setting is changed: a mode already on is left alone, and then
    nothing is counted)."""
    try:
        if backend.get_sync_debug_mode() != 0:
            inner(*args, **kwargs)
            return 0
        set_debug_mode(backend, 1)
    except Exception:  # no debug mode here: the capture itself will tell
        inner(*args, **kwargs)
        return 0
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            inner(*args, **kwargs)
    finally:
        set_debug_mode(backend, 0)
    syncs = 0
    for w in seen:
        if issubclass(w.category, UserWarning) and DEBUG_MESSAGE in str(w.message):
            syncs += 1
        else:  # the call's own warnings go on to the program
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return syncs


def _settle_failed_capture(backend: Any) -> None:
    """After a capture that raised: torch ended it before its RNG generators' epilogue, so
    their state still says "capturing" and every later random op on the device raises
    ("Offset increment outside graph capture"). An empty capture that succeeds runs the
    epilogue and puts them back; the generators' offsets are not advanced by it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the graph is empty
            empty = backend.CUDAGraph()
            with backend.stream(backend.current_stream()), backend.graph(empty):
                pass
            del empty
    except Exception as exc:
        warn_once("cuda-graphs-settle", f"perfsdk: apply_cuda_graphs: after a failed "
                  f"capture, torch's CUDA state could not be put back ({_describe(exc)}); "
                  "random numbers on the GPU may fail in this process.")


def _model_device(model: nn.Module) -> torch.device | None:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return None


def _check(max_shapes: int, warmup: int, clone_outputs: bool) -> None:
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
        raise ValueError(f"apply_cuda_graphs: max_shapes={max_shapes!r}; accepted values are "
                         "integers >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"apply_cuda_graphs: warmup={warmup!r}; accepted values are integers "
                         ">= 0")
    if not isinstance(clone_outputs, bool):
        raise ValueError(f"apply_cuda_graphs: clone_outputs={clone_outputs!r}; accepted values "
                         "are True, False")


def _no_effect(message: str) -> None:
    warnings.warn(f"apply_cuda_graphs: {message}; model returned unchanged.", NoEffectWarning,
                  stacklevel=3)


def apply_cuda_graphs(model: nn.Module, *, max_shapes: int = 8, warmup: int = 3,
                      clone_outputs: bool = True,
                      device: torch.device | str | None = None) -> nn.Module:
    """Capture the model's inference calls as CUDA graphs and replay them.

    Args:
        model: The module, already on its CUDA device. Modified in place and returned.
        max_shapes: How many input signatures (shapes, dtypes, ...) keep a graph; the least
            recently used is evicted beyond that.
        warmup: Eager iterations on a side stream before each capture.
        clone_outputs: Return copies of the graph's outputs (True) or the static outputs
            themselves (False: overwritten by the next call).
        device: The device the graphs run on; None: the device of the model's parameters.

    Returns:
        The same module object. On a CPU model (or without CUDA, or applied twice, or on a
        model compiled with ``mode="reduce-overhead"``, which already uses CUDA graphs) it warns
        with :class:`NoEffectWarning` and leaves the model unchanged.

    Raises:
        ValueError: An argument outside the accepted values (the message names it).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_cuda_graphs: model={type(model).__name__} is not an nn.Module")
    _check(max_shapes, warmup, clone_outputs)
    label = type(model).__name__
    try:
        where = torch.device(device) if device is not None else _model_device(model)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"apply_cuda_graphs: device={device!r} is not a device; accepted "
                         "values are None, a torch.device or a string such as 'cuda:0'") from exc
    if where is None:
        _no_effect(f"{label} has no parameters or buffers to tell its device (pass device=)")
        return model
    if where.type != "cuda":
        _no_effect(f"{label} is on {where}; CUDA graphs need a CUDA device")
        return model
    if not get_backend().is_initialized():
        _no_effect("CUDA is not initialized (move the model to the GPU first)")
        return model
    # what is in place now: a copy (deepcopy, pickle) keeps the marks but drops the wrappers
    current = model._compiled_call_impl
    if isinstance(current, _GraphRunner):
        _no_effect(f"already applied to {label}")
        return model
    if current is not None and applied(model).get("compile", {}).get("mode") == "reduce-overhead":
        _no_effect(f"{label} is compiled with mode='reduce-overhead', which already captures "
                   "CUDA graphs")
        return model
    inner = model._compiled_call_impl or model._call_impl
    model._compiled_call_impl = _GraphRunner(model, inner, where, max_shapes, warmup,
                                             clone_outputs)
    mark(model, "cuda_graphs", max_shapes=max_shapes, warmup=warmup,
         clone_outputs=clone_outputs, device=str(where))
    return model
