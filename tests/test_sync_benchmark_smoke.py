"""Smoke test of benchmarks/sync_guard.py: it runs end to end and writes complete results.

It checks the shape and sanity of what the benchmark measured (every workload and variant,
positive finite timings, the guard seeing exactly the syncs each loop makes), never the speed.
"""

from __future__ import annotations

import math
import sys

import pytest

from tests.benchmark_run import REPO_ROOT, positive, run_quick

SCRIPT = REPO_ROOT / "benchmarks" / "sync_guard.py"

GUARDED = {"none", "off", "count", "warn", "count_assume", "modes"}
VARIANTS = {"tensor_ops": GUARDED, "mlp_step": GUARDED, "item_sync": {"none", "count_assume"}}
HEADLINE = {
    "count_added_ns_per_op", "warn_added_ns_per_op", "count_assume_added_ns_per_op",
    "off_added_ns_per_op", "empty_modes_added_ns_per_op", "added_ns_per_detected_item",
    "recording_ns_per_sync", "mlp_none_ms_per_step", "mlp_count_ms_per_step",
    "mlp_count_vs_none", "mlp_count_assume_vs_none",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(SCRIPT, tmp_path_factory.mktemp("bench") / "sync_guard.json")


def test_every_workload_and_variant_has_positive_timings(quick_run):
    result, _ = quick_run
    repeats = result["settings"]["repeats"]
    assert {w: set(v["variants"]) for w, v in result["workloads"].items()} == VARIANTS
    for workload, w in result["workloads"].items():
        for name, v in w["variants"].items():
            for measure in ("wall_ns", "thread_cpu_ns"):
                stats = v[measure]
                for key in ("median", "p10", "p90"):
                    assert positive(stats[key]), (workload, name, measure, key, stats)
                assert stats["p10"] <= stats["median"] <= stats["p90"], (workload, name, stats)
                assert len(stats["samples"]) == v["repeats"] == repeats
            assert positive(v["ratio_vs_none"]), (workload, name)
            assert math.isfinite(v["added_ns"]), (workload, name)
        assert w["variants"]["none"]["ratio_vs_none"] == 1.0
        assert w["variants"]["none"]["added_ns"] == 0.0


def test_the_guard_saw_exactly_the_syncs_each_loop_makes(quick_run):
    """No sync in the tensor-op and training-step loops; one per .item() under assume_device."""
    result, stdout = quick_run
    settings = result["settings"]
    for workload, w in result["workloads"].items():
        for name, v in w["variants"].items():
            assert v["detected_as_expected"] is True, (workload, name, v["syncs_detected"])
            assert len(v["syncs_detected"]) == settings["repeats"]
    item = result["workloads"]["item_sync"]["variants"]["count_assume"]
    assert item["syncs_detected"] == [settings["sync_iterations"]] * settings["repeats"]
    assert "WRONG" not in stdout


def test_headline_and_context(quick_run):
    result, stdout = quick_run
    assert set(result["headline"]) == HEADLINE
    assert all(math.isfinite(v) for v in result["headline"].values()), result["headline"]
    assert positive(result["headline"]["mlp_none_ms_per_step"])
    assert result["settings"]["quick"] is True
    assert result["settings"]["mlp"]["batch"] == 32
    assert result["settings"]["mlp"]["hidden"] == 256
    for key in ("perfsdk", "torch"):
        assert result["versions"][key], key
    assert result["machine"]["python"] == sys.version.split()[0]
    assert "headline" in stdout
    assert 'no_sync_guard("count", assume_device=True)' in stdout
