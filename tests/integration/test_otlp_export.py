"""perfsdk's spans through OpenTelemetry's own OTLP exporters to a real loopback receiver.

Each scenario runs a script from ``_scripts/`` in a fresh interpreter (perfsdk sets the global
TracerProvider once per process); the receiver runs here and decodes what arrived, over gRPC and
over HTTP/protobuf. Once the script has exited, everything it delivered has been recorded (the
receiver stores a request before it answers), so the tests read ``receiver.spans()`` directly.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from tests.integration._scripts.harness import (
    NESTED_VALUES,
    PROTOCOLS,
    Exported,
    check_tree,
    clean_env,
    marker_line,
    run_script,
)
from tests.otlp_receiver import OTLPProtocol, OTLPReceiver, unused_port

WARNING_PREFIX = "perfsdk: the otlp exporter could not deliver"
SPAN_WARNING = re.compile(r"perfsdk: the otlp exporter could not deliver [\d,]+ spans to ")
# Span times are the region's perf_counter readings mapped through one (time_ns, perf_counter_ns)
# anchor; the script's window comes from time_ns. The two clocks may drift apart by NTP slewing
# (<= 0.5 ms/s); an epoch-confused or unanchored timestamp is off by far more than this.
CLOCK_SLACK_NS = 20_000_000


def export_nested(protocol: OTLPProtocol, how: str, tmp: Path) -> Exported:
    """Run nested_app.py (``flush``, ``exit`` or ``warm-exit``) against a fresh receiver."""
    with OTLPReceiver(protocol) as receiver:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=PROTOCOLS[protocol],
            OTEL_EXPORTER_OTLP_TIMEOUT="10",
            PERFSDK_EXPORTER="otlp",
            PERFSDK_SERVICE_NAME=f"svc-{protocol}",
        )
        run = run_script("nested_app.py", how, env=env, result=tmp / "result.json").check()
        spans = receiver.spans()
    return Exported(run, spans, protocol)


@pytest.fixture(scope="module", params=list(PROTOCOLS))
def flushed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """nested_app.py, which calls perfsdk.flush() after its work."""
    return export_nested(request.param, "flush", tmp_path_factory.mktemp("flushed"))


# -- spans after perfsdk.flush() ------------------------------------------------------------
def test_parents_follow_code_nesting(flushed: Exported) -> None:
    check_tree(flushed)
    assert flushed.run.result["values"] == NESTED_VALUES
    diagnostics = flushed.run.result["diagnostics"]
    assert diagnostics["span_mode"] == "owned"
    assert diagnostics["spans_failed"] == 0
    assert "PerfSDKWarning" not in flushed.run.stderr, flushed.run.stderr


def test_user_span_inside_region_is_its_child(flushed: Exported) -> None:
    """A span the application opens with OpenTelemetry's own API inside a region, with a tracer
    fetched at import (before perfsdk exported anything), arrives as the region's child."""
    user = flushed.one("user.span")
    region = flushed.one("level2.a")
    assert user.parent_span_id == region.span_id
    assert user.trace_id == region.trace_id
    assert user.scope_name == "user.lib"
    assert user.attributes == {"user.attr": "yes"}
    assert user.resource["service.name"] == f"svc-{flushed.protocol}"
    assert region.start_ns - CLOCK_SLACK_NS <= user.start_ns <= user.end_ns
    assert user.end_ns <= region.end_ns + CLOCK_SLACK_NS


def test_error_status_exception_event_and_propagation(flushed: Exported) -> None:
    explode = flushed.one("explode")
    assert explode.status_code == "ERROR"
    assert "boom 42" in explode.status_message
    assert len(explode.events) == 1
    name, attrs = explode.events[0]
    assert name == "exception"
    assert attrs["exception.type"] == "ValueError"
    assert attrs["exception.message"] == "boom 42"
    stacktrace = str(attrs["exception.stacktrace"])
    assert stacktrace.rstrip().endswith("ValueError: boom 42")
    assert "in explode" in stacktrace
    # The body's exception reached the caller unchanged: same object, type and message.
    assert flushed.run.result["caught"] == {
        "type": "ValueError", "message": "boom 42", "same_object": True,
    }
    assert "caught: ValueError('boom 42')" in flushed.run.stderr
    for span in flushed.regions():
        if span.name != "explode":
            assert span.status_code == "UNSET", span
            assert span.events == [], span


def test_attributes(flushed: Exported) -> None:
    script = flushed.run.result["file"]
    for span in flushed.regions():
        host_ms = span.attributes["perfsdk.host_ms"]
        assert isinstance(host_ms, float)
        assert host_ms > 0
        assert host_ms == pytest.approx(span.duration_ns / 1e6, rel=1e-9, abs=1e-6)
        assert "perfsdk.device_ms" not in span.attributes  # CPU only: no device time
        assert span.attributes["code.filepath"] == script
        assert span.scope_name == "perfsdk"
        assert span.kind == 1  # SPAN_KIND_INTERNAL

    def lineno(name: str) -> int:
        value = flushed.one(name).attributes["code.lineno"] if name != "leaf" else {
            s.attributes["code.lineno"] for s in flushed.named("leaf")}.pop()
        assert isinstance(value, int)
        return value

    # @profiled: the decorator's or the def's line; timed_region: the line of the `with`.
    for name in ("root", "leaf", "explode"):
        line = marker_line(script, name)
        assert lineno(name) in (line, line + 1), name
    assert lineno("level2.a") == marker_line(script, "level2.a")
    assert lineno("level2.b") == marker_line(script, "level2.b")
    functions = {s.name: s.attributes["code.function"] for s in flushed.regions()}
    assert functions == {"root": "root", "level2.a": "root", "level2.b": "root",
                         "leaf": "leaf", "explode": "explode"}

    root = flushed.one("root").attributes
    assert root["user.kind"] == "train"
    assert root["user.n"] == 3
    assert type(root["user.n"]) is int
    a = flushed.one("level2.a").attributes
    assert a["batch"] == 7
    assert a["phase"] == "warm"
    # Attributes belong to their own region only.
    for name in ("level2.b", "explode"):
        attrs = flushed.one(name).attributes
        assert not {"batch", "phase", "user.kind", "user.n"} & attrs.keys(), (name, attrs)
    for leaf in flushed.named("leaf"):
        assert not {"batch", "phase", "user.kind", "user.n"} & leaf.attributes.keys()


def test_resource_and_scope(flushed: Exported) -> None:
    result = flushed.run.result
    for span in flushed.spans:
        resource = span.resource
        assert resource["service.name"] == f"svc-{flushed.protocol}"
        assert resource["host.name"] == socket.gethostname()
        assert resource["process.pid"] == result["pid"]
        assert resource["perfsdk.torch.version"] == result["torch"]
    assert {s.scope_name for s in flushed.regions()} == {"perfsdk"}


def test_timestamps(flushed: Exported) -> None:
    result = flushed.run.result
    window = (result["t_start"] - CLOCK_SLACK_NS, result["t_end"] + CLOCK_SLACK_NS)
    for span in flushed.regions():
        assert 0 < span.start_ns < span.end_ns, span
        assert window[0] <= span.start_ns, (span.name, span.start_ns, window)
        assert span.end_ns <= window[1], (span.name, span.end_ns, window)
    by_id = {s.span_id: s for s in flushed.regions()}
    nested = 0
    for child in flushed.regions():
        parent = by_id.get(child.parent_span_id)
        if parent is not None:  # the same clock mapping for both: no slack
            assert parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns, (
                child.name, parent.name)
            nested += 1
    assert nested == 5


# -- spans at interpreter exit, without perfsdk.flush() ------------------------------------
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_spans_arrive_when_script_just_exits(protocol: OTLPProtocol, tmp_path: Path) -> None:
    """The script's last region ends right before it returns; perfsdk's atexit shutdown is the
    first and only time its spans are handed to the exporter."""
    exported = export_nested(protocol, "exit", tmp_path)
    assert "PerfSDKWarning" not in exported.run.stderr, exported.run.stderr
    check_tree(exported)
    assert exported.run.result["values"] == NESTED_VALUES


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_spans_arrive_at_exit_after_earlier_export(protocol: OTLPProtocol, tmp_path: Path) -> None:
    """Exporters already set up (a warm-up region was flushed); the work's spans leave at exit."""
    exported = export_nested(protocol, "warm-exit", tmp_path)
    assert "PerfSDKWarning" not in exported.run.stderr, exported.run.stderr
    check_tree(exported)
    assert exported.one("warmup").is_root
    user = exported.one("user.span")
    assert user.parent_span_id == exported.one("level2.a").span_id


# -- the application's own TracerProvider ---------------------------------------------------
@pytest.fixture(scope="module", params=list(PROTOCOLS))
def user_provider(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Exported:
    protocol: OTLPProtocol = request.param
    with OTLPReceiver(protocol) as receiver:
        # PERFSDK_EXPORTER is unset, but the OTLP endpoint is: on its own, perfsdk would pick the
        # otlp exporter. With the application's provider in place it must add nothing.
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=PROTOCOLS[protocol],
        )
        run = run_script(
            "user_provider_app.py", receiver.base_endpoint, protocol, env=env,
            result=tmp_path_factory.mktemp("user") / "result.json",
        ).check()
        spans = receiver.spans()
    return Exported(run, spans, protocol)


def test_user_provider_gets_region_spans_with_its_resource(user_provider: Exported) -> None:
    regions = user_provider.regions()
    assert sorted(s.name for s in regions) == ["outer", "step", "step", "under-user"]
    assert sorted(s.name for s in user_provider.spans if s.name.startswith("user.")) == [
        "user.in-outer", "user.in-step-0", "user.in-step-1", "user.top"]
    for span in user_provider.spans:
        assert span.resource["service.name"] == "user-app"
        assert "perfsdk.version" not in span.resource  # perfsdk's own resource is not used
        assert "perfsdk.torch.version" not in span.resource
    for span in regions:
        assert span.scope_name == "perfsdk"
        assert isinstance(span.attributes["perfsdk.host_ms"], float)
    assert user_provider.one("outer").attributes["epoch"] == 1
    assert user_provider.run.result["values"] == [0, 1]


def test_user_provider_parents(user_provider: Exported) -> None:
    outer = user_provider.one("outer")
    steps = user_provider.named("step")
    assert outer.is_root
    assert [s.parent_span_id for s in steps] == [outer.span_id, outer.span_id]
    assert user_provider.one("user.in-outer").parent_span_id == outer.span_id
    # Each step's user span has that step region as its parent, one for each.
    step_ids = {s.span_id for s in steps}
    in_step = [user_provider.one(f"user.in-step-{i}") for i in range(2)]
    assert {s.parent_span_id for s in in_step} == step_ids
    for span in (*steps, *in_step, user_provider.one("user.in-outer")):
        assert span.trace_id == outer.trace_id
    # A region opened under the application's span is that span's child.
    top = user_provider.one("user.top")
    under = user_provider.one("under-user")
    assert under.parent_span_id == top.span_id
    assert under.trace_id == top.trace_id


def test_user_provider_gets_nothing_added(user_provider: Exported) -> None:
    # Every span exactly once: no second processor or exporter sent them again.
    assert len({s.span_id for s in user_provider.spans}) == len(user_provider.spans) == 8
    result = user_provider.run.result
    assert result["processors"] == ["BatchSpanProcessor"]
    assert result["global_is_ours"] is True
    assert result["diagnostics"]["span_mode"] == "user"
    assert "PerfSDKWarning" not in user_provider.run.stderr, user_provider.run.stderr


# -- unreachable collector -------------------------------------------------------------------
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_unreachable_collector(protocol: OTLPProtocol, tmp_path: Path) -> None:
    # OTel's own exporter timeout is left at its default (10 s): flush and exit bounded by
    # PERFSDK_EXPORT_TIMEOUT (2 s) and ones that wait for OTel's timeout lie 8 s apart, so the
    # bounds below hold on a busy machine and still tell the two apart.
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{unused_port()}",
        OTEL_EXPORTER_OTLP_PROTOCOL=PROTOCOLS[protocol],
        PERFSDK_EXPORTER="otlp",
        PERFSDK_EXPORT_TIMEOUT="2",
    )
    run = run_script("unreachable_app.py", env=env, result=tmp_path / "result.json", timeout=120)
    exited_ns = time.monotonic_ns()
    run.check()
    # The program computed the same results, and flush and exit waited at most the timeout.
    assert run.result["values"] == [120 * i for i in range(250)]
    assert run.result["flush_s"] < 2 + 4, run.result["flush_s"]
    exit_s = (exited_ns - run.result["written_ns"]) / 1e9
    assert exit_s < 2 + 4, f"exit took {exit_s:.1f} s"
    # One clear warning; OpenTelemetry's per-batch retry messages do not reach the user.
    assert len(SPAN_WARNING.findall(run.stderr)) == 1, run.stderr
    lines = run.stderr.lower().splitlines()
    flood = ("transient error", "retry", "retrying", "failed to export")
    assert not [line for line in lines if any(word in line for word in flood)], run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stdout == ""
    diagnostics = run.result["diagnostics"]
    assert diagnostics["spans_exported"] == 0
    assert diagnostics["spans_failed"] > 0
    # Every span is accounted for: lost with a reason, or still queued when the result was
    # written; the warning and the exit line name the endpoint, the protocol and the cause.
    lost = diagnostics["spans_lost"]
    assert sum(lost.values()) + diagnostics["spans_pending"] == diagnostics["spans_produced"]
    assert 0 < diagnostics["spans_produced"] <= 500  # some may still be in the pipeline
    endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    cause = "gRPC UNAVAILABLE" if protocol == "grpc" else "connection refused"
    assert f"to {endpoint}" in run.stderr, run.stderr
    assert cause in run.stderr, run.stderr
    exit_line = [line for line in run.stderr.splitlines() if "spans were not exported" in line]
    assert len(exit_line) == 1, run.stderr
    # At exit, all 500 (250 train_step + 250 inner) are produced and every one is lost.
    assert exit_line[0].startswith("perfsdk: 500 of 500 spans were not exported by the otlp "
                                   f"exporter to {endpoint}"), exit_line
    assert f"last cause: {cause}" in exit_line[0]
