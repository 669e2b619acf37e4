"""perfsdk regions for the Hugging Face ``transformers.Trainer``.

``PerfsdkCallback`` maps the Trainer's callback events onto perfsdk regions (``epoch``,
``step``, ``microbatch``, ``optimizer``, ``validation``); ``instrument()`` adds one to every
Trainer (through :class:`TransformersInstrumentor`, the integration's
:class:`perfsdk.instrumentor.Instrumentor`, which :func:`perfsdk.instrument_all` finds through
the ``perfsdk_integrations`` entry point). Importing this package does not import transformers.

Example:
    >>> import perfsdk_transformers
    >>> perfsdk_transformers.instrument()    # every Trainer made from now on is timed
    >>> perfsdk_transformers.uninstrument()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from perfsdk_transformers._instrument import (
    TransformersInstrumentor,
    instrument,
    is_instrumented,
    uninstrument,
)
from perfsdk_transformers.version import __version__

if TYPE_CHECKING:
    from perfsdk_transformers.callback import PerfsdkCallback

__all__ = ("PerfsdkCallback", "TransformersInstrumentor", "__version__", "instrument",
           "is_instrumented", "uninstrument")


def __getattr__(name: str) -> Any:
    if name == "PerfsdkCallback":  # imports transformers only when asked for
        from perfsdk_transformers.callback import PerfsdkCallback

        return PerfsdkCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
