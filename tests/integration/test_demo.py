"""``perfsdk demo`` end to end: the lab's loop before and after its fixes, the advisor's
findings, the before/after table, the Perfetto trace and spans it writes, the runs that
``perfsdk report`` reads back, spans to a real OTLP receiver, and clear argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.otlp_receiver import OTLPReceiver


def perfsdk(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    return subprocess.run([sys.executable, "-m", "perfsdk.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env={**clean, **env}, check=False)


def table(text: str) -> dict[str, list[str]]:
    """The before/after table: metric -> [before, after, (change)]."""
    lines = text[text.index("before / after\n"):].splitlines()[3:]
    rows = {}
    for line in lines:
        if not line.strip():
            break
        name, _, rest = line.partition("  ")
        rows[name.strip()] = rest.split()
    return rows


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path, OTLPReceiver]:
    tmp = tmp_path_factory.mktemp("demo")
    with OTLPReceiver("http") as receiver:
        proc = perfsdk("demo", "--steps", "8", "--batch-size", "4", "--image-size", "16",
                       "--output-dir", str(tmp / "out"), cwd=tmp,
                       OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint)
        if proc.returncode == 0:
            receiver.wait_for_spans(20, timeout=20)
    return proc, tmp / "out", receiver


def test_demo_measures_the_lab_loop_then_the_fixed_one(demo) -> None:
    proc, _, _ = demo
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "1/2 before: the lab's loop (batch 4, num_workers=0, loss.item() on every step)" in out
    assert "2/2 after: the fixes" in out
    before, after = out.split("2/2 after")
    after = after.split("before / after")[0]
    for part, steps in ((before, "8"), (after, "2")):  # 32 images in batches of 4, then 16
        rows = {line.split()[0]: line.split()[1] for line in part.splitlines()
                if line.split() and line.split()[0] in {"step", "data_wait", "SimpleNet"}}
        assert rows == {"step": steps, "data_wait": steps, "SimpleNet": steps}, part
    assert "perfsdk advice" in before
    assert "Host-device syncs" in before  # the loss.item() on every step
    assert "demo.py" in before  # ... named at its line
    rows = table(out)
    assert rows["syncs per step"] == ["1.0", "0.0"]
    for column, name in ((0, "before"), (1, "after")):  # data wait over wait plus step time
        regions = json.loads((demo[1] / f"demo-{name}" / "run.json").read_text())["regions"]
        waits = sum(r["host_ms"] for r in regions if r["name"] == "data_wait")
        steps = sum(r["host_ms"] for r in regions if r["name"] == "step")
        assert rows["data wait share"][column] == f"{waits / (waits + steps):.0%}"
    assert rows["images per step"] == ["4", "16"]
    assert rows["images/s"][2].endswith("x")


def test_demo_writes_trace_spans_and_runs_report_reads(demo, tmp_path) -> None:
    proc, out, receiver = demo
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(next(out.glob("trace-*.json")).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    phases = {e["name"]: e for e in events if e["name"].startswith("demo.")}
    assert set(phases) == {"demo.before", "demo.after"}
    steps = [e for e in events if e["name"] == "step"]
    assert len(steps) == 10
    for e in steps:  # every step lies inside one of the two phases
        assert any(p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"]
                   for p in phases.values())
    spans = [json.loads(line) for line in next(out.glob("spans-*.jsonl")).read_text()
             .splitlines()]
    assert sum(s["name"] == "step" for s in spans) == 10
    received = {s.name for s in receiver.spans()}  # OTEL_EXPORTER_OTLP_ENDPOINT was set
    assert {"step", "data_wait", "demo.before"} <= received
    for name in ("before", "after"):
        assert f"perfsdk report {out}/demo-{name}" in proc.stdout
        report = perfsdk("report", str(out / f"demo-{name}"), cwd=tmp_path)
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith(f"perfsdk report: perfsdk demo {name} exited with 0")
        assert "perfsdk advice" in report.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--exporter", "jaeger"], "perfsdk demo: --exporter: unknown exporter 'jaeger'"),
    (["--image-size", "30"], "--image-size a multiple of 4"),
    (["--steps", "1"], "--steps must be >= 2"),
])
def test_demo_rejects_bad_arguments_naming_them(tmp_path, args, message) -> None:
    proc = perfsdk("demo", *args, "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_demo_refuses_an_unwritable_output_dir(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = perfsdk("demo", "--output-dir", str(blocker / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"perfsdk demo: --output-dir {blocker / 'out'}: cannot write")
