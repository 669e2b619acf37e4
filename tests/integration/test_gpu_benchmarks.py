"""On a real GPU: perfsdk.bench times CUDA work with CUDA events, benchmarks/gpu_regions.py
measures what it claims, and benchmarks/optimize.py runs on CUDA (``--device cuda``) with
optimize() trying CUDA graphs there. The CPU-side checks (both scripts refuse to run on CUDA
without a GPU, clearly) run everywhere.

The gpu tests skip without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure); the
optimize run is also ``slow`` (``--run-slow``; .ci/gpu passes it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from perfsdk import bench
from tests.benchmark_run import REPO_ROOT, positive
from tests.integration._gpu import spin_for

SCRIPT = REPO_ROOT / "benchmarks" / "optimize.py"
REGIONS = REPO_ROOT / "benchmarks" / "gpu_regions.py"


@pytest.mark.gpu
def test_bench_times_a_known_kernel_with_cuda_events():
    torch.cuda.init()
    cycles, reference = spin_for(2.0)
    x = torch.randn(256, 256, device="cuda")
    result = bench.benchmark(lambda a: torch.cuda._sleep(cycles), x, iters=30, warmup=2)
    assert result.device == "cuda"
    assert result.median_ms == pytest.approx(reference, rel=0.3)
    assert result.peak_memory_bytes is not None
    assert result.peak_memory_bytes >= x.numel() * 4


@pytest.mark.gpu
@pytest.mark.slow
def test_optimize_benchmark_runs_on_cuda(tmp_path):
    out = tmp_path / "optimize-cuda.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cuda", "--budget", "120",
         "--workloads", "simplenet_inference", "encoder_train", "--output", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["device"]["type"] == "cuda"
    assert result["device"]["name"] == torch.cuda.get_device_name()
    assert result["device"]["low_precision"] == "float16"
    for name, w in result["workloads"].items():
        assert positive(w["optimize"]["speedup_in_comparison"]), name
        assert positive(w["best_by_hand_speedup"]), name
        assert positive(w["retime"]["ratio"]), name
        assert not any("bf16" in v for v in w["hand"]), name  # float16 on a GPU
        assert any("fp16" in v for v in w["hand"]), name
    steps = result["workloads"]["simplenet_inference"]["optimize"]["steps"]
    graphs = [s for s in steps if "cuda_graphs" in s["name"]]
    assert graphs, [s["name"] for s in steps]
    assert any(s["median_ms"] is not None for s in graphs), graphs  # CUDA graphs were timed


@pytest.mark.gpu
def test_gpu_regions_benchmark_measures_what_it_claims(tmp_path):
    out = tmp_path / "gpu_regions.json"
    proc = subprocess.run([sys.executable, str(REGIONS), "--quick", "--output", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    head = result["headline"]
    assert set(head) == {"region_added_host_us", "region_vs_events_by_hand",
                         "syncs_in_timed_loops", "device_ms_relative_error",
                         "cuda_graphs_speedup"}
    assert head["syncs_in_timed_loops"]["value"] == 0, result["details"]["syncs"]
    assert head["device_ms_relative_error"]["value"] < 0.25, result["details"]["device_time"]
    assert positive(head["region_added_host_us"]["value"])
    assert positive(head["region_vs_events_by_hand"]["value"])
    assert len(result["details"]["region_cost"]["samples_ns"]["by_hand"]) == 5  # --quick
    assert positive(head["cuda_graphs_speedup"]["value"])
    assert result["details"]["cuda_graphs"]["device"] == "cuda"
    assert result["device"]["name"] == torch.cuda.get_device_name()


# the build, not the driver: asking for a GPU at collection would touch the driver in every run
@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the refusal on a CPU build")
@pytest.mark.parametrize(("script", "args", "message"), [
    (SCRIPT, ["--device", "cuda"], "--device cuda: torch.cuda.is_available() is False"),
    (REGIONS, [], "needs a CUDA GPU: torch.cuda.is_available() is False"),
])
def test_the_gpu_benchmarks_refuse_to_run_without_a_gpu(tmp_path, script, args, message):
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", *args, "--output", str(tmp_path / "x.json")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "x.json").exists()
