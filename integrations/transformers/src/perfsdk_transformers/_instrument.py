"""``instrument()`` / ``uninstrument()``: give every ``transformers.Trainer`` a PerfsdkCallback."""

from __future__ import annotations

import functools
import threading
from importlib import metadata
from typing import Any

from perfsdk_transformers.package import _instruments

__all__ = ["instrument", "is_instrumented", "uninstrument"]

_lock = threading.Lock()
_original_init: Any = None


def _trainer_class() -> Any:
    """``transformers.Trainer``; ImportError with the install command when it is missing."""
    try:
        metadata.version("transformers")
        import transformers
    except (ImportError, metadata.PackageNotFoundError):
        raise ImportError(
            f"perfsdk-transformers instruments {_instruments[0]!r}, which is not installed. "
            "Install it with: pip install 'perfsdk-transformers[instruments]'"
        ) from None
    return transformers.Trainer


def instrument(*, report: bool = True) -> None:
    """Add a :class:`~perfsdk_transformers.PerfsdkCallback` to every ``Trainer`` made from now on.

    Idempotent; a Trainer that already has one (``callbacks=[PerfsdkCallback()]``) gets no
    second. :func:`uninstrument` undoes it. ``report`` is the callback's: print the summary and
    the advice when training ends.

    Raises:
        ImportError: transformers is not installed (the message names the pip command).
        ValueError: ``report`` is not a bool.
    """
    global _original_init
    trainer = _trainer_class()
    from perfsdk_transformers.callback import PerfsdkCallback

    PerfsdkCallback(report=report)  # a bad argument raises here

    with _lock:
        if _original_init is not None:
            return
        original = trainer.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            handler = getattr(self, "callback_handler", None)
            if handler is not None and not any(
                isinstance(cb, PerfsdkCallback) for cb in handler.callbacks
            ):
                self.add_callback(PerfsdkCallback(report=report))

        trainer.__init__ = __init__
        _original_init = original


def uninstrument() -> None:
    """Stop adding the callback to new Trainers (existing ones keep theirs); idempotent."""
    global _original_init
    with _lock:
        if _original_init is None:
            return
        _trainer_class().__init__ = _original_init
        _original_init = None


def is_instrumented() -> bool:
    """Whether :func:`instrument` is in effect."""
    return _original_init is not None
