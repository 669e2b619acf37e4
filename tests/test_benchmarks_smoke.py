"""Smoke test of benchmarks/overhead.py: it runs end to end and writes complete results.

It checks the shape and sanity of what the benchmark measured, never the speed: the targets
are measurements, reported PASS/FAIL by the benchmark itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.benchmark_run import REPO_ROOT, positive, run_quick

SCRIPT = REPO_ROOT / "benchmarks" / "overhead.py"

VARIANTS = {
    "bare", "wraps", "disabled_decoration", "disabled_runtime", "nvtx_only", "full",
    "full_paused", "memory_paused", "nvtx_annotate", "nvtx_pushpop", "record_function", "otel",
}
TARGETS = {
    "full_added", "full_vs_otel", "whole_vs_otel", "nvtx_only_vs_pushpop", "memory_added",
    "nvml_core_fraction",
    "disabled_decoration_identity", "disabled_runtime_vs_wraps", "full_vs_wraps",
    "pipeline_inflation",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(SCRIPT, tmp_path_factory.mktemp("bench") / "x.json")


def test_every_variant_has_positive_timings(quick_run):
    result, _ = quick_run
    assert set(result["variants"]) == VARIANTS
    for name, v in result["variants"].items():
        for measure in ("ns_per_call", "thread_cpu_ns_per_call"):
            stats = v[measure]
            for key in ("median", "p10", "p90"):
                assert positive(stats[key]), (name, measure, key, stats)
            assert stats["p10"] <= stats["median"] <= stats["p90"], (name, measure, stats)
            assert len(stats["samples"]) == v["repeats"] == result["settings"]["repeats"]
        assert positive(v["ratio_vs_bare"]), name
        assert positive(v["ratio_vs_wraps"]), name
    assert result["variants"]["bare"]["ratio_vs_bare"] == 1.0
    assert result["variants"]["wraps"]["ratio_vs_wraps"] == 1.0


def test_variants_do_the_work_they_claim(quick_run):
    """Spans reach the dropping exporters exactly for the span-producing variants."""
    variants = quick_run[0]["variants"]
    producing = {"full", "full_paused", "memory_paused", "otel"}
    for name in producing:
        assert variants[name]["spans_per_call"] == 1.0, name
    for name in VARIANTS - producing:
        assert variants[name]["spans_per_call"] == 0.0, name


def test_whole_cost_counts_every_span(quick_run):
    result, _ = quick_run
    whole = result["whole_cost"]
    assert set(whole) == {"full", "otel"}
    calls = result["settings"]["whole_calls"]
    for name, w in whole.items():
        assert positive(w["ns_per_call"]["median"]), name
        assert w["spans_exported"] == [calls] * result["settings"]["whole_repeats"], name
        assert w["complete"] is True, name


def test_targets_section(quick_run):
    result, stdout = quick_run
    targets = {t["name"]: t for t in result["targets"]}
    assert set(targets) == TARGETS
    for t in targets.values():
        assert isinstance(t["passed"], bool), t
        assert t["definition"], t
        assert f"{'PASS' if t['passed'] else 'FAIL'}  {t['definition']}" in stdout
    # Deterministic, not a timing: PERFSDK_ENABLED=0 at decoration returns the function itself.
    assert targets["disabled_decoration_identity"]["passed"] is True


def test_context_is_recorded(quick_run):
    result, stdout = quick_run
    assert result["settings"]["quick"] is True
    for key in ("perfsdk", "torch", "nvtx", "opentelemetry-sdk"):
        assert result["versions"][key], key
    assert result["machine"]["python"] == sys.version.split()[0]
    nvtx = result["nvtx_injection"]
    # Where the recorder library can be built, it must really be attached in the child.
    assert nvtx["loaded"] is (nvtx["error"] is None), nvtx
    assert "bare call" in stdout
    assert "targets (issues 2, 3 and 16)" in stdout


def test_background_section_shape(quick_run):
    """The issue-16 loops: every body bare, full and paused, with positive timings; the
    inflation is computed from them (its value is a measurement, never checked)."""
    result, stdout = quick_run
    bg = result["background"]
    assert bg["calls"] == result["settings"]["gil_calls"]
    assert set(bg["loops"]) == {"tight", "hash", "torch"}
    for kind, loop in bg["loops"].items():
        assert set(loop["variants"]) == {"bare", "full", "full_paused"}, kind
        for name, v in loop["variants"].items():
            assert len(v["ns_per_call"]["samples"]) == bg["repeats"], (kind, name)
            assert positive(v["ns_per_call"]["median"]), (kind, name)
        assert isinstance(loop["inflation"], float), kind
        assert "total" in loop["background_cpu_ns_per_call"], kind
    assert "background:" in stdout


# -- benchmarks/instrument_module.py --------------------------------------------------------------
IM_SCRIPT = REPO_ROOT / "benchmarks" / "instrument_module.py"
IM_VARIANTS = {
    "simplenet_infer": {"bare", "instrumented"},
    "simplenet_train": {"bare", "instrumented_fwd", "instrumented"},
    "encoder_infer": {"bare", "instrumented", "hooks_everywhere"},
}


@pytest.fixture(scope="module")
def instrument_module_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(IM_SCRIPT, tmp_path_factory.mktemp("bench") / "instrument_module.json")


def test_instrument_module_benchmark_shape(instrument_module_run):
    result, stdout = instrument_module_run
    assert result["settings"]["quick"] is True
    workloads = result["workloads"]
    assert {w: set(v["variants"]) for w, v in workloads.items()} == IM_VARIANTS
    for w in workloads.values():
        assert w["variants"]["bare"]["ratio_vs_bare"] == 1.0
        for name, v in w["variants"].items():
            assert v["iters"] == result["settings"]["iters"], name
            assert len(v["times_ms"]) == v["iters"], name
            for key in ("median_ms", "p95_ms", "min_ms", "ratio_vs_bare"):
                assert positive(v[key]), (name, key, v[key])
    assert "headline" in stdout
    assert "hooks_everywhere" in stdout


IM_PER_MODULE = {"bare", "nvtx_hooks_fwd", "nvtx_hooks_fwd_bwd", "instrumented_fwd",
                 "instrumented"}
IM_TARGETS = {"fwd_vs_hooks", "fwd_bwd_vs_hooks", "step_vs_bare"}


def test_instrument_module_benchmark_per_module_shape(instrument_module_run):
    """The per-module table against hand-written NVTX hooks (issue 16): every variant timed in
    every round, the NVTX injection library attached, and the targets printed PASS or FAIL."""
    result, stdout = instrument_module_run
    pm = result["per_module"]
    assert set(pm["variants"]) == IM_PER_MODULE
    assert pm["modules"] == 49
    rounds = result["settings"]["per_module_rounds"]
    for name, v in pm["variants"].items():
        for key in ("step_ms", "added_us_per_module", "vs_bare_step", "vs_nvtx_hooks_fwd_added",
                    "thread_cpu_step_ms", "thread_cpu_added_us_per_module"):
            stats = v[key]
            assert len(stats["samples"]) == rounds, (name, key)
            if key != "vs_nvtx_hooks_fwd_added":  # NaN when the hooks' cost is within noise
                assert stats["p25"] <= stats["median"] <= stats["p75"], (name, key, stats)
        assert positive(v["step_ms"]["median"]), name
        assert positive(v["thread_cpu_step_ms"]["median"]), name
    assert pm["variants"]["bare"]["vs_bare_step"]["median"] == 1.0
    nvtx = result["nvtx_injection"]
    # Where the recorder library can be built, it must really be attached in the child.
    assert nvtx["attached"] is (nvtx["error"] is None), nvtx
    targets = {t["name"]: t for t in result["targets"]}
    assert set(targets) == IM_TARGETS
    for t in targets.values():
        assert isinstance(t["passed"], bool), t
        assert f"{'PASS' if t['passed'] else 'FAIL'}  {t['definition']}" in stdout


def test_instrument_module_benchmark_checks_the_fast_path(instrument_module_run):
    """Deterministic, not a timing: instrument_module keeps the encoder's fused kernel (one per
    layer), hooks on every module lose it."""
    result, _ = instrument_module_run
    fast = result["workloads"]["encoder_infer"]["fast_path_calls_per_forward"]
    assert fast == {"bare": 4, "instrumented": 4, "hooks_everywhere": 0}
    assert result["headline"]["encoder_fast_path_kept"] is True


# -- benchmarks/soak.py --------------------------------------------------------------------------
SOAK_SCRIPT = REPO_ROOT / "benchmarks" / "soak.py"
SOAK_CASES = {"none", "dropping", "slow", "blackhole", "healthy"}
REASONS = {"queue_full", "backing_off", "export_failed", "export_timeout", "shutdown"}


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(SOAK_SCRIPT, tmp_path_factory.mktemp("bench") / "soak.json",
                     ("--seconds", "1", "--export-timeout", "1"))


def test_soak_runs_every_case(soak_run):
    result, stdout = soak_run
    assert result["settings"]["quick"] is True
    assert result["settings"]["seconds"] == 1
    assert set(result["cases"]) == SOAK_CASES
    for name, case in result["cases"].items():
        assert "error" not in case, (name, case.get("error"), case.get("stderr"))
        assert case["returncode"] == 0, (name, case["stderr"])
        assert case["regions"] > 0, name
        assert positive(case["regions_per_s"]), name
        lat = case["latency_us"]
        assert lat["count"] == case["regions"] - 1, name  # the first region is reported apart
        assert 0 < lat["p50"] <= lat["p99"] <= lat["p99_9"] <= lat["max"], (name, lat)
        assert case["samples"], name
        assert all(s["rss_mib"] > 0 for s in case["samples"]), name
        assert positive(case["exit_s"]), name
    targets = {(t["case"], t["name"]) for t in result["targets"]}
    for name in SOAK_CASES:
        assert {(name, t) for t in ("rss_growth", "account", "p99_9", "exit")} <= targets
    assert "targets (issue 13)" in stdout


def test_soak_account_balances_after_shutdown(soak_run):
    """Deterministic, not a timing: after perfsdk's exit shutdown every span produced is exported
    or lost with a reason, in every case."""
    result, _ = soak_run
    for name, case in result["cases"].items():
        final = case["final"]["diagnostics"]
        assert set(final["spans_lost"]) == REASONS, name
        assert final["spans_pending"] == 0, (name, final)
        assert final["spans_exported"] + sum(final["spans_lost"].values()) == \
            final["spans_produced"], (name, final)
        assert case["account"]["balance"] == 0, name
    cases = result["cases"]
    assert cases["none"]["final"]["diagnostics"]["spans_produced"] == 0
    assert cases["dropping"]["final"]["diagnostics"]["spans_exported"] == 0
    for name in ("dropping", "slow", "blackhole", "healthy"):
        assert cases[name]["final"]["diagnostics"]["spans_produced"] > 0, name
    assert cases["healthy"]["final"]["diagnostics"]["spans_exported"] > 0
    # A batch counts as exported once the receiver has answered, so it received at least those
    # (more if an answer came after the exit budget: counted lost, ``shutdown``).
    healthy = cases["healthy"]
    assert healthy["collector"]["spans_received"] >= \
        healthy["final"]["diagnostics"]["spans_exported"]


# -- benchmarks/user_provider.py -----------------------------------------------------------------
UP_SCRIPT = REPO_ROOT / "benchmarks" / "user_provider.py"
UP_CASES = {"default", "ratio", "on_start"}


@pytest.fixture(scope="module")
def user_provider_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(UP_SCRIPT, tmp_path_factory.mktemp("bench") / "user_provider.json")


def test_user_provider_benchmark_shape(user_provider_run):
    result, stdout = user_provider_run
    settings = result["settings"]
    assert settings["quick"] is True
    assert set(result["cases"]) == UP_CASES
    for name, case in result["cases"].items():
        assert "error" not in case, (name, case.get("stderr"))
        assert case["span_mode"] == "user", name
        assert set(case["arms"]) == {"perfsdk", "otel"}
        for arm in case["arms"].values():
            for measure in ("cpu_ns_per_call", "wall_ns_per_call", "caller_ns_per_call"):
                stats = arm[measure]
                assert positive(stats["median"]), (name, measure)
                assert stats["p25"] <= stats["median"] <= stats["p75"], (name, measure)
                assert len(stats["samples"]) == settings["repeats"]
            assert arm["spans_exported"] == [settings["calls"]] * settings["repeats"], name
            assert arm["complete"] is True
        assert positive(case["ratio_cpu"])
        assert positive(case["ratio_wall"])
    targets = {t["name"]: t for t in result["targets"]}
    assert set(targets) == {"whole_vs_otel_default", "whole_vs_otel_ratio"}
    for t in targets.values():
        assert isinstance(t["passed"], bool)
        assert f"{'PASS' if t['passed'] else 'FAIL'}  {t['definition']}" in stdout


def test_user_provider_benchmark_takes_the_paths_it_names(user_provider_run):
    """Deterministic, not a timing: the direct path for BatchSpanProcessor alone, the tracer
    for a processor with its own on_start; every region once (warm-up included)."""
    cases = user_provider_run[0]["cases"]
    for name in ("default", "ratio"):
        paths = cases[name]["provider_paths"]
        assert paths["through_tracer"] == paths["sampled_out"] == 0, name
        assert paths["direct"] > 0
    paths = cases["on_start"]["provider_paths"]
    assert paths["direct"] == paths["sampled_out"] == 0
    assert paths["through_tracer"] > 0


# -- benchmarks/metrics_cost.py ------------------------------------------------------------------
MC_SCRIPT = REPO_ROOT / "benchmarks" / "metrics_cost.py"


def test_metrics_cost_benchmark_shape(tmp_path: Path):
    result, stdout = run_quick(MC_SCRIPT, tmp_path / "metrics_cost.json")
    assert result["settings"]["quick"] is True
    variants = result["variants"]
    assert set(variants) == {"own", "sdk"}
    assert variants["own"]["aggregated_by_perfsdk"] is True
    assert variants["sdk"]["aggregated_by_perfsdk"] is False
    for v in variants.values():
        for key in ("cpu_ns_per_record", "cpu_ns_per_step_record"):
            stats = v[key]
            assert positive(stats["median"])
            assert len(stats["samples"]) == result["settings"]["repeats"]
    assert result["settings"]["step_records"] >= 64  # steps given samples=, each one recorded
    assert positive(result["sdk_over_own"])
    assert result["exports"] >= result["settings"]["repeats"]  # a flush per repeat exported
    assert "perfsdk aggregates the histograms" in stdout


# -- benchmarks/summary_cost.py -------------------------------------------------------------------
SC_SCRIPT = REPO_ROOT / "benchmarks" / "summary_cost.py"


def test_summary_cost_benchmark_shape(tmp_path: Path):
    result, stdout = run_quick(SC_SCRIPT, tmp_path / "summary_cost.json")
    assert result["settings"]["quick"] is True
    assert result["settings"]["records"] == 4 * 200  # a step and three phases each
    assert set(result["results"]) == {"filling", "full"}
    for by_name in result["results"].values():
        assert {"python", "one_add_each"} <= set(by_name) <= {"compiled", "python",
                                                            "one_add_each"}
        for v in by_name.values():
            stats = v["cpu_ns_per_record"]
            assert positive(stats["median"])
            assert len(stats["samples"]) == result["settings"]["repeats"]
    # the sinks fed before hold 20 x RESERVOIR records a name, each counted
    assert all(n >= 4 * 20 * result["settings"]["reservoir"]
               for n in result["records_in_full_sinks"].values())
    assert "one _Series.add call a record" in stdout


# -- benchmarks/trace_flush.py --------------------------------------------------------------------
TF_SCRIPT = REPO_ROOT / "benchmarks" / "trace_flush.py"


def test_trace_flush_benchmark_shape(tmp_path: Path):
    result, stdout = run_quick(TF_SCRIPT, tmp_path / "trace_flush.json")
    settings = result["settings"]
    assert settings["quick"] is True
    assert set(result["results"]) == {str(n) for n in settings["sizes"]}
    for size, r in result["results"].items():
        # the file holds the regions handed over and one step (4 regions) per timed flush,
        # quiet and beside a busy thread
        assert r["regions_in_file"] == int(size) + 2 * 4 * settings["repeats"]
        assert positive(r["file_mb"])
        for key in ("flush_ms", "flush_beside_busy_thread_ms", "whole_render_ms"):
            assert positive(r[key]["median"])
            assert len(r[key]["samples"]) == settings["repeats"]
        assert positive(r["whole_over_flush"])
    assert "every region rendered again" in stdout


# -- benchmarks/step_overhead.py ------------------------------------------------------------------
STEP_SCRIPT = REPO_ROOT / "benchmarks" / "step_overhead.py"
STEP_CONFIGS = {"summary", "otlp_drop", "otlp_encode", "run"}
STEP_VARIANTS = {"full", "step", "timed", "by_hand", "none"}
STEP_PRIMITIVES = {"a Python call", "perf_counter_ns", "nvtx push + pop", "getrandbits(64)",
                   "Region allocation", "context switch", "record to queue", "thread id check",
                   "CUDA initialized?", "profiler on?", "timed_region", "phase (in a step)"}
STEP_CALLS = {"step_start", "forward_enter", "forward_exit", "backward_enter", "backward_exit",
              "optimizer_enter", "optimizer_exit", "step_end"}


@pytest.fixture(scope="module")
def step_overhead_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_quick(STEP_SCRIPT, tmp_path_factory.mktemp("bench") / "step_overhead.json")


def test_step_overhead_benchmark_shape(step_overhead_run):
    result, stdout = step_overhead_run
    settings = result["settings"]
    assert settings["quick"] is True
    assert set(result["configs"]) == STEP_CONFIGS
    for name, config in result["configs"].items():
        assert set(config["variants"]) == STEP_VARIANTS, name
        assert positive(config["plain_step_ms"]), name
        for variant, v in config["variants"].items():
            assert v["blocks"] == settings["blocks_per_variant"], (name, variant)
            assert len(v["block_medians"]) == v["blocks"], (name, variant)
            assert len(v["block_medians_one_median"]) == v["blocks"], (name, variant)
            for key in ("overhead", "overhead_one_median", "overhead_total_time", "added_us"):
                spread = v[key]
                assert spread["p25"] <= spread["median"] <= spread["p75"], (name, variant, key)
            assert positive(v["plain_step_ms"]), (name, variant)
        for key in ("caller_us_per_call", "by_hand_us_per_call"):
            assert set(config[key]) == STEP_CALLS, (name, key)
            assert all(positive(us) for us in config[key].values()), (name, key)
        assert set(config["primitives_us"]) == STEP_PRIMITIVES, name
        assert all(positive(us) for us in config["primitives_us"].values()), name
    targets = {t["name"]: t for t in result["targets"]}
    assert set(targets) == {f"full_overhead_{c}" for c in STEP_CONFIGS}
    for t in targets.values():
        assert isinstance(t["passed"], bool), t
        assert isinstance(t["by_hand"], float), t
        low, high = t["interval95"]
        assert low <= t["value"] <= high, t  # the median lies in its own bootstrap interval
        assert t["verdict"] in {"met", "missed", "unsettled"}, t
        assert f"{'PASS' if t['passed'] else 'FAIL'}  {t['definition']}" in stdout
    assert "target (issue 16)" in stdout
    assert "in place: median us of each thing a region transition does" in stdout


def test_step_overhead_intervals_and_verdicts():
    """The bootstrap interval of the median over blocks, and what it says of the target: met,
    missed, or within the noise."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import step_overhead as so

    low, high = so.median_interval([1.0] * 9)
    assert low == high == 1.0
    spread = [1.0 + k / 1000 for k in range(-10, 11)]  # -1% .. +1% around +0%
    low, high = so.median_interval(spread)
    assert 0.99 < low < 1.0 < high < 1.01
    assert so.median_interval(spread) == (low, high)  # seeded
    assert so.verdict(-0.004, 0.009, 0.01) == "met"
    assert so.verdict(0.011, 0.03, 0.01) == "missed"
    assert so.verdict(0.002, 0.015, 0.01) == "unsettled"


def test_step_overhead_calibration_corrects_from_the_step_it_got():
    """A step is not proportional to its layers: the count is corrected from each step time
    until one lands within 10% of the target; readings stay bounded (at most 5)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import step_overhead as so

    def step_ms(layers: int) -> float:  # a fixed 1.2 ms of loss and optimizer, 0.04 a layer
        return 1.2 + 0.04 * layers

    tried = so.fit_layers(4.0, step_ms)
    assert tried[0] == (24, step_ms(24))
    assert abs(tried[-1][1] - 4.0) <= 0.4  # one scaling from 24 layers would give 3.0 ms
    assert abs(step_ms(round(24 * 4.0 / step_ms(24))) - 4.0) > 0.4
    assert so.fit_layers(2.16, step_ms) == [(24, step_ms(24))]  # on target at once
    readings = []
    so.fit_layers(4.0, lambda n: readings.append(n) or 1.0)  # a machine that never moves
    assert len(readings) == 5


def test_step_overhead_benchmark_does_the_work_it_claims(step_overhead_run):
    """Deterministic, not a timing: both models trained alike (equal weights at the end), and
    the instrumented steps produced their spans (4 per step: a step and three phases or
    regions)."""
    result, _ = step_overhead_run
    for name, config in result["configs"].items():
        assert config["identical_weights"] is True, name
    for name in ("otlp_drop", "otlp_encode"):
        drop = result["configs"][name]
        assert drop["expected_spans_per_step"] == {"full": 4, "step": 1, "timed": 4,
                                                   "by_hand": 0, "none": 0}, name
        for variant, spans in drop["expected_spans_per_step"].items():
            assert drop["variants"][variant]["spans_per_step"] == spans, (name, variant)
    assert result["configs"]["otlp_drop"]["encoded_bytes"] == 0
    assert result["configs"]["otlp_encode"]["encoded_bytes"] > 0  # OTel's encoder ran


def test_step_overhead_block_ratio_cancels_the_pair_order_effect(monkeypatch):
    """A block whose second step of each pair runs 10% slower (pairs alternate the order): its
    ratio is the overhead itself, where one median over all pairs lands between the clusters."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    from step_overhead import block_ratio

    overhead, order = 1.01, 1.10
    ratios = [overhead * order if i % 2 == 0 else overhead / order for i in range(40)]
    assert block_ratio(ratios) == pytest.approx(overhead)
    assert block_ratio([1.02] * 7) == pytest.approx(1.02)  # an odd count: both orders there
    assert block_ratio([1.03]) == pytest.approx(1.03)  # one pair: its ratio


# -- benchmarks/stalls.py ------------------------------------------------------------------------
STALLS_SCRIPT = REPO_ROOT / "benchmarks" / "stalls.py"


def test_stalls_benchmark_shape_and_its_spans(tmp_path: Path) -> None:
    """Deterministic, not a timing: every arm ran; each decorated call's span reached the
    exporter (warm-up included); the compiled arm is there where the module is built."""
    import importlib.util

    result, stdout = run_quick(STALLS_SCRIPT, tmp_path / "stalls.json")
    settings = result["settings"]
    assert settings["quick"] is True
    built = importlib.util.find_spec("perfsdk.export._spanbuild") is not None
    assert settings["compiled_builder"] is built
    assert set(result["arms"]) == ({"bare", "compiled", "python"} if built
                                   else {"bare", "python"})
    decorated = len(result["arms"]) - 1
    assert result["spans_exported"] == 200 + decorated * settings["repeats"] * settings["calls"]
    for name, arm in result["arms"].items():
        assert positive(arm["median_us"]), name
        assert arm["median_us"] * 1e-3 <= arm["p999_ms"] <= arm["max_ms"], name
        assert 0 <= arm["over_10ms"] <= arm["over_1ms"] <= settings["calls"], name
        assert f"{name:<10}" in stdout
