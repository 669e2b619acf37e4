"""The composition root: the one place that creates perfsdk's sinks and registers them with the
pipeline, and the process-wide ends of it: flush, shutdown, summary and diagnostics.

The pipeline hands every finished record to the sinks in this order: GPU telemetry (it attaches
the NVML readings over the region's window, which the others read), the summary, the trace file,
then the OpenTelemetry spans and metrics (only when the ``otlp`` extra is installed). Nothing
else registers a sink at import time; a sink added at run time (``perfsdk run``'s recorder,
``perfsdk.testing.capture()``) comes after these.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

from perfsdk import config as _config
from perfsdk import errors
from perfsdk import gpu as _gpu
from perfsdk import memory as _memory
from perfsdk import pipeline as _pipeline
from perfsdk import sync as _sync
from perfsdk.config import Config
from perfsdk.errors import warn_once
from perfsdk.export.summary import Summary, SummarySink
from perfsdk.export.trace import TraceSink
from perfsdk.pipeline import PIPELINE

__all__ = ["diagnostics", "flush", "shutdown", "summary"]

PIPELINE.on_round.append(_gpu.TELEMETRY.tick)
PIPELINE.sinks.insert(0, _gpu.TELEMETRY)  # first, whatever was added at run time before
SUMMARY = SummarySink()
PIPELINE.sinks.insert(1, SUMMARY)
TRACE = TraceSink(_config.get_config())
PIPELINE.sinks.insert(2, TRACE)


def _for_otel(config: Config) -> Config:
    """The configuration OpenTelemetry's sinks see: without ``trace``, which perfsdk writes
    itself (see :mod:`perfsdk.export.trace`)."""
    if "trace" not in config.exporters:
        return config
    return dataclasses.replace(config, exporters=tuple(e for e in config.exporters
                                                       if e != "trace"))


try:
    from perfsdk.export.otel import SpanSink
except ImportError:  # optional: pip install opentelemetry-sdk
    SPANS: Any = None
else:
    SPANS = SpanSink(_for_otel(_config.get_config()))
    PIPELINE.sinks.insert(3, SPANS)
    PIPELINE.on_lost = SPANS.count_lost
    _pipeline.lost_report = SPANS.lost_lines


try:
    from perfsdk.export.metrics import MetricsSink
except ImportError:  # optional: pip install opentelemetry-sdk
    METRICS: Any = None
else:
    METRICS = MetricsSink(_for_otel(_config.get_config()), gpu_readings=_gpu.TELEMETRY.latest)
    PIPELINE.sinks.insert(3 + (SPANS is not None), METRICS)


def _on_change(old: Config, new: Config) -> None:
    if new.memory_snapshots != old.memory_snapshots:
        _memory.want_snapshots(new.memory_snapshots)
    otel_new = _for_otel(new)
    if SPANS is None and otel_new.exporters:
        raise errors.MissingDependencyError(
            "opentelemetry-sdk", "otlp", f"exporter={_config._show(otel_new.exporters)}")
    if new.exporters != old.exporters or new.output_dir != old.output_dir:
        # Regions so far go out under the old settings: those still waiting for the GPU (or
        # its sampler) too, waited for within the old export budget, or a GPU run lost them.
        PIPELINE.settle(old.export_timeout_s)
        TRACE.configure(new)
    old, new = _for_otel(old), otel_new
    if SPANS is None:
        return
    fields = ("exporters", "output_dir", "service_name")
    if any(getattr(old, f) != getattr(new, f) for f in fields):
        PIPELINE.drain(wait=False)  # regions so far go out under the old settings (settled
        # above when the exporters or the directory changed; the service name alone: queued)
        SPANS.configure(new, timeout=old.export_timeout_s)
        if METRICS is not None:
            METRICS.configure(new, timeout=old.export_timeout_s)
        if new.exporters:
            SPANS.validate()
        if PIPELINE.started:
            SPANS.prepare()
    elif any(getattr(old, f) != getattr(new, f) for f in _QUEUE_FIELDS):
        PIPELINE.drain(wait=False)  # queued spans go out under the old settings
        SPANS.configure(new, timeout=old.export_timeout_s)
        if PIPELINE.started:
            SPANS.prepare()


_QUEUE_FIELDS = ("export_queue_size", "export_batch_size", "export_delay_s",
                 "export_batch_timeout_s", "export_backoff_min_s", "export_backoff_max_s")


_config.on_change(_on_change)
if _config.get_config().memory_snapshots:
    _memory.want_snapshots(True)


def flush(timeout: float | None = None) -> None:
    """Resolve every finished region (waiting for their GPU work) and push spans out.

    Returns within ``timeout`` seconds (default ``PERFSDK_EXPORT_TIMEOUT``) whatever the
    exporters do: the work happens on perfsdk's threads; this only waits for it. What is not
    out by then stays queued (bounded) for a later export.
    """
    PIPELINE.flush(_config.get_config().export_timeout_s if timeout is None else timeout)


def shutdown(timeout: float | None = None) -> None:
    """Flush and close perfsdk's exporters, within ``timeout`` seconds in total (default
    ``PERFSDK_EXPORT_TIMEOUT``); spans not out by then are counted as lost (``shutdown``). Runs
    by itself at interpreter exit."""
    PIPELINE.shutdown(_config.get_config().export_timeout_s if timeout is None else timeout)


def summary(*, show: bool = True, file: TextIO | None = None) -> Summary:
    """Flush, then return the per-region summary, printing it as a table when ``show``.

    Host-device syncs recorded by :func:`perfsdk.no_sync_guard` are listed below the table, per
    call site, and counted per region in a ``syncs`` column.

    Example:
        >>> import perfsdk
        >>> table = perfsdk.summary(show=False)
        >>> isinstance(table.rows, tuple)
        True
    """
    if not PIPELINE.settle(_config.get_config().export_timeout_s):
        warn_once("summary-timeout", f"perfsdk: {PIPELINE.pending:,} regions were still "
                  "waiting (for the GPU) after PERFSDK_EXPORT_TIMEOUT; the summary leaves "
                  "them out.")
    table = SUMMARY.snapshot()
    sites = _sync.sites()
    if sites:
        table = dataclasses.replace(table, sync_sites=sites)
    if show:
        out = sys.stdout if file is None else file
        out.write(f"{table}\n")
    return table


def diagnostics() -> dict[str, Any]:
    """What perfsdk's own machinery did: warnings by kind, pending regions, and the span
    account: ``spans_produced``, ``spans_exported``, ``spans_lost`` by reason (``queue_full``,
    ``backing_off``, ``export_failed``, ``export_timeout``, ``shutdown``) and ``spans_pending``
    (queued or in an export call); ``spans_exported + sum(spans_lost.values()) +
    spans_pending == spans_produced``, and after :func:`shutdown` nothing is pending.
    ``exporters`` has the same per exporter, with its target and last failure's cause."""
    info: dict[str, Any] = {"warnings": errors.counts(), "pending_regions": PIPELINE.pending}
    sampler = _gpu.TELEMETRY.sampler
    info["gpu_sampling"] = "off" if sampler is None else "on"
    if sampler is not None:
        info["gpu_sampler_core_fraction"] = sampler.overhead().core_fraction
    info.update(TRACE.stats())
    if SPANS is not None:
        info["span_mode"] = SPANS.decided or "undecided"
        info.update(SPANS.stats())
    if METRICS is not None:
        info.update(METRICS.stats())
    return info
