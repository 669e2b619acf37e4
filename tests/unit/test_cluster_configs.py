"""The Collector, docker compose, Tempo and Grafana files of docs/distributed.md hang together:
each parses, every pipeline uses only components it defines (of types the Collector contrib
image has), every exporter points at a compose service on a port that service listens on, the
ports training processes send to are published, and every mounted file exists. (The Collector's
own ``validate`` command is a binary that cannot be fetched here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "docs" / "cluster"
SETUPS = sorted(p.name for p in CLUSTER.iterdir() if p.is_dir())
KNOWN = {  # component types of otel/opentelemetry-collector-contrib used here
    "receivers": {"otlp"}, "processors": {"batch", "memory_limiter", "resourcedetection"},
    "exporters": {"otlp", "debug"}}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_both_setups_are_there() -> None:
    assert SETUPS == ["jaeger", "tempo"]


@pytest.mark.parametrize("setup", SETUPS)
def test_collector_pipelines_use_defined_components(setup: str) -> None:
    config = load(CLUSTER / setup / "otel-collector.yaml")
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline.get(kind, []):
                assert name in config[kind], f"{setup}: {kind[:-1]} {name!r} is not defined"
                assert name.split("/")[0] in KNOWN[kind], f"{setup}: unknown type {name!r}"
    assert pipelines["traces"]["processors"][-1] == "batch"  # batch last, as recommended


@pytest.mark.parametrize("setup", SETUPS)
def test_exporters_reach_a_listening_service(setup: str) -> None:
    config = load(CLUSTER / setup / "otel-collector.yaml")
    compose = load(CLUSTER / setup / "docker-compose.yml")
    services = compose["services"]
    backend = {"jaeger": "jaeger", "tempo": "tempo"}[setup]
    endpoint = config["exporters"][f"otlp/{backend}"]["endpoint"]
    host, port = endpoint.split(":")
    assert host == backend
    assert host in services
    if setup == "jaeger":  # all-in-one takes OTLP gRPC on 4317 once OTLP is enabled
        assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
        assert int(port) == 4317
    else:  # Tempo's distributor receives OTLP gRPC where tempo.yaml says
        tempo = load(CLUSTER / "tempo" / "tempo.yaml")
        grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
        assert port_of(grpc) == int(port)
        grafana = load(CLUSTER / "tempo" / "grafana-datasources.yaml")
        (source,) = grafana["datasources"]
        assert source["type"] == "tempo"
        assert source["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"


@pytest.mark.parametrize("setup", SETUPS)
def test_training_processes_can_send_and_mounts_exist(setup: str) -> None:
    config = load(CLUSTER / setup / "otel-collector.yaml")
    compose = load(CLUSTER / setup / "docker-compose.yml")
    services = compose["services"]
    collector = services["otel-collector"]
    published = {int(p.split(":")[0]) for p in collector["ports"]}
    protocols = config["receivers"]["otlp"]["protocols"]
    assert {port_of(protocols["grpc"]["endpoint"]), port_of(protocols["http"]["endpoint"])} \
        == published == {4317, 4318}  # 4318: perfsdk's default OTLP protocol, http/protobuf
    mounted = collector["volumes"][0].split(":")[1]
    assert collector["command"] == [f"--config={mounted}"]
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{setup}: {name} depends on unknown {dep!r}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (CLUSTER / setup / source).is_file(), f"{setup}: {source} is missing"
