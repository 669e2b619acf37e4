"""``perfsdk demo`` end to end: the lab's loop, each fix tried in an interleaved A/B and kept only
when it measured faster, the loop again with the kept fixes, the advisor's findings, the
before/after table, the Perfetto trace and spans it writes, the runs that ``perfsdk report``
reads back, spans to a real OTLP receiver, and clear argument errors.

The end-to-end run uses latency-dominated data (:data:`LATENCY_MS` of simulated storage latency
per image, a sleep): DataLoader workers overlap sleeps whatever else runs on the machine, so
"after is faster than before" holds beside busy processes. Which of the compute fixes win there
depends on the machine; the tests check that whatever was kept measured faster and whatever was
not is not applied, and a second test fixes the measurements to check exactly that.
"""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from perfsdk.cli import choose as choose_module
from perfsdk.cli import demo as demo_module
from perfsdk.cli.demo import KEEP_ABOVE, Setup, StoredImages, measure_fix, run_demo
from tests.otlp_receiver import OTLPReceiver

LATENCY_MS = 20.0
"""Storage latency per image in the end-to-end run: far above the decoding's CPU time."""

# Runs the real `perfsdk demo` command line; run_demo gets the test's storage latency, and its
# result (DemoResult.as_dict()) is written to a JSON file for the tests to read.
RUNNER = """
import json, sys
import perfsdk.cli.demo
from perfsdk.cli import main

real, results = perfsdk.cli.demo.run_demo, []

def run_demo(*args, **kwargs):
    results.append(real(*args, **{**kwargs, "latency_ms": float(sys.argv[1])}))
    return results[-1]

perfsdk.cli.demo.run_demo = run_demo
code = main(sys.argv[3:])
if results:
    with open(sys.argv[2], "w") as f:
        json.dump(results[0].as_dict(), f)
sys.exit(code)
"""


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


def choices(text: str) -> list[str]:
    """The rows of the choice table (between its header and the "chosen:" line)."""
    part = text[text.index("2/3 choose"):text.index("  chosen: ")]
    lines = part.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["fix", "measured",
                                                                           "on"])
    return lines[start + 1:]


def trial_row(trial: dict[str, Any]) -> str:
    """How the choice table prints one trial's ratio and result."""
    ratio = "-" if trial["ratio"] is None else f"{trial['ratio']:.2f}x"
    return f"{ratio}  {trial['status']}: {trial['reason']}"


def applied_as_chosen(trials: list[dict[str, Any]], ran: dict[str, Any]) -> None:
    """Each kept fix is on in ``ran`` (the last kept value of its field); no rejected or
    untried value is."""
    kept = {t["field"]: t["value"] for t in trials if t["status"] == "kept"}
    for field, value in kept.items():
        assert ran[field] == value, (field, ran)
    for t in trials:
        if t["status"] != "kept":
            assert ran[t["field"]] != t["value"], (t, ran)


def saved_attributes(out: Path, name: str) -> dict[str, Any]:
    regions = json.loads((out / f"demo-{name}" / "run.json").read_text())["regions"]
    phase = next(r for r in regions if r["name"] == f"demo.{name}")
    return {k.removeprefix("demo."): v for k, v in phase["attributes"].items()
            if k.startswith("demo.")}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path, OTLPReceiver,
                                    dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("demo")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    with OTLPReceiver("http") as receiver:
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(LATENCY_MS), str(tmp / "result.json"), "demo",
             "--steps", "24", "--batch-size", "4", "--image-size", "16", "--output-dir",
             str(tmp / "out")], capture_output=True, text=True, timeout=300, cwd=tmp,
            env={**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_endpoint}, check=False)
        if proc.returncode == 0:
            receiver.wait_for_spans(20, timeout=20)
    result = json.loads((tmp / "result.json").read_text()) if proc.returncode == 0 else {}
    return proc, tmp / "out", receiver, result


def test_demo_measures_the_lab_loop_chooses_then_runs_the_kept_fixes(demo) -> None:
    proc, out_dir, _, result = demo
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert f"the data: each image waits {LATENCY_MS:g} ms of simulated storage latency" in out
    assert re.search(r"then is decoded on the CPU \(\d+\.\d ms, measured\)", out)
    assert "1/3 before: the lab's loop (batch 4, num_workers=0, loss.item() on every step)" in out
    setup = Setup(**result["setup"])
    assert f"3/3 after: the kept fixes ({setup.describe()})" in out
    before, after = out.split("3/3 after")
    before = before.split("2/3 choose")[0]
    after = after.split("before / after")[0]
    after_steps = result["after"]["steps"]
    assert after_steps == math.ceil(96 / setup.batch_size)
    for part, steps in ((before, 24), (after, after_steps)):
        # Summary rows only (name, then calls): the advice in the same part may print a fix
        # starting "step = perfsdk.optimize.TrainStep(...)", depending on what it measured.
        rows = {line.split()[0]: line.split()[1] for line in part.splitlines()
                if len(line.split()) > 1 and line.split()[1].isdigit()
                and line.split()[0] in {"step", "data_wait", "SimpleNet"}}
        assert rows == {"step": str(steps), "data_wait": str(steps), "SimpleNet": str(steps)}
    assert "perfsdk advice" in before
    assert "Host-device syncs" in before  # the loss.item() on every step
    assert "demo.py" in before  # ... named at its line
    rows = table(out)
    assert rows["syncs per step"] == ["1.0", "0.0"]
    for column, name in ((0, "before"), (1, "after")):  # data wait over wait plus step time
        regions = json.loads((out_dir / f"demo-{name}" / "run.json").read_text())["regions"]
        waits = sum(r["host_ms"] for r in regions if r["name"] == "data_wait")
        steps = sum(r["host_ms"] for r in regions if r["name"] == "step")
        assert rows["data wait share"][column] == f"{waits / (waits + steps):.0%}"
    assert rows["images per step"] == ["4", f"{96 / after_steps:.0f}"]


def test_demo_after_is_faster_than_before(demo) -> None:
    proc, _, _, result = demo
    assert proc.returncode == 0, proc.stderr
    before, after = result["before"], result["after"]
    assert after["samples"] == before["samples"] == 96
    assert after["samples_per_s"] > before["samples_per_s"], (before, after)
    assert table(proc.stdout)["images/s"] == [f"{before['samples_per_s']:,.1f}",
                                              f"{after['samples_per_s']:,.1f}",
                                              f"{result['speedup']:.2f}x"]
    # the data waits on storage: workers overlap it, and the A/B measured that
    workers = [t for t in result["trials"] if t["field"] == "workers"]
    assert workers, result["trials"]
    assert workers[0]["status"] == "kept", workers


def test_demo_keeps_only_the_fixes_it_measured_faster(demo) -> None:
    proc, out_dir, _, result = demo
    assert proc.returncode == 0, proc.stderr
    trials = result["trials"]
    assert [t["field"] for t in trials if t["field"] != "workers"] == [
        "batch_size", "amp", "channels_last", "compiled"]
    for t in trials:
        if t["status"] == "kept":
            assert t["ratio"] >= KEEP_ABOVE > 1, t
        elif t["status"] == "rejected":
            assert t["ratio"] is not None, t
            assert t["ratio"] < KEEP_ABOVE, t
        else:
            assert (t["status"], t["ratio"]) == ("not tried", None), t
    compiled = trials[-1]  # on a CPU, compiling does not fit the demo's budget
    assert compiled["status"] == "not tried"
    assert compiled["reason"].startswith("~60 s to compile on CPU, ")
    ran = result["after"]["ran"]
    assert ran == result["setup"]  # read back from the after loop's own objects
    applied_as_chosen(trials, ran)
    saved = saved_attributes(out_dir, "after")  # what the after run's region recorded
    assert saved == {**ran, "amp": ran["amp"] or "fp32"}
    assert saved_attributes(out_dir, "before") == {**result["before"]["ran"], "amp": "fp32"}
    # the output lists every fix tried, with its ratio and what became of it
    rows = choices(proc.stdout)
    assert len(rows) == len(trials)
    for row, t in zip(rows, trials, strict=True):
        assert row.startswith(f"  {t['label']} "), (row, t)
        assert row.endswith(trial_row(t)), (row, t)


def test_demo_writes_trace_spans_and_runs_report_reads(demo, tmp_path) -> None:
    proc, out, receiver, result = demo
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(next(out.glob("trace-*.json")).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    phases = {e["name"]: e for e in events if e["name"] in ("demo.before", "demo.after")}
    assert set(phases) == {"demo.before", "demo.after"}
    tries = [e for e in events if e["name"] == "demo.try"]
    assert len(tries) == sum(t["ratio"] is not None and t["measured_on"] != "the autocast probe"
                             for t in result["trials"])
    total = 24 + result["after"]["steps"]
    steps = [e for e in events if e["name"] == "step"]
    assert len(steps) == total
    for e in steps:  # every step lies inside one of the two phases
        assert any(p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"]
                   for p in phases.values())
    spans = [json.loads(line) for line in next(out.glob("spans-*.jsonl")).read_text()
             .splitlines()]
    assert sum(s["name"] == "step" for s in spans) == total
    received = {s.name for s in receiver.spans()}  # OTEL_EXPORTER_OTLP_ENDPOINT was set
    assert {"step", "data_wait", "demo.before", "demo.choose"} <= received
    for name in ("before", "after"):
        assert f"perfsdk report {out}/demo-{name}" in proc.stdout
        report = perfsdk("report", str(out / f"demo-{name}"), cwd=tmp_path)
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith(f"perfsdk report: perfsdk demo {name} exited with 0")
        assert "perfsdk advice" in report.stdout


@pytest.mark.parametrize(("probe", "amp_ratio"), [(0.3, None), (1.5, 1.2)])
def test_the_after_loop_runs_exactly_the_fixes_measured_faster(monkeypatch, tmp_path, probe,
                                                               amp_ratio) -> None:
    """With the measurements fixed: kept fixes are on in the after loop, rejected ones are off,
    and autocast is measured only when the probe says it can win."""
    ratios = {("workers", 2): 2.0, ("workers", 4): 0.9, ("batch_size", 8): 0.95,
              ("amp", "bf16"): amp_ratio, ("channels_last", True): 1.5}
    measured: list[tuple[str, Any, str]] = []

    def fake_measure(without: Setup, with_fix: Setup, data: StoredImages, *, on: str,
                     device: str) -> float:
        changed = [(f, v) for f, v in vars(with_fix).items() if vars(without)[f] != v]
        field, value = changed[0]
        measured.append((field, value, on))
        ratio = ratios.get((field, value))
        assert ratio is not None, changed  # only the candidates meant to be measured
        return ratio

    monkeypatch.setattr(demo_module, "measure_fix", fake_measure)
    monkeypatch.setattr(choose_module, "autocast_speedup", lambda dtype, device: probe)
    out = io.StringIO()
    result = run_demo(steps=4, batch_size=2, image_size=8, output_dir=tmp_path,
                      exporters=("none",), out=out, progress=False, latency_ms=0)
    text = out.getvalue()
    assert not multiprocessing.active_children()  # no worker process outlives the demo
    amp = amp_ratio is not None
    expected = Setup(2, workers=2, amp="bf16" if amp else None, channels_last=True)
    assert result.setup == expected
    assert result.after.ran == expected  # read back from the loop's DataLoader, model, step
    assert saved_attributes(tmp_path, "after") == {**dataclasses_dict(expected),
                                                   "amp": "bf16" if amp else "fp32"}
    assert result.after.steps == 4
    assert table(text)["images per step"] == ["2", "2"]
    fields = [(f, on) for f, _, on in measured]
    if amp:  # the probe said it could win: measured on the step
        assert ("amp", "step") in fields
    else:  # the probe said it could not: rejected without an A/B
        assert all(f != "amp" for f, _ in fields)
    assert ("workers", "loop") in fields
    assert ("batch_size", "loop") in fields
    assert ("channels_last", "step") in fields
    assert {t.field for t in result.kept} == {"workers", "channels_last"} | ({"amp"} if amp
                                                                             else set())
    rejected = {(t.field, t.value) for t in result.rejected}
    assert ("batch_size", 8) in rejected
    assert (("amp", "bf16") in rejected) is not amp
    row = next(r for r in choices(text) if r.startswith("  TrainStep(amp='bf16')"))
    if amp:
        assert row.endswith("1.20x  kept: the probe said 1.50x, then faster here")
    else:
        assert "the autocast probe" in row
        assert row.endswith("0.30x  rejected: slower than float32 here (below 0.8x: no A/B)")
    row = next(r for r in choices(text) if r.startswith("  apply_compile(model)"))
    assert re.search(r" -  not tried: ~60 s to compile on CPU, \d+ s of the budget left$", row)
    assert "  batch_size=8 (lr 4x)" in text
    assert "0.95x  rejected: not faster here" in text


def test_a_slow_before_run_stops_and_an_exhausted_budget_tries_nothing(monkeypatch,
                                                                       tmp_path) -> None:
    """Past BEFORE_S the before run stops (the after run trains on as many images); past the
    budget no A/B starts, and nothing untried or rejected is applied."""

    def no_measure(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("no A/B may start once the budget has run out")

    monkeypatch.setattr(demo_module, "BEFORE_S", 0.0)
    monkeypatch.setattr(demo_module, "measure_fix", no_measure)
    monkeypatch.setattr(choose_module, "autocast_speedup", lambda dtype, device: 0.1)
    out = io.StringIO()
    result = run_demo(steps=5, batch_size=2, image_size=8, output_dir=tmp_path,
                      exporters=("none",), out=out, progress=False, latency_ms=0,
                      budget_s=1e-6)
    text = out.getvalue()
    assert "stopped after 0 s, at step 1 of 5" in text
    assert result.before.samples == result.after.samples == 2
    assert result.setup == result.after.ran == Setup(2)
    assert "3/3 after: the kept fixes (batch 2, num_workers=0, float32)" in text
    assert [(t.field, t.status) for t in result.trials if t.field != "workers"] == [
        ("batch_size", "not tried"), ("amp", "rejected"), ("channels_last", "not tried"),
        ("compiled", "not tried")]
    assert all(t.status == "not tried" for t in result.trials if t.field == "workers")
    assert "the 0 s budget ran out" in text
    assert "0.10x  rejected: slower than float32 here" in text  # the probe needs no budget
    assert result.after.syncs_per_step == 0  # TrainStep keeps the losses on the device


def dataclasses_dict(setup: Setup) -> dict[str, Any]:
    return {field: getattr(setup, field) for field in vars(setup)}


def test_stored_images_wait_without_using_the_cpu() -> None:
    """The latency is a sleep: the process waits and its CPU time stays small (that is why
    DataLoader workers overlap it even on a machine with no spare core)."""
    data = StoredImages(4, 16, latency_ms=50)
    wall, cpu = time.perf_counter(), time.process_time()
    items = [data[i] for i in range(4)]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 0.2
    assert cpu < 0.5 * wall, (cpu, wall)
    assert items[1][0].shape == (3, 16, 16)
    assert [y for _, y in items] == [0, 1, 2, 3]
    assert data.decode_ms() > 0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: run_demo(steps=1), "run_demo: steps=1; accepted values are integers >= 2"),
    (lambda: run_demo(batch_size=True), "run_demo: batch_size=True; accepted values are "
                                        "integers >= 1"),
    (lambda: run_demo(image_size=30), "run_demo: image_size=30; accepted values are positive "
                                      "multiples of 4"),
    (lambda: run_demo(latency_ms=-1), "run_demo: latency_ms=-1; accepted values are finite "
                                      "numbers >= 0"),
    (lambda: run_demo(latency_ms=float("nan")), "run_demo: latency_ms=nan; accepted values"),
    (lambda: run_demo(budget_s=0), "run_demo: budget_s=0; accepted values are finite numbers "
                                   "> 0"),
    (lambda: StoredImages(4, 16, latency_ms="5"), "StoredImages: latency_ms='5'; accepted"),
    (lambda: StoredImages(0, 16), "StoredImages: length=0; accepted values are integers >= 1"),
    (lambda: measure_fix(Setup(2), Setup(2, workers=2), StoredImages(4, 8), on="epoch"),
     "measure_fix: on='epoch'; accepted values are 'loop' and 'step'"),
])
def test_bad_arguments_are_named_before_any_work(call, message, tmp_path) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        call()
    assert str(info.value).startswith(message)


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
