"""OptimizationReport: the table, the plain data and the PNG bar chart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from perfsdk.errors import MissingDependencyError
from perfsdk.optimize.report import OptimizationReport, StepResult

BASE = "eager fp32 (baseline)"


def step(name: str, reason: str, speedup: float | None = None, *, applied: bool = False,
         error: float | None = None, setup: float = 0.0, memory: int | None = None) -> StepResult:
    median = None if speedup is None else 100.0 / speedup
    return StepResult(name, applied, reason, median, None if median is None else median * 1.1,
                      None if median is None else 16_000.0 / median, speedup, memory, error,
                      setup)


@pytest.fixture
def report() -> OptimizationReport:
    steps = (
        step(BASE, "reference", 1.0, error=0.0),
        step("amp(bf16)", "slower than chosen (1.20x < 2.56x)", 1.2, error=4e-3),
        step("channels_last", "no Conv2d"),
        step("compile + amp(bf16)", "chosen", 2.56, applied=True, error=5e-3, setup=12.3,
             memory=3 * 2**30),
        step("compile + channels_last + amp(bf16) + freezing", "budget"),
        step("compile", "out of tolerance: max error 0.12 > 0.0001", None, error=0.12,
             setup=4.0),
    )
    return OptimizationReport("inference", steps, "compile + amp(bf16)", 60.0, 31.5)


def test_table_marks_the_chosen_row_and_aligns_columns(report: OptimizationReport) -> None:
    text = report.table()
    assert str(report) == text
    lines = text.splitlines()
    assert lines[0] == ("optimize (inference): chose compile + amp(bf16), 2.56x the speed of "
                        "eager fp32; search took 31.5 s (budget 60 s)")
    header = lines[2]
    for column in ("step", "median ms", "p95 ms", "samples/s", "speedup", "peak mem",
                   "max err", "setup s", "result"):
        assert column in header
    rows = lines[4:]
    assert len(rows) == len(report.steps)
    marked = [row for row in rows if row.startswith("*")]
    assert len(marked) == 1
    assert "compile + amp(bf16)" in marked[0]
    # every row's numeric columns end where the header's do
    end = header.index("speedup") + len("speedup")
    for row in rows:
        assert row[end - 1] != " ", row
    chosen = marked[0]
    assert "39.06" in chosen
    assert "2.56x" in chosen
    assert "3.0 GiB" in chosen
    assert "5.0e-03" in chosen
    assert "12.3" in chosen
    assert chosen.endswith("chosen")
    skipped = next(row for row in rows if "freezing" in row)
    assert skipped.endswith("budget")
    assert " - " in skipped


def test_best_speedup_and_headline(report: OptimizationReport) -> None:
    assert report.best.name == "compile + amp(bf16)"
    assert report.speedup == pytest.approx(2.56)
    baseline_only = OptimizationReport("train", (step(BASE, "chosen: no candidate beat eager",
                                                      1.0, applied=True),), BASE, None, 2.0)
    assert baseline_only.speedup == 1.0
    assert "budget" not in baseline_only.headline()
    assert baseline_only.headline().startswith(
        "optimize (train): no change (no candidate beat eager fp32); search took 2.0 s")
    with pytest.raises(LookupError):
        _ = OptimizationReport("train", (), "missing", None, 0.0).best


def test_as_dicts(report: OptimizationReport) -> None:
    rows = report.as_dicts()
    assert [r["name"] for r in rows] == [s.name for s in report.steps]
    assert [r["chosen"] for r in rows] == [False, False, False, True, False, False]
    assert set(rows[0]) == {"name", "applied", "reason", "median_ms", "p95_ms",
                            "samples_per_s", "speedup", "peak_memory_bytes", "max_error",
                            "setup_s", "chosen"}
    assert rows[3]["peak_memory_bytes"] == 3 * 2**30
    assert rows[2]["median_ms"] is None


def test_plot_writes_a_png(report: OptimizationReport, tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    out = report.plot(tmp_path / "speedup.png")
    assert out == tmp_path / "speedup.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000
    pixels = image.imread(out)
    assert pixels.ndim == 3
    assert pixels.shape[0] > 100
    assert pixels.shape[1] > 100
    assert pixels.shape[2] in (3, 4)
    assert isinstance(report.plot(str(tmp_path / "again.png")), Path)


def test_plot_without_matplotlib(report: OptimizationReport, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(MissingDependencyError, match=r"perfsdk\[plot\]") as info:
        report.plot(tmp_path / "x.png")
    assert info.value.package == "matplotlib"
    assert info.value.extra == "plot"
    assert "OptimizationReport.plot" in str(info.value)
    assert not (tmp_path / "x.png").exists()
