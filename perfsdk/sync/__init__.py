"""Host-device synchronizations: find them and name the line of code behind each.

- :mod:`perfsdk.sync.guard`: :class:`no_sync_guard` and the process-wide :func:`sites`;
- :mod:`perfsdk.sync.report`: :class:`SyncSite` and :class:`SyncReport`, what a guard saw, as
  plain data;
- :mod:`perfsdk.sync.ops`: the operations that synchronize (:data:`OPS`, with the fix for each)
  and the torch modes that watch them;
- :mod:`perfsdk.sync.debug`: explicit ``synchronize`` calls and torch's CUDA sync debug mode.

Example:
    >>> import torch
    >>> from perfsdk import no_sync_guard
    >>> with no_sync_guard("count", assume_device=True) as guard:
    ...     loss = torch.ones(3).sum()
    ...     value = loss.item()
    >>> guard.report.total, guard.report.sites[0].op
    (1, 'item')
"""

from __future__ import annotations

from perfsdk.errors import SyncError, SyncWarning
from perfsdk.sync.guard import MAX_SPAN_SITES, OPS, no_sync_guard, reset, sites
from perfsdk.sync.report import MAX_OUTSIDE_TIMES, SyncReport, SyncSite, short_path

__all__ = ["MAX_OUTSIDE_TIMES", "MAX_SPAN_SITES", "OPS", "SyncError", "SyncReport", "SyncSite",
           "SyncWarning", "no_sync_guard", "reset", "short_path", "sites"]
