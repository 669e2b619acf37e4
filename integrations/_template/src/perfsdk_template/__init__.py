"""A skeleton perfsdk integration: copy ``integrations/_template`` to start one.

Stay thin: map the framework's hooks onto perfsdk's public API (``perfsdk.timed_region``,
``perfsdk.auto.STEPS``, ``perfsdk.instrumentor.RunReport``), with no measurement of your own.
Importing this package must not import the framework: do that inside ``_instrument`` or in a
module only it imports (a ``callback.py``). Here the "framework" is torch, and every
``torch.optim.SGD`` made while instrumented gets its ``step()`` timed as an ``optimizer`` region.

Example:
    >>> import perfsdk_template
    >>> perfsdk_template.TemplateInstrumentor().instrument()
    True
    >>> perfsdk_template.TemplateInstrumentor().uninstrument()
    True
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from perfsdk.instrumentor import InitPatch, Instrumentor
from perfsdk_template.package import instruments
from perfsdk_template.version import __version__

__all__ = ("TemplateInstrumentor", "__version__")


class TemplateInstrumentor(Instrumentor):
    """Every ``torch.optim.SGD`` made while instrumented has its ``step()`` in a region."""

    distribution = "perfsdk-template"

    def __init__(self) -> None:
        if not hasattr(self, "_patch"):
            self._patch: InitPatch | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return instruments

    def _instrument(self, **kwargs: Any) -> None:
        import perfsdk  # the framework's hooks -> perfsdk's public API

        region = perfsdk.timed_region("optimizer", category="update")

        def hook(optimizer: Any) -> None:  # your framework: add a callback here
            optimizer.step = region(optimizer.step)

        self._patch = InitPatch("torch.optim.sgd", "SGD", hook)
        self._patch.install()

    def _uninstrument(self, **kwargs: Any) -> None:
        if self._patch is not None:
            self._patch.remove()
            self._patch = None
