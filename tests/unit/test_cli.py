"""The ``perfsdk`` command: ``perfsdk demo`` trains, prints the summary and writes spans."""

from __future__ import annotations

import json
import subprocess
import sys


def _perfsdk(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "perfsdk.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, check=False)


def test_demo_prints_summary_and_writes_spans(tmp_path):
    proc = _perfsdk("demo", "--steps", "12", "--batch-size", "8", "--output-dir",
                    str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "training a 3-layer MLP for 12 steps" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()
            if line.split() and line.split()[0] in
            {"step", "train_step", "forward", "backward", "optimizer", "data"}}
    assert rows == {"step": "12", "train_step": "12", "forward": "12", "backward": "12",
                    "optimizer": "12", "data": "12"}, out
    [spans_file] = (tmp_path / "out").glob("spans-*.jsonl")
    assert f"spans written to {spans_file}" in out
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    by_id = {s["context"]["span_id"]: s for s in spans}
    forward = [s for s in spans if s["name"] == "forward"]
    assert len(forward) == 12
    assert {by_id[s["parent_id"]]["name"] for s in forward} == {"train_step"}
    assert all(by_id[s["parent_id"]]["name"] == "step"
               for s in spans if s["name"] == "train_step")


def test_demo_rejects_bad_arguments_naming_them(tmp_path):
    proc = _perfsdk("demo", "--exporter", "jaeger", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--exporter" in proc.stderr
    assert "otlp, console, file, none" in proc.stderr
    proc = _perfsdk("demo", "--steps", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--steps" in proc.stderr
    assert "not >= 1" in proc.stderr


def test_version(tmp_path):
    import perfsdk

    proc = _perfsdk("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"perfsdk {perfsdk.__version__}"
