"""instrument_ddp on a real DDP model in a one-process gloo group (a FileStore in tmp_path): one
``ddp.all_reduce`` region of category ``collective`` per bucket per backward, nested in the
step; a user's hook is wrapped (it runs: its scaling shows in the gradients), given here or
registered after; a hook registered before, or a built-in one, is refused naming the fix; the
hook called on a thread with no current region nests under the model's forward; what a bucket
region measures, with a fake clock and a fake GPU; ``perfsdk run``'s patches instrument a DDP
model they see called. And stragglers() counts overlapping collectives once."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import perfsdk
from perfsdk import distributed
from perfsdk.distributed import DDP_REGION, instrument_ddp, stragglers
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import Capture, FakeCuda, capture, use_fake_clock

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("ddp") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        distributed._from_group = None  # the next tests' regions carry no rank


def make_ddp(bucket_cap_mb: float | None = 0.00001) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)


def train(model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        with perfsdk.step():
            model(torch.ones(2, 4)).sum().backward()


def buckets(model: nn.parallel.DistributedDataParallel) -> int:
    return len(model.reducer._get_zeros_like_grad_buckets())


def ddp_regions(cap: Capture) -> list[Any]:
    """The ddp.all_reduce regions recorded so far: each bucket's region is ended by the
    callback whose future DDP waits for, so all are in once ``backward()`` has returned."""
    PIPELINE.drain(wait=True)
    return [r for r in cap.regions if r.name == DDP_REGION]


def test_one_collective_region_per_bucket_nested_in_the_step(group: None) -> None:
    model = instrument_ddp(make_ddp())
    train(model, 2)  # DDP's first backward reduces one bucket; the next forward rebuilds them
    n = buckets(model)
    assert n > 1
    with capture() as cap:
        train(model, 3)
        found = ddp_regions(cap)
    steps = {r.span_id: r for r in cap.regions if r.name == "step"}
    assert len(steps) == 3
    assert len(found) == 3 * n
    for step in steps.values():  # each backward: every bucket once
        mine = [r for r in found if r.parent_span_id == step.span_id]
        assert sorted(r.attributes["perfsdk.ddp.bucket"] for r in mine) == list(range(n))
    for r in found:
        assert r.attributes["perfsdk.category"] == "collective"
        assert r.attributes["perfsdk.ddp.comm_hook"] == "allreduce"
        assert r.attributes["perfsdk.ddp.bucket_bytes"] > 0
        assert r.trace_id == steps[r.parent_span_id].trace_id
        assert r.start_ns >= steps[r.parent_span_id].start_ns
        assert r.error is None


def test_the_default_hook_reduces_as_ddp_does(group: None) -> None:
    plain, instrumented = make_ddp(), instrument_ddp(make_ddp())
    with capture() as cap:
        for model in (plain, instrumented):
            train(model, 2)
        assert len(ddp_regions(cap)) == 1 + buckets(instrumented)
    for a, b in zip(plain.parameters(), instrumented.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def doubling(calls: list[int]) -> Any:
    def double_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        calls.append(bucket.index())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer() * state)
        return fut
    return double_hook


@pytest.mark.parametrize("how", ["argument", "registered_after"])
def test_a_users_hook_is_wrapped_and_runs(group: None, how: str) -> None:
    plain, model = make_ddp(bucket_cap_mb=None), make_ddp(bucket_cap_mb=None)
    calls: list[int] = []
    if how == "argument":
        instrument_ddp(model, hook=doubling(calls), state=2.0)
    else:
        instrument_ddp(model)
        model.register_comm_hook(2.0, doubling(calls))
    with capture() as cap:
        train(model, 1)
        train(plain, 1)
        found = ddp_regions(cap)
    assert len(calls) == len(found) == 1
    assert found[0].attributes["perfsdk.ddp.comm_hook"].endswith("double_hook")
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(b.grad, 2 * a.grad)  # the user's hook did the reduction
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(None, doubling(calls))  # as DDP refuses a second hook


def test_instrumenting_twice_records_each_bucket_once(group: None) -> None:
    model = make_ddp(bucket_cap_mb=None)
    assert instrument_ddp(instrument_ddp(model)) is model
    with capture() as cap:
        train(model, 1)
        assert len(ddp_regions(cap)) == 1


def test_a_hook_registered_before_is_refused_naming_the_fix(group: None) -> None:
    model = make_ddp()
    model.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match=r"instrument_ddp\(model, hook=allreduce_hook"):
        instrument_ddp(model)
    builtin = make_ddp()
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(RuntimeError, match="DDP refused perfsdk's communication hook"):
        instrument_ddp(builtin)


def test_bad_arguments_are_named(group: None) -> None:
    with pytest.raises(ValueError, match="model is a Linear"):
        instrument_ddp(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hook=3"):
        instrument_ddp(make_ddp(), hook=3)  # type: ignore[arg-type]


def test_disabled_records_nothing_and_still_reduces(group: None) -> None:
    plain, model = make_ddp(), instrument_ddp(make_ddp())
    perfsdk.configure(enabled=False)
    with capture() as cap:
        train(model, 2)
        train(plain, 2)
    assert cap.regions == []
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


class FakeBucket:
    """A GradBucket's surface the hook reads."""

    def __init__(self, index: int = 0) -> None:
        self._index = index

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return torch.zeros(6)


def pending_hook(futures: list[torch.futures.Future[torch.Tensor]]) -> Any:
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        futures.append(fut)
        return fut
    return hook


def our_hook(model: nn.parallel.DistributedDataParallel) -> Any:
    (hook, _), = model._comm_hooks
    return hook


@pytest.mark.usefixtures("no_cuda")  # on the CPU: host time only, on a GPU machine too
def test_a_bucket_region_runs_from_the_call_to_the_futures_completion(group: None) -> None:
    futures: list[torch.futures.Future[torch.Tensor]] = []
    model = instrument_ddp(make_ddp(), hook=pending_hook(futures))
    hook = our_hook(model)
    with use_fake_clock() as clock, capture() as cap:
        with perfsdk.step():
            returned = hook(None, FakeBucket(3))
            clock.advance(7)  # the all-reduce in flight: the wait
            assert not returned.done()
            futures[0].set_result(torch.ones(6))  # completes: the callback ends the region
            clock.advance(1)
            assert returned.done()
            assert returned.value().tolist() == [1.0] * 6
        failing = hook(None, FakeBucket(4))
        futures[1].set_exception(RuntimeError("peer gone"))
        with pytest.raises(RuntimeError, match="peer gone"):
            failing.wait()  # DDP sees the reduction's error unchanged
    done, failed = sorted((r for r in cap.regions if r.name == DDP_REGION),
                          key=lambda r: r.attributes["perfsdk.ddp.bucket"])
    assert done.host_ms == 7.0
    assert done.attributes["perfsdk.ddp.bucket_bytes"] == 24
    assert done.error is None
    assert done.device_ms is None
    assert isinstance(failed.error, RuntimeError)
    assert "peer gone" in str(failed.error)


def test_on_a_gpu_the_bucket_has_device_time_and_nothing_waits(group: None,
                                                                fake_cuda: FakeCuda) -> None:
    futures: list[torch.futures.Future[torch.Tensor]] = []
    model = instrument_ddp(make_ddp(), hook=pending_hook(futures))
    hook = our_hook(model)
    with capture() as cap:
        hook(None, FakeBucket())  # start event: the bucket is ready on the stream
        fake_cuda.launch(5.0)  # the all-reduce on the device
        futures[0].set_result(torch.zeros(6))  # end event, behind the all-reduce
        PIPELINE.drain(wait=False)
        assert cap.regions == []  # its device time is not known yet, and nothing waited
        fake_cuda.complete_all()
    (r,) = cap.regions
    assert r.device_ms == 5.0
    assert fake_cuda.sync_calls == []


def test_a_hook_called_on_a_thread_without_context_nests_under_the_forward(group: None) -> None:
    """CUDA's autograd threads call the hook without the training thread's context."""
    futures: list[torch.futures.Future[torch.Tensor]] = []
    model = instrument_ddp(make_ddp(), hook=pending_hook(futures))
    hook = our_hook(model)

    def elsewhere() -> None:
        hook(None, FakeBucket())
        futures[-1].set_result(torch.zeros(6))

    with capture() as cap, perfsdk.step() as step:
        region = step.region
        model(torch.ones(2, 4))  # the forward notes the current region: the step
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        with perfsdk.timed_region("forward"):
            model(torch.ones(2, 4))  # now the forward region, which ends before backward
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
    assert region is not None
    found = [r for r in cap.regions if r.name == DDP_REGION]
    assert [r.parent_span_id for r in found] == [region.span_id] * 2


def test_perfsdk_run_instruments_a_ddp_model_it_sees(group: None) -> None:
    from perfsdk.cli.patches import RunPatches

    model = make_ddp()
    with capture() as cap, RunPatches():
        for _ in range(2):
            with perfsdk.step():
                model(torch.ones(2, 4)).sum().backward()
        found = ddp_regions(cap)
    assert len(found) == 1 + buckets(model)  # instrumented once: each bucket once
    backward = {r.span_id for r in cap.regions if r.name == "backward"}
    assert {r.parent_span_id for r in found} <= backward  # in `backward`, in the step


def test_perfsdk_run_leaves_a_model_with_its_own_hook_as_it_is(group: None) -> None:
    from perfsdk.cli.patches import RunPatches

    model = make_ddp()
    calls: list[int] = []
    model.register_comm_hook(1.0, doubling(calls))
    with capture() as cap, RunPatches(), pytest.warns(UserWarning, match="not recorded"):
        model(torch.ones(2, 4)).sum().backward()
    assert calls == [0]
    assert [r for r in cap.regions if r.name == DDP_REGION] == []


_ids = itertools.count(1)


def test_overlapping_collectives_count_once_in_a_step() -> None:
    """DDP's buckets are in flight together: the wait is the time any one of them was."""
    def region(name: str, start: int, end: int, parent: int = 0, **attrs: Any) -> Any:
        return SimpleNamespace(name=name, host_ms=(end - start) / 1e6, span_id=next(_ids),
                               parent_span_id=parent, attributes=attrs, start_ns=start,
                               end_ns=end)

    ms = 1_000_000
    regions = []
    for rank, waits in ((0, [(10, 50), (20, 52), (60, 61)]), (1, [(49, 51), (50, 52)])):
        step = region("step", 0, 70 * ms, **{"perfsdk.step": 0, "perfsdk.rank": rank})
        regions.append(step)
        regions += [region(DDP_REGION, a * ms, b * ms, step.span_id,
                           **{"perfsdk.category": "collective"}) for a, b in waits]
    (r,) = stragglers(regions)
    assert r.busy_ms_by_rank == {0: 70.0 - 43.0, 1: 70.0 - 3.0}
    assert r.slowest_rank == 1



def test_ddps_python_reducer_pairs_are_reduced_unrecorded(group: None) -> None:
    """Under compiled autograd DDP's Python reducer calls the hook with (grad, param) and
    ignores what it returns: perfsdk's default reduces the gradient as DDP does without a
    hook, and records nothing."""
    model = instrument_ddp(make_ddp())
    param = next(model.parameters())
    grad = torch.arange(16.0).reshape(4, 4)
    with capture() as cap:
        assert our_hook(model)(None, (grad, param)) is None
    torch.testing.assert_close(grad, torch.arange(16.0).reshape(4, 4))  # one rank: the mean
    assert cap.regions == []
