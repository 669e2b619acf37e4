"""perfsdk run's patches: a real training loop (DataLoader with workers, a model with layers,
backward, SGD and a user-defined optimizer) gets data_wait / forward / backward / optimizer
regions with nothing changed in its code, and removing the patches restores every class."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from perfsdk.cli.patches import RunPatches
from perfsdk.testing import capture


class Slow(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.01)
        return torch.randn(4), torch.tensor(i % 2)


class Plain(torch.optim.Optimizer):
    """A user-defined optimizer class: its own step is wrapped too."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def train(optimizer_cls, workers: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = optimizer_cls(model.parameters(), lr=0.1)
    loader = DataLoader(Slow(), batch_size=4, num_workers=workers)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


CLASSES = {"DataLoader.__iter__": (DataLoader, "__iter__"),
           "Tensor.backward": (torch.Tensor, "backward"),
           "Optimizer.__init__": (torch.optim.Optimizer, "__init__"),
           "Module.__call__": (nn.Module, "__call__"),
           "SGD.step": (torch.optim.SGD, "step"), "Plain.step": (Plain, "step")}


@pytest.mark.parametrize(("optimizer_cls", "workers"), [(torch.optim.SGD, 2), (Plain, 0)])
def test_a_plain_training_loop_gets_its_regions(optimizer_cls, workers) -> None:
    for cls in (torch.optim.SGD, Plain):  # torch hooks a class's step at its first instance
        cls([nn.Parameter(torch.zeros(1))])
    before = {k: owner.__dict__[name] for k, (owner, name) in CLASSES.items()}
    expected = train(optimizer_cls, workers)
    with capture() as cap, RunPatches():
        got = train(optimizer_cls, workers)
    names = [r.name for r in cap.regions]
    assert names.count("step") == 3  # one per batch
    assert names.count("data_wait") == 3
    assert names.count("Sequential.forward") == 3  # the model, not its layers
    assert names.count("backward") == 3
    assert names.count("optimizer") == 3
    assert not [n for n in names if n.startswith(("Linear", "ReLU"))]
    steps = {r.span_id: r for r in cap.regions if r.name == "step"}
    assert sorted(r.attributes["perfsdk.step"] for r in steps.values()) == [0, 1, 2]
    assert all(r.attributes["perfsdk.samples"] == 4 for r in steps.values())
    assert all(r.attributes["perfsdk.samples_per_s"] > 0 for r in steps.values())
    for r in cap.regions:  # each batch's wait and work nest under its step
        if r.name != "step":
            assert r.parent_span_id in steps, r.name
    waits = [r for r in cap.regions if r.name == "data_wait"]
    assert [r.attributes["perfsdk.batch"] for r in waits] == [0, 1, 2]
    assert all(r.error is None for r in cap.regions)
    if not workers:  # each batch is 4 x 10 ms of __getitem__ on this thread
        assert all(r.host_ms >= 39 for r in waits)
    for a, b in zip(got.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # the program computes what it did
    after = {k: owner.__dict__[name] for k, (owner, name) in CLASSES.items()}
    assert after == before


def test_user_errors_propagate_and_regions_close() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("bad input")

    with capture() as cap, RunPatches(), pytest.raises(ValueError, match="bad input"):
        Boom()(torch.ones(1))
    (region,) = cap.regions
    assert region.name == "Boom.forward"
    assert isinstance(region.error, ValueError)


def test_one_backward_region_under_a_torch_function_mode() -> None:
    """With a no_sync_guard on, Tensor.backward calls itself again through
    __torch_function__: still one region."""
    import perfsdk

    model = nn.Linear(4, 2)
    with capture() as cap, RunPatches(), perfsdk.no_sync_guard("count"):
        model(torch.ones(3, 4)).sum().backward()
    assert sorted(r.name for r in cap.regions) == ["Linear.forward", "backward"]
    assert model.weight.grad is not None


@pytest.mark.parametrize("own", ["phase", "timed_region"])
def test_a_script_s_own_backward_and_optimizer_are_not_recorded_twice(own) -> None:
    """A script that already times its backward and optimizer (as a phase or a region of
    those names) keeps its own: perfsdk run adds no second span inside."""
    import perfsdk

    make = perfsdk.phase if own == "phase" else perfsdk.timed_region
    backward, optimizer = make("backward"), make("optimizer")
    model = nn.Linear(4, 2)
    with capture() as cap, RunPatches():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made under the patches: wrapped
        for _ in range(2):
            with perfsdk.step():
                loss = model(torch.ones(3, 4)).sum()
                with backward:
                    loss.backward()
                with optimizer:
                    opt.step()
    names = [r.name for r in cap.regions]
    assert names.count("backward") == names.count("optimizer") == 2
    assert names.count("step") == names.count("Linear.forward") == 2
    outside = [r.name for r in cap.regions if r.name in ("backward", "optimizer")]
    with capture() as cap, RunPatches():  # elsewhere perfsdk run still records them
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    assert sorted(r.name for r in cap.regions) == ["Linear.forward", "backward", "optimizer"]
    assert sorted(outside) == ["backward"] * 2 + ["optimizer"] * 2


def test_installing_twice_is_refused_and_removal_is_idempotent() -> None:
    patches = RunPatches().install()
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            RunPatches().install()
    finally:
        patches.remove()
        patches.remove()
    assert not hasattr(nn.Module.__call__, "__wrapped__")
    with RunPatches():  # installable again
        pass


@pytest.mark.initializes_cuda
def test_a_compiled_model_is_one_graph_under_the_patches() -> None:
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(copy.deepcopy(model), backend=counting)
    x = torch.randn(3, 4)
    with capture() as cap, RunPatches():
        out = compiled(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, model(x))
    assert len(graphs) == 1  # the patched Module.__call__ caused no graph break
    assert [r.name for r in cap.regions] == ["Sequential.forward"]


class _Callback:
    """Stands for a framework integration's callback."""


def test_the_patches_step_aside_while_a_framework_draws_the_steps() -> None:
    """While FRAMEWORK_STEPS is held, a batch starts no step and backward() and step() record
    nothing (the callback's regions time those); the wait and the model's call stay. After
    end(), the same loop gets every region again."""
    from perfsdk.instrumentor import FRAMEWORK_STEPS

    callback = _Callback()
    with RunPatches():
        FRAMEWORK_STEPS.begin(callback)
        try:
            with capture() as framework:
                train(torch.optim.SGD, 0)
        finally:
            FRAMEWORK_STEPS.end(callback)
        with capture() as plain:
            train(torch.optim.SGD, 0)
    names = [r.name for r in framework.regions]
    assert sorted(set(names)) == ["Sequential.forward", "data_wait"]
    assert names.count("Sequential.forward") == names.count("data_wait") == 3
    names = [r.name for r in plain.regions]
    assert {n: names.count(n) for n in set(names)} == {
        "step": 3, "data_wait": 3, "Sequential.forward": 3, "backward": 3, "optimizer": 3}


class Sized(Dataset):
    def __len__(self) -> int:
        return 18  # batches of 4: four full ones, then 2 samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.tensor(i % 2)


def _loop(model: nn.Module, *, explicit: bool = False) -> None:
    import perfsdk

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(Sized(), batch_size=4):
        if explicit:
            perfsdk.step(samples=len(x))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if explicit:
        perfsdk.auto.end_step()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_the_run_counts_one_steps_flops_and_gives_later_steps_theirs(monkeypatch) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from perfsdk.cli.patches import FLOPS_STEP

    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "1e12")
    probe = _model()
    x, y = next(iter(DataLoader(Sized(), batch_size=4)))
    with FlopCounterMode(display=False) as counter:  # one step's forward and backward
        nn.functional.cross_entropy(probe(x), y).backward()
    per_step = counter.get_total_flops()
    assert per_step == 2 * 4 * (4 * 8 + 8 * 2) * 2 + 2 * 4 * 8 * 2  # + grad input of layer 2

    expected = _model()
    _loop(expected)
    got = _model()
    with capture() as cap, RunPatches():
        _loop(got)
    for a, b in zip(got.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # counting changed no result
    steps = sorted(cap.named("step"), key=lambda r: r.attributes["perfsdk.step"])
    assert [r.attributes.get("perfsdk.flops") for r in steps] == [
        None, None, per_step, per_step, per_step / 2]  # the last batch has 2 samples
    counted = steps[FLOPS_STEP]
    assert "perfsdk.flops_per_s" not in counted.attributes  # the counter slowed it down
    for r in steps[FLOPS_STEP + 1:]:
        rate = r.attributes["perfsdk.flops"] / (r.host_ms / 1e3)
        assert r.attributes["perfsdk.flops_per_s"] == pytest.approx(rate, rel=1e-6)
        assert r.attributes["perfsdk.mfu"] == r.attributes["perfsdk.flops_per_s"] / 1e12


def test_the_run_counts_nothing_when_the_script_draws_its_own_steps() -> None:
    with capture() as cap, RunPatches():
        _loop(_model(), explicit=True)
    steps = cap.named("step")
    assert len(steps) >= 5  # the script's five (the first batch came before its first call)
    assert not any("perfsdk.flops" in r.attributes for r in steps)
