"""perfsdk: drop-in performance instrumentation for PyTorch.

NVTX ranges for Nsight Systems, host and CUDA-event timings without added syncs, and
OpenTelemetry spans, from one decorator (:func:`profiled`) or one ``with`` block
(:class:`timed_region`); the phases of a training step at a fraction of a region's cost
(:class:`phase`).

``import perfsdk`` itself imports neither torch nor perfsdk's machinery, so that the ``perfsdk``
command parses its arguments at once: the first use of any name below imports them all, as one
``import perfsdk`` did before (see :func:`__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from perfsdk._version import __version__

if TYPE_CHECKING:
    from perfsdk import auto, bench, distributed, optimize, testing
    from perfsdk.advisor import Advice, Finding, advise
    from perfsdk.auto import instrument_dataloader, instrument_module, step
    from perfsdk.config import Config, configure, get_config
    from perfsdk.decorator import profiled
    from perfsdk.errors import (
        MissingDependencyError,
        NoEffectWarning,
        PerfSDKError,
        PerfSDKWarning,
        SyncError,
        SyncWarning,
    )
    from perfsdk.export.summary import RegionStats, Summary
    from perfsdk.export.trace import write_trace
    from perfsdk.flops import count_flops, peak_flops
    from perfsdk.instrumentor import instrument_all
    from perfsdk.lifecycle import diagnostics, flush, shutdown, summary
    from perfsdk.phases import phase
    from perfsdk.region import Region, RegionResult
    from perfsdk.sync import SyncReport, SyncSite, no_sync_guard
    from perfsdk.timing import timed_region

__all__ = (
    "Advice",
    "Config",
    "Finding",
    "MissingDependencyError",
    "NoEffectWarning",
    "PerfSDKError",
    "PerfSDKWarning",
    "Region",
    "RegionResult",
    "RegionStats",
    "Summary",
    "SyncError",
    "SyncReport",
    "SyncSite",
    "SyncWarning",
    "__version__",
    "advise",
    "auto",
    "bench",
    "configure",
    "count_flops",
    "diagnostics",
    "distributed",
    "flush",
    "get_config",
    "instrument_all",
    "instrument_dataloader",
    "instrument_module",
    "no_sync_guard",
    "optimize",
    "peak_flops",
    "phase",
    "profiled",
    "shutdown",
    "step",
    "summary",
    "testing",
    "timed_region",
    "write_trace",
)

# Where each public name lives, in the order the modules are imported (the composition root,
# perfsdk.lifecycle, among them). "" marks a submodule exported under its own name; a name of
# __all__ listed nowhere here is the sub-package perfsdk.<name>, imported when first used.
_SOURCES: dict[str, tuple[str, ...]] = {
    "perfsdk.auto": ("", "instrument_dataloader", "instrument_module", "step"),
    "perfsdk.advisor": ("Advice", "Finding", "advise"),
    "perfsdk.config": ("Config", "configure", "get_config"),
    "perfsdk.decorator": ("profiled",),
    "perfsdk.errors": ("MissingDependencyError", "NoEffectWarning", "PerfSDKError",
                       "PerfSDKWarning", "SyncError", "SyncWarning"),
    "perfsdk.export.summary": ("RegionStats", "Summary"),
    "perfsdk.export.trace": ("write_trace",),
    "perfsdk.flops": ("count_flops", "peak_flops"),
    "perfsdk.instrumentor": ("instrument_all",),
    "perfsdk.lifecycle": ("diagnostics", "flush", "shutdown", "summary"),
    "perfsdk.phases": ("phase",),
    "perfsdk.region": ("Region", "RegionResult"),
    "perfsdk.sync": ("SyncReport", "SyncSite", "no_sync_guard"),
    "perfsdk.timing": ("timed_region",),
}


def __getattr__(name: str) -> Any:
    """The first public name asked for imports every module behind :data:`__all__` (torch
    and perfsdk's exporters included) and binds all their names here; later lookups never come
    back to this function."""
    if name not in __all__:
        raise AttributeError(f"module 'perfsdk' has no attribute {name!r}")
    found: dict[str, Any] = {}
    for source, names in _SOURCES.items():
        module = importlib.import_module(source)
        for public in names:
            found[public or source.rpartition(".")[2]] = getattr(module, public) if public \
                else module
    globals().update(found)
    if name not in found:  # a name of __all__ that _SOURCES does not list: a sub-package
        found[name] = globals()[name] = importlib.import_module(f"perfsdk.{name}")
    return found[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
