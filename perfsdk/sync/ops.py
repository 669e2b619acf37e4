"""The sync detector: which tensor operations make the host wait for the device.

Two torch modes see every operation on the thread they are pushed on: a ``TorchFunctionMode``
for the Python-level calls that never reach the dispatcher on a CPU tensor (``.tolist()``,
``.cpu()``, ``.numpy()``, printing) and a ``TorchDispatchMode`` for the ATen operators that
synchronize on a CUDA device (``aten::_local_scalar_dense`` behind ``.item()`` / ``int()`` /
``bool()``, ``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, device-to-host copies, non-blocking copies from
pageable memory). Each classifier answers an op label from :data:`OPS` or None.

A tensor counts as a device tensor when it lives on a device other than the CPU (or ``meta``),
or, with ``assume_device=True``, always: then a CPU-only run flags what *would* synchronize on a
GPU. Except what is known to be on the host: the result of ``.cpu()``, of ``.to("cpu")`` of a
device tensor, and what an operation computes from such results only (``x.cpu().sum()``). On a
CPU-only run ``x.cpu()`` returns ``x`` itself; under ``assume_device`` the detector hands back an
alias of it instead (a view, as a copy from a GPU would be a new tensor), so that only the alias,
not ``x``, is taken as the host copy. What this module decides is reported through the
``report`` callback given to :func:`push_modes`; it never raises on its own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
)

__all__ = ["OPS", "on_host", "push_modes", "pop_modes"]

OPS: dict[str, str] = {
    # label: how to avoid it (shown in warnings, errors and the docs)
    "item": "keep the value on the device (accumulate with tensor ops) and read it every N "
            "steps; int()/float()/bool()/.item() and `if tensor:` all copy it to the host",
    "tolist": "keep the tensor on the device, or copy it with .to('cpu', non_blocking=True) "
              "into pinned memory and read it after a later sync point",
    "numpy": "move the tensor with .to('cpu', non_blocking=True) and read it later",
    "to_host": "copy with .to('cpu', non_blocking=True) and read the result after a later sync "
               "point, or keep the work on the device",
    "print": "log every N steps, or log a value accumulated on the device",
    "nonzero": "use a mask (torch.where, masked_fill, multiplication) instead of indices; "
               "the output size depends on the data",
    "masked_select": "use torch.where or multiply by the mask; the output size depends on "
                     "the data",
    "unique": "the output size depends on the data; precompute it, or pass a known size "
              "where the API allows",
    "mask_index": "use torch.where / masked_fill, or keep a fixed size; x[mask] has a "
                  "data-dependent size",
    "mask_assign": "use x.masked_fill_(mask, v) or torch.where(mask, v, x) instead of "
                   "x[mask] = v",
    "repeat_interleave": "pass output_size= so the output size need not be read from the "
                         "device",
    "pageable_copy": "non_blocking=True from pageable memory still waits; pin the source "
                     "(DataLoader(pin_memory=True) or tensor.pin_memory())",
    "synchronize": "remove it from the hot path; measure with perfsdk regions (CUDA events) "
                   "instead of synchronize + time.time()",
    "event_synchronize": "use event.query(), or let perfsdk resolve event times in the "
                         "background",
    "stream_synchronize": "order work with events (stream.wait_event) instead of waiting "
                          "on the host",
    "cuda": "torch's CUDA sync debug mode reported this operation as synchronizing",
}

_HOST = frozenset({"cpu", "meta"})
_aten = torch.ops.aten


# Tensors known to be on the host although assume_device stands every tensor for a device one:
# results of copies to the host, and what was computed from those alone. By id, with a weak
# reference to tell a live tensor from a later one with the same id (tensors compare
# elementwise, so they cannot be members of a WeakSet).
_ON_HOST: dict[int, weakref.ref[torch.Tensor]] = {}


def _forget(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _ON_HOST.get(key) is ref:
            _ON_HOST.pop(key, None)
    return forget


def _mark_host(value: Any) -> None:
    """Remember the tensors in ``value`` (a tensor, or a tuple or list of them) as host ones."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for t in items:
        if isinstance(t, torch.Tensor) and t.device.type in _HOST:
            key = id(t)
            try:
                _ON_HOST[key] = weakref.ref(t, _forget(key))
            except TypeError:  # not weakly referenceable: stays a device tensor
                pass


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is known to be a host copy (a result of ``.cpu()``, or computed from those
    alone), which ``assume_device`` does not take for a device tensor."""
    ref = _ON_HOST.get(id(t))
    return ref is not None and ref() is t


def _dev(t: Any, assume: bool) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type not in _HOST:
        return True
    return assume and not (_ON_HOST and on_host(t))


def _all_host(args: tuple[Any, ...]) -> bool:
    """Whether the tensors among ``args`` (one level into lists and tuples) are all host copies
    (and there is at least one)."""
    seen = False
    for a in args:
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor):
                if not on_host(t):
                    return False
                seen = True
    return seen


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except Exception:  # pinned memory needs an accelerator build
        return False


def _first(label: str) -> Callable[[tuple[Any, ...], dict[str, Any], bool], str | None]:
    def classify(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
        return label if args and _dev(args[0], assume) else None
    return classify


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _index(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    if len(args) > 1 and _dev(args[0], assume) and _bool_index(args[1]):
        return "mask_index"
    return None


def _index_put(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    if len(args) > 1 and _dev(args[0], assume) and _bool_index(args[1]):
        return "mask_assign"
    return None


def _repeat(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    if kwargs.get("output_size") is not None or (len(args) > 2 and args[2] is not None):
        return None
    return "repeat_interleave" if args and _dev(args[0], assume) else None


def _copy(dst_host: bool, src: Any, non_blocking: bool, dst_pinned: Callable[[], bool]
          ) -> str | None:
    """A copy between host and device memory: real devices only (``assume_device`` cannot tell
    a CPU tensor that stands for a device tensor from a host one at this level)."""
    src_host = src.device.type in _HOST
    if dst_host and not src_host:  # device -> host
        return None if non_blocking and dst_pinned() else "to_host"
    if not dst_host and src_host and non_blocking and not _pinned(src):
        return "pageable_copy"
    return None


def _to_copy(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    src = args[0]
    device = kwargs.get("device")
    if device is None:
        return None
    dst_host = torch.device(device).type in _HOST
    # torch allocates a pinned destination for a non-blocking device-to-host _to_copy
    return _copy(dst_host, src, bool(kwargs.get("non_blocking")), lambda: True)


def _copy_(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    dst, src = args[0], args[1]
    if not isinstance(src, torch.Tensor):
        return None
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return _copy(dst.device.type in _HOST, src, non_blocking, lambda: _pinned(dst))


_DISPATCH: dict[Any, Callable[[tuple[Any, ...], dict[str, Any], bool], str | None]] = {
    _aten._local_scalar_dense.default: _first("item"),
    _aten.is_nonzero.default: _first("item"),
    _aten.equal.default: _first("item"),
    _aten.allclose.default: _first("item"),
    _aten.nonzero.default: _first("nonzero"),
    _aten.masked_select.default: _first("masked_select"),
    _aten._unique.default: _first("unique"),
    _aten._unique2.default: _first("unique"),
    _aten.unique_dim.default: _first("unique"),
    _aten.unique_consecutive.default: _first("unique"),
    _aten.unique_dim_consecutive.default: _first("unique"),
    _aten.index.Tensor: _index,
    _aten.index_put_.default: _index_put,
    _aten.index_put.default: _index_put,
    _aten._index_put_impl_.default: _index_put,
    _aten.repeat_interleave.Tensor: _repeat,
    _aten.repeat_interleave.self_Tensor: _repeat,
    _aten._to_copy.default: _to_copy,
    _aten.copy_.default: _copy_,
}


def _to_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """Target device and non_blocking of ``Tensor.to(...)`` in any of its three forms."""
    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    rest = list(args[1:])
    if rest:
        first = rest.pop(0)
        if isinstance(first, torch.Tensor):
            device = first.device
        elif isinstance(first, (str, int, torch.device)):
            device = first
            if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
                rest.pop(0)
        if rest:
            non_blocking = rest[0]
    return device, bool(non_blocking)


def _fn_to(args: tuple[Any, ...], kwargs: dict[str, Any], assume: bool) -> str | None:
    src = args[0]
    device, non_blocking = _to_args(args, kwargs)
    if device is None or not isinstance(src, torch.Tensor):
        return None
    dst_host = torch.device(device).type in _HOST
    if dst_host and src.device.type in _HOST:
        # On a CPU-only run x.to("cpu") and x.to(device) are the same call; it is read as the
        # host-to-device move portable code writes, which never synchronizes.
        return None
    return _copy(dst_host, src, non_blocking, lambda: True)


_Tensor = torch.Tensor
_FUNCTION: dict[Any, Callable[[tuple[Any, ...], dict[str, Any], bool], str | None]] = {
    _Tensor.tolist: _first("tolist"),
    _Tensor.numpy: _first("numpy"),
    _Tensor.__array__: _first("numpy"),
    _Tensor.cpu: _first("to_host"),
    _Tensor.to: _fn_to,
    _Tensor.__repr__: _first("print"),
    _Tensor.__str__: _first("print"),
    _Tensor.__format__: _first("print"),
}

def _copied_to_host(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """``Tensor.to`` moved a device tensor to the host (``x.to("cpu")`` of a CPU tensor is read
    as the upload portable code writes: see :func:`_fn_to`)."""
    src = args[0] if args else None
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.device.type not in _HOST and out.device.type in _HOST)


def _host_copy(src: Any, out: Any, scope: Any) -> Any:
    """The result of a copy to the host, remembered as such. A CPU tensor's ``.cpu()`` is the
    tensor itself: under ``assume_device`` an alias stands for the copy a GPU would make, so the
    source stays a device tensor (not for a parameter or another leaf that requires grad, whose
    identity module code relies on: ``Module.cpu()`` sets ``param.data`` to the result)."""
    if not isinstance(out, torch.Tensor):
        return out
    if out is src:
        if (scope is None or not scope.assume_any or isinstance(out, torch.nn.Parameter)
                or (out.requires_grad and out.is_leaf)):
            return out
        try:
            out = out.view_as(out)
        except Exception:  # a layout without views (sparse): left as it is
            return src
    _mark_host(out)
    return out


Report = Callable[[str, str, bool], bool]
"""``report(label, operator, real)``: record a sync (``real``: it is one without
``assume_device`` too); the guard raises from inside the callback in ``error`` mode."""


def _classify(classify: Callable[[tuple[Any, ...], dict[str, Any], bool], str | None],
              args: tuple[Any, ...], kwargs: dict[str, Any], scope: Any
              ) -> tuple[str | None, bool]:
    """The label under the widest ``assume_device`` of the open guards, and whether the sync
    is real (a guard without ``assume_device`` counts only those)."""
    assume = scope.assume_any
    label = classify(args, kwargs, assume)
    if label is None or not assume:
        return label, True
    return label, classify(args, kwargs, False) is not None


class _Local(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.quiet = 0  # > 0 inside an operation already classified at a higher level
        # Operators the dispatch mode decided in the current user-level call. On a GPU, torch's
        # sync debug mode warns from C++, and the warning reaches Python only when the
        # outermost torch call returns (``Tensor.item``, ``Tensor.__getitem__``), after the
        # operator and its ``quiet`` are done: it is the same sync, already decided.
        self.decided = 0
        self.modes: tuple[_FunctionMode, _DispatchMode] | None = None


LOCAL = _Local()


class _FunctionMode(TorchFunctionMode):
    def __init__(self, active: Callable[[], Any], report: Report) -> None:
        super().__init__()
        self._active = active
        self._report = report

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        classify = _FUNCTION.get(func)
        local = LOCAL
        if classify is None:
            host = _ON_HOST and _all_host(args)  # computed from host copies alone: on the host
            decided, local.decided = local.decided, 0  # this call's own (see _Local.decided)
            try:
                out = func(*args, **kwargs)
            finally:
                local.decided = decided
            if host:
                _mark_host(out)
            return out
        scope = self._active()
        if scope is not None and not local.quiet:
            label, real = _classify(classify, args, kwargs, scope)
            if label is not None:
                self._report(label, f"Tensor.{func.__name__}", real)
        local.quiet += 1  # one report per user-level call: not again for its ATen operators
        try:
            out = func(*args, **kwargs)
        finally:
            local.quiet -= 1
        if func is _Tensor.cpu or (func is _Tensor.to and _copied_to_host(args, kwargs, out)):
            out = _host_copy(args[0], out, scope)
        return out


class _DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, active: Callable[[], Any], report: Report) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._active = active
        self._report = report

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        classify = _DISPATCH.get(func)
        if classify is None or LOCAL.quiet:
            return func(*args, **kwargs)
        scope = self._active()
        if scope is None:
            return func(*args, **kwargs)
        label, real = _classify(classify, args, kwargs, scope)
        if label is not None:
            self._report(label, func._schema.name, real)
        # Decided here either way: torch's sync debug mode must not second-guess it (a
        # blocking host-to-device copy waits on the stream, but is how a GPU is fed).
        local = LOCAL
        local.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            local.quiet -= 1
            local.decided += 1


def _on_stack(modes: tuple[_FunctionMode, _DispatchMode]) -> bool:
    fstack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return modes[0] in fstack and modes[1] in _get_current_dispatch_mode_stack()


def push_modes(active: Callable[[], Any], report: Report) -> None:
    """Enter the detector on this thread (nested entries share one pair of modes)."""
    local = LOCAL
    local.depth += 1
    if local.modes is not None and (local.depth > 1 or _on_stack(local.modes)):
        return  # nested, or left below a mode of the program's own last time: reuse it
    fmode, dmode = _FunctionMode(active, report), _DispatchMode(active, report)
    fmode.__enter__()  # type: ignore[no-untyped-call]
    try:
        dmode.__enter__()  # type: ignore[no-untyped-call]
    except BaseException:
        fmode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        local.depth -= 1
        raise
    local.modes = (fmode, dmode)


def pop_modes() -> None:
    """Leave the detector on this thread; the last exit pops the modes when they are on top.

    If the program pushed a mode of its own inside the guard and has not popped it yet, ours
    stays below it, inert (it reports only inside an active guard), and is reused next time.
    """
    local = LOCAL
    local.depth = max(0, local.depth - 1)
    if local.depth or local.modes is None:
        return
    fmode, dmode = local.modes
    stack = _get_current_dispatch_mode_stack()
    fstack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    if stack and stack[-1] is dmode and fstack and fstack[-1] is fmode:
        local.modes = None
        try:
            dmode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            fmode.__exit__(None, None, None)
