"""Where region spans go: perfsdk's own exporters or the application's TracerProvider.

The OpenTelemetry SDK is imported only under ``perfsdk/export/`` (this module, ``spans.py``,
``exporters.py``); ``import perfsdk`` works without it.

Spans are built in the background from region records, never on the training thread:

* **perfsdk's own pipeline** (``PERFSDK_EXPORTER`` = ``otlp``, ``console``, ``file``): perfsdk
  creates an SDK ``TracerProvider`` with those exporters and installs it globally *only if the
  application has none*, so the user's own spans reach the same backend. Region spans are built
  directly as ``ReadableSpan`` objects with the ids that were handed out at enter, on each
  exporter's own export thread (:mod:`perfsdk.export.delivery`: a bounded queue, batches,
  backoff, every span counted), which skips the tracer machinery (about 1 us a span instead of
  about 10).
* **the application's provider**: if the application installed a TracerProvider, perfsdk's
  spans go through it (its sampler, span limits and processors apply), built on a bounded queue
  and thread of its own (:mod:`perfsdk.export.provider`); perfsdk adds no processor, exporter
  or resource.

Exporters come from OpenTelemetry itself: OTLP over gRPC or HTTP/protobuf (chosen by the standard
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, default ``http/protobuf``), console, and a JSON-lines
file (the console exporter writing to ``<output_dir>/spans-<pid>.jsonl``). A failing exporter
warns once (naming the endpoint and the cause), backs off and counts every lost span; exit waits
at most ``PERFSDK_EXPORT_TIMEOUT`` seconds in all.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from perfsdk.config import Config
from perfsdk.distributed import rank_attributes
from perfsdk.errors import warn_once
from perfsdk.export.delivery import REASONS, Backoff, Destination
from perfsdk.export.exporters import bounded, describe, make_exporter, otlp_target
from perfsdk.export.provider import ProviderExporter, user_tracer
from perfsdk.export.spans import build_resource, build_spans, region_span
from perfsdk.record import Record

__all__ = ["SpanSink", "build_resource", "make_exporter", "region_span"]


class _Fanout(SpanProcessor):
    """perfsdk's processor on its own provider: the application's spans join the region spans
    in perfsdk's bounded export queues (counted like them)."""

    def __init__(self) -> None:
        self.destinations: list[Destination] = []

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        for destination in self.destinations:
            destination.offer((span,))

    def shutdown(self) -> None:
        """perfsdk closes its destinations itself, with a bound."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        return all([d.flush(deadline) for d in self.destinations])


class SpanSink:
    """Turns resolved regions into spans for perfsdk's own exporters or the user's provider.

    Each exporter is a :class:`~perfsdk.export.delivery.Destination`: a bounded queue and an
    export thread of its own, so one slow collector holds back neither the program nor the other
    exporters. Spans are built on those threads.
    """

    def __init__(self, config: Config) -> None:
        self._lock = threading.Lock()
        self._provider: TracerProvider | None = None
        self._fanout = _Fanout()
        self.destinations: list[Destination] = []
        self._retired: dict[str, Any] = _empty_account()
        self._retired_by: dict[tuple[str, str], dict[str, Any]] = {}
        self._closing: list[Destination] = []
        self.configure(config)

    # -- set-up ----------------------------------------------------------------------------
    def configure(self, config: Config, timeout: float | None = None) -> None:
        """Adopt a new configuration; perfsdk's previous exporters get ``timeout`` seconds
        (default ``export_timeout_s``) to send what they hold, on their own threads."""
        with self._lock:
            old = self.destinations
            self.config = config
            self._resource: Resource | None = None
            self._mode: str | None = None
            self._tracer: Any = None
            self._fanout.destinations = []
            self.destinations = []
        self._close(old, time.monotonic() + (
            config.export_timeout_s if timeout is None else timeout), wait=False)

    def validate(self) -> None:
        """Raise now (a missing OTLP package) when the user asked for exporters explicitly;
        warn about a malformed endpoint. Builds no exporter."""
        if "otlp" in self.config.exporters:
            otlp_target()

    @property
    def resource(self) -> Resource:
        if self._resource is None:
            self._resource = build_resource(self.config)
        return self._resource

    def _decide(self) -> str:
        current = trace.get_tracer_provider()
        if self._provider is not None and current is self._provider:
            if not self.destinations:
                self._install_exporters()
            return "owned" if self.destinations else "off"
        if not isinstance(current, trace.ProxyTracerProvider):
            self._tracer = tracer = user_tracer(current)
            self.destinations = [self._destination(
                "provider", "the application's TracerProvider",
                lambda: ProviderExporter(tracer), list)]
            return "user"
        if not self.config.exporters:
            return "off"
        self._install_exporters()
        if not self.destinations:
            return "off"
        provider = TracerProvider(resource=self.resource, shutdown_on_exit=False)
        provider.add_span_processor(self._fanout)
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is provider:
            self._provider = provider
            return "owned"
        self.destinations = []
        self._fanout.destinations = []
        return self._decide()  # someone else won the race: use theirs

    def _destination(self, label: str, target: str, make: Any, build: Any) -> Destination:
        config = self.config
        return Destination(
            label, target, make, build, queue_size=config.export_queue_size,
            batch_size=config.export_batch_size, delay=config.export_delay_s,
            backoff=Backoff(config.export_backoff_min_s, config.export_backoff_max_s))

    def _install_exporters(self) -> None:
        """One destination per exporter; the exporters themselves are built on their export
        threads, never here (this runs on the caller's thread at the first region)."""
        config = self.config
        for name in config.exporters:
            if not isinstance(name, (str, SpanExporter)):
                continue  # a metric exporter or reader: perfsdk.export.metrics takes it
            if name == "otlp":
                try:
                    target = otlp_target()
                except Exception as exc:
                    warn_once("exporter:otlp", f"perfsdk: cannot use the otlp exporter: {exc}")
                    continue
            else:
                target = describe(name, config)
            label = name if isinstance(name, str) else type(name).__name__
            self.destinations.append(self._destination(
                label, target, functools.partial(make_exporter, name, config), self._spans))
        # The application's own spans on perfsdk's provider go to the same destinations.
        self._fanout.destinations = list(self.destinations)

    def _spans(self, items: list[Any]) -> list[ReadableSpan]:
        """Region records (tuples) become spans; the application's spans pass as they are."""
        return build_spans(items, self.resource, rank_attributes())  # ranks: 1 us, once a batch

    @property
    def decided(self) -> str | None:
        """The mode if decided yet, else None (never decides)."""
        return self._mode

    def count_lost(self, count: int, reason: str) -> None:
        """Regions that never reached this sink (see ``Pipeline.on_lost``): while spans are
        exported, their spans are produced and lost, for ``reason``."""
        if self._mode in ("owned", "user"):
            for destination in list(self.destinations):
                destination.count_lost(count, reason)

    @property
    def mode(self) -> str:
        """``owned`` (perfsdk's exporters), ``user`` (the app's provider) or ``off``."""
        with self._lock:
            if self._mode is None:
                self._mode = self._decide()
            return self._mode

    # -- the sink --------------------------------------------------------------------------
    def consume(self, records: list[Record]) -> None:
        if self.mode != "off":
            for destination in self.destinations:
                destination.offer(records)

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for destination in list(self.destinations):
            destination.flush(deadline)
        if self._mode == "user":
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            left = deadline - time.monotonic()
            if flush is not None and left > 0:
                bounded(lambda: flush(int(left * 1000)), left, "flush")

    def shutdown(self, timeout: float) -> None:
        with self._lock:
            old, self.destinations = self.destinations, []
            self._fanout.destinations = []
            user = self._mode == "user"
            self._mode = None
        deadline = time.monotonic() + timeout
        self._close(old, deadline)
        if user:  # the application owns its provider and shuts it down itself: flush only
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            left = deadline - time.monotonic()
            if flush is not None and left > 0:
                bounded(lambda: flush(int(left * 1000)), left, "flush")

    def _close(self, destinations: list[Destination], deadline: float, *,
               wait: bool = True) -> None:
        """Close ``destinations`` together (one deadline) and keep their account; without
        ``wait``, on a thread of their own (a reconfiguration must not hold the caller)."""
        if not destinations:
            return
        with self._lock:
            self._closing.extend(destinations)

        def close_all() -> None:
            threads = [threading.Thread(target=d.close, args=(deadline,), daemon=True,
                                        name=f"perfsdk-close-{d.label}") for d in destinations[1:]]
            for thread in threads:
                thread.start()
            destinations[0].close(deadline)  # here: at exit, threads started now may fail
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            with self._lock:
                for destination in destinations:
                    stats = destination.stats()
                    _add_account(self._retired, stats)
                    key = (destination.label, destination.target)
                    self._retired_by[key] = _merged(self._retired_by.get(key), stats)
                    self._closing.remove(destination)

        if wait:
            close_all()
        else:
            threading.Thread(target=close_all, name="perfsdk-close", daemon=True).start()

    def prepare(self) -> None:
        """Decide where spans go, on the caller's thread at the first region: an owned provider
        must be in place before the user opens spans inside that region. Cheap: each exporter's
        thread starts here and builds its exporter there (early: some exporters cannot be built
        once the interpreter is shutting down)."""
        if self.mode != "off":
            for destination in list(self.destinations):
                destination.start()

    def wait_ready(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for the exporters being built on their threads."""
        for destination in list(self.destinations):
            destination.wait_built(deadline)

    def after_fork(self) -> None:
        """In a forked child: new destinations (own file, own connections, own account) and
        resource (own pid), made on first use; the parent's are left alone. What the parent
        knew about a failing collector carries over."""
        self._lock = threading.Lock()
        self._resource = None
        for destination in self.destinations:
            destination.after_fork()
        self._retired = _empty_account()
        self._retired_by = {}
        self._closing = []

    def stats(self) -> dict[str, Any]:
        """The span account over every destination, past and present."""
        total = _empty_account()
        with self._lock:
            _add_account(total, self._retired)
            live = self.destinations + self._closing
        per: dict[str, Any] = {}
        for destination in live:
            stats = destination.stats()
            _add_account(total, stats)
            exporter = destination.exporter
            if isinstance(exporter, ProviderExporter):
                stats.update(exporter.counts())
            per[destination.label] = stats
        lost = total["lost"]
        return {
            "spans_produced": total["produced"],
            "spans_exported": total["exported"],
            "spans_lost": lost,
            "spans_pending": total["pending"],
            "spans_failed": lost["export_failed"] + lost["export_timeout"],
            "spans_dropped": lost["queue_full"] + lost["backing_off"] + lost["shutdown"],
            "exporters": per,
        }

    def lost_lines(self) -> list[str]:
        """One line per exporter that lost spans: how many of how many, why, and to where."""
        with self._lock:
            accounts = dict(self._retired_by)
            live = self.destinations + self._closing
        for destination in live:
            key = (destination.label, destination.target)
            accounts[key] = _merged(accounts.get(key), destination.stats())
        lines = []
        for (label, target), stats in accounts.items():
            lost = {k: v for k, v in stats["lost"].items() if v}
            if lost:
                why = ", ".join(f"{k} {v:,}" for k, v in lost.items())
                cause = f"; last cause: {stats['last_cause']}" if stats["last_cause"] else ""
                lines.append(f"perfsdk: {sum(lost.values()):,} of {stats['produced']:,} spans "
                             f"were not exported by the {label} exporter to {target} "
                             f"({why}{cause}); see perfsdk.diagnostics().")
        return lines


def _empty_account() -> dict[str, Any]:
    return {"produced": 0, "exported": 0, "pending": 0, "lost": dict.fromkeys(REASONS, 0)}


def _merged(old: dict[str, Any] | None, stats: dict[str, Any]) -> dict[str, Any]:
    out = _empty_account()
    out["last_cause"] = stats.get("last_cause") or (old or {}).get("last_cause")
    if old is not None:
        _add_account(out, old)
    _add_account(out, stats)
    return out


def _add_account(total: dict[str, Any], stats: dict[str, Any]) -> None:
    for key in ("produced", "exported", "pending"):
        total[key] += stats[key]
    for reason, n in stats["lost"].items():
        total["lost"][reason] += n
