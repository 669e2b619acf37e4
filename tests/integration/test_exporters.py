"""perfsdk's file and console exporters, a bad PERFSDK_EXPORTER, and a missing OTLP package.

Each case runs a script from ``_scripts/`` in a fresh interpreter (perfsdk sets the global
TracerProvider once per process) and reads what it wrote: the JSON-lines file, stdout, stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration._scripts.harness import (
    NESTED_VALUES,
    Exported,
    Run,
    check_tree,
    clean_env,
    json_objects,
    run_script,
    span_from_json,
)

PIP_HINT = "pip install 'perfsdk[otlp]'"


def run_nested(tmp_path: Path, exporter: str, **env: str) -> Run:
    """nested_app.py (flushes after its work) with ``PERFSDK_EXPORTER=exporter``, run in
    ``tmp_path`` so a default output directory would land there."""
    return run_script(
        "nested_app.py", "flush",
        env=clean_env(PERFSDK_EXPORTER=exporter, PERFSDK_SERVICE_NAME="svc-local", **env),
        result=tmp_path / "result.json", cwd=tmp_path,
    ).check()


def spans_file(out_dir: Path, pid: int) -> list[dict]:
    """The file exporter's output: ``spans-<pid>.jsonl`` (one JSON span a line) beside the
    metrics file ``metrics-<pid>.jsonl``, and nothing else."""
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == [f"metrics-{pid}.jsonl", f"spans-{pid}.jsonl"], files
    lines = (out_dir / f"spans-{pid}.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines, "empty spans file"
    return [json.loads(line) for line in lines]  # each line on its own is one span


def check_nested_spans(objs: list[dict], run: Run) -> Exported:
    """The spans nested_app.py's regions produced, in OpenTelemetry's JSON form."""
    for obj in objs:
        assert {"name", "context", "parent_id", "attributes", "status", "resource"} <= obj.keys()
    exported = Exported(run, [span_from_json(obj) for obj in objs])
    check_tree(exported)
    for span in exported.regions():
        assert span.kind == 1
        assert span.attributes["perfsdk.host_ms"] > 0
        assert "perfsdk.device_ms" not in span.attributes
        assert span.attributes["code.filepath"] == run.result["file"]
        assert span.resource["service.name"] == "svc-local"
        assert span.resource["process.pid"] == run.result["pid"]
    assert exported.one("root").attributes["user.kind"] == "train"
    level2a = exported.one("level2.a").attributes
    assert (level2a["batch"], level2a["phase"], level2a["code.function"]) == (7, "warm", "root")
    explode = exported.one("explode")
    assert explode.status_code == "ERROR"
    assert [name for name, _ in explode.events] == ["exception"]
    assert explode.events[0][1]["exception.message"] == "boom 42"
    assert exported.one("root").status_code == "UNSET"
    assert run.result["values"] == NESTED_VALUES
    return exported


def test_file_exporter_writes_json_lines(tmp_path: Path) -> None:
    out_dir = tmp_path / "out" / "spans"  # does not exist yet: created on first write
    run = run_nested(tmp_path, "file", PERFSDK_OUTPUT_DIR=str(out_dir))
    check_nested_spans(spans_file(out_dir, run.result["pid"]), run)
    assert run.stdout == ""  # nothing on the console
    assert "PerfSDKWarning" not in run.stderr, run.stderr
    assert run.result["diagnostics"]["span_mode"] == "owned"


def console_spans(stdout: str) -> list[dict]:
    """The span objects the console exporter printed (its metrics are printed beside them)."""
    objs = json_objects(stdout)
    assert any("resource_metrics" in o for o in objs), "no metrics on the console"
    return [o for o in objs if "resource_metrics" not in o]


def test_console_exporter_prints_spans(tmp_path: Path) -> None:
    run = run_nested(tmp_path, "console")
    check_nested_spans(console_spans(run.stdout), run)
    assert not (tmp_path / "perfsdk-output").exists()  # no file without the file exporter
    assert "PerfSDKWarning" not in run.stderr, run.stderr


def test_file_and_console_together(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    run = run_nested(tmp_path, "file,console", PERFSDK_OUTPUT_DIR=str(out_dir))
    from_file = check_nested_spans(spans_file(out_dir, run.result["pid"]), run)
    from_console = check_nested_spans(console_spans(run.stdout), run)
    # The same spans, once each, in both places.
    ids = sorted((s.name, s.span_id, s.parent_span_id) for s in from_file.regions())
    assert ids == sorted((s.name, s.span_id, s.parent_span_id) for s in from_console.regions())
    assert "PerfSDKWarning" not in run.stderr, run.stderr


def test_bogus_exporter_warns_once_and_runs(tmp_path: Path) -> None:
    run = run_nested(tmp_path, "bogus")
    assert run.result["values"] == NESTED_VALUES
    assert run.result["caught"]["message"] == "boom 42"
    message = "perfsdk: ignoring PERFSDK_EXPORTER='bogus'"
    lines = [line for line in run.stderr.splitlines() if message in line]
    assert lines, run.stderr
    for line in lines:
        accepted = line.split("'bogus'", 1)[1]
        for value in ("otlp", "console", "file", "none"):
            assert value in accepted, line
    # The default (no exporter) is in force: nothing printed, nothing written.
    assert run.result["diagnostics"]["span_mode"] == "off"
    assert run.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    # Once: not once per read of the setting, nor once per output channel.
    assert run.stderr.count(message) == 1, run.stderr


def test_configure_otlp_without_package_names_the_extra(tmp_path: Path) -> None:
    run = run_script("blocked_otlp_app.py", "configure", env=clean_env(),
                     result=tmp_path / "result.json").check()
    result = run.result
    assert result["blocked"] is True  # the finder really hides the package
    for protocol in ("http/protobuf", "grpc"):
        raised = result["raised"][protocol]
        assert raised is not None, f"configure(exporter='otlp') did not raise under {protocol}"
        assert raised["type"] == "MissingDependencyError"
        assert raised["missing_dependency"] is True
        assert raised["import_error"] is True
        assert PIP_HINT in raised["message"]
        assert "opentelemetry-exporter-otlp" in raised["message"]
    # The failed configure changed nothing, and the program goes on.
    assert result["exporters_after"] == []
    assert result["value"] == 42
    assert result["diagnostics"]["spans_failed"] == 0


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_env_otlp_without_package_warns_once(tmp_path: Path, protocol: str) -> None:
    """Set by whoever launched the job, PERFSDK_EXPORTER=otlp must not kill the run."""
    env = clean_env(PERFSDK_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                    OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    run = run_script("blocked_otlp_app.py", "env", env=env, result=tmp_path / "result.json").check()
    assert run.result["blocked"] is True
    assert run.result["value"] == 42
    assert run.stderr.count(PIP_HINT) == 1, run.stderr
    assert run.stderr.count("PerfSDKWarning") == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
