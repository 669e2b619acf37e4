"""TrainStep: accumulation equals one large batch, DDP no_sync, AMP and the scaler, clipping
order, regions, and no host-device sync on the hot path."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import perfsdk
from perfsdk.errors import PerfSDKWarning
from perfsdk.optimize.train_step import TrainStep
from perfsdk.testing import capture


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=gen), torch.randn(size, 3, generator=gen))
            for _ in range(n)]


# -- the proof: accumulation == one large batch --------------------------------------------------
def test_accumulation_equals_one_large_batch():
    micro = batches(4, 8)
    big_x = torch.cat([x for x, _ in micro])
    big_y = torch.cat([y for _, y in micro])

    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(big_x), big_y).backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_opt.step()

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[torch.Tensor]] = []
    step_fn = opt.step

    def recording_step(*args, **kwargs):
        seen.append([p.grad.clone() for p in model.parameters()])
        return step_fn(*args, **kwargs)

    opt.step = recording_step  # type: ignore[method-assign]
    train = TrainStep(model, opt, F.mse_loss, accumulate=4)
    for i, (x, y) in enumerate(micro):
        train(x, target=y)
        assert train.step_count == (1 if i == 3 else 0)
    assert len(seen) == 1
    for got, want in zip(seen[0], ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    # the step's loss is the mean over its micro-batches, i.e. the large batch's loss
    with torch.no_grad():
        big_loss = sum(F.mse_loss(make_model()(x), y) for x, y in micro) / 4
    assert train.loss_history() == pytest.approx([float(big_loss)], abs=1e-6)


def test_counts_and_returned_loss_is_undivided_and_detached():
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), F.mse_loss,
                      accumulate=3)
    x, y = batches(1, 4)[0]
    with torch.no_grad():
        want = F.mse_loss(model(x), y)
    for _ in range(7):
        loss = train(x, target=y)
    assert not loss.requires_grad
    assert loss.device.type == "cpu"
    torch.testing.assert_close(loss, want)
    assert (train.step_count, train.micro_step) == (2, 7)
    assert len(train.loss_history()) == 2
    assert "accumulate=3" in repr(train)
    assert "steps=2" in repr(train)


def test_failed_forward_does_not_count_as_a_micro_step():
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      accumulate=2)
    x, y = batches(1, 4)[0]
    with pytest.raises(RuntimeError):
        train(torch.randn(4, 5), target=y)  # wrong width: the user's error, unchanged
    assert train.micro_step == 0
    train(x, target=y)
    train(x, target=y)
    assert (train.step_count, train.micro_step) == (1, 2)


def test_loss_history_is_bounded(monkeypatch):
    monkeypatch.setattr(TrainStep, "max_history", 3)
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), F.mse_loss)
    data = batches(5, 4)
    for x, y in data:
        train(x, target=y)
    with torch.no_grad():
        want = [float(F.mse_loss(model(x), y)) for x, y in data[-3:]]
    assert train.loss_history() == pytest.approx(want, abs=1e-6)
    assert TrainStep(model, torch.optim.SGD(model.parameters()), F.mse_loss).loss_history() == []


# -- DDP: no all-reduce on micro-batches that do not step ----------------------------------------
class FakeDDP(nn.Module):
    """Exposes no_sync() like DistributedDataParallel and records when forward runs in it."""

    def __init__(self) -> None:
        super().__init__()
        self.module = make_model()
        self.entries = 0
        self.inside = False
        self.forwards: list[bool] = []

    @contextlib.contextmanager
    def no_sync(self):
        self.entries += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, x):
        self.forwards.append(self.inside)
        return self.module(x)


def test_no_sync_on_all_but_the_stepping_micro_batch():
    model = FakeDDP()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      accumulate=4)
    for x, y in batches(8, 4):
        train(x, target=y)
    assert model.entries == 6
    assert model.forwards == [True, True, True, False] * 2
    model = FakeDDP()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    for x, y in batches(3, 4):
        train(x, target=y)
    assert model.entries == 0  # accumulate=1: every call steps, no_sync is never needed


@pytest.fixture
def gloo_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a default process group already exists")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_real_ddp_all_reduces_once_per_optimizer_step(gloo_group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def ddp_with_counter():
        ddp = nn.parallel.DistributedDataParallel(make_model())
        calls = [0]

        def hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        return ddp, calls

    ddp, calls = ddp_with_counter()
    train = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), F.mse_loss, accumulate=4)
    data = batches(8, 4)
    for x, y in data:
        train(x, target=y)
    assert train.step_count == 2
    assert calls[0] == 2  # one all-reduce per optimizer step, not per micro-batch

    naive, naive_calls = ddp_with_counter()  # the mistake TrainStep avoids
    for x, y in data:
        (F.mse_loss(naive(x), y) / 4).backward()
    assert naive_calls[0] == 8

    ref = make_model()  # and the result is the single-process one (world size 1)
    ref_train = TrainStep(ref, torch.optim.SGD(ref.parameters(), lr=0.1), F.mse_loss,
                          accumulate=4)
    for x, y in data:
        ref_train(x, target=y)
    for got, want in zip(ddp.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# -- AMP, the scaler, clipping --------------------------------------------------------------------
@pytest.mark.parametrize("amp", ["bf16", "bfloat16", torch.bfloat16])
def test_bf16_autocast_on_cpu_without_scaler(amp):
    model = make_model()
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    before = [p.detach().clone() for p in model.parameters()]
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, amp=amp)
    assert train.dtype is torch.bfloat16
    assert train.scaler is None
    x, y = batches(1, 8)[0]
    loss = train(x, target=y)
    assert seen == [torch.bfloat16]
    assert math.isfinite(float(loss))
    assert all(p.dtype is torch.float32 for p in model.parameters())  # master weights stay fp32
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("amp", [None, "fp32", "float32", torch.float32])
def test_fp32_means_no_autocast(amp):
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters()), F.mse_loss, amp=amp)
    assert train.dtype is None
    assert train.scaler is None


@pytest.mark.parametrize("amp", ["fp16", "float16", torch.float16])
def test_fp16_on_cpu_needs_an_explicit_scaler(amp):
    model = make_model()
    with pytest.raises(ValueError, match=r"amp=.*CUDA.*bf16"):
        TrainStep(model, torch.optim.SGD(model.parameters()), F.mse_loss, amp=amp)


class RecordingScaler:
    """A real GradScaler('cpu') that logs the order of its calls."""

    def __init__(self, log: list[str]) -> None:
        self.real = torch.amp.GradScaler("cpu", init_scale=1024.0)
        self.log = log

    def scale(self, loss):
        self.log.append("scale")
        return self.real.scale(loss)

    def unscale_(self, optimizer):
        self.log.append("unscale_")
        self.real.unscale_(optimizer)

    def step(self, optimizer):
        self.log.append("step")
        return self.real.step(optimizer)

    def update(self):
        self.log.append("update")
        self.real.update()


def test_fp16_with_scaler_unscales_before_clipping(monkeypatch):
    log: list[str] = []
    model = make_model()
    real_clip = torch.nn.utils.clip_grad_norm_
    norms: list[float] = []

    def clip(params, max_norm, *args, **kwargs):
        params = list(params)
        log.append("clip")
        norms.append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))))
        return real_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    scaler = RecordingScaler(log)
    with pytest.warns(PerfSDKWarning, match="float16 autocast on CPU is slow"):
        train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                          amp="fp16", scaler=scaler, clip_grad=0.5, accumulate=2)
    assert train.dtype is torch.float16
    assert train.scaler is scaler
    data = batches(2, 8)
    for x, y in data:
        train(x, target=y)
    assert log == ["scale", "scale", "unscale_", "clip", "step", "update"]
    # the clipped norm is the true (unscaled) one: compare with an fp32 run of the same data
    ref = make_model()
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(ref(x), y) / 2
        loss.backward()
    want = float(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()])))
    assert norms[0] == pytest.approx(want, rel=1e-2)
    assert norms[0] < 1000  # not the 1024x-scaled norm


def test_clip_grad_limits_the_update():
    model = make_model()
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1.0), F.mse_loss,
                      clip_grad=1e-3)
    x, y = batches(1, 8)[0]
    train(x, target=y * 100)
    moved = torch.nn.utils.parameters_to_vector(model.parameters()).detach() - before
    assert float(moved.norm()) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.gpu
def test_fp16_on_cuda_creates_a_grad_scaler():
    model = make_model().cuda()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      amp="fp16", clip_grad=1.0)
    assert isinstance(train.scaler, torch.amp.GradScaler)
    x, y = batches(1, 8)[0]
    loss = train(x.cuda(), target=y.cuda())
    assert loss.device.type == "cuda"
    assert math.isfinite(float(loss))
    assert train.step_count == 1


# -- regions ---------------------------------------------------------------------------------
def test_regions_for_forward_backward_optimizer():
    model = make_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      accumulate=2)
    with capture() as cap:
        for x, y in batches(4, 4):
            train(x, target=y)
    assert len(cap.named("train.forward")) == 4
    assert len(cap.named("train.backward")) == 4
    assert len(cap.named("train.optimizer")) == 2
    quiet = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                      regions=False)
    with capture() as cap:
        for x, y in batches(2, 4):
            quiet(x, target=y)
    assert not [r for r in cap.regions if r.name.startswith("train.")]


# -- no .item() on the hot path --------------------------------------------------------------
def run_steps(read_every: int, steps: int = 10, **kwargs):
    model = make_model()
    logs: list[tuple[int, float]] = []
    train = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), F.mse_loss,
                      amp="bf16", clip_grad=1.0, accumulate=2, read_every=read_every,
                      on_log=lambda step, value: logs.append((step, value)), **kwargs)
    data = batches(2 * steps, 4)
    with perfsdk.no_sync_guard("count", assume_device=True) as guard:
        for x, y in data:
            train(x, target=y)
    return train, guard.report, logs


def test_no_host_device_sync_per_step():
    train, report, logs = run_steps(read_every=0)
    assert train.step_count == 10
    assert report.total == 0, str(report)
    assert logs == []
    assert train.logged == []


def test_read_every_reads_once_per_k_steps():
    train, report, logs = run_steps(read_every=5)
    assert report.total == 2, str(report)
    # reported at the caller's line, through TrainStep's own read
    assert all(site.via.rpartition(":")[0].endswith(os.path.join("optimize", "train_step.py"))
               for site in report.sites)
    history = train.loss_history()
    want = [sum(history[:5]) / 5, sum(history[5:]) / 5]
    assert train.logged == pytest.approx(want, rel=1e-5)
    assert [step for step, _ in logs] == [5, 10]
    assert [value for _, value in logs] == train.logged


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"accumulate": 0}, "accumulate"),
    ({"accumulate": 1.5}, "accumulate"),
    ({"accumulate": True}, "accumulate"),
    ({"clip_grad": 0}, "clip_grad"),
    ({"clip_grad": -1.0}, "clip_grad"),
    ({"clip_grad": float("nan")}, "clip_grad"),
    ({"clip_grad": "1"}, "clip_grad"),
    ({"read_every": -1}, "read_every"),
    ({"amp": "int8"}, r"amp=.*accepted values.*bf16"),
    ({"amp": torch.int8}, r"amp=.*accepted values"),
    ({"on_log": 3}, "on_log"),
])
def test_validation_names_the_argument(kwargs, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        TrainStep(model, torch.optim.SGD(model.parameters()), F.mse_loss, **kwargs)


def test_validation_of_model_and_loss_fn():
    model = make_model()
    with pytest.raises(ValueError, match="model"):
        TrainStep(lambda x: x, torch.optim.SGD(model.parameters()), F.mse_loss)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_fn"):
        TrainStep(model, torch.optim.SGD(model.parameters()), "mse")  # type: ignore[arg-type]
