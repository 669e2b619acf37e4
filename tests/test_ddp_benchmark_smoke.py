"""Smoke test of benchmarks/ddp_hook.py: it runs end to end and writes complete results.

It checks the shape and sanity of what the benchmark measured (every variant, positive finite
timings, one region per bucket per instrumented backward), never the speed.
"""

from __future__ import annotations

import pytest

from tests.benchmark_run import REPO_ROOT, positive, run_quick

SCRIPT = REPO_ROOT / "benchmarks" / "ddp_hook.py"
VARIANTS = {"ddp", "ddp_allreduce_hook", "instrument_ddp", "instrument_ddp_disabled"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(SCRIPT, tmp_path_factory.mktemp("bench") / "ddp_hook.json")


def test_every_variant_has_positive_timings(quick_run):
    result, stdout = quick_run
    assert set(result["variants"]) == VARIANTS
    for name, v in result["variants"].items():
        assert positive(v["median_ms"]), name
        assert len(v["times_ms"]) == result["settings"]["iters"], name
        assert all(positive(t) for t in v["times_ms"]), name
        assert isinstance(v["added_us_per_bucket"], float), name
    assert result["variants"]["ddp"]["ratio_vs_ddp"] == 1.0
    for name in VARIANTS - {"ddp"}:
        assert f"{name} " in stdout.split("added per bucket")[1], name


def test_the_instrumented_variant_records_a_region_per_bucket(quick_run):
    """Deterministic, not a timing: DDP reduces one bucket in its first backward, then one per
    layer; the disabled variant records nothing."""
    result, _ = quick_run
    settings = result["settings"]
    layers, iters = settings["layers"], settings["iters"]
    assert settings["buckets"] == dict.fromkeys(("ddp", "ddp_allreduce_hook", "instrument_ddp"),
                                                layers)
    calls = 2 + 3 + iters  # two set-up backwards, compare's warm-up, the timed ones
    assert result["ddp_all_reduce_regions"] == 1 + (calls - 1) * layers
