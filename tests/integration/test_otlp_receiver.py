"""Prove tests/otlp_receiver.py against the real OpenTelemetry SDK + OTLP exporters.

No perfsdk code is involved here, and the global tracer provider is never set.
"""

from __future__ import annotations

import gzip
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GRPCSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression as HTTPCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HTTPSpanExporter,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.otlp_receiver import OTLPProtocol, OTLPReceiver, unused_port

PROTOCOLS: list[OTLPProtocol] = ["grpc", "http"]


def _exporter(receiver: OTLPReceiver, *, gzip_: bool = False) -> SpanExporter:
    if receiver.protocol == "grpc":
        return GRPCSpanExporter(
            endpoint=receiver.endpoint,
            insecure=True,
            timeout=5,
            compression=grpc.Compression.Gzip if gzip_ else None,
        )
    return HTTPSpanExporter(
        endpoint=receiver.endpoint,
        timeout=5,
        compression=HTTPCompression.Gzip if gzip_ else None,
    )


@pytest.fixture(params=PROTOCOLS)
def receiver(request: pytest.FixtureRequest) -> Iterator[OTLPReceiver]:
    with OTLPReceiver(request.param) as recv:
        yield recv


def _emit_three_spans(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("recv-test.scope", "1.2.3")
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent:
        parent.set_attribute("s", "text")
        parent.set_attribute("i", 42)
        parent.set_attribute("f", 1.5)
        parent.set_attribute("b", True)
        parent.set_attribute("l", [1, 2, 3])
        parent.set_attribute("ls", ["a", "b"])
        with tracer.start_as_current_span("child") as child:
            child.add_event("child.event", {"k": "v"})
    with tracer.start_as_current_span(
        "boom", record_exception=False, set_status_on_exception=False
    ) as err:
        try:
            raise ValueError("bad value")
        except ValueError as exc:
            err.record_exception(exc)
            err.set_status(StatusCode.ERROR, "it broke")


@pytest.mark.parametrize("gzip_", [False, True], ids=["plain", "gzip"])
def test_real_sdk_exporter_roundtrip(receiver: OTLPReceiver, gzip_: bool) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "recv-test"}))
    provider.add_span_processor(SimpleSpanProcessor(_exporter(receiver, gzip_=gzip_)))
    try:
        _emit_three_spans(provider)
        spans = receiver.wait_for_spans(3, timeout=10)
    finally:
        provider.shutdown()

    assert sorted(s.name for s in spans) == ["boom", "child", "parent"]
    # SimpleSpanProcessor exports one span per request.
    assert receiver.requests == 3
    by_name = {s.name: s for s in spans}
    parent, child, boom = by_name["parent"], by_name["child"], by_name["boom"]

    # ids are hex of the right width; parent/child link.
    for s in spans:
        assert len(s.trace_id) == 32
        assert len(s.span_id) == 16
        int(s.trace_id, 16)
        int(s.span_id, 16)
        assert s.end_ns >= s.start_ns > 0
        assert s.resource["service.name"] == "recv-test"
        assert s.resource["telemetry.sdk.language"] == "python"
        assert s.scope_name == "recv-test.scope"
    assert parent.parent_span_id == ""
    assert parent.is_root
    assert child.parent_span_id == parent.span_id
    assert child.trace_id == parent.trace_id
    assert boom.parent_span_id == ""
    assert boom.trace_id != parent.trace_id
    assert parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns

    # Attributes come back as Python values of the right types.
    assert parent.attributes == {
        "s": "text",
        "i": 42,
        "f": 1.5,
        "b": True,
        "l": [1, 2, 3],
        "ls": ["a", "b"],
    }
    assert type(parent.attributes["i"]) is int
    assert type(parent.attributes["b"]) is bool
    assert parent.kind == SpanKind.SERVER.value + 1  # OTLP kinds are API kinds + 1
    assert child.kind == 1  # SPAN_KIND_INTERNAL
    assert child.events == [("child.event", {"k": "v"})]

    # Status + exception event.
    assert parent.status_code == "UNSET"
    assert boom.status_code == "ERROR"
    assert boom.status_message == "it broke"
    assert len(boom.events) == 1
    ev_name, ev_attrs = boom.events[0]
    assert ev_name == "exception"
    assert ev_attrs["exception.type"] == "ValueError"
    assert ev_attrs["exception.message"] == "bad value"
    assert "ValueError: bad value" in str(ev_attrs["exception.stacktrace"])

    if gzip_ and receiver.protocol == "http":
        assert receiver.request_headers[0]["content-encoding"] == "gzip"


def test_http_receiver_rejects_bad_requests() -> None:
    with OTLPReceiver("http") as recv:

        def post(path: str, body: bytes, headers: dict[str, str]) -> int:
            req = urllib.request.Request(
                recv.base_endpoint + path, data=body, headers=headers, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    status: int = resp.status
                    payload = resp.read()
            except urllib.error.HTTPError as err:
                err.close()
                return err.code
            ExportTraceServiceResponse.FromString(payload)
            return status

        proto = {"Content-Type": "application/x-protobuf"}
        assert post("/v1/logs", b"", proto) == 404
        assert post("/v1/traces", b"{}", {"Content-Type": "application/json"}) == 415
        assert post("/v1/traces", b"\xff\xff\xff", proto) == 400
        assert post("/v1/traces", b"not gzip", {**proto, "Content-Encoding": "gzip"}) == 400
        # An empty protobuf message is a valid (empty) request.
        assert post("/v1/traces", gzip.compress(b""), {**proto, "Content-Encoding": "gzip"}) == 200
        assert recv.requests == 1
        assert recv.spans() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_metrics_requests_are_stored(protocol: OTLPProtocol) -> None:
    req = ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(schema_url="x")])
    with OTLPReceiver(protocol) as recv:
        if protocol == "grpc":
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import (
                MetricsServiceStub,
            )

            with grpc.insecure_channel(f"127.0.0.1:{recv.port}") as channel:
                stub = MetricsServiceStub(channel)  # type: ignore[no-untyped-call]
                stub.Export(req, timeout=5)
        else:
            http_req = urllib.request.Request(
                recv.metrics_endpoint,
                data=req.SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
                method="POST",
            )
            with urllib.request.urlopen(http_req, timeout=5) as resp:
                assert resp.status == 200
        got = recv.wait_for_metrics_requests(1, timeout=5)
    assert got == [req]
    assert recv.requests == 0


def test_wait_for_spans_times_out_with_clear_message() -> None:
    with (
        OTLPReceiver("http") as recv,
        pytest.raises(AssertionError, match=r"expected at least 1 span\(s\) within 0.2s, got 0"),
    ):
        recv.wait_for_spans(1, timeout=0.2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_endpoints_are_loopback_and_server_stops(protocol: OTLPProtocol) -> None:
    with OTLPReceiver(protocol) as recv:
        port = recv.port
        assert recv.base_endpoint == f"http://127.0.0.1:{port}"
        if protocol == "grpc":
            assert recv.endpoint == recv.base_endpoint
        else:
            assert recv.endpoint == f"http://127.0.0.1:{port}/v1/traces"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", port), timeout=2),
    ):
        pass


def test_unused_port_refuses_connections() -> None:
    port = unused_port()
    assert 0 < port < 65536
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", port), timeout=2),
    ):
        pass


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_base_endpoint_via_env(protocol: OTLPProtocol, monkeypatch: pytest.MonkeyPatch) -> None:
    with OTLPReceiver(protocol) as recv:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", recv.base_endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        exporter: SpanExporter = GRPCSpanExporter() if protocol == "grpc" else HTTPSpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        try:
            with provider.get_tracer("env").start_as_current_span("via-env"):
                pass
            (span,) = recv.wait_for_spans(1, timeout=10)
        finally:
            provider.shutdown()
    assert span.name == "via-env"
    assert span.scope_name == "env"
