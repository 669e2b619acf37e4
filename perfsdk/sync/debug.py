"""The process-wide half of ``no_sync_guard``: explicit ``synchronize`` calls and torch's CUDA
sync debug mode, installed by the first open guard and removed by the last.

While any guard is open, ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``,
``torch.cuda.Stream.synchronize`` (and ``torch.accelerator.synchronize``) are wrapped: a call
from a guarded context is reported, any other goes straight through. Where the application has
initialized CUDA, torch's sync debug mode is set to ``warn`` (through the device interface) and
its warnings are routed to the guard of the context they come from, swallowed elsewhere, and the
previous mode is restored at the end.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from perfsdk import _device
from perfsdk.errors import warn_once
from perfsdk.sync import ops as _syncops

__all__ = ["DEBUG_MESSAGE", "PROTOTYPE_MESSAGE", "SHARED", "set_debug_mode"]

DEBUG_MESSAGE = "called a synchronizing CUDA operation"
_lock = threading.Lock()


def _no_guard() -> Any:
    return None


def _no_report(label: str, name: str) -> bool:
    return True


_active: Callable[[], Any] = _no_guard
_report: Callable[[str, str], bool] = _no_report


def connect(active: Callable[[], Any], report: Callable[[str, str], bool]) -> None:
    """Plug in the guard module: the active guard of this context, and its reporter."""
    global _active, _report
    _active, _report = active, report


def _explicit(original: Callable[..., Any], label: str, name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def synchronize(*args: Any, **kwargs: Any) -> Any:
        if _active() is None:
            return original(*args, **kwargs)
        _report(label, name)
        _syncops.LOCAL.quiet += 1
        try:
            return original(*args, **kwargs)
        finally:
            _syncops.LOCAL.quiet -= 1
    synchronize.__perfsdk_wrapped__ = original  # type: ignore[attr-defined]
    return synchronize


def _patch_targets() -> list[tuple[Any, str, str, str]]:
    targets: list[tuple[Any, str, str, str]] = [
        (torch.cuda, "synchronize", "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize", "event_synchronize", "Event.synchronize"),
        (torch.cuda.Stream, "synchronize", "stream_synchronize", "Stream.synchronize"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", "synchronize",
                        "torch.accelerator.synchronize"))
    return targets


class _Shared:
    """Process-wide pieces, installed by the first open guard and removed by the last."""

    def __init__(self) -> None:
        self.users = 0
        self.patched: list[tuple[Any, str, Any]] = []
        self.backend: Any = None
        self.prior_debug: int | None = None
        self.showwarning: Any = None
        self.filter: Any = None

    def acquire(self) -> None:
        with _lock:
            self.users += 1
            if self.users > 1:
                return
            for owner, attr, label, name in _patch_targets():
                original = getattr(owner, attr)
                setattr(owner, attr, _explicit(original, label, name))
                self.patched.append((owner, attr, original))
            self._start_debug_mode()

    def release(self) -> None:
        with _lock:
            self.users -= 1
            if self.users:
                return
            for owner, attr, original in reversed(self.patched):
                setattr(owner, attr, original)
            self.patched.clear()
            self._stop_debug_mode()

    def _start_debug_mode(self) -> None:
        """Where the application runs CUDA, torch's sync debug mode sees syncs inside ops the
        detector does not model; its warnings go to the guard of the context they come from."""
        backend = _device.active()
        if backend is None:
            return
        prior = None
        try:
            prior = int(backend.get_sync_debug_mode())
            if prior == 0:
                set_debug_mode(backend, 1)
        except Exception as exc:  # never break the program over an optional extra
            if prior == 0:  # set, then failed (a warning filter set to error, say): undo it
                try:
                    set_debug_mode(backend, 0)
                except Exception:
                    pass
            warn_once("sync-debug-mode", f"perfsdk: torch's CUDA sync debug mode is not "
                      f"available ({exc}); no_sync_guard uses its own detector only")
            return
        self.backend, self.prior_debug = backend, prior
        self.showwarning = warnings.showwarning
        warnings.showwarning = _showwarning
        warnings.filterwarnings("always", message=DEBUG_MESSAGE, category=UserWarning)
        self.filter = warnings.filters[0]

    def _stop_debug_mode(self) -> None:
        if self.backend is None:
            return
        try:
            if self.prior_debug == 0:
                set_debug_mode(self.backend, 0)
        finally:
            if warnings.showwarning is _showwarning:
                warnings.showwarning = self.showwarning
            if self.filter in warnings.filters:
                warnings.filters.remove(self.filter)  # type: ignore[attr-defined]
                warnings._filters_mutated()  # type: ignore[attr-defined]
            self.backend = self.prior_debug = self.filter = None


SHARED = _Shared()

PROTOTYPE_MESSAGE = "Synchronization debug mode is a prototype feature"
"""What torch warns, once a process, at the first ``set_sync_debug_mode``: perfsdk's own use of
the mode is not the program's business, and under ``-W error`` the warning would raise after
the mode was set."""


def set_debug_mode(backend: Any, mode: int | str) -> None:
    """``backend.set_sync_debug_mode(mode)`` without torch's prototype warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PROTOTYPE_MESSAGE, category=UserWarning)
        backend.set_sync_debug_mode(mode)


def _showwarning(message: Any, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    if issubclass(category, UserWarning) and DEBUG_MESSAGE in str(message):
        local = _syncops.LOCAL
        if local.quiet:
            return  # the detector or an explicit wrapper already reported this sync
        if local.decided:  # torch delivers it as the user's call returns: decided already
            local.decided -= 1
            return
        if _active() is not None:
            _report("cuda", "cuda sync debug mode")
            return
        if SHARED.prior_debug == 0:
            return  # perfsdk turned the debug mode on; other contexts did not ask for it
    show = SHARED.showwarning or warnings._showwarning_orig  # type: ignore[attr-defined]
    show(message, category, filename, lineno, file, line)
