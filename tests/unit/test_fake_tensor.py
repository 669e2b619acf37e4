"""The fake CUDA tensor and autograd: gradients through fake CUDA tensors equal the CPU ones,
autograd state answers from the data, host reads still look like syncs, and the snippet that
used to abort the whole process (``c10::Error: not linked with support for cuda devices``)
exits cleanly in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from perfsdk import no_sync_guard
from perfsdk.testing import FakeCudaTensor

ROOT = Path(__file__).resolve().parents[2]


def mlp() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_the_snippet_that_aborted_the_process_exits_cleanly(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from perfsdk.testing import FakeCudaTensor

        model = nn.Linear(8, 4)
        out = model(FakeCudaTensor(torch.randn(4, 8, requires_grad=True)))
        out.sum().backward()
        print("ok", out.device, model.weight.grad is not None)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "cuda:0", "True"]
    assert "c10::Error" not in proc.stderr


def test_gradients_through_fake_cuda_tensors_equal_cpu_gradients():
    model, twin = mlp()
    x = torch.randn(4, 8)
    x_fake = FakeCudaTensor(x.clone().requires_grad_())
    x_ref = x.clone().requires_grad_()
    out = model(x_fake)
    assert isinstance(out, FakeCudaTensor)
    assert out.device == torch.device("cuda", 0)
    assert out.requires_grad
    assert out.grad_fn is not None
    assert not out.is_leaf
    (out.relu() * 3).mean().backward()
    (twin(x_ref).relu() * 3).mean().backward()
    assert isinstance(x_fake.grad, FakeCudaTensor)
    assert x_fake.grad is x_fake.grad  # one wrapper while the gradient stays the same
    torch.testing.assert_close(x_fake.grad.cpu(), x_ref.grad)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_few_training_steps_follow_the_cpu_run():
    model, twin = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        loss = nn.functional.mse_loss(model(FakeCudaTensor(x)), FakeCudaTensor(y))
        assert loss.device.type == "cuda"
        loss.backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(twin(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_autograd_state_answers_from_the_data():
    x = FakeCudaTensor(torch.ones(3))
    assert not x.requires_grad
    x.requires_grad_()
    assert x.requires_grad
    assert x.is_leaf
    assert x.grad is None
    y = x * 2
    y.retain_grad()
    assert y.retains_grad
    seen = []
    hook = x.register_hook(lambda g: seen.append(g.device) or g * 10)
    (y * y).sum().backward()
    hook.remove()
    assert seen == [torch.device("cuda", 0)]
    torch.testing.assert_close(y.grad.cpu(), torch.full((3,), 4.0))
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 80.0))  # hook: times 10
    (g,) = torch.autograd.grad((x ** 2).sum(), x)
    assert isinstance(g, FakeCudaTensor)
    torch.testing.assert_close(g.cpu(), torch.full((3,), 2.0))
    x.grad = None
    assert x.grad is None
    x.requires_grad = False
    assert not x.requires_grad


def test_device_moves_with_gradients():
    x = FakeCudaTensor(torch.randn(3, requires_grad=True))
    host = (x * 2).cpu()
    assert type(host) is torch.Tensor
    assert host.device.type == "cpu"
    assert host.grad_fn is not None  # the copy to the host is part of the graph, as on a GPU
    host.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 2.0))
    y = x * 1
    assert y.to("cpu").device.type == "cpu"
    assert y.cuda() is y
    assert y.to("cuda") is y
    assert y.to(torch.float64).device.type == "cuda"
    assert y.to(torch.float64).dtype == torch.float64
    assert y.to(x).device.type == "cuda"


def test_in_place_calls_with_gradients_give_back_the_callers_objects():
    w = torch.ones(3, requires_grad=True)
    y = FakeCudaTensor(torch.zeros(3)) * 1
    assert y.add_(w) is y
    assert y.requires_grad
    host = torch.zeros(3)
    assert host.add_(y) is host  # a plain tensor given back stays itself, not a fake
    assert type(host) is torch.Tensor
    host.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3))


def test_without_gradients_calls_reach_the_dispatcher_as_cuda_tensors():
    model, _ = mlp()
    x = FakeCudaTensor(torch.randn(2, 8))
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, FakeCudaTensor)
    assert not out.requires_grad
    with torch.inference_mode():
        assert not model(x).requires_grad


def test_host_reads_of_a_tensor_with_history_are_still_syncs():
    model, _ = mlp()
    loss = model(FakeCudaTensor(torch.randn(2, 8))).sum()
    assert loss.requires_grad
    with no_sync_guard("count") as guard:
        loss.item()
        bool(loss > 0)
    assert sorted(site.op for site in guard.report.sites) == ["item", "item"], guard.report
    assert loss.requires_grad  # read from a detached view: the graph is intact
    loss.backward()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_printing(requires_grad):
    x = FakeCudaTensor(torch.tensor([1.5, 2.0], requires_grad=requires_grad))
    assert "device='cuda:0'" in repr(x * 1)
    assert f"{(x * 1).sum():.2f}" == "3.50"
