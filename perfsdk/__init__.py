"""perfsdk: drop-in performance instrumentation for PyTorch.

NVTX ranges for Nsight Systems, host and CUDA-event timings without added syncs, and
OpenTelemetry spans, from one decorator (:func:`profiled`) or one ``with`` block
(:class:`timed_region`).
"""

from perfsdk import auto
from perfsdk._version import __version__
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
from perfsdk.lifecycle import diagnostics, flush, shutdown, summary
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
    "configure",
    "diagnostics",
    "flush",
    "get_config",
    "instrument_dataloader",
    "instrument_module",
    "no_sync_guard",
    "profiled",
    "shutdown",
    "step",
    "summary",
    "timed_region",
    "write_trace",
)
