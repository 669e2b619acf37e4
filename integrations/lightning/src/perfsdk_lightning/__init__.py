"""perfsdk regions for Lightning training: a Callback, a Profiler, or :func:`instrument` for
every Trainer.

:class:`PerfsdkCallback` (in :mod:`perfsdk_lightning.callback`) maps Lightning's hooks onto
perfsdk's regions: ``step``, inside it ``forward``, ``backward`` and ``optimizer``;
``validation``, ``sanity_check`` and ``epoch``; and prints the summary and the advice when ``fit``
ends. :class:`PerfsdkProfiler` (in :mod:`perfsdk_lightning.profiler`) is the same from Lightning's
profiler slot, ``Trainer(profiler=PerfsdkProfiler())``, with a ``data_wait`` region per batch
fetch; its ``summary()`` is what Lightning logs at the end. :class:`LightningInstrumentor` is the
integration's :class:`perfsdk.instrumentor.Instrumentor` (found by :func:`perfsdk.instrument_all`
through the ``perfsdk_integrations`` entry point): it gives every ``lightning.Trainer`` made
while it is in effect a ``PerfsdkCallback`` (unless its profiler is a ``PerfsdkProfiler``).
Importing this package does not import Lightning.

Example:
    >>> import perfsdk_lightning
    >>> perfsdk_lightning.instrument()    # doctest: +SKIP
    >>> perfsdk_lightning.uninstrument()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from perfsdk.instrumentor import InitPatch, Instrumentor
from perfsdk_lightning import package
from perfsdk_lightning.options import check_options
from perfsdk_lightning.version import __version__

if TYPE_CHECKING:
    from perfsdk_lightning.callback import PerfsdkCallback
    from perfsdk_lightning.profiler import PerfsdkProfiler

__all__ = ("LightningInstrumentor", "PerfsdkCallback", "PerfsdkProfiler", "__version__",
           "instrument", "uninstrument")


class LightningInstrumentor(Instrumentor):
    """Every ``lightning.Trainer`` made while instrumented gets a ``PerfsdkCallback`` (one that
    has its own keeps it; one whose profiler is a ``PerfsdkProfiler`` gets none: the profiler
    records the same regions). ``instrument()`` takes the callback's keyword arguments
    (``batch_size``, ``memory``, ``report``) and ignores others."""

    distribution = "perfsdk-lightning"
    instruments = package.instruments

    def _patches(self, **kwargs: Any) -> list[InitPatch]:
        options = {k: kwargs[k] for k in ("batch_size", "memory", "report") if k in kwargs}
        check_options("instrument", **{"batch_size": None, "memory": None, "report": True,
                                       **options})

        def add_callback(trainer: Any) -> None:
            from perfsdk_lightning.callback import PerfsdkCallback
            from perfsdk_lightning.profiler import PerfsdkProfiler

            if isinstance(getattr(trainer, "profiler", None), PerfsdkProfiler):
                return  # the profiler records the regions: a callback would count them twice
            callbacks = trainer.callbacks
            if not any(isinstance(cb, PerfsdkCallback) for cb in callbacks):
                callbacks.append(PerfsdkCallback(**options))

        return [InitPatch("lightning.pytorch.trainer.trainer", "Trainer", add_callback)]


def instrument(*, batch_size: int | Callable[[Any], int] | None = None,
               memory: bool | None = None, report: bool = True) -> None:
    """Give every ``lightning.Trainer`` created from now on a :class:`PerfsdkCallback`.

    A Trainer that already has one keeps its own; one whose profiler is a
    :class:`PerfsdkProfiler` gets none. Idempotent: while instrumented, a second call
    changes nothing. The arguments are :class:`PerfsdkCallback`'s.

    Raises:
        ValueError: An argument has a value outside those accepted.
        ImportError: Lightning is not installed, or older than the ``instruments`` extra asks
            (the message names the pip command).
    """
    check_options("instrument", batch_size=batch_size, memory=memory, report=report)
    LightningInstrumentor().instrument(raise_on_missing=True, batch_size=batch_size,
                                       memory=memory, report=report)


def uninstrument() -> None:
    """Trainers created from now on get no callback from :func:`instrument`; idempotent."""
    instrumentor = LightningInstrumentor()
    if instrumentor.is_instrumented:
        instrumentor.uninstrument()


def __getattr__(name: str) -> Any:
    if name == "PerfsdkCallback":  # imports Lightning only when asked for
        from perfsdk_lightning.callback import PerfsdkCallback

        return PerfsdkCallback
    if name == "PerfsdkProfiler":
        from perfsdk_lightning.profiler import PerfsdkProfiler

        return PerfsdkProfiler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
