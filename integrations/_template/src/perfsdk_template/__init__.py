"""A skeleton perfsdk integration: copy ``integrations/_template`` to start one.

Stay thin: map the framework's hooks onto perfsdk's public API (``perfsdk.timed_region``,
``perfsdk.auto.STEPS``, ``perfsdk.instrumentor.RunReport``), with no measurement of your own.
The instrumentor states only what differs from :class:`perfsdk.instrumentor.Instrumentor`: the
framework requirements, the distribution, and in ``_patches`` the ``InitPatch`` es that
``instrument()`` installs and ``uninstrument()`` removes. Importing this package must not import
the framework: do that inside ``_patches``' hook or in a module only it imports (a
``callback.py``). A callback that draws the training steps calls
``perfsdk.instrumentor.FRAMEWORK_STEPS.begin(self)`` when the framework's run starts and
``.end(self)`` when it ends, so that ``perfsdk run`` leaves the steps to it. Here the
"framework" is torch, and every ``torch.optim.SGD`` made while instrumented gets its ``step()``
timed as an ``optimizer`` region.

Example:
    >>> import perfsdk_template
    >>> perfsdk_template.TemplateInstrumentor().instrument()
    True
    >>> perfsdk_template.TemplateInstrumentor().uninstrument()
    True
"""

from __future__ import annotations

from typing import Any

from perfsdk.instrumentor import InitPatch, Instrumentor
from perfsdk_template import package
from perfsdk_template.version import __version__

__all__ = ("TemplateInstrumentor", "__version__")


class TemplateInstrumentor(Instrumentor):
    """Every ``torch.optim.SGD`` made while instrumented has its ``step()`` in a region."""

    distribution = "perfsdk-template"  # named in the install hint when the framework is missing
    instruments = package.instruments  # checked before instrumenting

    def _patches(self, **kwargs: Any) -> list[InitPatch]:
        """What ``instrument()`` installs and ``uninstrument()`` removes: read the options in
        ``kwargs`` here (ValueError for a bad one), patch nothing yet."""
        import perfsdk  # the framework's hooks -> perfsdk's public API

        region = perfsdk.timed_region("optimizer", category="update")

        def hook(optimizer: Any) -> None:  # your framework: add a callback here
            optimizer.step = region(optimizer.step)

        return [InitPatch("torch.optim.sgd", "SGD", hook)]
