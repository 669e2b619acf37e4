"""Backend switches in one place: ``cudnn.benchmark`` and TF32.

- ``cudnn_benchmark``: cuDNN times several convolution algorithms for each new input shape
  and keeps the fastest (a slower first call per shape; a win when shapes repeat).
- ``tf32``: float32 matrix multiplications and convolutions on Ampere and newer GPUs use
  TensorFloat-32 (10-bit mantissa inputs, float32 accumulation): several times faster,
  about 1e-3 relative error. Sets ``torch.backends.cuda.matmul.allow_tf32``,
  ``torch.backends.cudnn.allow_tf32`` and ``torch.set_float32_matmul_precision`` ("high" or
  "highest").

These are process-wide flags. Reading and setting them never initializes CUDA, so this is safe
before ``fork`` and on CPU-only machines (where they change nothing measurable).

Example:
    >>> from perfsdk.optimize.backends import backend_flags, restore_backends, set_backends
    >>> previous = set_backends(cudnn_benchmark=True, tf32=True)
    >>> backend_flags()["cudnn_benchmark"]
    True
    >>> restore_backends(previous)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["backend_flags", "restore_backends", "set_backends"]

_PRECISIONS = ("highest", "high", "medium")


def _read(legacy: Callable[[], Any], new: Callable[[], Any]) -> bool:
    """A TF32 flag. torch >= 2.9 refuses the legacy getter after the new ``fp32_precision``
    API was used for a related flag (RuntimeError); then the new API answers."""
    try:
        return bool(legacy())
    except RuntimeError:
        return bool(new() == "tf32")


def _precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # mixed legacy/new APIs (torch >= 2.9): derive it from the new one
        return "high" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "highest"


def backend_flags() -> dict[str, Any]:
    """The current values, as a dict that :func:`restore_backends` takes back.

    Keys: ``cudnn_benchmark``, ``matmul_allow_tf32``, ``cudnn_allow_tf32`` (bools) and
    ``float32_matmul_precision`` (``"highest"``, ``"high"`` or ``"medium"``).
    """
    cudnn: Any = torch.backends.cudnn  # ``conv.fp32_precision``: torch >= 2.9 only
    return {
        "cudnn_benchmark": bool(cudnn.benchmark),
        "matmul_allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32,
                                   lambda: torch.backends.cuda.matmul.fp32_precision),
        "cudnn_allow_tf32": _read(lambda: cudnn.allow_tf32, lambda: cudnn.conv.fp32_precision),
        "float32_matmul_precision": _precision(),
    }


def _check(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"set_backends: {name}={value!r}; accepted values are None (leave it), "
                         "True, False")


def set_backends(*, cudnn_benchmark: bool | None = None,
                 tf32: bool | None = None) -> dict[str, Any]:
    """Set backend flags; None leaves a flag as it is.

    Args:
        cudnn_benchmark: ``torch.backends.cudnn.benchmark``.
        tf32: True: TF32 for float32 matmuls and cuDNN convolutions, float32 matmul precision
            "high". False: neither, precision "highest" (exact float32).

    Returns:
        The values before the call (:func:`backend_flags`); pass them to
        :func:`restore_backends` to undo.

    Raises:
        ValueError: An argument that is not None, True or False (the message names it).
    """
    _check("cudnn_benchmark", cudnn_benchmark)
    _check("tf32", tf32)
    previous = backend_flags()
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return previous


def restore_backends(flags: Mapping[str, Any]) -> None:
    """Set the flags in ``flags`` (as :func:`backend_flags` / :func:`set_backends` return them);
    keys absent from it are left as they are.

    Raises:
        ValueError: An unknown key or a value of the wrong kind (the message names it).
    """
    known = ("cudnn_benchmark", "matmul_allow_tf32", "cudnn_allow_tf32",
             "float32_matmul_precision")
    unknown = sorted(set(flags) - set(known))
    if unknown:
        raise ValueError(f"restore_backends: flags has unknown keys {unknown}; accepted keys "
                         f"are {', '.join(known)}")
    for key in known[:3]:
        if key in flags and not isinstance(flags[key], bool):
            raise ValueError(f"restore_backends: flags[{key!r}]={flags[key]!r}; accepted "
                             "values are True, False")
    precision = flags.get("float32_matmul_precision")
    if precision is not None and precision not in _PRECISIONS:
        raise ValueError(f"restore_backends: flags['float32_matmul_precision']={precision!r}; "
                         f"accepted values are {', '.join(map(repr, _PRECISIONS))}")
    if "cudnn_benchmark" in flags:
        torch.backends.cudnn.benchmark = bool(flags["cudnn_benchmark"])
    if "matmul_allow_tf32" in flags:
        torch.backends.cuda.matmul.allow_tf32 = bool(flags["matmul_allow_tf32"])
    if "cudnn_allow_tf32" in flags:
        torch.backends.cudnn.allow_tf32 = bool(flags["cudnn_allow_tf32"])
    if precision is not None:  # after allow_tf32, which also sets the precision
        torch.set_float32_matmul_precision(precision)
