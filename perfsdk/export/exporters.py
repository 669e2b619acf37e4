"""OpenTelemetry's span exporters by perfsdk's names, and where each one sends.

Failures, backoff and counting are :mod:`perfsdk.export.delivery`'s: an exporter here is built
on its export thread and called only there."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import urllib.parse
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, TraceState, format_span_id

from perfsdk.config import Config
from perfsdk.errors import MissingDependencyError, warn_once
from perfsdk.export.delivery import note_failure, run_within

__all__ = ["bounded", "describe", "make_exporter", "otlp_exporter", "otlp_target"]

def otlp_exporter(export_timeout: float = 5.0) -> SpanExporter:
    """OpenTelemetry's OTLP span exporter for the configured protocol, its timeout
    ``export_timeout`` unless ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`` is set."""
    protocol = otlp_protocol()
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
        # OTel's default is 10 s of retries per batch; without the user's own choice, keep one
        # batch within perfsdk's bound (OTEL_BSP_EXPORT_TIMEOUT, else PERFSDK_EXPORT_TIMEOUT).
        timeout = export_timeout
    session = None if protocol == "grpc" else _status_session()
    if session is not None:
        exporter: SpanExporter = OTLPSpanExporter(timeout=timeout, session=session)  # type: ignore[call-arg]
    else:
        exporter = OTLPSpanExporter(timeout=timeout)
    return exporter


_CREDENTIAL_VARS = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")


def _status_session() -> Any:
    """A requests session that notes each HTTP error status in the export thread's captured
    log (``code: 503``), so a failure names its status even when OpenTelemetry's exporter says
    only that its retries ran out. None where the user configured a session of their own (a
    credential provider) or requests is missing: OpenTelemetry's default then."""
    if any(os.environ.get(var) for var in _CREDENTIAL_VARS):
        return None
    try:
        import requests
    except ImportError:
        return None

    def note(response: Any, *args: Any, **kwargs: Any) -> None:
        if response.status_code >= 400:
            note_failure(f"code: {response.status_code}, reason: {response.reason}")

    session = requests.Session()
    session.hooks["response"].append(note)
    return session


def make_exporter(name: Any, config: Config) -> SpanExporter:
    """The exporter for one ``PERFSDK_EXPORTER`` name (or a user's SpanExporter, as it is)."""
    if not isinstance(name, str):
        return name  # type: ignore[no-any-return]
    if name == "otlp":
        return otlp_exporter(config.batch_timeout_s)
    if name == "console":
        return ConsoleSpanExporter()
    if name == "file":
        return _JsonLinesFile(config.output_dir)
    raise ValueError(f"unknown exporter {name!r}")


def describe(name: Any, config: Config) -> str:
    """Where an exporter sends, for people: a file, stdout, or the exporter's class."""
    if name == "file":
        return str(config.output_dir / f"spans-{os.getpid()}.jsonl")
    if name == "console":
        return "standard output"
    return type(name).__name__


def otlp_protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()


def otlp_target() -> str:
    """The OTLP endpoint spans go to and the protocol, as OpenTelemetry's exporter resolves them
    (``http://localhost:4318/v1/traces (http/protobuf)``).

    Raises MissingDependencyError without the OTLP package. A malformed endpoint warns once,
    naming the variable and the value (every span sent there is then counted as lost)."""
    protocol = otlp_protocol()
    package = ("opentelemetry.exporter.otlp.proto.grpc" if protocol == "grpc"
               else "opentelemetry.exporter.otlp.proto.http")
    try:
        found = importlib.util.find_spec(package) is not None
    except ImportError:  # a parent package is missing
        found = False
    if not found:
        raise MissingDependencyError(
            "opentelemetry-exporter-otlp", "otlp", "The otlp exporter")
    variable = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    endpoint = raw = os.environ.get(variable, "").strip()
    if not endpoint:
        variable = "OTEL_EXPORTER_OTLP_ENDPOINT"
        raw = os.environ.get(variable, "").strip()
        if protocol == "grpc":
            endpoint = raw or "http://localhost:4317"
        else:
            endpoint = (raw or "http://localhost:4318").rstrip("/") + "/v1/traces"
    problem = _endpoint_problem(endpoint)
    if problem:
        warn_once(f"otlp-endpoint:{endpoint}",
                  f"perfsdk: {variable}={raw!r} is not a usable endpoint ({problem}); "
                  "accepted values are URLs like http://collector:4318 (grpc: "
                  "http://collector:4317). Spans sent there are counted as lost "
                  "(export_failed) in perfsdk.diagnostics().")
    return f"{endpoint} ({protocol})"


def _endpoint_problem(endpoint: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(endpoint)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https") and not (parts.scheme == "" and ":" in endpoint):
        return f"the scheme {parts.scheme!r} is not http or https"
    if not parts.hostname:
        return "no host"
    del port
    return None


_RESOURCE_JSON: dict[int, tuple[Any, str]] = {}
"""A resource's JSON text by id, with the resource (a reused id is seen): a few at most."""


def span_line(span: ReadableSpan) -> str:
    """``span.to_json(indent=None)`` and a newline: the same text, made in 7 us instead of 40.
    ``to_json`` serializes and parses the resource for every span (about half of its time; the
    spans of a process share one resource: its text is made once), formats both times with
    ``strftime`` (here the date and time to the second are made once a second:
    :func:`iso_time`), and encodes a dict of every field (here the fields of a fixed format,
    ids, times, kind and status, are written as text; the name, attributes, events and links go
    through the JSON encoder)."""
    resource = span.resource
    known = _RESOURCE_JSON.get(id(resource))
    if known is None or known[0] is not resource:
        if len(_RESOURCE_JSON) >= 8:
            _RESOURCE_JSON.clear()
        known = _RESOURCE_JSON[id(resource)] = (
            resource, json.dumps(json.loads(resource.to_json())))
    # to_json's dict, in its order, as json.dumps writes it: the fixed-format fields (ids,
    # times, kind, status code) written here, the rest through the encoder
    context = span._context
    parent = span.parent
    status = span._status
    attributes = span._attributes
    if attributes is not None and type(attributes) is not dict:
        attributes = ReadableSpan._format_attributes(attributes)
    start, end = span._start_time, span._end_time
    described = f', "description": {_string(status.description)}' if status.description else ""
    return "".join((
        '{"name": ', _json(span._name),
        ', "context": ', "null" if not context else (
            f'{{"trace_id": "0x{context.trace_id:032x}", "span_id": "0x{context.span_id:016x}"'
            f', "trace_state": {_string(_trace_state(context.trace_state))}}}'),
        ', "kind": ', _string(_KINDS.get(span.kind) or str(span.kind)),
        ', "parent_id": ', "null" if parent is None else f'"0x{format_span_id(parent.span_id)}"',
        ', "start_time": ', f'"{iso_time(start)}"' if start else "null",
        ', "end_time": ', f'"{iso_time(end)}"' if end else "null",
        ', "status": {"status_code": ', _string(str(status.status_code.name)), described, "}",
        ', "attributes": ', _json(attributes),
        ', "events": ', _json(ReadableSpan._format_events(span._events)) if span._events
        else "[]",
        ', "links": ', _json(ReadableSpan._format_links(span._links)) if span._links else "[]",
        ', "resource": ', known[1], "}\n"))


_json = json.JSONEncoder().encode
"""``json.dumps`` with its defaults, without its argument handling."""
_string = encode_basestring_ascii
"""``json.dumps`` of a str."""
_KINDS = {kind: str(kind) for kind in SpanKind}
"""``str(kind)`` of each span kind, as ``to_json`` writes it."""
_EMPTY_STATE = TraceState()


def _trace_state(state: TraceState) -> str:
    """``repr(state)``, made once for the empty state every span of perfsdk's has."""
    if state is _EMPTY_STATE or (type(state) is TraceState and not len(state)):
        return _EMPTY_STATE_REPR
    return repr(state)


_EMPTY_STATE_REPR = repr(_EMPTY_STATE)
_SECOND: tuple[int, str] = (0, "1970-01-01T00:00:00")
"""The last whole second :func:`iso_time` formatted, and its text (replaced whole, so that
export threads never read one's second with another's text)."""


def iso_time(ns: int) -> str:
    """``opentelemetry.sdk.util.ns_to_iso_str(ns)`` (``datetime.fromtimestamp(ns / 1e9, UTC)``
    with ``strftime``), the same text: ``ns / 1e9`` split and its fraction rounded to
    microseconds half to even, as ``fromtimestamp`` does, and the date and time of its whole
    second formatted once, as long as the second stays the same."""
    fraction, whole = math.modf(ns / 1e9)
    micro = round(fraction * 1e6)
    if micro >= 1_000_000:
        whole += 1.0
        micro -= 1_000_000
    elif micro < 0:
        whole -= 1.0
        micro += 1_000_000
    second = int(whole)
    cached = _SECOND
    if cached[0] != second:
        cached = _remember_second(second)
    return f"{cached[1]}.{micro:06d}Z"


def _remember_second(second: int) -> tuple[int, str]:
    global _SECOND
    _SECOND = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return _SECOND


def _to_json_line(span: ReadableSpan) -> str:
    return f"{span.to_json(indent=None)}\n"


class _JsonLinesFile(ConsoleSpanExporter):
    """OTel's console exporter and span JSON, one span per line, to a file opened on first use
    (:func:`span_line`: OTel's text, made faster; ``to_json`` itself where the SDK's span has
    changed shape)."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(formatter=span_line)
        self.path = output_dir / f"spans-{os.getpid()}.jsonl"
        self._file: IO[str] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        try:
            text = "".join(self.formatter(span) for span in spans)
        except AttributeError:  # an SDK whose spans have other fields: their own to_json
            self.formatter = _to_json_line
            text = "".join(self.formatter(span) for span in spans)
        self._file.write(text)
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def bounded(fn: Callable[[], object], timeout: float, what: str, subject: str = "span") -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds for it, so a slow or
    unreachable collector never holds the program (flush, shutdown, exit); warns once when
    time runs out."""
    if not run_within(fn, timeout, f"{subject}-{what}"):
        warn_once(f"{subject}-{what}-timeout", f"perfsdk: {subject} {what} did not finish "
                  f"within {timeout:g} s (PERFSDK_EXPORT_TIMEOUT); what was not sent is dropped "
                  "so the program can go on.")
        return False
    return True
