"""Proof for the model transforms on CPU: apply_amp, apply_channels_last, apply_checkpointing,
set_backends. Each: same outputs (and gradients) as eager fp32 within tolerance, state_dict keys
unchanged and loadable into an untransformed model, no-effect cases warn and return the model
unchanged, bad arguments raise ValueError naming the argument, and the transform really acts
(bfloat16 matmuls, channels-last tensors at the convolution, fewer bytes held for backward)."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import perfsdk.optimize.checkpoint as checkpoint_module
from perfsdk.errors import NoEffectWarning
from perfsdk.optimize._marks import applied, mark
from perfsdk.optimize.amp import apply_amp
from perfsdk.optimize.backends import backend_flags, restore_backends, set_backends
from perfsdk.optimize.channels_last import apply_channels_last
from perfsdk.optimize.checkpoint import apply_checkpointing
from perfsdk.optimize.compile import apply_compile
from perfsdk.testing.models import SimpleNet, encoder, simplenet_inputs

# ---------------------------------------------------------------------------------- helpers


def _simplenet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return SimpleNet(image_size=32), simplenet_inputs(4, 32)[0]


def _encoder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return encoder(d_model=64, layers=2), torch.randn(4, 16, 64, generator=torch.Generator()
                                                      .manual_seed(1))


def _sequential() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)]
    return nn.Sequential(*layers), torch.randn(512, 64)


MODELS = {"simplenet": _simplenet, "encoder": _encoder}


def _eval_out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * weight).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute error relative to the reference's scale (its max magnitude)."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _check_state_dict(model: nn.Module, make: Any) -> None:
    fresh, _ = make()
    assert list(model.state_dict()) == list(fresh.state_dict())
    fresh.load_state_dict(model.state_dict())  # strict: same keys, same shapes
    model.load_state_dict(fresh.state_dict())
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class _LiveBytes(TorchDispatchMode):
    """A real memory consumer on CPU: bytes of tensor storages alive, tracked per operation
    (each op's outputs registered, freed ones dropped by weak reference); ``peak`` is the most
    seen at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                storage = item.untyped_storage()
                self.live[StorageWeakRef(storage).cdata] = (StorageWeakRef(storage),
                                                            storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _memory(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(tensors saved for backward outside checkpoints, peak live bytes of forward+backward)."""
    model.train()
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _LiveBytes() as live:
        model(x).sum().backward()
    return saved[0], live.peak


# ---------------------------------------------------------------------------------- marks


def test_marks_record_and_copy() -> None:
    model = nn.Linear(2, 2)
    assert applied(model) == {}
    mark(model, "amp", dtype="bfloat16")
    record = applied(model)
    record["amp"]["dtype"] = "changed"
    assert applied(model) == {"amp": {"dtype": "bfloat16"}}
    assert "_perfsdk_applied" not in dict(model.state_dict())


# ---------------------------------------------------------------------------------- amp
# Measured here (bf16 autocast vs eager fp32, 2.13 CPU with AMX): outputs, max abs error / max
# |output|: SimpleNet(32) 5.9e-3, encoder(64, 2) 6.5e-3 (eval) / 1.6e-3 (train). Gradients, per
# parameter, ||g - g_ref|| / ||g_ref|| (cosine): SimpleNet worst 0.116 (0.9933) on conv1.weight,
# the earliest layer, after three bf16 convolutions' backward (fc2 0.004); encoder worst 0.045
# (0.9990) on linear1. Largest single-element error / max |grad|: SimpleNet 0.17, encoder 0.24,
# so elementwise bounds are meaningless for bf16 gradients; norms and directions are checked.


@pytest.mark.parametrize("name", list(MODELS))
def test_amp_outputs_and_grads_close_to_fp32(name: str) -> None:
    make = MODELS[name]
    ref_model, x = make()
    model = apply_amp(copy.deepcopy(ref_model))
    out = _eval_out(model, x)
    assert out.dtype == torch.float32
    assert _rel_err(out, _eval_out(ref_model, x)) < 5e-2
    out, grads = _grads(model, x)
    ref_out, ref_grads = _grads(ref_model, x)
    assert _rel_err(out, ref_out) < 5e-2
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        assert grads[key].dtype == torch.float32  # master weights stay float32
        got, ref = grads[key].flatten(), ref_grads[key].flatten()
        assert float((got - ref).norm() / ref.norm()) < 0.15, key
        assert float(nn.functional.cosine_similarity(got, ref, dim=0)) > 0.99, key
    _check_state_dict(model, make)


@pytest.mark.parametrize(("name", "probe"), [("simplenet", "fc1"),
                                             ("encoder", "layers.0.linear1")])
@pytest.mark.parametrize("cast_output", [True, False])
def test_amp_matmuls_run_in_bfloat16(name: str, probe: str, cast_output: bool) -> None:
    model, x = MODELS[name]()
    apply_amp(model, dtype="bf16", cast_output=cast_output)
    seen: list[torch.dtype] = []
    model.get_submodule(probe).register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = _eval_out(model, x)
    assert seen == [torch.bfloat16]
    assert out.dtype == (torch.float32 if cast_output else torch.bfloat16)
    assert applied(model)["amp"] == {"dtype": "bfloat16", "device_type": "cpu",
                                     "cast_output": cast_output, "weights": False, "stored": 0}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast casts per call


@pytest.mark.parametrize("name", sorted(MODELS))
def test_amp_weights_stores_bfloat16_weights_for_inference(name: str) -> None:
    """weights=True: the same outputs as autocast alone (it rounds the same weights), half the
    weight bytes, the same Parameter objects, norms kept in float32, state_dict loadable."""
    make = MODELS[name]
    model, x = make()
    model.eval()
    autocast_only = apply_amp(copy.deepcopy(model))
    params = {n: p for n, p in model.named_parameters()}
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    assert apply_amp(model, weights=True) is model
    assert {n: p for n, p in model.named_parameters()} == params  # same objects (optimizers)
    for pname, p in model.named_parameters():
        norm = isinstance(model.get_submodule(pname.rpartition(".")[0]), nn.LayerNorm)
        assert p.dtype == (torch.float32 if norm else torch.bfloat16), pname
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after < 0.51 * before
    out = _eval_out(model, x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _eval_out(autocast_only, x), rtol=1e-2, atol=1e-3)
    assert _rel_err(out, _eval_out(make()[0], x)) < 5e-2
    record = applied(model)["amp"]
    assert record["weights"] is True
    assert record["stored"] == sum(p.dtype == torch.bfloat16 for p in model.parameters())
    fresh, _ = make()
    assert list(model.state_dict()) == list(fresh.state_dict())
    fresh.load_state_dict(model.state_dict())  # float32 model, bf16 values: cast on load
    for (key, got), want in zip(fresh.state_dict().items(), model.state_dict().values(),
                                strict=True):
        assert got.dtype == torch.float32 or not got.is_floating_point(), key
        assert torch.equal(got, want.to(got.dtype)), key


def test_amp_weights_refuses_a_training_model() -> None:
    model, _ = _simplenet()
    with pytest.raises(ValueError, match=r"weights=True is for inference.*model.eval\(\)"):
        apply_amp(model.train(), weights=True)
    assert applied(model) == {}
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "bf16", "bfloat16", "BF16"])
def test_amp_dtype_spellings(dtype: Any) -> None:
    model = apply_amp(nn.Linear(4, 4), dtype=dtype)
    assert applied(model)["amp"]["dtype"] == "bfloat16"


def test_amp_casts_nested_outputs_back_only_where_autocast_lowered_them() -> None:
    Pair = namedtuple("Pair", "a b")

    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            y = self.lin(x)
            return y, {"y": y, "n": y.argmax(-1)}, [y, x.double()], Pair(y, 3)

    model = apply_amp(Multi())
    y, d, lst, pair = model(torch.randn(2, 4))
    assert y.dtype == d["y"].dtype == lst[0].dtype == pair.a.dtype == torch.float32
    assert d["n"].dtype == torch.int64
    assert lst[1].dtype == torch.float64
    assert isinstance(pair, Pair)
    assert pair.b == 3


def test_amp_without_float_inputs_casts_to_parameter_dtype() -> None:
    model = apply_amp(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)))
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.float32


def test_amp_twice_warns_and_changes_nothing() -> None:
    model, x = _simplenet()
    apply_amp(model)
    forward = model.forward
    before = _eval_out(model, x)
    with pytest.warns(NoEffectWarning, match="already applied"):
        assert apply_amp(model, dtype="bf16") is model
    assert model.forward is forward
    assert torch.equal(_eval_out(model, x), before)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtype": torch.float32}, "dtype=torch.float32.*accepted values"),
    ({"dtype": "int8"}, "dtype='int8'.*'bf16'"),
    ({"dtype": torch.float16}, "dtype=torch.float16.*bfloat16"),
    ({"dtype": "fp16"}, "dtype='fp16'.*CPU"),
    ({"cast_output": "yes"}, "cast_output='yes'"),
    ({"weights": 1}, "weights=1; accepted values are True, False"),
])
def test_amp_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        apply_amp(model, **kwargs)
    assert applied(model) == {}
    assert "forward" not in model.__dict__


@pytest.mark.initializes_cuda
def test_amp_survives_deepcopy_pickle_and_compile() -> None:
    model, x = _simplenet()
    apply_amp(model)
    expected = _eval_out(model, x)
    clone = copy.deepcopy(model)
    assert clone.forward.module is clone  # type: ignore[attr-defined]
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(_eval_out(restored, x), expected)
    apply_compile(clone, backend="eager")  # dynamo traces autocast inside the wrapper
    assert torch.equal(_eval_out(clone, x), expected)
    assert list(clone.state_dict()) == list(SimpleNet(32).state_dict())


# ---------------------------------------------------------------------------------- channels_last


def test_channels_last_converts_weights_and_inputs() -> None:
    ref_model, x = _simplenet()
    model = apply_channels_last(copy.deepcopy(ref_model))
    for conv in (model.conv1, model.conv2, model.conv3):
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    reaching: list[bool] = []
    model.conv1.register_forward_pre_hook(
        lambda m, args: reaching.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    assert x.is_contiguous()
    assert not x.is_contiguous(memory_format=torch.channels_last)
    out = _eval_out(model, x)
    assert reaching == [True]
    assert _rel_err(out, _eval_out(ref_model, x)) < 1e-5  # fp32, reordered sums only
    out, grads = _grads(model, x)
    ref_out, ref_grads = _grads(ref_model, x)
    assert _rel_err(out, ref_out) < 1e-5
    for key in grads:
        assert _rel_err(grads[key], ref_grads[key]) < 1e-4, key
    assert applied(model) == {"channels_last": {"conv2d": 3}}
    _check_state_dict(model, _simplenet)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)  # after loading


def test_channels_last_keeps_parameter_objects() -> None:
    model, _ = _simplenet()
    params = list(model.parameters())  # as an optimizer holds them
    apply_channels_last(model)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


def test_channels_last_without_conv2d_warns_and_changes_nothing() -> None:
    model, x = _encoder()
    before = _eval_out(model, x)
    strides = [p.stride() for p in model.parameters()]
    with pytest.warns(NoEffectWarning, match="no nn.Conv2d"):
        assert apply_channels_last(model) is model
    assert [p.stride() for p in model.parameters()] == strides
    assert not model._forward_pre_hooks
    assert applied(model) == {}
    assert torch.equal(_eval_out(model, x), before)


def test_channels_last_twice_warns() -> None:
    model, _x = _simplenet()
    apply_channels_last(model)
    with pytest.warns(NoEffectWarning, match="already"):
        assert apply_channels_last(model) is model
    assert len(model._forward_pre_hooks) == 1


def test_channels_last_bad_model() -> None:
    with pytest.raises(ValueError, match="model=str"):
        apply_channels_last("net")  # type: ignore[arg-type]


def _stub_comparison(monkeypatch: pytest.MonkeyPatch, medians: dict[str, float]) -> list[Any]:
    """bench.compare as channels_last calls it, with the medians given: it still calls each
    variant once (a hook on the model's conv1, deep-copied with it, records the layout that
    reached each copy's first convolution)."""
    from perfsdk import bench
    from perfsdk.optimize import channels_last as module

    seen: list[Any] = []

    def compare(fns: Any, *args: Any, baseline: str, **kwargs: Any) -> bench.Comparison:
        for fn in fns.values():
            fn(*args)
        results = {name: bench.BenchResult(name, (ms,), ms, ms, ms, ms, ms, 0.0, None, None,
                                           "cpu", 0, 1) for name, ms in medians.items()}
        seen.append((list(fns), baseline, kwargs["min_time"] >= 0.5))
        return bench.Comparison(results, baseline)

    monkeypatch.setattr(module.bench, "compare", compare)
    return seen


def test_channels_last_with_inputs_keeps_it_when_it_measures_faster(monkeypatch) -> None:
    model, x = _simplenet()
    seen = _stub_comparison(monkeypatch, {"contiguous": 10.0, "channels_last": 8.0})
    model.conv1.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NoEffectWarning
        assert apply_channels_last(model, inputs=x) is model
    # the first look (contiguous: a warm-up and a timed call), then both variants, on copies
    assert seen == [False, False, False, True,
                    (["contiguous", "channels_last"], "contiguous", True)]
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert applied(model) == {"channels_last": {"conv2d": 3}}


def test_channels_last_with_inputs_measured_slower_warns_with_the_ratio(monkeypatch) -> None:
    model, x = _simplenet()
    before = [p.stride() for p in model.parameters()]
    _stub_comparison(monkeypatch, {"contiguous": 10.0, "channels_last": 10.0 / 0.9})
    with pytest.warns(NoEffectWarning, match=r"measured 0\.90x the speed of contiguous"):
        assert apply_channels_last(model, example_inputs=(x,)) is model
    assert [p.stride() for p in model.parameters()] == before  # contiguous, unchanged
    assert not model._forward_pre_hooks
    assert applied(model) == {}
    _stub_comparison(monkeypatch, {"contiguous": 10.0, "channels_last": 10.0 / 1.02})
    with pytest.warns(NoEffectWarning, match=r"1\.02x .*kept only from 1\.03x"):
        apply_channels_last(model, inputs=x)  # within noise: not kept either
    with pytest.raises(ValueError, match="inputs"):
        apply_channels_last(model, inputs="images")
    with pytest.raises(ValueError, match="not both"):
        apply_channels_last(model, inputs=x, example_inputs=x)


# ---------------------------------------------------------------------------------- checkpointing

CHECKPOINT_CASES = {
    "simplenet-names": (_simplenet, {"modules": ["conv2", "conv3", "fc1"]}),
    "simplenet-type": (_simplenet, {"modules": nn.Conv2d}),
    "simplenet-segments": (_simplenet, {"segments": 3}),
    "encoder-type": (_encoder, {"modules": nn.TransformerEncoderLayer}),
    "encoder-segments": (_encoder, {"segments": 2}),
    "sequential-segments": (_sequential, {"segments": 3}),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_checkpointing_same_outputs_and_gradients(case: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    make, kwargs = CHECKPOINT_CASES[case]
    ref_model, x = make()
    model = apply_checkpointing(copy.deepcopy(ref_model), **kwargs)
    calls = []
    real = checkpoint_module.checkpoint
    monkeypatch.setattr(checkpoint_module, "checkpoint",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    out, grads = _grads(model, x)
    ref_out, ref_grads = _grads(ref_model, x)
    assert calls
    assert all(k.get("use_reentrant") is False for k in calls)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=0, atol=1e-6)
    calls.clear()
    torch.testing.assert_close(_eval_out(model, x), _eval_out(ref_model, x), rtol=0, atol=1e-6)
    model.train()
    with torch.no_grad():
        model(x)
    assert calls == []  # eval mode and no_grad: the plain forward
    _check_state_dict(model, make)


@pytest.mark.parametrize("case", ["encoder-type", "sequential-segments"])
def test_checkpointing_holds_less_for_backward(case: str) -> None:
    make, kwargs = CHECKPOINT_CASES[case]
    ref_model, x = make()
    if case.startswith("encoder"):
        x = torch.randn(8, 128, 64)  # activations (attention scores) well above the weights
    model = apply_checkpointing(copy.deepcopy(ref_model), **kwargs)
    saved, peak = _memory(model, x)
    ref_saved, ref_peak = _memory(ref_model, x)
    assert saved < ref_saved
    # measured peak (forward + backward, activations and grads): encoder, 8x128 tokens,
    # 9.20 MB -> 6.27 MB; Sequential of 6 MLP blocks in 3 segments, 8.32 MB -> 4.26 MB
    assert peak < ref_peak * (0.8 if case == "encoder-type" else 0.6)


def test_checkpointing_records_what_it_wrapped() -> None:
    model, _ = _encoder()
    apply_checkpointing(model, modules=["layers.0"])
    apply_checkpointing(model, modules="layers.1")  # one string is one name
    assert applied(model)["checkpointing"] == {"segments": None,
                                               "modules": ["layers.0", "layers.1"]}
    seq, _ = _sequential()
    apply_checkpointing(seq, segments=2)
    assert applied(seq)["checkpointing"] == {"segments": 2, "modules": [""]}


def test_checkpointing_composes_with_amp_on_a_sequential(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _sequential()
    apply_amp(model)
    apply_checkpointing(model, segments=2)
    apply_checkpointing(model, modules=["0"])  # nested inside a segment: allowed
    calls = []
    real = checkpoint_module.checkpoint
    monkeypatch.setattr(checkpoint_module, "checkpoint",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out, _ = _grads(model, x)
    # two segments + layer 0 in the forward, layer 0 again when segment 1 is recomputed
    assert out.dtype == torch.float32
    assert len(calls) == 4
    assert seen
    assert set(seen) == {torch.bfloat16}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "exactly one of segments= .* modules="),
    ({"segments": 2, "modules": ["conv1"]}, "exactly one of segments= .* modules="),
    ({"segments": 0}, "segments=0"),
    ({"segments": True}, "segments=True"),
    ({"segments": 2.0}, "segments=2.0"),
    ({"segments": 99}, "segments=99 .* 1 to 7"),
    ({"modules": ["conv1", "nope"]}, "'nope'.*valid names include 'conv1'"),
    ({"modules": [3]}, "modules=\\[3\\]"),
    ({"modules": int}, "modules=int"),
])
def test_checkpointing_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    model, _ = _simplenet()
    with pytest.raises(ValueError, match=match):
        apply_checkpointing(model, **kwargs)
    assert applied(model) == {}
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(("make", "kwargs"), [
    (_simplenet, {"modules": nn.LSTM}),
    (_simplenet, {"modules": []}),
    (lambda: (nn.ReLU(), torch.randn(2, 3)), {"segments": 1}),
])
def test_checkpointing_nothing_selected_warns(make: Any, kwargs: dict[str, Any]) -> None:
    model, _x = make()
    with pytest.warns(NoEffectWarning, match="nothing was selected"):
        assert apply_checkpointing(model, **kwargs) is model
    assert applied(model) == {}
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("case", ["simplenet-type", "encoder-segments", "sequential-segments"])
def test_checkpointing_twice_warns_and_changes_nothing(case: str) -> None:
    make, kwargs = CHECKPOINT_CASES[case]
    model, _x = make()
    apply_checkpointing(model, **kwargs)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    with pytest.warns(NoEffectWarning, match="already checkpointed"):
        assert apply_checkpointing(model, **kwargs) is model
    assert forwards == {n: m.__dict__.get("forward") for n, m in model.named_modules()}


def test_checkpointing_survives_deepcopy() -> None:
    model, x = _encoder()
    apply_checkpointing(model, modules=nn.TransformerEncoderLayer)
    clone = copy.deepcopy(model)
    assert clone.layers[0].forward.module is clone.layers[0]  # type: ignore[attr-defined]
    torch.testing.assert_close(_grads(clone, x)[1], _grads(model, x)[1], rtol=0, atol=0)


# ---------------------------------------------------------------------------------- backends


@pytest.fixture
def _restore_flags() -> Any:
    flags = backend_flags()
    yield
    restore_backends(flags)


@pytest.mark.usefixtures("_restore_flags")
@pytest.mark.parametrize("value", [True, False])
def test_set_backends_sets_and_restores(value: bool) -> None:
    initialized = torch.cuda.is_initialized()  # on a GPU machine, an earlier test may have
    start = backend_flags()
    previous = set_backends(cudnn_benchmark=value, tf32=value)
    assert previous == start
    assert backend_flags() == {"cudnn_benchmark": value, "matmul_allow_tf32": value,
                               "cudnn_allow_tf32": value,
                               "float32_matmul_precision": "high" if value else "highest"}
    restore_backends(previous)
    assert backend_flags() == start
    assert set_backends() == start
    assert backend_flags() == start
    assert torch.cuda.is_initialized() == initialized  # setting flags initializes nothing


@pytest.mark.usefixtures("_restore_flags")
def test_backend_flags_after_new_tf32_api() -> None:
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the legacy getters now refuse
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]
    flags = backend_flags()
    assert flags["matmul_allow_tf32"]
    assert flags["float32_matmul_precision"] == "high"
    set_backends(tf32=False)
    assert backend_flags()["matmul_allow_tf32"] is False
    restore_backends(flags)  # through the legacy setters: the legacy getters answer again
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize(("call", "match"), [
    (lambda: set_backends(cudnn_benchmark="yes"), "cudnn_benchmark='yes'"),
    (lambda: set_backends(tf32=1.0), "tf32=1.0"),
    (lambda: restore_backends({"tf33": True}), "tf33"),
    (lambda: restore_backends({"cudnn_allow_tf32": None}), "cudnn_allow_tf32"),
    (lambda: restore_backends({"float32_matmul_precision": "low"}), "'low'"),
])
def test_backends_bad_arguments(call: Any, match: str) -> None:
    start = backend_flags()
    with pytest.raises(ValueError, match=match):
        call()
    assert backend_flags() == start
