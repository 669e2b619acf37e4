"""perfsdk's metrics through OpenTelemetry's own OTLP metric exporters to a real loopback receiver,
and through the file exporter across a fork.

Each scenario runs a script from ``_scripts/`` in a fresh interpreter (perfsdk sets the global
MeterProvider once per process); the receiver runs here and decodes the
ExportMetricsServiceRequests that arrived, over gRPC and over HTTP/protobuf.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from tests.integration._scripts.harness import PROTOCOLS, Run, clean_env, run_script
from tests.otlp_receiver import OTLPReceiver, decode_attributes, unused_port

CUMULATIVE = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


def perfsdk_metrics(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    """Metric name -> the protobuf Metric, for the ``perfsdk`` scope of one request."""
    found: dict[str, Any] = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            if sm.scope.name == "perfsdk":
                found.update({m.name: m for m in sm.metrics})
    return found


@dataclass
class Sent:
    protocol: str
    run: Run
    requests: list[ExportMetricsServiceRequest]

    def last(self) -> dict[str, Any]:
        return perfsdk_metrics(self.requests[-1])


@pytest.fixture(scope="module", params=list(PROTOCOLS))
def sent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Sent:
    protocol = request.param
    with OTLPReceiver(protocol) as receiver:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=PROTOCOLS[protocol],
            PERFSDK_EXPORTER="otlp",
            PERFSDK_SERVICE_NAME=f"svc-{protocol}",
        )
        result = tmp_path_factory.mktemp(f"metrics-{protocol}") / "result.json"
        run = run_script("metrics_app.py", env=env, result=result).check()
        requests = receiver.metrics_requests
    return Sent(protocol, run, requests)


def test_duration_histogram_per_region(sent: Sent):
    assert "PerfSDKWarning" not in sent.run.stderr, sent.run.stderr
    # perfsdk.flush() exported once, interpreter exit once more; both carry every region
    # (cumulative), and the second adds nothing.
    assert len(sent.requests) >= 2
    host_ms = sent.run.result["host_ms"]
    for request in (sent.requests[0], sent.requests[-1]):
        hist = perfsdk_metrics(request)["perfsdk.region.duration"]
        assert hist.unit == "ms"
        assert hist.histogram.aggregation_temporality == CUMULATIVE
        by_name = {}
        for point in hist.histogram.data_points:
            attrs = decode_attributes(point.attributes)
            by_name[attrs["perfsdk.region"]] = (attrs["perfsdk.region.error"], point)
        assert sorted(by_name) == ["bwd", "explode", "fwd"]
        for name, times in host_ms.items():
            error, point = by_name[name]
            assert error is (name == "explode")
            assert point.count == len(times)
            assert point.sum == pytest.approx(sum(times), rel=1e-9)
            assert point.min == pytest.approx(min(times), rel=1e-9)
            assert point.max == pytest.approx(max(times), rel=1e-9)
            assert sum(point.bucket_counts) == len(times)
    assert "perfsdk.region.device_duration" not in sent.last()  # no GPU here


def test_errors_counter(sent: Sent):
    errors = sent.last()["perfsdk.region.errors"]
    assert errors.unit == "{error}"
    assert errors.sum.is_monotonic
    (point,) = errors.sum.data_points
    assert decode_attributes(point.attributes) == {"perfsdk.region": "explode",
                                                   "error.type": "ValueError"}
    assert point.as_int == 2


def test_resource_and_process_memory(sent: Sent):
    (rm,) = sent.requests[-1].resource_metrics
    resource = decode_attributes(rm.resource.attributes)
    assert resource["service.name"] == f"svc-{sent.protocol}"
    assert resource["process.pid"] == sent.run.result["pid"]
    memory = sent.last()["process.memory.usage"]
    assert memory.unit == "By"
    assert not memory.sum.is_monotonic  # an up-down counter, as the semantic conventions say
    (point,) = memory.sum.data_points
    assert point.as_int > 10 * 2**20


def test_unreachable_collector_warns_once_and_exits(tmp_path: Path):
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{unused_port()}",
        PERFSDK_EXPORTER="otlp",
        PERFSDK_EXPORT_TIMEOUT="1",
    )
    run = run_script("metrics_app.py", env=env, result=tmp_path / "result.json", timeout=120)
    exited_ns = time.monotonic_ns()
    run.check()
    assert run.stderr.count("could not deliver metrics") == 1, run.stderr
    # ... naming where to and why
    endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert f"could not deliver metrics to {endpoint}/v1/metrics: connection refused" in \
        run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    # the exit's export waits at most PERFSDK_EXPORT_TIMEOUT (1 s), not OTel's default 10 s
    exit_s = (exited_ns - run.result["written_ns"]) / 1e9
    assert exit_s < 1 + 4, f"exit took {exit_s:.1f} s"


def _counts(line: str) -> tuple[dict[str, Any], dict[str, int]]:
    """(resource attributes, region -> duration count) of one file-exporter line."""
    data = json.loads(line)
    (rm,) = data["resource_metrics"]
    counts = {}
    for sm in rm["scope_metrics"]:
        for metric in sm["metrics"]:
            if metric["name"] == "perfsdk.region.duration":
                for p in metric["data"]["data_points"]:
                    counts[p["attributes"]["perfsdk.region"]] = p["count"]
    return rm["resource"]["attributes"], counts


def test_file_exporter_per_process_across_fork(tmp_path: Path):
    out = tmp_path / "out"
    env = clean_env(PERFSDK_EXPORTER="file", PERFSDK_OUTPUT_DIR=str(out))
    run = run_script("metrics_fork_app.py", env=env, result=tmp_path / "result.json").check()
    assert "PerfSDKWarning" not in run.stderr, run.stderr
    parent, child = run.result["parent"], run.result["child"]
    assert run.result["child_status"] == 0
    assert sorted(p.name for p in out.glob("metrics-*.jsonl")) == sorted(
        [f"metrics-{parent}.jsonl", f"metrics-{child}.jsonl"])

    parent_lines = (out / f"metrics-{parent}.jsonl").read_text().splitlines()
    # flush, flush, exit: the child's copy of the parent's exporter wrote nothing here
    assert [_counts(line)[1] for line in parent_lines] == [{"parent": 3}, {"parent": 4},
                                                           {"parent": 4}]
    assert {_counts(line)[0]["process.pid"] for line in parent_lines} == {parent}

    child_lines = (out / f"metrics-{child}.jsonl").read_text().splitlines()
    assert child_lines
    for line in child_lines:  # only the child's regions, not the parent's copied state
        resource, counts = _counts(line)
        assert counts == {"child": 2}
        assert resource["process.pid"] == child
