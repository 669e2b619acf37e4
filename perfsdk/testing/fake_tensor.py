"""Tensors that say they live on a CUDA device (or in pinned memory) but compute on the CPU.

For testing code that decides by ``tensor.device`` / ``tensor.is_pinned()`` — the sync detector
among them — on a machine without a GPU. The data stays a CPU tensor inside; every ATen operator
runs on it and results are wrapped again, except copies to the CPU, which come back as plain CPU
tensors. torch's Python bindings put a CUDA device guard around some calls before they reach the
dispatcher (indexing with ``x[i]``, ``int(x)``, ``float(x)``, ``torch.nonzero``), and those
raise ``RuntimeError`` on a CPU-only build: use the operator form there
(``torch.ops.aten.index.Tensor``) or a real GPU. ``.tolist()`` is answered by the fake itself
(torch refuses it on subclasses), so it is not a torch call on these tensors.

**Autograd.** A CPU-only build of torch cannot hold a CUDA tensor in an autograd graph: the
engine asks for the CUDA device guard and the process aborts (``c10::Error: PyTorch is not
linked with support for cuda devices``, which no ``except`` can catch). So a
:class:`FakeCudaTensor` never takes part in autograd itself: where gradients are recorded (grad
mode on and an input that requires grad, a fake's data or a plain tensor such as a parameter),
its ``__torch_function__`` runs the call on the CPU data, where autograd records it, and wraps
the result again. ``requires_grad``, ``grad``, ``grad_fn``, ``is_leaf``, ``retain_grad()``,
``register_hook()``, ``backward()`` and ``torch.autograd.grad`` all answer from the data, so
``FakeCudaTensor(torch.randn(4, 8, requires_grad=True))`` trains like a tensor on a GPU, and
gradients come back as fake CUDA tensors. Operators recorded that way reach torch's dispatcher
(and a ``TorchDispatchMode`` such as the fake CUDA graph's recorder) as CPU tensors; reading a
value to the host (``.item()``, ``bool()``, printing) still goes through the fake, so the sync
detector sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from perfsdk import _device
from perfsdk.testing.fake_cuda import FakeCuda

__all__ = ["FakeCudaTensor", "FakePinnedTensor"]

_CUDA = torch.device("cuda", 0)
_T: Any = torch.Tensor  # its getset descriptors, untyped


def _unwrap(value: Any) -> Any:
    return value._data if isinstance(value, _Wrapper) else value


class _Wrapper(torch.Tensor):
    """A tensor subclass holding a plain CPU tensor in ``_data``."""

    _data: torch.Tensor
    _device: torch.device | None = None  # None: the data's own device

    @staticmethod
    def __new__(cls: Any, data: torch.Tensor) -> Any:
        out = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype,
            device=cls._device or data.device,
            # a CUDA tensor in an autograd graph aborts a CPU-only build: the data holds it
            requires_grad=data.requires_grad and cls._device is None)
        out._data = data
        return out

    def __format__(self, format_spec: str) -> str:
        # torch formats 0-d elements of plain tensors only; printing goes through here
        if self.dim() == 0:
            return self._data.item().__format__(format_spec)
        return super().__format__(format_spec)  # type: ignore[no-untyped-call, no-any-return]

    def tolist(self) -> Any:  # torch refuses .tolist() on subclasses; printing needs it
        return self._data.tolist()


# -- FakeCudaTensor's autograd: the calls answered from the CPU data ----------------------------
def _grad(self: FakeCudaTensor) -> Any:
    grad = self._data.grad
    if grad is None:
        return None
    cached = self.__dict__.get("_grad_view")
    if cached is None or cached._data is not grad:  # the same wrapper while the grad is
        cached = self.__dict__["_grad_view"] = FakeCudaTensor(grad)
    return cached


def _set_grad(self: FakeCudaTensor, value: Any) -> None:
    self._data.grad = _unwrap(value)


def _set_requires_grad(self: FakeCudaTensor, value: bool) -> None:
    self._data.requires_grad = value


def _requires_grad_(self: FakeCudaTensor, requires_grad: bool = True) -> FakeCudaTensor:
    self._data.requires_grad_(requires_grad)
    return self


def _register_hook(self: FakeCudaTensor, hook: Callable[[Any], Any]) -> Any:
    def on_cpu(grad: torch.Tensor) -> Any:
        new = hook(FakeCudaTensor(grad))
        return None if new is None else _unwrap(new)
    return self._data.register_hook(on_cpu)  # type: ignore[no-untyped-call]


_FROM_DATA: dict[Any, Callable[..., Any]] = {
    _T.requires_grad.__get__: lambda self: self._data.requires_grad,
    _T.requires_grad.__set__: _set_requires_grad,
    _T.requires_grad_: _requires_grad_,
    _T.grad.__get__: _grad,
    _T.grad.__set__: _set_grad,
    _T.grad_fn.__get__: lambda self: self._data.grad_fn,
    _T.is_leaf.__get__: lambda self: self._data.is_leaf,
    _T.retains_grad.__get__: lambda self: self._data.retains_grad,
    _T.retain_grad: lambda self: self._data.retain_grad(),
    _T.register_hook: _register_hook,
}
"""Autograd state lives on the data: these are answered from it, with or without grad mode."""

_HOST_READS = frozenset({
    _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__complex__, _T.numpy,
    _T.__repr__, _T.__format__, _T.__array__,
})
"""Reads of a value to the host: they record no gradient, and on a GPU they synchronize, so
they go to the dispatcher on a detached fake, where the sync detector sees a CUDA tensor."""

_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})


def _records_grad(args: Any, kwargs: Any) -> bool:
    """Whether autograd would record this call: grad mode on and an input requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, FakeCudaTensor):
            if t._data.requires_grad:
                return True
        elif isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def _detached(value: Any) -> Any:
    return FakeCudaTensor(value._data.detach()) if isinstance(value, FakeCudaTensor) else value


def _with_autograd(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on the CPU data, recorded by autograd there; results wrapped as fakes again
    (an input returned by an in-place call comes back as its own wrapper)."""
    self = args[0] if args else None
    if isinstance(self, FakeCudaTensor) and func in (_T.to, _T.cpu, _T.cuda):
        return _move(func, self, args[1:], kwargs)
    inputs: dict[int, tuple[torch.Tensor, Any]] = {}  # id of what func sees -> (it, returned)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, FakeCudaTensor):
            inputs[id(t._data)] = (t._data, t)
        elif isinstance(t, torch.Tensor):
            inputs[id(t)] = (t, t)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

    def wrap(t: Any) -> Any:
        if type(t) is not torch.Tensor:
            return t
        seen, returned = inputs.get(id(t), (None, None))
        if seen is t:  # an input given back (in-place calls, out=): the caller's own object
            return returned
        return FakeCudaTensor(t) if t.device.type == "cpu" else t
    return tree_map(wrap, out)


def _move(func: Any, self: FakeCudaTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``.to()``, ``.cpu()``, ``.cuda()`` with gradients recorded: a copy to the host is a plain
    CPU tensor (a copy, as from a GPU), anything else stays a fake."""
    data = self._data
    if func is _T.cpu:
        fmt = kwargs.get("memory_format", args[0] if args else torch.preserve_format)
        return data.to("cpu", copy=True, memory_format=fmt)
    if func is _T.cuda:
        fmt = kwargs.get("memory_format", torch.preserve_format)
        out = data.to(memory_format=fmt)
        return self if out is data else FakeCudaTensor(out)
    with torch._C.DisableTorchFunctionSubclass():  # x.to(other_fake): other's own device
        device, dtype, non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
    options: dict[str, Any] = {"dtype": dtype or data.dtype, "non_blocking": non_blocking,
               "memory_format": fmt or torch.preserve_format}
    if device is not None and device.type == "cpu":
        return data.to("cpu", copy=True, **options)
    if device is not None and device.type != "cuda":
        return data.to(device, copy=bool(kwargs.get("copy", False)), **options)
    out = data.to("cpu", copy=bool(kwargs.get("copy", False)), **options)
    return self if out is data else FakeCudaTensor(out)


_OPERATOR_SYNCS = frozenset({torch.ops.aten._local_scalar_dense.default,
                             torch.ops.aten.nonzero.default})
"""Operators that synchronize on a GPU from inside: with a fake GPU in use they are reported to
it as torch's sync debug mode reports them (``FakeCuda.operator_sync``)."""


def _fake_backend() -> Any:
    backend = _device.get_backend()
    return backend if isinstance(backend, FakeCuda) else None


class FakeCudaTensor(_Wrapper):
    """A CPU tensor that reports ``device == cuda:0``. Build with ``FakeCudaTensor(tensor)``;
    gradients work (see the module's notes on autograd)."""

    _device = _CUDA

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        from_data = _FROM_DATA.get(func)
        if from_data is not None:
            return from_data(*args, **kwargs)
        try:
            if getattr(func, "__name__", None) not in _ACCESSORS and _records_grad(args, kwargs):
                if func in _HOST_READS:
                    return func(*tree_map(_detached, args), **tree_map(_detached, kwargs))
                return _with_autograd(func, args, kwargs)
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        finally:  # the call returns to Python: torch's C++ warnings are delivered now
            fake = _fake_backend()
            if fake is not None:
                fake.deliver_held()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _OPERATOR_SYNCS:
            fake = _fake_backend()
            if fake is not None:
                fake.operator_sync(func._schema.name)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten.is_pinned.default:
            return False
        if func is torch.ops.aten._to_copy.default:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                return out
        if func is torch.ops.aten.copy_.default and not isinstance(args[0], FakeCudaTensor):
            return args[0]  # a copy into host memory stays a host tensor
        return tree_map(lambda t: cls(t) if type(t) is torch.Tensor else t, out)


class FakePinnedTensor(_Wrapper):
    """A CPU tensor that reports ``is_pinned() == True`` (a CPU-only build cannot pin memory)."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten.is_pinned.default:
            return True
        return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
