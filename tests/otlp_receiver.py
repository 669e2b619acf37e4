"""A real, in-process OTLP trace (and metrics) receiver for tests.

It listens on 127.0.0.1 only, on a free port, and speaks either OTLP/gRPC or
OTLP/HTTP (protobuf).  It decodes exactly what the real OpenTelemetry exporters
send, so tests can assert on spans the way a collector would see them::

    with OTLPReceiver("grpc") as receiver:
        exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        ...
        spans = receiver.wait_for_spans(3)

Everything stops on ``__exit__`` within a few seconds at most.
"""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Literal, TypeAlias

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from typing_extensions import Self

if TYPE_CHECKING:
    from collections.abc import Iterable

    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

__all__ = [
    "AttrValue",
    "OTLPProtocol",
    "OTLPReceiver",
    "ReceivedSpan",
    "decode_any_value",
    "decode_attributes",
    "BlackHole",
    "decode_spans",
    "unused_port",
]

OTLPProtocol: TypeAlias = Literal["grpc", "http"]
AttrValue: TypeAlias = (
    "str | bool | int | float | bytes | list[AttrValue] | dict[str, AttrValue] | None"
)

_HOST = "127.0.0.1"
_TRACES_PATH = "/v1/traces"
_METRICS_PATH = "/v1/metrics"
_PROTOBUF = "application/x-protobuf"
_MAX_BODY = 64 * 1024 * 1024


# --------------------------------------------------------------------------- #
# Decoded span
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as decoded from an OTLP export request."""

    name: str
    trace_id: str  # 32 lowercase hex chars
    span_id: str  # 16 lowercase hex chars
    parent_span_id: str  # 16 hex chars, or "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    status_code: str = "UNSET"  # "UNSET" | "OK" | "ERROR"
    status_message: str = ""
    events: list[tuple[str, dict[str, AttrValue]]] = field(default_factory=list)
    resource: dict[str, AttrValue] = field(default_factory=dict)
    scope_name: str = ""
    kind: int = 0  # opentelemetry.proto.trace.v1.Span.SpanKind value

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def is_root(self) -> bool:
        return self.parent_span_id == ""


def decode_any_value(value: AnyValue) -> AttrValue:
    """Convert an OTLP ``AnyValue`` into a plain Python value.

    Arrays become lists, kvlists become dicts, an empty AnyValue becomes None.
    """
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "bytes_value":
        return value.bytes_value
    if which == "array_value":
        return [decode_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    return None


def decode_attributes(attributes: Iterable[KeyValue]) -> dict[str, AttrValue]:
    return {kv.key: decode_any_value(kv.value) for kv in attributes}


def _status_name(code: Status.StatusCode.ValueType) -> str:
    # STATUS_CODE_UNSET / STATUS_CODE_OK / STATUS_CODE_ERROR -> UNSET / OK / ERROR
    return str(Status.StatusCode.Name(code)).removeprefix("STATUS_CODE_")


def decode_spans(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Flatten an ``ExportTraceServiceRequest`` into :class:`ReceivedSpan` objects."""
    out: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope_name = scope_spans.scope.name
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=decode_attributes(span.attributes),
                        status_code=_status_name(span.status.code),
                        status_message=span.status.message,
                        events=[(ev.name, decode_attributes(ev.attributes)) for ev in span.events],
                        resource=dict(resource),
                        scope_name=scope_name,
                        kind=int(span.kind),
                    )
                )
    return out


# --------------------------------------------------------------------------- #
# Ports
# --------------------------------------------------------------------------- #


def unused_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on (bind, then close).

    Connecting to it gets "connection refused" right away, which makes it
    the right target for "unreachable collector" tests.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
    return port


# --------------------------------------------------------------------------- #
# gRPC servicers
# --------------------------------------------------------------------------- #


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> ExportTraceServiceResponse:
        metadata = {str(k): str(v) for k, v in context.invocation_metadata()}
        receiver = self._receiver
        if receiver.reject is not None:
            receiver._count_rejected()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rejected ({receiver.reject})")
        receiver._record_traces(request, metadata)
        receiver._linger()
        return ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: ExportMetricsServiceRequest, context: grpc.ServicerContext
    ) -> ExportMetricsServiceResponse:
        metadata = {str(k): str(v) for k, v in context.invocation_metadata()}
        self._receiver._record_metrics(request, metadata)
        return ExportMetricsServiceResponse()


# --------------------------------------------------------------------------- #
# HTTP handler
# --------------------------------------------------------------------------- #


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    receiver: OTLPReceiver


class _OTLPHTTPHandler(BaseHTTPRequestHandler):
    server: _HTTPServer
    # HTTP/1.0: the connection closes after each response, so no handler
    # thread is left blocked on an idle keep-alive socket at shutdown.
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:
        """Keep the test output quiet."""

    def _reply(self, status: HTTPStatus, body: bytes = b"", content_type: str = _PROTOBUF) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    # Trailers (if any) up to the blank line.
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length", "0"))
        if length < 0 or length > _MAX_BODY:
            raise ValueError(f"bad Content-Length {length}")
        return self.rfile.read(length)

    def _decode_body(self, raw: bytes) -> bytes:
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("", "identity"):
            return raw
        if encoding == "gzip":
            return gzip.decompress(raw)
        if encoding == "deflate":
            return zlib.decompress(raw)
        raise ValueError(f"unsupported Content-Encoding {encoding!r}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in (_TRACES_PATH, _METRICS_PATH):
            self._reply(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
            return
        content_type = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if content_type != _PROTOBUF:
            self._reply(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"only {_PROTOBUF} is supported".encode(),
                "text/plain",
            )
            return
        try:
            body = self._decode_body(self._read_body())
        except (ValueError, OSError, EOFError, zlib.error) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, str(exc).encode(), "text/plain")
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        receiver = self.server.receiver
        # Parse first (protobuf raises google.protobuf.message.DecodeError, which
        # ships without type stubs, hence the broad catch limited to parsing).
        trace_request: ExportTraceServiceRequest | None = None
        metrics_request: ExportMetricsServiceRequest | None = None
        try:
            if path == _TRACES_PATH:
                trace_request = ExportTraceServiceRequest.FromString(body)
            else:
                metrics_request = ExportMetricsServiceRequest.FromString(body)
        except Exception as exc:
            self._reply(HTTPStatus.BAD_REQUEST, f"bad protobuf: {exc}".encode(), "text/plain")
            return
        if trace_request is not None:
            if receiver.reject is not None:
                receiver._count_rejected()
                self._reply(HTTPStatus(receiver.reject), b"rejected", "text/plain")
                return
            receiver._record_traces(trace_request, headers)
            receiver._linger()
            response = ExportTraceServiceResponse().SerializeToString()
        else:
            assert metrics_request is not None
            receiver._record_metrics(metrics_request, headers)
            response = ExportMetricsServiceResponse().SerializeToString()
        self._reply(HTTPStatus.OK, response)


# --------------------------------------------------------------------------- #
# Receiver
# --------------------------------------------------------------------------- #


class OTLPReceiver:
    """OTLP trace/metrics receiver on 127.0.0.1 for tests (a context manager).

    Attributes available once entered:

    * ``endpoint`` - what to pass to the exporter's ``endpoint=`` argument:
      ``http://127.0.0.1:PORT`` for gRPC, ``http://127.0.0.1:PORT/v1/traces``
      for HTTP.
    * ``base_endpoint`` - ``http://127.0.0.1:PORT``, for
      ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    * ``port``.

    Faults, settable at any time (a collector that is slow, down, or comes back):

    * ``delay_s`` - each trace request is recorded (accepted), then answered only after this
      many seconds (a slow collector; answered late, after a client's timeout, the spans were
      still received). Stopping the receiver cuts the wait short.
    * ``reject`` - an HTTP status (e.g. 503; gRPC answers UNAVAILABLE): trace requests are
      refused and not recorded; ``rejected`` counts them. ``None`` accepts again.
    """

    def __init__(self, protocol: OTLPProtocol = "grpc", *, delay_s: float = 0.0,
                 reject: int | None = None) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', not {protocol!r}")
        self.protocol: OTLPProtocol = protocol
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._trace_requests: list[ExportTraceServiceRequest] = []
        self._metrics_requests: list[ExportMetricsServiceRequest] = []
        self._request_headers: list[dict[str, str]] = []
        self._port: int | None = None
        self._grpc_server: grpc.Server | None = None
        self._grpc_executor: futures.ThreadPoolExecutor | None = None
        self._http_server: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.delay_s = delay_s
        self.reject = reject
        self.rejected = 0
        self._stopped = threading.Event()

    def _linger(self) -> None:
        if self.delay_s > 0:
            self._stopped.wait(self.delay_s)

    def _count_rejected(self) -> None:
        with self._cond:
            self.rejected += 1
            self._cond.notify_all()

    # -- lifecycle --------------------------------------------------------- #

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._port is not None:
            raise RuntimeError("OTLPReceiver already started")
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()

    def _start_grpc(self) -> None:
        executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-recv-grpc")
        self._grpc_executor = executor
        server = grpc.server(
            executor,
            options=[("grpc.so_reuseport", 0)],
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceServicer(self), server
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _MetricsServicer(self), server
        )
        port = server.add_insecure_port(f"{_HOST}:0")
        if port == 0:
            raise RuntimeError("could not bind a gRPC port on 127.0.0.1")
        server.start()
        self._grpc_server = server
        self._port = port

    def _start_http(self) -> None:
        server = _HTTPServer((_HOST, 0), _OTLPHTTPHandler)
        server.receiver = self
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-recv-http",
            daemon=True,
        )
        thread.start()
        self._http_server = server
        self._http_thread = thread
        self._port = int(server.server_address[1])

    def stop(self) -> None:
        """Stop the server; bounded to a few seconds, safe to call twice."""
        self._stopped.set()
        grpc_server, self._grpc_server = self._grpc_server, None
        if grpc_server is not None:
            grpc_server.stop(grace=1).wait(5)
        executor, self._grpc_executor = self._grpc_executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        http_server, self._http_server = self._http_server, None
        if http_server is not None:
            http_server.shutdown()
            http_server.server_close()
        http_thread, self._http_thread = self._http_thread, None
        if http_thread is not None:
            http_thread.join(timeout=5)

    # -- addresses --------------------------------------------------------- #

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("OTLPReceiver not started (use it as a context manager)")
        return self._port

    @property
    def base_endpoint(self) -> str:
        return f"http://{_HOST}:{self.port}"

    @property
    def endpoint(self) -> str:
        if self.protocol == "grpc":
            return self.base_endpoint
        return self.base_endpoint + _TRACES_PATH

    @property
    def metrics_endpoint(self) -> str:
        if self.protocol == "grpc":
            return self.base_endpoint
        return self.base_endpoint + _METRICS_PATH

    # -- recording (server threads) ---------------------------------------- #

    def _record_traces(
        self, request: ExportTraceServiceRequest, headers: Mapping[str, str]
    ) -> None:
        spans = decode_spans(request)
        with self._cond:
            self._trace_requests.append(request)
            self._request_headers.append(dict(headers))
            self._spans.extend(spans)
            self._cond.notify_all()

    def _record_metrics(
        self, request: ExportMetricsServiceRequest, headers: Mapping[str, str]
    ) -> None:
        with self._cond:
            self._metrics_requests.append(request)
            self._request_headers.append(dict(headers))
            self._cond.notify_all()

    # -- queries ------------------------------------------------------------ #

    def spans(self) -> list[ReceivedSpan]:
        """All spans received so far, flattened, in arrival order."""
        with self._cond:
            return list(self._spans)

    @property
    def requests(self) -> int:
        """Number of trace export requests received so far."""
        with self._cond:
            return len(self._trace_requests)

    @property
    def trace_requests(self) -> list[ExportTraceServiceRequest]:
        """The raw decoded trace export requests."""
        with self._cond:
            return list(self._trace_requests)

    @property
    def metrics_requests(self) -> list[ExportMetricsServiceRequest]:
        """The raw decoded metrics export requests."""
        with self._cond:
            return list(self._metrics_requests)

    @property
    def request_headers(self) -> list[dict[str, str]]:
        """Headers (HTTP, lowercased) or metadata (gRPC) of each request, in order."""
        with self._cond:
            return [dict(h) for h in self._request_headers]

    def _wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout)

    def wait_for_spans(self, n: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until at least ``n`` spans arrived; AssertionError after ``timeout`` s."""
        if not self._wait(lambda: len(self._spans) >= n, timeout):
            got = self.spans()
            names = [s.name for s in got]
            raise AssertionError(
                f"OTLPReceiver({self.protocol}) at {self.base_endpoint}: expected at least {n} "
                f"span(s) within {timeout}s, got {len(got)} in {self.requests} request(s): {names}"
            )
        return self.spans()

    def wait_for_metrics_requests(
        self, n: int, timeout: float = 10.0
    ) -> list[ExportMetricsServiceRequest]:
        """Block until at least ``n`` metrics requests arrived; AssertionError on timeout."""
        if not self._wait(lambda: len(self._metrics_requests) >= n, timeout):
            raise AssertionError(
                f"OTLPReceiver({self.protocol}) at {self.base_endpoint}: expected at least {n} "
                f"metrics request(s) within {timeout}s, got {len(self.metrics_requests)}"
            )
        return self.metrics_requests

    def spans_named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans() if s.name == name]

    def span(self, name: str) -> ReceivedSpan:
        """The single span called ``name``; AssertionError if none or several."""
        matches = self.spans_named(name)
        if len(matches) != 1:
            raise AssertionError(
                f"expected exactly one span named {name!r}, found {len(matches)}; "
                f"all names: {[s.name for s in self.spans()]}"
            )
        return matches[0]


class BlackHole:
    """A "collector" on 127.0.0.1 that accepts connections, reads what is sent and never
    answers: the worst case for an exporter (only its own timeout ends a request). A context
    manager; ``endpoint`` is ``http://127.0.0.1:PORT``; everything stops on exit."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((_HOST, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = int(self._sock.getsockname()[1])
        self.endpoint = f"http://{_HOST}:{self.port}"
        self.connections = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="otlp-black-hole", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the 50 ms accept timeout: look at the stop flag again
                pass
            else:
                conn.setblocking(False)
                self._conns.append(conn)
                self.connections += 1
            for conn in self._conns:  # read and discard, so senders never block on a full buffer
                try:
                    while conn.recv(65536):
                        pass
                except OSError:
                    pass
