"""apply_compile: in place (state_dict keys unchanged), the fallback to eager when compiling
fails, the user's own errors untouched, argument checks, and inductor freezing scoped to the
model. Two real inductor compiles (tiny models); the rest uses cheap or failing backends."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from perfsdk.errors import NoEffectWarning, PerfSDKWarning
from perfsdk.optimize import fallbacks
from perfsdk.optimize.compile import apply_compile

# inductor imports torch.utils.mkldnn, whose torch.jit.script_method warns at import (torch's own)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Counting:
    """A backend that compiles nothing (runs the traced graph) and counts the graphs."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.initializes_cuda
def test_inductor_in_place_keeps_state_dict_keys_and_outputs():
    torch.manual_seed(0)
    model = Tiny().eval()
    keys = list(model.state_dict())
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
    assert apply_compile(model) is model
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert fallbacks(model) == {}
    assert model.__dict__["_perfsdk_applied"]["compile"]["backend"] == "inductor"

    fresh = Tiny()  # the compiled model's state dict loads into an uncompiled one, and back
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(x), expected)
    model.load_state_dict(Tiny().state_dict())


@pytest.mark.parametrize("make", [Tiny, lambda: nn.Sequential(nn.Linear(8, 4), nn.ReLU()),
                                  lambda: nn.Linear(8, 4)], ids=["custom", "Sequential", "Linear"])
def test_every_kind_of_module_is_really_compiled(make):
    """nn.Module.compile() skips torch.nn's own modules (their frames are torch's); ours doesn't."""
    backend = Counting()
    model = make()
    expected = model(torch.ones(2, 8))
    apply_compile(model, backend=backend)
    torch.testing.assert_close(model(torch.ones(2, 8)), expected)
    assert backend.graphs == 1


def test_hooks_run_inside_the_compiled_call():
    backend = Counting()
    model = Tiny()
    seen = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(1))
    apply_compile(model, backend=backend)
    model(torch.ones(2, 8))
    assert seen == [1]
    assert backend.graphs == 1


def test_a_failing_compile_falls_back_to_eager_with_one_warning():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 8)
    expected = model(x)
    apply_compile(model, backend=failing_backend)
    with pytest.warns(PerfSDKWarning, match=r"torch.compile failed for Tiny .*no compiler.*"
                                            r"running eagerly") as record:
        got = model(x)
    assert len(record) == 1
    torch.testing.assert_close(got, expected)
    error = fallbacks(model)["compile"]
    assert isinstance(error, RuntimeError)
    assert "no compiler" in str(error)
    assert fallbacks(copy.deepcopy(model)) == {}  # a copy drops the call wrapper: not compiled
    torch.testing.assert_close(model(x), expected)  # no second warning (filterwarnings=error)
    torch.testing.assert_close(model(torch.randn(7, 8)).shape, torch.Size([7, 4]))


def test_the_users_own_error_propagates_unchanged():
    backend = Counting()
    model = apply_compile(Tiny(), backend=backend)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as excinfo:
        model(torch.randn(3, 5))  # wrong width: fails eagerly too
    assert excinfo.type is RuntimeError  # the eager exception itself, not dynamo's wrapper
    assert excinfo.value.__context__ is None
    assert fallbacks(model) == {}  # still compiled
    model(torch.randn(3, 8))
    assert backend.graphs >= 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "fast"}, "mode='fast'.*'reduce-overhead'"),
    ({"backend": 3}, "backend=3"),
    ({"freezing": True, "backend": "eager"}, "freezing=True needs backend='inductor'"),
    ({"freezing": "yes"}, "freezing='yes'"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"mode": "max-autotune", "backend": "eager", "x": 1}, "backend='inductor'"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    model = Tiny().eval()
    with pytest.raises(ValueError, match=match):
        apply_compile(model, **kwargs)
    assert model._compiled_call_impl is None


def test_freezing_needs_an_eval_model_and_not_a_module_is_rejected():
    with pytest.raises(ValueError, match=r"training mode.*model\.eval"):
        apply_compile(Tiny(), freezing=True)
    with pytest.raises(ValueError, match=r"not an nn\.Module"):
        apply_compile(lambda x: x)  # type: ignore[arg-type]


def test_mode_and_inductor_options_are_combined():
    model = apply_compile(Tiny(), mode="max-autotune-no-cudagraphs", epilogue_fusion=False)
    assert model.__dict__["_perfsdk_applied"]["compile"] == {
        "mode": "max-autotune-no-cudagraphs", "backend": "inductor", "fullgraph": False,
        "dynamic": None, "freezing": False, "epilogue_fusion": False}


def test_compiling_twice_has_no_effect():
    model = apply_compile(Tiny(), backend="eager")
    guard = model._compiled_call_impl
    with pytest.warns(NoEffectWarning, match="already compiled"):
        assert apply_compile(model, backend="eager") is model
    assert model._compiled_call_impl is guard


def test_freezing_is_scoped_to_the_model(monkeypatch):
    import torch._inductor.freezing as freezing_module

    frozen = []
    real_freeze = freezing_module.freeze
    monkeypatch.setattr(freezing_module, "freeze",
                        lambda *a, **k: frozen.append(1) or real_freeze(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        apply_compile(model, freezing=True)
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert frozen == [1]  # inductor froze this model's graph
    assert torch._inductor.config.freezing is False  # and the global setting never changed
    assert model.__dict__["_perfsdk_applied"]["compile"]["freezing"] is True


def test_freezing_warns_for_calls_with_gradients_on():
    model = apply_compile(Tiny().eval(), freezing=True)
    guard = model._compiled_call_impl
    guard.compiled = guard.eager  # no compile needed to see the check
    with pytest.warns(PerfSDKWarning, match=r"freezes only calls made under torch.no_grad"):
        model(torch.ones(1, 8))
    with torch.no_grad():
        model(torch.ones(1, 8))


class ShapeRecorder:
    """A backend that runs the traced graph and records, per graph, whether any input has a
    symbolic (dynamic) size."""

    def __init__(self) -> None:
        self.dynamic: list[bool] = []

    def __call__(self, gm, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.dynamic.append(any(not isinstance(s, int) for v in values
                                if isinstance(v, torch.Tensor) for s in v.shape))
        return gm.forward


def test_each_model_compiles_on_its_own_code_and_stays_static() -> None:
    """The cause of the issue's slow returned model: one shared entry frame made a model's first
    compilation dynamic after another model with other shapes, and past recompile_limit models
    ran eagerly. Each compiled model now has its own code object."""
    recorder = ShapeRecorder()
    other = apply_compile(nn.Linear(5, 3), backend=recorder)
    with torch.no_grad():
        other(torch.randn(7, 5))
        other(torch.randn(2, 5))  # a second shape: only *this* model goes dynamic
    assert recorder.dynamic == [False, True]
    limit = torch._dynamo.config.recompile_limit
    models = [apply_compile(Tiny().eval(), backend=recorder) for _ in range(limit + 2)]
    x = torch.randn(4, 8)
    for model in models:
        with torch.no_grad():
            assert torch.allclose(model(x), model._compiled_call_impl.eager(x))
        assert fallbacks(model) == {}
    # every Tiny compiled once, static, none fell back to eager past the recompile limit
    assert recorder.dynamic[2:] == [False] * len(models)
    names = {m._compiled_call_impl.compiled._torchdynamo_orig_callable.__code__.co_name
             for m in models}
    assert len(names) == len(models)
    assert all(name.startswith("perfsdk_compiled_Tiny_") for name in names)
