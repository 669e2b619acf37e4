"""Smoke test of benchmarks/nvtx_overhead.py: it runs end to end and writes complete results.

Shape and sanity only, never speed: the targets are measurements the benchmark reports.
"""

from __future__ import annotations

import pytest

from tests.benchmark_run import REPO_ROOT, positive, run_quick

SCRIPT = REPO_ROOT / "benchmarks" / "nvtx_overhead.py"
VARIANTS = {"bare", "wraps", "nvtx_pushpop", "hand_decorator", "nvtx_annotate",
            "nvtx_only_compiled", "nvtx_only_python", "full_paused", "memory_paused",
            "memory_paused_python"}
TARGETS = {"nvtx_only_strict_compiled", "nvtx_only_strict_python",
           "nvtx_only_like_for_like_compiled", "nvtx_only_like_for_like_python",
           "memory_added_compiled", "memory_added_python"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(SCRIPT, tmp_path_factory.mktemp("bench") / "nvtx.json")


def test_every_variant_has_positive_timings(quick_run):
    result, stdout = quick_run
    assert set(result["variants"]) == VARIANTS
    for name, v in result["variants"].items():
        for measure in ("ns_per_call", "thread_cpu_ns_per_call"):
            stats = v[measure]
            assert all(positive(stats[k]) for k in ("median", "p10", "p90")), (name, stats)
            assert stats["p10"] <= stats["median"] <= stats["p90"], (name, measure, stats)
            assert len(stats["samples"]) == result["settings"]["repeats"]
        assert v["label"] in stdout
    assert result["variants"]["bare"]["added_ns"] == 0.0


def test_targets_are_reported_on_wall_and_cpu_time(quick_run):
    result, stdout = quick_run
    for key in ("targets", "targets_cpu"):
        assert set(result[key]) == TARGETS
        for name, target in result[key].items():
            assert isinstance(target["value"], float), name
            assert target["pass"] == (target["value"] <= target["limit"]), name
    for name in TARGETS:
        assert name in stdout


def test_the_paths_measured_are_the_ones_named(quick_run):
    """The compiled row runs the compiled path wherever it can: built, and a tool attached."""
    nvtx = quick_run[0]["nvtx"]
    assert nvtx["compiled_in_use"] == bool(nvtx["compiled_nvtx"] and nvtx["library"])
