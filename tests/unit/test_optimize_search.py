"""optimize(): explicit flags, the automatic search (tolerance check, never slower than eager,
budget), training mode (the caller's model untouched during the search), compile failures.

The search's decisions are tested on a model whose speed is a knob and whose calls take their
time on a fake clock (bench's and the search's): the timings, and so the decisions, are exact
on any machine. Real models (TinyCNN) check what does not depend on speed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from perfsdk import bench
from perfsdk.errors import NoEffectWarning
from perfsdk.optimize import _candidates, search
from perfsdk.optimize.search import (
    AMP_GRAD_RTOL,
    AMP_RTOL,
    BASELINE,
    FP32_GRAD_RTOL,
    FP32_RTOL,
    optimize,
)
from perfsdk.testing import FakeClock

FAST = {"iters": 3, "progress": False}
SLEEPY = {"iters": 3, "progress": False}  # calls timed on the fake clock: exact, so few suffice
CLOCK = FakeClock(0)  # the fake host clock of the Sleepy tests (the `clock` fixture installs it)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """bench's timings and the search's budget and setup times read CLOCK, which only the
    Sleepy model and the fake transforms move."""
    monkeypatch.setattr(CLOCK, "ns", 0)
    monkeypatch.setattr(bench, "_now_ns", CLOCK)
    monkeypatch.setattr(search, "_now", lambda: CLOCK() / 1e9)
    monkeypatch.setattr(search, "autocast_speedup", lambda dtype, device="cpu": 1.0)  # pays
    return CLOCK


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))  # type: ignore[no-any-return]


class Sleepy(nn.Module):
    """Its speed and its error are knobs the fake transforms below turn: a call takes ``delay``
    ms on the fake clock."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.delay = 20.0
        self.corrupt = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CLOCK.advance(self.delay)
        return self.conv(x) + self.corrupt  # type: ignore[no-any-return]


def fake(speed: float, corrupt: float = 0.0, cost_ms: float = 0.0) -> Any:
    def apply(model: Sleepy, **options: Any) -> Sleepy:
        CLOCK.advance(cost_ms)
        model.delay /= speed
        model.corrupt += corrupt
        return model
    return apply


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """amp: 10x faster but wrong; channels_last: 2x faster and right; compile: 2x slower."""
    monkeypatch.setattr(search, "apply_amp", fake(10.0, corrupt=100.0))
    monkeypatch.setattr(search, "apply_channels_last", fake(2.0))
    monkeypatch.setattr(search, "apply_compile", fake(0.5))


def rows(report: search.OptimizationReport) -> dict[str, search.StepResult]:
    return {s.name: s for s in report.steps}


@pytest.mark.initializes_cuda
def test_explicit_flags_apply_exactly_what_is_asked() -> None:
    model = TinyCNN()
    keys = list(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    out, report = optimize(model, x, compile={"backend": "eager"}, channels_last=True, **FAST)
    assert out is model
    assert list(model.state_dict()) == keys
    assert [s.name for s in report.steps] == [BASELINE, "compile[eager] + channels_last"]
    chosen = report.best
    assert report.chosen == chosen.name
    assert chosen.applied
    assert chosen.reason.startswith("applied as asked")
    assert chosen.median_ms
    assert chosen.p95_ms
    assert chosen.samples_per_s
    assert chosen.speedup
    assert chosen.max_error is not None
    assert chosen.max_error <= FP32_RTOL
    assert not report.steps[0].applied
    assert report.steps[0].speedup == 1.0
    assert model._compiled_call_impl is not None
    with torch.no_grad():
        assert torch.allclose(model(x), expected, rtol=1e-5, atol=1e-6)
    assert report.mode == "inference"
    assert report.budget_s == search.DEFAULT_BUDGET_S == 120
    assert report.search_s > 0


def test_explicit_amp_is_checked_with_the_amp_tolerance() -> None:
    model = TinyCNN()
    _out, report = optimize(model, torch.randn(4, 3, 8, 8), amp="bf16", **FAST)
    step = report.best
    assert step.name == "amp(bf16)"
    assert step.applied
    assert step.max_error is not None
    assert 0 < step.max_error <= AMP_RTOL


def test_explicit_out_of_tolerance_is_applied_with_a_warning(monkeypatch, fakes) -> None:
    model = Sleepy()
    with pytest.warns(search.PerfSDKWarning, match="out of tolerance"):
        _, report = optimize(model, torch.randn(2, 2, 4, 4), amp=True, **SLEEPY)
    assert report.best.applied
    assert "out of tolerance" in report.best.reason
    assert report.best.speedup is not None  # timed anyway: it was asked for
    assert model.corrupt == 100.0


def test_nothing_asked_warns_and_returns_the_model_unchanged() -> None:
    model = TinyCNN()
    with pytest.warns(NoEffectWarning, match="nothing to try"):
        out, report = optimize(model, torch.randn(2, 3, 8, 8), amp=False, **FAST)
    assert out is model
    assert report.chosen == BASELINE
    assert len(report.steps) == 1


def spy_compare(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Record the variant names of every bench.compare call."""
    calls: list[list[str]] = []
    compare = bench.compare

    def spy(fns: Any, *args: Any, **kwargs: Any) -> bench.Comparison:
        calls.append(list(fns))
        return compare(fns, *args, **kwargs)

    monkeypatch.setattr(search.bench, "compare", spy)
    return calls


def test_auto_rejects_wrong_and_slower_candidates(fakes, monkeypatch) -> None:
    calls = spy_compare(monkeypatch)
    model = Sleepy()
    out, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, **SLEEPY)
    assert out is model
    by = rows(report)
    amp = "amp(bf16 weights)"
    assert list(by) == [BASELINE, amp, "channels_last", f"channels_last + {amp}", "compile",
                        f"compile + {amp}", f"compile + channels_last + {amp} + freezing"]
    for name in (amp, f"channels_last + {amp}", f"compile + {amp}"):
        assert by[name].reason.startswith("out of tolerance: max error "), by[name]
        assert by[name].reason.endswith(f"> {AMP_RTOL:g}")
        assert by[name].speedup is None
    assert by["compile"].reason == "slower than baseline"
    assert by["compile"].speedup == 0.5
    assert report.chosen == "channels_last"
    assert by["channels_last"].reason == "chosen"
    assert [s.name for s in report.steps if s.applied] == ["channels_last"]
    assert report.speedup == 2.0
    assert (by[BASELINE].median_ms, by["channels_last"].median_ms) == (20.0, 10.0)
    assert model.delay == 10.0  # channels_last applied to the caller's model
    # timed: every candidate that passed, together with eager, in one comparison
    assert calls == [[BASELINE, "channels_last", "compile"]]
    assert model.corrupt == 0.0


def test_every_timed_row_shares_one_baseline(monkeypatch, clock) -> None:
    """One interleaved comparison times eager and every candidate that passed: each row's
    speedup is that comparison's eager median over the row's median, so rows cannot drift."""
    calls = spy_compare(monkeypatch)
    monkeypatch.setattr(search, "apply_amp", fake(2.0))
    monkeypatch.setattr(search, "apply_compile", fake(0.8))
    _, report = optimize(Sleepy(), torch.randn(2, 2, 4, 4), auto=True, **SLEEPY)
    by = rows(report)
    timed = [name for name, row in by.items() if row.median_ms is not None]
    (timed_together,) = calls  # one comparison: eager first, then every candidate that passed
    assert timed_together[0] == BASELINE
    assert sorted(timed_together) == sorted(timed)
    base = by[BASELINE].median_ms
    for name in timed:
        assert by[name].speedup == pytest.approx(base / by[name].median_ms)
    assert report.chosen == "amp(bf16 weights)"  # 2x (real channels-last: no change in delay)
    assert by["compile"].speedup == pytest.approx(0.8)


def test_slow_steps_get_enough_calls_for_a_median(monkeypatch, clock) -> None:
    """min_time=0.01 s would time a 20 ms step once per round; the comparison times at least
    FINAL_CALLS eager calls instead."""
    seen: list[tuple[list[str], float, int]] = []
    compare = bench.compare

    def spy(fns: Any, *args: Any, **kwargs: Any) -> bench.Comparison:
        result = compare(fns, *args, **kwargs)
        seen.append((list(fns), kwargs["min_time"], result.results[BASELINE].iters))
        return result

    monkeypatch.setattr(search.bench, "compare", spy)
    monkeypatch.setattr(search, "apply_amp", fake(2.0))
    model = Sleepy()  # 20 ms a call, so a calibrated min_time is at least calls x 20 ms
    _, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, channels_last=False,
                         compile=False, min_time=0.01, progress=False)
    ((fns, min_time, calls),) = seen
    assert fns == [BASELINE, "amp(bf16 weights)"]
    assert min_time >= search.FINAL_CALLS * 0.02
    assert calls >= search.FINAL_CALLS
    assert report.chosen == "amp(bf16 weights)"


class Erratic(Sleepy):
    """Alternates 6 ms and 30 ms calls: a median 1.11x faster than Sleepy's 20 ms, which the
    calls do not bear out (half of them are 1.5x slower)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        CLOCK.advance(6.0 if self.calls % 2 else 30.0)
        return self.conv(x) + self.corrupt  # type: ignore[no-any-return]


def erratic(model: Sleepy, **options: Any) -> Sleepy:
    model.__class__ = Erratic
    return model


def test_a_gain_within_the_noise_is_not_kept(monkeypatch, clock) -> None:
    """On an H200, optimize() kept compile at 1.06x by the medians, which re-timing read as
    0.93x: the gain must show through the spread of the calls (the bootstrap interval of the
    time ratio, as the regression gate uses), not only in the medians."""
    monkeypatch.setattr(search, "apply_amp", erratic)
    model = Sleepy()
    _, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, channels_last=False,
                         compile=False, iters=20, progress=False)
    row = rows(report)["amp(bf16 weights)"]
    assert row.speedup >= search.MIN_GAIN  # the medians alone would have kept it
    assert report.chosen == BASELINE
    assert row.reason.startswith("not faster than baseline beyond the noise (1.11x")
    assert type(model) is Sleepy  # the caller's model was left as it was


def test_auto_returns_eager_when_nothing_beats_it(monkeypatch, clock) -> None:
    monkeypatch.setattr(search, "apply_amp", fake(0.7))
    monkeypatch.setattr(search, "apply_compile", fake(0.5))
    model = Sleepy()
    _, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, channels_last=False, **SLEEPY)
    assert report.chosen == BASELINE
    assert report.speedup == 1.0
    assert report.steps[0].applied
    assert report.steps[0].reason.startswith("chosen")
    amp = rows(report)["amp(bf16 weights)"]
    assert "than baseline" in amp.reason
    assert amp.speedup == pytest.approx(0.7, rel=1e-6)  # 20 / 0.7 ms, to the clock's ns
    assert not amp.applied
    assert model.delay == 20.0  # unchanged


def test_ties_go_to_the_candidate_with_fewer_transforms() -> None:
    def row(name: str, speedup: float | None) -> search.StepResult:
        return search.StepResult(name, False, "passed", 1.0, 1.0, None, speedup, None, 0.0, 0.0)

    amp, compiled = ((("amp", {}),), (("amp", {}), ("compile", {})))
    names = [_candidates.candidate_name(c, "cpu") for c in (amp, compiled)]
    assert names == ["amp(bf16)", "compile + amp(bf16)"]
    rows = {names[0]: row(names[0], 2.0), names[1]: row(names[1], 2.05)}
    assert _candidates.choose(rows, [amp, compiled], "cpu") == "amp(bf16)"  # within 3%: simpler
    rows[names[1]] = row(names[1], 2.2)
    assert _candidates.choose(rows, [amp, compiled], "cpu") == "compile + amp(bf16)"
    rows = {names[0]: row(names[0], 1.02), names[1]: row(names[1], None)}
    assert _candidates.choose(rows, [amp, compiled], "cpu") == BASELINE  # < MIN_GAIN: noise
    reasons = _candidates.reasons({BASELINE: row(BASELINE, 1.0), **rows}, BASELINE)
    assert reasons[names[0]].reason == "not faster than baseline (1.02x < 1.03x)"


def test_inference_candidates_store_weights_in_the_autocast_dtype() -> None:
    """In inference autocast also stores the weights (no per-call casts, same rounding); not in
    training (the optimizer needs float32 weights), nor when the amp options say no."""
    def amp_options(mode: str, amp: Any = None) -> list[dict[str, Any]]:
        flags = {"amp": amp or {}, "compile": {}, "channels_last": {}, "cuda_graphs": None}
        cands = _candidates.auto_candidates(TinyCNN(), mode, "cpu", flags)
        return [dict(c)["amp"] for c in cands if "amp" in dict(c)]

    assert amp_options("inference") == [{"weights": True}] * 4
    assert amp_options("train") == [{}] * 4
    assert amp_options("inference", {"weights": False}) == [{"weights": False}] * 4


def test_budget_skips_candidates_not_started(fakes, monkeypatch) -> None:
    monkeypatch.setattr(search, "apply_amp", fake(1.0, cost_ms=800))
    model = Sleepy()
    _, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, budget_s=0.5, **SLEEPY)
    by = rows(report)
    assert by["amp(bf16 weights)"].reason != "budget"  # started in time, so it finished
    assert by["amp(bf16 weights)"].setup_s == pytest.approx(0.8 + 0.02)  # the cost and a call
    rest = [s for s in report.steps[2:]]
    assert rest
    assert all(s.reason == "budget" and not s.applied for s in rest)
    assert report.budget_s == 0.5
    _, report = optimize(Sleepy(), torch.randn(2, 2, 4, 4), auto=True, budget_s=0, **SLEEPY)
    assert all(s.reason == "budget" for s in report.steps[1:])
    assert report.chosen == BASELINE
    assert report.steps[0].median_ms is not None


def test_train_mode_leaves_the_model_alone_during_the_search(monkeypatch) -> None:
    model = TinyCNN()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    params = {k: v.clone() for k, v in model.state_dict().items()}
    original = copy.deepcopy(model)
    compare = bench.compare
    calls = []

    def spy(*args: Any, **kwargs: Any) -> bench.Comparison:
        calls.append(1)
        for key, value in model.state_dict().items():
            assert torch.equal(value, params[key]), key
        assert all(p.grad is None for p in model.parameters())
        return compare(*args, **kwargs)

    monkeypatch.setattr(search.bench, "compare", spy)
    loss_fn = nn.functional.cross_entropy
    out, report = optimize(model, x, mode="train", auto=True, loss_fn=loss_fn, target=y,
                           compile={"backend": "aot_eager"}, **FAST)
    assert calls
    assert out is model
    assert report.mode == "train"
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    assert "freezing" not in " ".join(s.name for s in report.steps)
    # the chosen model's gradients are within the chosen tolerance of eager fp32
    grads = []
    for m in (original, model):
        m.zero_grad(set_to_none=True)
        loss_fn(m(x), y).backward()
        grads.append([p.grad for p in m.parameters()])
    rtol = AMP_GRAD_RTOL if "amp" in report.chosen else FP32_GRAD_RTOL
    for ref, got in zip(*grads, strict=True):
        assert (got - ref).norm() <= rtol * ref.norm()


def test_compile_failure_is_reported(monkeypatch) -> None:
    def broken(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("backend exploded")

    model = TinyCNN()
    _, report = optimize(model, torch.randn(2, 3, 8, 8), auto=True, amp=False,
                         channels_last=False, compile={"backend": broken}, **FAST)
    failed = rows(report)["compile[broken]"]
    assert failed.reason.startswith("compile failed: ")
    assert "backend exploded" in failed.reason
    assert report.chosen == BASELINE
    assert model._compiled_call_impl is None


def test_a_candidate_that_raises_is_reported_and_skipped() -> None:
    """The lab's ``x.view(...)`` cannot flatten a channels-last tensor: that candidate fails,
    the search carries on."""

    class ViewNet(TinyCNN):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv(x))
            return self.fc(y.view(y.size(0), -1))  # type: ignore[no-any-return]

    model = ViewNet()
    _, report = optimize(model, torch.randn(2, 3, 8, 8), auto=True, amp=False, compile=False,
                         **FAST)
    failed = rows(report)["channels_last"]
    assert failed.reason.startswith("failed: RuntimeError: view size is not compatible")
    assert failed.speedup is None
    assert report.chosen == BASELINE
    assert next(model.parameters()).is_contiguous()  # the caller's model was not touched


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "fit"}, "mode='fit'"),
    ({"mode": "train"}, "loss_fn"),
    ({"amp": 3}, "amp=3"),
    ({"compile": ["x"]}, "compile="),
    ({"rtol": -1}, "rtol=-1"),
    ({"budget_s": "1"}, "budget_s="),
    ({"mode": "train", "loss_fn": torch.sum, "cuda_graphs": True}, "cuda_graphs"),
])
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        optimize(TinyCNN(), torch.randn(2, 3, 8, 8), **kwargs)


# inductor imports torch.utils.mkldnn, whose torch.jit.script_method warns at import (torch's own)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_with_freezing_explicitly() -> None:
    """The one real inductor compile here: freezing in inference, on the caller's model."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    _out, report = optimize(model, torch.randn(8, 16), compile={"freezing": True}, **FAST)
    assert report.chosen == "compile + freezing"
    assert report.best.applied
    assert report.best.max_error is not None
    assert report.best.max_error <= FP32_RTOL
    assert report.best.setup_s > 0
    assert not model.training


# -- issue 14: inputs=, pruning, budget, "no change", the returned model -------------------------
def test_inputs_is_the_name_and_example_inputs_still_works() -> None:
    x = torch.randn(2, 3, 8, 8)
    for kwargs in ({"inputs": x}, {"example_inputs": x}):
        _, report = optimize(TinyCNN(), compile={"backend": "eager"}, **kwargs, **FAST)
        assert report.chosen == "compile[eager]"
    with pytest.raises(ValueError, match=r"inputs= .*not both"):
        optimize(TinyCNN(), x, example_inputs=x, **FAST)
    with pytest.raises(ValueError, match="inputs is required"):
        optimize(TinyCNN(), compile=True, **FAST)


def test_autocast_the_probe_measured_slow_is_pruned(fakes, monkeypatch) -> None:
    """The probe (measured once) says bf16 runs at 0.3x fp32 here: no amp candidate is built,
    each is reported with the ratio, and the combinations are tried without autocast."""
    probed: list[Any] = []

    def slow(dtype: torch.dtype, device: str = "cpu") -> float:
        probed.append((dtype, device))
        return 0.3

    monkeypatch.setattr(search, "autocast_speedup", slow)
    applied: list[str] = []
    monkeypatch.setattr(search, "apply_amp", lambda m, **o: applied.append("amp") or m)
    model = Sleepy()
    _, report = optimize(model, torch.randn(2, 2, 4, 4), auto=True, **SLEEPY)
    by = rows(report)
    assert probed == [(torch.bfloat16, "cpu")]
    assert applied == []
    amp = "amp(bf16 weights)"
    for name in (amp, f"channels_last + {amp}", f"compile + {amp}",
                 f"compile + channels_last + {amp} + freezing"):
        assert by[name].reason == ("pruned: autocast bf16 ran at 0.30x fp32 in the probe on "
                                   "this cpu (< 0.8x)"), by[name]
        assert by[name].speedup is None
    assert by["compile + channels_last + freezing"].speedup == pytest.approx(1.0)
    assert report.chosen == "channels_last"
    assert "pruned" in report.table()


def test_compile_is_skipped_when_the_first_compile_says_it_cannot_fit(fakes, monkeypatch) -> None:
    """Compiled candidates are tried fullest first. The first compile takes 30 s (fake clock);
    with 60 s of budget, compiling again (and the winner once more at the end) would not fit:
    the other compiled candidate is skipped, citing the measured time, and the search still
    ends with the final comparison in budget."""
    monkeypatch.setattr(search, "apply_compile", fake(1.0, cost_ms=30_000))
    calls = spy_compare(monkeypatch)
    _, report = optimize(Sleepy(), torch.randn(2, 2, 4, 4), auto=True, amp=False,
                         budget_s=60, **SLEEPY)
    by = rows(report)
    assert by["compile + channels_last + freezing"].setup_s >= 30
    assert by["compile"].reason.startswith("budget: compiling took 30 s")
    assert list(by) == [BASELINE, "channels_last", "compile", "compile + channels_last + freezing"]
    assert calls == [[BASELINE, "channels_last", "compile + channels_last + freezing"]]
    assert report.chosen == "channels_last"
    assert report.search_s <= 60


def test_the_final_comparison_shrinks_to_the_budget_left(fakes, monkeypatch) -> None:
    seen: list[dict[str, Any]] = []
    compare = bench.compare

    def spy(fns: Any, *args: Any, **kwargs: Any) -> bench.Comparison:
        seen.append(kwargs)
        return compare(fns, *args, **kwargs)

    monkeypatch.setattr(search.bench, "compare", spy)
    # each amp candidate costs 9 s to build; 20 ms calls, 20 calls a variant would be 0.4 s
    monkeypatch.setattr(search, "apply_amp", fake(1.0, cost_ms=9_000))
    _, report = optimize(Sleepy(), torch.randn(2, 2, 4, 4), auto=True, compile=False,
                         budget_s=19.0, min_time=0.01, progress=False)
    (kwargs,) = seen
    assert 3 <= kwargs["iters"] < search.FINAL_CALLS  # shortened to what was left
    assert report.search_s <= 19.0


def test_a_transform_with_no_effect_is_no_change_never_chosen() -> None:
    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)  # type: ignore[no-any-return]

    x = torch.randn(2, 4)
    for kwargs, why in (({"channels_last": True}, "channels_last: no Conv2d"),
                        ({"cuda_graphs": True}, "cuda_graphs: ")):
        with pytest.warns(NoEffectWarning):
            _, report = optimize(Dense(), x, **kwargs, **FAST)
        assert report.chosen == BASELINE
        assert not any(step.applied for step in report.steps[1:])
        assert report.headline().startswith(f"optimize (inference): no change ({why}")
        assert "chose" not in report.table()
    with pytest.warns(NoEffectWarning):
        _, report = optimize(Dense(), x, channels_last=True, compile={"backend": "eager"},
                             **FAST)
    assert report.chosen == "compile[eager]"  # channels_last is not in the name
    assert report.best.reason.endswith("no change from channels_last: no Conv2d")
    assert "; no change from channels_last: no Conv2d; search took" in report.headline()
    assert report.unchanged == ("channels_last: no Conv2d",)


def test_without_a_terminal_one_summary_line(capsys) -> None:
    _, report = optimize(TinyCNN(), torch.randn(2, 3, 8, 8), compile={"backend": "eager"},
                         iters=3)
    assert capsys.readouterr().err == report.headline() + "\n"


class GraphRecorder:
    """A compile backend that runs the traced graph and records what it was compiled for."""

    def __init__(self) -> None:
        self.graphs: list[tuple[Any, ...]] = []
        self.__name__ = "recorder"

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.graphs.append(tuple((tuple(v.shape), v.stride(), v.dtype) for v in values
                                 if isinstance(v, torch.Tensor)))
        return gm.forward


def test_the_returned_model_is_the_chosen_transforms_applied_to_a_fresh_copy(monkeypatch
                                                                             ) -> None:
    """In one process, after other models with other shapes were compiled: the model optimize()
    returns compiles the same static graph as the chosen transforms applied alone to a fresh
    copy, once, with no fallback (the issue's slow returned model had a dynamic graph)."""
    recorder = GraphRecorder()
    other = search.apply_compile(nn.Linear(3, 3), backend=recorder)
    with torch.no_grad():
        other(torch.randn(5, 3))
        other(torch.randn(6, 3))  # that model went dynamic; the next ones must not
    chosen = "compile[recorder] + channels_last"
    monkeypatch.setattr(search, "choose", lambda rows, cands, device, uncertain: chosen)  # decided
    monkeypatch.setattr(search, "autocast_speedup", lambda dtype, device="cpu": 1.0)
    base, x = TinyCNN(), torch.randn(2, 3, 8, 8)
    fresh = copy.deepcopy(base).eval()
    model, report = optimize(base, x, auto=True, amp=False, compile={"backend": recorder},
                             **FAST)
    assert report.chosen == chosen
    returned = recorder.graphs[-1]
    search.apply_compile(search.apply_channels_last(fresh), backend=recorder)
    with torch.no_grad():
        fresh(x)
        model(x)  # already compiled by optimize(): no new graph
    assert recorder.graphs[-1] == returned  # same shapes, strides (layout), dtypes
    assert all(isinstance(size, int) for graph in (returned,) for shape, _, _ in graph
               for size in shape)  # static
    assert search.fallbacks(model) == {}
    assert model._compiled_call_impl.compiled is not fresh._compiled_call_impl.compiled
