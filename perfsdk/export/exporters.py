"""OpenTelemetry's exporters, guarded: a failure warns once, is counted, and never reaches the
program; an unreachable collector is given a rest instead of a retry cycle per batch."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult

from perfsdk.config import Config
from perfsdk.errors import MissingDependencyError, warn_once

__all__ = ["GuardedExporter", "bounded", "make_exporter", "otlp_exporter"]

_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)


class _Quiet(logging.Filter):
    """Drops OTel exporter log records on a thread while a guarded export runs there; the guard
    reports the failure once instead of a retry message per batch."""

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.local, "depth", 0):
            self.local.dropped = getattr(self.local, "dropped", 0) + 1
            return False
        return True


_QUIET = _Quiet()
for _name in _EXPORTER_LOGGERS:
    logging.getLogger(_name).addFilter(_QUIET)


class GuardedExporter(SpanExporter):
    """Wraps an OTel exporter: a failure warns once (naming the exporter) and is counted.

    After a failure the exporter rests for ``backoff`` seconds: batches in that window are
    counted as dropped at once instead of each waiting out the exporter's own retries, so an
    unreachable collector costs the program neither time nor memory.
    """

    def __init__(self, inner: SpanExporter, label: str, backoff: float = 30.0) -> None:
        self.inner = inner
        self.label = label
        self.backoff = backoff
        self.exported = 0
        self.failed = 0
        self.dropped = 0
        self._rest_until = 0.0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._rest_until and time.monotonic() < self._rest_until:
            self.dropped += len(spans)
            return SpanExportResult.FAILURE
        local = _Quiet.local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            result = SpanExportResult.FAILURE
            reason = repr(exc)
        else:
            reason = "the exporter reported failure"
        finally:
            local.depth -= 1
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self._rest_until = 0.0
        else:
            self.failed += len(spans)
            self._rest_until = time.monotonic() + self.backoff
            warn_once(f"export:{self.label}",
                      f"perfsdk: the {self.label} exporter could not deliver spans ({reason}); "
                      f"the program continues; spans are dropped for {self.backoff:g} s after "
                      "each failure and counted in perfsdk.diagnostics().")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def otlp_exporter(export_timeout: float = 5.0) -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            if protocol != "http/protobuf":
                warn_once("otlp-protocol", f"perfsdk: OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} "
                          "is not supported; accepted values are grpc, http/protobuf. "
                          "Using http/protobuf.")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
    except ImportError:
        raise MissingDependencyError(
            "opentelemetry-exporter-otlp", "otlp", "The otlp exporter") from None
    timeout = None
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        # OTel's default is 10 s of retries per batch; without the user's own choice, keep
        # one batch within perfsdk's export bound so exit is never held longer than that.
        timeout = export_timeout
    exporter: SpanExporter = OTLPSpanExporter(timeout=timeout)
    return exporter


def make_exporter(name: Any, config: Config) -> SpanExporter:
    """The exporter for one ``PERFSDK_EXPORTER`` name (or a user's SpanExporter), guarded."""
    if not isinstance(name, str):
        return GuardedExporter(name, type(name).__name__)
    if name == "otlp":
        return GuardedExporter(otlp_exporter(config.export_timeout_s), "otlp")
    if name == "console":
        return GuardedExporter(ConsoleSpanExporter(), "console")
    if name == "file":
        return GuardedExporter(_JsonLinesFile(config.output_dir), "file")
    raise ValueError(f"unknown exporter {name!r}")


class _JsonLinesFile(ConsoleSpanExporter):
    """OTel's console exporter and span JSON, one span per line, to a file opened on first use."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(formatter=lambda span: span.to_json(indent=None) + "\n")
        self.path = output_dir / f"spans-{os.getpid()}.jsonl"
        self._file: IO[str] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write("".join(self.formatter(span) for span in spans))
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def bounded(fn: Callable[[], object], timeout: float, what: str, subject: str = "span") -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds for it, so a slow or
    unreachable collector never holds the program (flush, shutdown, exit)."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:
            warn_once(f"{subject}-{what}-error", f"perfsdk: {subject} {what} failed: {exc!r}")
        finally:
            done.set()

    threading.Thread(target=run, name=f"perfsdk-{subject}-{what}", daemon=True).start()
    if not done.wait(timeout):
        warn_once(f"{subject}-{what}-timeout", f"perfsdk: {subject} {what} did not finish "
                  f"within {timeout:g} s (PERFSDK_EXPORT_TIMEOUT); what was not sent is dropped "
                  "so the program can go on.")
        return False
    return True

