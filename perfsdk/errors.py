"""Exceptions and warnings, and the one place perfsdk reports its own trouble.

perfsdk never raises into a training run for its own failures: it warns once per kind of
trouble and counts every occurrence (see :func:`perfsdk.diagnostics`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter

__all__ = [
    "MissingDependencyError",
    "NoEffectWarning",
    "PerfSDKError",
    "PerfSDKWarning",
    "SyncError",
    "SyncWarning",
]

logger = logging.getLogger("perfsdk")
logger.addHandler(logging.NullHandler())  # here, before config reads the environment


class PerfSDKError(Exception):
    """Base class of perfsdk's exceptions."""


class MissingDependencyError(PerfSDKError, ImportError):
    """An optional dependency that the requested feature needs is not installed."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs the '{package}' package, which is not installed. "
            f"Install it with: pip install 'perfsdk[{extra}]'"
        )
        self.package = package
        self.extra = extra


class PerfSDKWarning(UserWarning):
    """perfsdk degraded a feature (no collector, no NVTX, a bad setting) and carried on."""


class NoEffectWarning(PerfSDKWarning):
    """A call did nothing for this model or machine and returned its input unchanged."""


class SyncError(PerfSDKError, RuntimeError):
    """``no_sync_guard("error")`` met a host-device synchronization; raised at that line.

    ``op`` is the kind of sync (a key of ``perfsdk.sync.OPS``), ``operator`` what synchronized
    (``aten::_local_scalar_dense``, ``Tensor.cpu`` ...), ``file`` and ``line`` the call site.
    """

    def __init__(self, message: str, *, op: str, operator: str, file: str, line: int) -> None:
        super().__init__(message)
        self.op = op
        self.operator = operator
        self.file = file
        self.line = line


class SyncWarning(UserWarning):
    """``no_sync_guard("warn")`` met a host-device synchronization (once per call site)."""


_lock = threading.Lock()
_counts: Counter[str] = Counter()


def warn_once(key: str, message: str, category: type[Warning] = PerfSDKWarning) -> None:
    """Count one occurrence of ``key``; on the first, emit ``message`` as a warning.

    Safe on any thread: if warnings are turned into errors (``-W error``), the error is
    swallowed here rather than killing a background thread, and the message is logged.
    """
    with _lock:
        _counts[key] += 1
        first = _counts[key] == 1
    if not first:
        return
    logger.warning(message)
    try:
        warnings.warn(message, category, stacklevel=3)
    except Exception:
        pass


def counts() -> dict[str, int]:
    """How often each kind of trouble happened in this process."""
    with _lock:
        return dict(_counts)


def reset_counts() -> None:
    """Forget all counts, so the next occurrence of each kind warns again (for tests)."""
    with _lock:
        _counts.clear()
