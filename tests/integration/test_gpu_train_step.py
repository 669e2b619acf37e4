"""On a real GPU: TrainStep with float16 autocast and a GradScaler. An overflowing scale skips
the step and backs off, a good step lets it grow, the loss stays finite and training converges;
the step's regions get device times.

Skipped without CUDA (PERFSDK_REQUIRE_GPU=1 turns the skip into a failure on GPU runners).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from perfsdk.optimize.train_step import TrainStep
from perfsdk.testing import capture

pytestmark = pytest.mark.gpu


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(32, 16, device="cuda", generator=gen)
    return x, x[:, :4] * 0.5 + 0.1  # a target the model can learn


def params(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def test_fp16_creates_a_grad_scaler_and_runs_in_half_precision():
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      amp="fp16", clip_grad=1.0)
    assert isinstance(train.scaler, torch.amp.GradScaler)
    assert train.scaler.is_enabled()
    x, y = batch(0)
    loss = train(x, target=y)
    assert seen == [torch.float16]  # autocast reached the model
    assert loss.device.type == "cuda"
    assert loss.dtype == torch.float32  # mse_loss runs in float32 under autocast
    assert math.isfinite(float(loss))
    assert train.step_count == 1


def test_an_overflowing_scale_skips_the_step_and_backs_off():
    model = make_model()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40, growth_interval=1000)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      amp="fp16", scaler=scaler)
    before = params(model)
    x, y = batch(0)
    loss = train(x, target=y)
    assert math.isfinite(float(loss))  # the loss is fine; its scaled gradients overflow fp16
    assert scaler.get_scale() == 2.0**39  # backed off by backoff_factor=0.5
    assert torch.equal(params(model), before)  # the optimizer step was skipped
    for i in range(1, 40):  # each overflow halves the scale until the gradients fit
        x, y = batch(i)
        loss = train(x, target=y)
        assert math.isfinite(float(loss))
        if not torch.equal(params(model), before):
            break
    else:
        pytest.fail(f"no step taken; scale still {scaler.get_scale()}")
    assert scaler.get_scale() < 2.0**39
    assert torch.isfinite(params(model)).all()


def test_good_steps_grow_the_scale():
    model = make_model()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**4, growth_interval=1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), F.mse_loss,
                      amp="fp16", scaler=scaler)
    for i in range(3):
        x, y = batch(i)
        before = params(model)
        assert math.isfinite(float(train(x, target=y)))
        assert not torch.equal(params(model), before)  # every step taken
        assert scaler.get_scale() == 2.0 ** (5 + i)  # growth_factor=2 after each good step


def test_fp16_training_converges_with_finite_losses():
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      amp="fp16", read_every=10)
    x, y = batch(100)
    first = float(F.mse_loss(model(x), y).detach())
    for _ in range(200):
        train(x, target=y)
    final = float(F.mse_loss(model(x), y).detach())
    assert math.isfinite(final)
    assert final < first / 2, (first, final)
    assert len(train.logged) == 20
    assert all(math.isfinite(v) for v in train.logged)
    assert train.scaler.get_scale() > 1.0


def test_train_step_regions_have_device_time():
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      amp="fp16")
    with capture() as cap:
        for i in range(3):
            x, y = batch(i)
            train(x, target=y)
    for name in ("train.forward", "train.backward", "train.optimizer"):
        regions = cap.named(name)
        assert len(regions) == 3, name
        assert all(r.device_ms is not None and r.device_ms > 0 for r in regions), name
