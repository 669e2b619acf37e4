"""The one command for the GPU (.ci/gpu.py, ``nox -s gpu``): its report logic on made-up
results, and on this machine, when it has no GPU, a run that fails clearly and says why."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / ".ci" / "gpu.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.integration.test_gpu" name="test_ok" time="0.1"/>
<testcase classname="tests.integration.test_gpu" name="test_bad" time="0.1">
  <failure message="AssertionError: 3 != 4">long traceback</failure></testcase>
<testcase classname="tests.integration.test_gpu_nvml" name="test_setup" time="0.0">
  <error message="failed on setup with &quot;boom&quot;">x</error></testcase>
<testcase classname="tests.integration.test_gpu_nvml" name="test_skipped" time="0.0">
  <skipped type="pytest.skip" message="nvidia-ml-py is not installed">x</skipped></testcase>
<testcase classname="tests.integration.test_gpu_backward" name="test_known_gap[cuda]" time="0.1">
  <skipped type="pytest.xfail" message="expected on a GPU: ...">x</skipped></testcase>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("ci_gpu", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_env(**kwargs):
    env = {"cuda_available": True, "torch": "2.13.0", "torch_cuda": "12.8", "cudnn": 90100,
           "devices": [{"index": 0, "name": "NVIDIA H100", "capability": "9.0",
                        "memory_gib": 79.1}], "driver": "570.1", "perfsdk": "0.1.0",
           "git_commit": "abc1234", "git_dirty": False, "python": "3.11.7",
           "created": "2026-01-01T00:00:00+00:00"}
    env.update(kwargs)
    return env


def test_junit_counts_and_problems(runner, tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    counts = runner.parse_junit(path)
    assert {k: counts[k] for k in ("total", "passed", "failed", "errors", "skipped",
                                   "xfailed")} == {"total": 5, "passed": 1, "failed": 1,
                                                   "errors": 1, "skipped": 1, "xfailed": 1}
    assert [(p["test"].split("::")[1], p["outcome"]) for p in counts["problems"]] == [
        ("test_bad", "failed"), ("test_setup", "errors"), ("test_skipped", "skipped")]
    assert counts["problems"][0]["message"] == "AssertionError: 3 != 4"
    assert counts["expected_failures"][0]["test"].endswith("test_known_gap[cuda]")


def test_verdict_passes_only_a_clean_gpu_run(runner):
    clean = {**runner.empty_counts(), "total": 30, "passed": 29, "xfailed": 1, "returncode": 0}
    bench = {"optimize": {"returncode": 0}, "gpu_regions": {"returncode": 0}}
    assert runner.verdict(gpu_env(), clean, bench) == []
    assert runner.verdict(gpu_env(), {**clean, "skipped": 1, "returncode": 1}, bench) == [
        "pytest exited with 1", "1 gpu test(s) skipped (a skip is a failure here)"]
    assert runner.verdict(gpu_env(), clean, {"optimize": {"returncode": 3}}) == [
        "benchmark optimize exited with 3"]
    assert runner.verdict(gpu_env(), {**clean, "passed": 0}, None) == ["no gpu test passed"]
    reasons = runner.verdict(gpu_env(cuda_available=False, torch_cuda=None, devices=[]),
                             clean, None)
    assert reasons[0].startswith("no CUDA GPU: torch.cuda.is_available() is False")


def test_markdown_report_has_the_numbers(runner, tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    tests = {**runner.parse_junit(path), "returncode": 1, "wall_s": 12.5,
             "command": "PERFSDK_REQUIRE_GPU=1 python -m pytest -m gpu --run-slow"}
    bench = {"optimize": {"returncode": 0, "wall_s": 80.0, "output": "/x/optimize-cuda.json",
                          "headline": [{"workload": "simplenet_inference",
                                        "chosen": "amp(fp16) + cuda_graphs", "speedup": 3.1}]}}
    env = gpu_env()
    reasons = runner.verdict(env, tests, bench)
    text = runner.markdown({"status": "FAIL", "reasons": reasons, "no_bench": False,
                            "environment": env, "tests": tests, "benchmarks": bench})
    assert text.startswith("# perfsdk GPU run: FAIL\n")
    assert "NVIDIA H100 (sm 9.0, 79.1 GiB); driver 570.1" in text
    assert "| 1 | 1 | 1 | 1 | 1 | 5 |" in text
    assert "| `tests.integration.test_gpu::test_bad` | failed | AssertionError: 3 != 4 |" in text
    assert "test_known_gap[cuda]" in text
    assert "| simplenet_inference | amp(fp16) + cuda_graphs | 3.1 |" in text


@pytest.mark.skipif(torch.version.cuda is not None, reason="the no-GPU run, on a CPU build")
def test_without_a_gpu_the_command_fails_clearly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PERFSDK_REQUIRE_GPU",
                                                            "PYTEST_ADDOPTS")}
    proc = subprocess.run(
        [sys.executable, str(RUNNER), "--output-dir", str(tmp_path), "--",
         "tests/integration/test_gpu_capture.py"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "No CUDA GPU here" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "FAIL"
    assert report["reasons"][0].startswith("no CUDA GPU")
    assert report["tests"]["errors"] == 1
    assert report["tests"]["passed"] == 0
    assert "PERFSDK_REQUIRE_GPU=1 but torch.cuda.is_available() is False" in \
        report["tests"]["problems"][0]["message"]
    assert report["benchmarks"] is None
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# perfsdk GPU run: FAIL")
    assert "Not run: no CUDA GPU." in text
    assert (tmp_path / "junit.xml").exists()
    assert (tmp_path / "pytest.log").exists()
