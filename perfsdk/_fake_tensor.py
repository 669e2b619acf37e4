"""Tensors that say they live on a CUDA device (or in pinned memory) but compute on the CPU.

For testing code that decides by ``tensor.device`` / ``tensor.is_pinned()`` — the sync detector
among them — on a machine without a GPU. The data stays a CPU tensor inside; every ATen operator
runs on it and results are wrapped again, except copies to the CPU, which come back as plain CPU
tensors. torch's Python bindings put a CUDA device guard around some calls before they reach the
dispatcher (indexing with ``x[i]``, ``int(x)``, ``float(x)``, ``torch.nonzero``), and those
raise ``RuntimeError`` on a CPU-only build: use the operator form there
(``torch.ops.aten.index.Tensor``) or a real GPU. ``.tolist()`` is answered by the fake itself
(torch refuses it on subclasses), so it is not a torch call on these tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["FakeCudaTensor", "FakePinnedTensor"]

_CUDA = torch.device("cuda", 0)


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
            device=cls._device or data.device, requires_grad=data.requires_grad)
        out._data = data
        return out

    def __format__(self, format_spec: str) -> str:
        # torch formats 0-d elements of plain tensors only; printing goes through here
        if self.dim() == 0:
            return self._data.item().__format__(format_spec)
        return super().__format__(format_spec)  # type: ignore[no-untyped-call, no-any-return]

    def tolist(self) -> Any:  # torch refuses .tolist() on subclasses; printing needs it
        return self._data.tolist()


class FakeCudaTensor(_Wrapper):
    """A CPU tensor that reports ``device == cuda:0``. Build with ``FakeCudaTensor(tensor)``."""

    _device = _CUDA

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
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
