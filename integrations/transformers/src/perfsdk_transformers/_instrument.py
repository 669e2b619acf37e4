"""``TransformersInstrumentor``, ``instrument()`` / ``uninstrument()``: give every
``transformers.Trainer`` a PerfsdkCallback."""

from __future__ import annotations

import importlib.util
from typing import Any

from perfsdk.instrumentor import InitPatch, Instrumentor
from perfsdk_transformers import package

__all__ = ["TransformersInstrumentor", "instrument", "is_instrumented", "uninstrument"]


def _check_report(report: Any) -> None:
    if not isinstance(report, bool):
        raise ValueError(f"PerfsdkCallback: report={report!r}; accepted values are True "
                         "(print the summary and advice when training ends) or False")


class TransformersInstrumentor(Instrumentor):
    """Every ``transformers.Trainer`` made while instrumented gets a ``PerfsdkCallback`` (one
    that was given one keeps it). ``instrument()`` takes the callback's ``report`` and ignores
    other keyword arguments."""

    distribution = "perfsdk-transformers"
    instruments = package.instruments

    def _patches(self, **kwargs: Any) -> list[InitPatch]:
        report = kwargs.get("report", True)
        _check_report(report)
        if importlib.util.find_spec("transformers") is None:  # installed, but not importable
            raise ImportError("transformers cannot be imported")

        def add_callback(trainer: Any) -> None:
            from perfsdk_transformers.callback import PerfsdkCallback

            handler = getattr(trainer, "callback_handler", None)
            if handler is not None and not any(
                isinstance(cb, PerfsdkCallback) for cb in handler.callbacks
            ):
                trainer.add_callback(PerfsdkCallback(report=report))

        return [InitPatch("transformers.trainer", "Trainer", add_callback)]


def instrument(*, report: bool = True) -> None:
    """Add a :class:`~perfsdk_transformers.PerfsdkCallback` to every ``Trainer`` made from now on.

    Idempotent; a Trainer that already has one (``callbacks=[PerfsdkCallback()]``) gets no
    second. :func:`uninstrument` undoes it. ``report`` is the callback's: print the summary and
    the advice when training ends.

    Raises:
        ImportError: transformers is not installed (the message names the pip command).
        ValueError: ``report`` is not a bool.
    """
    _check_report(report)
    TransformersInstrumentor().instrument(raise_on_missing=True, report=report)


def uninstrument() -> None:
    """Stop adding the callback to new Trainers (existing ones keep theirs); idempotent."""
    instrumentor = TransformersInstrumentor()
    if instrumentor.is_instrumented:
        instrumentor.uninstrument()


def is_instrumented() -> bool:
    """Whether :func:`instrument` is in effect."""
    return TransformersInstrumentor().is_instrumented
