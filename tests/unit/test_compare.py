"""``perfsdk compare`` and ``perfsdk.bench.compare_runs``: verdicts, exit codes and messages on
saved runs written through the real run-file writer, with per-call times chosen here (no
timing is measured; ``tests/integration/test_cli_compare.py`` compares real runs)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest

from perfsdk.bench import RunComparison, compare_runs, compare_samples
from perfsdk.cli import main
from perfsdk.compare import (
    FASTER,
    MAX_CALLS,
    MIN_CALLS,
    ONLY_IN_BASE,
    ONLY_IN_NEW,
    SAME,
    SLOWER,
    TOO_FEW,
    WITHIN,
)
from perfsdk.export.runfile import RUN_FILE, load_run, save_run
from perfsdk.export.summary import Summary
from perfsdk.record import RegionResult

ROOT = Path(__file__).resolve().parents[2]


def noisy(median: float, n: int = 60, seed: int = 0, spread: float = 0.02) -> list[float]:
    """``n`` times around ``median`` (within +-``spread``), in a fixed shuffled order."""
    rng = random.Random(seed)
    return [median * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def save(directory: Path, times: Mapping[str, Sequence[float]], *, errors: Mapping[str, int]
         | None = None, exit_code: int = 0, dropped: int = 0) -> Path:
    """A saved run whose regions took ``times`` (ms per call, in order), plus ``errors`` calls
    per name that raised, written by ``save_run``."""
    regions = []
    t = 1_000_000
    for name, values in times.items():
        for ms in values:
            regions.append(_region(name, ms, t))
            t += int(ms * 1e6) + 1000
    for name, count in (errors or {}).items():
        for _ in range(count):
            regions.append(_region(name, 0.5, t, ValueError("boom")))
            t += 1_000_000
    directory.mkdir(parents=True, exist_ok=True)
    save_run(directory, command=["train.py"], exit_code=exit_code, wall_s=1.0, files={},
             summary=Summary(()), regions=regions, dropped=dropped)
    return directory


def _region(name: str, ms: float, t: int, error: BaseException | None = None) -> RegionResult:
    return RegionResult(name=name, host_ms=ms, device_ms=None, attributes=MappingProxyType({}),
                        error=error, start_ns=t, end_ns=t + int(ms * 1e6), trace_id=1,
                        span_id=t, parent_span_id=0, thread_id=1)


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """Five runs of a step and a forward: a base, a rerun (the same times shuffled), one 50%
    slower in its step, one 5% slower, one 30% faster."""
    forward = noisy(2.0, seed=9)
    base = noisy(10.0, seed=1)
    return {
        "base": save(tmp_path / "base", {"step": base, "forward": forward}),
        "rerun": save(tmp_path / "rerun", {"step": random.Random(5).sample(base, len(base)),
                                           "forward": forward}),
        "slow": save(tmp_path / "slow", {"step": noisy(15.0, seed=2), "forward": forward}),
        "bit": save(tmp_path / "bit", {"step": noisy(10.5, seed=3, spread=0.01),
                                       "forward": forward}),
        "fast": save(tmp_path / "fast", {"step": noisy(7.0, seed=4), "forward": forward}),
    }


# -- verdicts ------------------------------------------------------------------------------------
def test_a_rerun_with_the_same_times_is_no_change(runs: dict[str, Path]) -> None:
    result = compare_runs(runs["base"], runs["rerun"])
    step = result["step"]
    assert step.verdict == SAME
    assert step.ratio == 1.0
    assert step.low is not None
    assert step.high is not None
    assert step.low <= 1.0 <= step.high
    assert step.base_calls == step.new_calls == 60
    assert step.gated
    assert not result["forward"].gated
    assert not result.regressed


def test_a_clearly_slower_step_regresses(runs: dict[str, Path]) -> None:
    result = compare_runs(runs["base"], runs["slow"], fail_if_slower=10)
    step = result["step"]
    assert step.verdict == SLOWER
    assert step.low is not None
    assert step.low > 1.1
    assert step.ratio is not None
    assert step.low <= step.ratio <= (step.high or 0)
    assert result.regressed
    assert step.regressed
    assert result["forward"].verdict == SAME
    assert result.outcome().startswith("REGRESSION: step ")


def test_a_slowdown_within_the_threshold_is_named_but_passes(runs: dict[str, Path]) -> None:
    tolerant = compare_runs(runs["base"], runs["bit"], fail_if_slower=20)
    assert tolerant["step"].verdict == WITHIN
    assert not tolerant.regressed
    strict = compare_runs(runs["base"], runs["bit"])  # no threshold: any sure slowdown
    assert strict["step"].verdict == SLOWER
    assert strict.regressed


def test_a_faster_step_passes(runs: dict[str, Path]) -> None:
    result = compare_runs(runs["base"], runs["fast"], fail_if_slower=0)
    assert result["step"].verdict == FASTER
    assert result["step"].high is not None
    assert result["step"].high < 1
    assert not result.regressed
    assert compare_runs(runs["fast"], runs["base"]).regressed  # and the other way round


def test_the_same_seed_gives_the_same_intervals(runs: dict[str, Path]) -> None:
    first = compare_runs(runs["base"], runs["slow"], seed=7)
    assert compare_runs(runs["base"], runs["slow"], seed=7) == first
    assert compare_runs(load_run(runs["base"]), load_run(runs["slow"]), seed=7).rows == first.rows


def test_named_regions_are_the_gate(runs: dict[str, Path], tmp_path: Path) -> None:
    slow_forward = save(tmp_path / "slow_forward", {"step": noisy(10.0, seed=1),
                                                    "forward": noisy(4.0, seed=8)})
    assert not compare_runs(runs["base"], slow_forward).regressed  # the step held
    result = compare_runs(runs["base"], slow_forward, regions=["forward"])
    assert result.gated == ("forward",)
    assert result.regressed
    assert result["forward"].regressed
    assert not result["step"].gated
    assert compare_runs(runs["base"], slow_forward, regions="forward").regressed
    table_only = compare_runs(runs["base"], slow_forward, regions=())
    assert not table_only.regressed
    assert table_only.outcome() == "no region gated: nothing can regress"


def test_too_few_calls_never_fail(tmp_path: Path) -> None:
    base = save(tmp_path / "base", {"step": [10.0] * (MIN_CALLS - 1)})
    new = save(tmp_path / "new", {"step": [50.0] * 40})
    result = compare_runs(base, new, fail_if_slower=0)
    assert result["step"].verdict == TOO_FEW
    assert result["step"].ratio == 5.0
    assert result["step"].low is None
    assert not result.regressed
    assert any("too few calls to judge" in note for note in result.notes)


def test_calls_that_raised_are_left_out(tmp_path: Path) -> None:
    base = save(tmp_path / "base", {"step": noisy(10.0)}, errors={"step": 30})
    new = save(tmp_path / "new", {"step": noisy(10.0, seed=1)}, errors={"step": 2})
    assert compare_runs(base, new)["step"].base_calls == 60
    only_errors = save(tmp_path / "only_errors", {}, errors={"step": 10})
    result = compare_runs(base, only_errors)  # the step is there; no call of it finished
    assert result["step"].verdict == TOO_FEW
    assert result["step"].new_calls == 0


def test_regions_in_one_run_only_are_listed_not_failed(tmp_path: Path) -> None:
    base = save(tmp_path / "base", {"step": noisy(10.0), "old": noisy(1.0)})
    new = save(tmp_path / "new", {"step": noisy(10.0, seed=1), "added": noisy(99.0)})
    result = compare_runs(base, new)
    assert result["old"].verdict == ONLY_IN_BASE
    assert result["old"].new_calls == 0
    assert result["added"].verdict == ONLY_IN_NEW
    assert result["added"].base_median_ms is None
    assert result["added"].ratio is None
    assert not result.regressed
    assert [row.name for row in result.rows] == ["step", "old", "added"]


def test_the_most_recent_calls_are_compared(tmp_path: Path) -> None:
    warm_up = [100.0] * 1000  # slow first calls, then the steady state
    base = save(tmp_path / "base", {"step": warm_up + [10.0] * MAX_CALLS})
    new = save(tmp_path / "new", {"step": [10.0] * 100})
    result = compare_runs(base, new, fail_if_slower=0)
    assert result["step"].base_calls == MAX_CALLS
    assert result["step"].base_median_ms == 10.0
    assert result["step"].verdict == SAME
    assert f"step: the base run's most recent {MAX_CALLS:,} of {MAX_CALLS + 1000:,} calls " \
           "compared" in result.notes


def test_notes_name_a_failed_script_and_dropped_regions(tmp_path: Path) -> None:
    base = save(tmp_path / "base", {"step": noisy(10.0)})
    new = save(tmp_path / "new", {"step": noisy(10.0, seed=1)}, exit_code=1, dropped=12)
    notes = compare_runs(base, new).notes
    assert "the new run's script exited with 1" in notes
    assert any("12 more" in note for note in notes)


def test_zero_times() -> None:
    assert compare_samples([0.0] * 10, [0.0] * 10).verdict == SAME
    went_up = compare_samples([0.0] * 10, [1.0] * 10)
    assert went_up.ratio == math.inf
    assert went_up.verdict == SLOWER


def test_str_is_the_table_the_method_and_the_outcome(runs: dict[str, Path]) -> None:
    result = compare_runs(runs["base"], runs["slow"], fail_if_slower=10, seed=3)
    text = str(result)
    lines = text.splitlines()
    assert lines[0] == f"perfsdk compare: base {runs['base']}, new {runs['slow']}"
    assert lines[2].split() == ["region", "base", "calls", "base", "p50", "ms", "new", "calls",
                                "new", "p50", "ms", "ratio", "95%", "CI", "verdict"]
    step = next(line for line in lines if line.startswith("step "))
    assert step.endswith("slower  <- gate")
    assert "1.50" in step  # the ratio of the medians, 15 / 10
    assert "CI: bootstrap of the medians, 2,000 resamples, seed 3" in lines
    assert lines[-1] == result.outcome()
    assert "more than 10% slower with 95% confidence" in lines[-1]
    assert isinstance(result, RunComparison)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"fail_if_slower": -1}, "fail_if_slower must be a percentage >= 0"),
    ({"fail_if_slower": math.nan}, "fail_if_slower must be"),
    ({"fail_if_slower": math.inf}, "fail_if_slower must be"),
    ({"fail_if_slower": "10"}, "fail_if_slower must be"),
    ({"confidence": 1.0}, "confidence must be a number between 0 and 1"),
    ({"confidence": 95}, "confidence must be"),
    ({"seed": 1.5}, "seed must be an int"),
    ({"resamples": 10}, "resamples must be an int >= 100"),
    ({"regions": [1]}, "regions must be region names"),
])
def test_bad_arguments(runs: dict[str, Path], options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compare_runs(runs["base"], runs["rerun"], **options)  # type: ignore[arg-type]


def test_a_gated_region_not_in_both_runs(tmp_path: Path, runs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"region 'backward' is in neither run; the regions in "
                                         r"both runs: forward, step"):
        compare_runs(runs["base"], runs["rerun"], regions=["backward"])
    no_step = save(tmp_path / "no_step", {"forward": noisy(2.0)})
    with pytest.raises(ValueError, match=r"region 'step' is not in the new run \(the default "
                                         r"gate: .*--region, regions=\); the regions in both "
                                         r"runs: forward"):
        compare_runs(runs["base"], no_step)


def test_not_a_run(tmp_path: Path, runs: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match=r"run\.json does not exist"):
        compare_runs(tmp_path / "nowhere", runs["base"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / RUN_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="is not a perfsdk run file"):
        compare_runs(runs["base"], bad)


# -- the command ---------------------------------------------------------------------------------
def test_command_exit_codes(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(runs["base"]), str(runs["rerun"])]) == 0
    assert "no regression (step: no significant change" in capsys.readouterr().out
    assert main(["compare", str(runs["base"]), str(runs["slow"]), "--fail-if-slower", "10%"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: step 1.51x (CI from 1.50x)" in out
    assert main(["compare", str(runs["base"]), str(runs["slow"]), "--fail-if-slower", "60"]) == 0
    assert main(["compare", str(runs["base"]), str(runs["bit"])]) == 1
    assert main(["compare", str(runs["base"]), str(runs["bit"]), "--fail-if-slower=20"]) == 0
    assert main(["compare", str(runs["base"]), str(runs["slow"]), "--region", "forward"]) == 0
    assert main(["compare", str(runs["slow"]), str(runs["base"]), "--confidence", "0.99"]) == 0
    assert "99% CI" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--fail-if-slower", "-5"], "argument --fail-if-slower: -5 is not a percentage >= 0"),
    (["--fail-if-slower", "ten"], "argument --fail-if-slower: 'ten' is not a percentage"),
    (["--fail-if-slower", "inf"], "inf is not a percentage >= 0"),
    (["--confidence", "95"], "argument --confidence: 95 is not between 0 and 1"),
    (["--region", "backward"], "perfsdk compare: region 'backward' is in neither run; the "
                               "regions in both runs: forward, step"),
])
def test_command_bad_options(runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                             args: list[str], message: str) -> None:
    assert main(["compare", str(runs["base"]), str(runs["rerun"]), *args]) == 2
    assert message in capsys.readouterr().err


def test_command_bad_directories(tmp_path: Path, runs: dict[str, Path],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing")
    assert main(["compare", str(runs["base"]), missing]) == 2
    assert f"perfsdk compare: {missing}: no such directory" in capsys.readouterr().err
    demo = tmp_path / "demo-output"  # what `perfsdk demo` writes: two runs inside
    save(demo / "demo-before", {"step": noisy(10.0)})
    save(demo / "demo-after", {"step": noisy(5.0)})
    assert main(["compare", str(demo), str(runs["base"])]) == 2
    err = capsys.readouterr().err
    assert f"{demo}: not a saved run, no run.json there; the runs inside it: demo-after, " \
           "demo-before" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(runs["base"]), str(empty)]) == 2
    assert "`perfsdk run` and `perfsdk demo` write it" in capsys.readouterr().err
    assert main(["compare", str(demo / "demo-before"), str(demo / "demo-after")]) == 0
    (empty / RUN_FILE).write_text(json.dumps({"format": 99}))
    assert main(["compare", str(runs["base"]), str(empty)]) == 2
    assert "is not a perfsdk run file: format 99" in capsys.readouterr().err
    assert main(["compare", str(runs["base"])]) == 2
    assert "the following arguments are required: NEW" in capsys.readouterr().err


_WATCH = """
import runpy, sys
try:
    runpy.run_module("perfsdk", run_name="__main__", alter_sys=True)
finally:
    sys.stderr.write(f"\\nTORCH-IMPORTED={'torch' in sys.modules}\\n")
"""


@pytest.mark.parametrize(("args", "expected"), [
    (["compare", "--help"], "usage: perfsdk compare [-h] [--fail-if-slower PCT]"),
    (["compare", "a"], "the following arguments are required: NEW"),
    (["compare", "a", "b", "--fail-if-slower", "x"], "'x' is not a percentage (10 or 10%)"),
    (["compare", "a", "b"], "perfsdk compare: a: no such directory"),
])
def test_command_answers_bad_input_without_importing_torch(tmp_path: Path, args: list[str],
                                                           expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _WATCH, *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == (0 if "--help" in args else 2), proc.stderr
    assert expected in proc.stdout + proc.stderr
    assert proc.stderr.rstrip().endswith("TORCH-IMPORTED=False")
