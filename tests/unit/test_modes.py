"""NVTX-only mode (PERFSDK_TIMING=0), sampling of timed_region blocks, exporter instances and
the service name OpenTelemetry's own variables choose."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest

import perfsdk
from perfsdk.config import Config, configure
from perfsdk.testing import capture


def test_service_name_from_otel_resource_attributes():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=dev, service.name = ranker "}
    assert Config.from_env(env).service_name == "ranker"
    assert Config.from_env({**env, "OTEL_SERVICE_NAME": "svc"}).service_name == "svc"
    assert Config.from_env({**env, "PERFSDK_SERVICE_NAME": "mine"}).service_name == "mine"
    assert Config.from_env({"OTEL_RESOURCE_ATTRIBUTES": "a=b"}).service_name == "perfsdk"


def test_timing_variable_and_argument():
    assert Config.from_env({"PERFSDK_TIMING": "0"}).timing is False
    assert Config.from_env({}).timing is True
    with pytest.raises(ValueError, match=r"configure\(timing='no'\).*True or False"):
        configure(timing="no")  # type: ignore[arg-type]


def test_timing_off_records_nothing_and_changes_no_result():
    @perfsdk.profiled("m.f")
    def f(x: int) -> int:
        return x + 1

    @perfsdk.profiled("m.g")
    def g():
        yield from range(3)

    configure(timing=False)
    with capture() as cap:
        assert f(1) == 2
        assert list(g()) == [0, 1, 2]
        with perfsdk.timed_region("m.block", k=1) as handle:
            pass
        with pytest.raises(ZeroDivisionError), perfsdk.timed_region("m.raises"):
            1 / 0  # noqa: B018
    assert cap.regions == []
    assert math.isnan(handle.host_ms)
    assert not handle.recorded
    configure(timing=True)
    with capture() as cap:
        assert f(1) == 2
    assert [r.name for r in cap.regions] == ["m.f"]


def test_sample_every_applies_to_timed_region_blocks():
    configure(sample_every=3)
    handles = []
    with capture() as cap:
        for i in range(9):
            with perfsdk.timed_region("m.sampled", i=i) as handle:
                handles.append(handle)
    assert [r.attributes["i"] for r in cap.named("m.sampled")] == [0, 3, 6]
    assert [h.recorded for h in handles] == [i % 3 == 0 for i in range(9)]
    assert [not math.isnan(h.host_ms) for h in handles] == [i % 3 == 0 for i in range(9)]


def test_none_cannot_be_combined_with_an_exporter_instance():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    with pytest.raises(ValueError, match="'none' cannot be combined"):
        configure(exporter=["none", InMemorySpanExporter()])


def test_exporter_instance_receives_region_spans(tmp_path):
    # In a subprocess: an exporter installs perfsdk's global TracerProvider for good.
    script = textwrap.dedent("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import perfsdk

        memory = InMemorySpanExporter()
        perfsdk.configure(exporter=memory)

        @perfsdk.profiled("inst.outer")
        def outer():
            with trace.get_tracer("user").start_as_current_span("inst.user"):
                pass

        outer()
        perfsdk.flush()
        spans = {s.name: s for s in memory.get_finished_spans()}
        assert set(spans) == {"inst.outer", "inst.user"}, spans
        assert spans["inst.user"].parent.span_id == spans["inst.outer"].context.span_id
        print("diag", perfsdk.diagnostics()["span_mode"])
    """)
    env = {"PATH": "/usr/bin:/bin", "PERFSDK_OUTPUT_DIR": str(tmp_path)}
    if "PYTHONPATH" in os.environ:  # packages put on the path rather than installed
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "diag owned" in proc.stdout


@pytest.mark.parametrize("setting", [{"enabled": False}, {"timing": False}, {"sample_every": 2}])
def test_result_of_an_unrecorded_block_says_so_and_never_raises(setting):
    configure(**setting)
    handles = []
    for _ in range(2):
        with perfsdk.timed_region("m.unrecorded", k=1) as handle:
            pass
        handles.append(handle)
    unrecorded = handles[1] if "sample_every" in setting else handles[0]
    result = unrecorded.result()
    assert not unrecorded.recorded
    assert not result.recorded
    assert math.isnan(result.host_ms)
    assert result.device_ms is None
    assert (result.name, result.attributes["k"], result.span_id) == ("m.unrecorded", 1, 0)
    assert f"{result.host_ms:.1f} ms" == "nan ms"  # printing it keeps the program running
    if "sample_every" in setting:  # the sampled entry next to it is a real result
        assert handles[0].result().recorded
        assert handles[0].result().host_ms >= 0


def test_attributes_set_after_the_block_are_ignored():
    from opentelemetry import trace

    with capture() as cap:
        with perfsdk.timed_region("m.attrs") as handle:
            trace.get_current_span().set_attribute("inside", 1)
        handle.set_attribute("after", 2)
    [result] = cap.named("m.attrs")
    assert result.attributes["inside"] == 1
    assert "after" not in result.attributes
    assert "after" not in handle.attributes
