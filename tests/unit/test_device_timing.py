"""Device timing on the fake CUDA backend: nothing resolves early, device_ms is exact, events go
back to the pool, and the non-sync flow makes no synchronizing call at all."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import time
from pathlib import Path

import pytest
import torch

import perfsdk
from perfsdk import _device, clocks, profiled, timed_region
from perfsdk.errors import counts
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import FakeCuda, FakeDeviceProperties, FakeEvent, FakeStream, use_fake_cuda
from tests.signatures import assert_stands_in, params
from tests.waiting import one_pipeline_round, wait_until


def pending():
    """Regions not yet handed to the sinks, read while no drain is half-way through."""
    lock = getattr(PIPELINE, "_drain_lock", None) or contextlib.nullcontext()
    with lock:
        return PIPELINE.pending


def test_nothing_resolves_until_the_gpu_finishes(fake_cuda, captured):
    with timed_region("work") as r:
        fake_cuda.launch(5.0)
    assert r.host_ms >= 0
    PIPELINE.drain(wait=False)
    assert captured.regions == []
    assert pending() == 1
    assert r.device_ms is None

    fake_cuda.advance(4.0)  # not quite there
    PIPELINE.drain(wait=False)
    assert captured.regions == []
    assert pending() == 1

    fake_cuda.advance(1.0)
    PIPELINE.drain(wait=False)
    (region,) = captured.regions
    assert region.device_ms == 5.0
    assert r.device_ms == 5.0
    assert pending() == 0
    assert captured.span("work").attributes["perfsdk.device_ms"] == 5.0
    assert fake_cuda.sync_calls == []


def test_device_ms_of_nested_regions(fake_cuda, captured):
    @profiled("inner")
    def inner():
        fake_cuda.launch(2.0)

    with timed_region("outer"):
        fake_cuda.launch(1.0)
        inner()
        fake_cuda.launch(0.5)
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    regions = {r.name: r for r in captured.regions}
    assert regions["inner"].device_ms == 2.0
    assert regions["outer"].device_ms == 3.5
    assert regions["inner"].parent_span_id == regions["outer"].span_id
    assert fake_cuda.sync_calls == []


def test_later_regions_do_not_wait_for_earlier_ones(fake_cuda, captured):
    with timed_region("first"):
        fake_cuda.launch(3.0)
    with timed_region("second"):
        fake_cuda.launch(4.0)
    fake_cuda.advance(3.0)
    PIPELINE.drain(wait=False)
    assert [(r.name, r.device_ms) for r in captured.regions] == [("first", 3.0)]
    assert pending() == 1
    fake_cuda.advance(4.0)
    PIPELINE.drain(wait=False)
    assert [(r.name, r.device_ms) for r in captured.regions] == [("first", 3.0), ("second", 4.0)]


def test_the_background_poller_only_queries_and_resolves_by_itself(fake_cuda, captured):
    with timed_region("polled"):
        fake_cuda.launch(1.0)
    start = fake_cuda.queries
    # the poller keeps asking (query) without ever waiting for the GPU
    assert wait_until(lambda: fake_cuda.queries >= start + 3)
    assert fake_cuda.sync_calls == []
    assert captured.regions == []
    fake_cuda.complete_all()
    assert wait_until(lambda: len(captured.regions) == 1)  # nobody called drain()
    assert captured.regions[0].device_ms == 1.0
    assert fake_cuda.sync_calls == []


def test_events_return_to_the_pool(fake_cuda, captured):
    pool = clocks.event_pool(fake_cuda)
    with timed_region("pooled"):
        fake_cuda.launch(1.0)
    assert pool.created == 2
    assert pool.free == 0
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    assert pool.free == 2

    for _ in range(200):  # one at a time: the same two events over and over
        with timed_region("pooled"):
            fake_cuda.launch(0.1)
        fake_cuda.complete_all()
        PIPELINE.drain(wait=False)
    assert pool.created == 2
    assert pool.free == 2
    assert fake_cuda.events_created == 2

    for _ in range(50):  # 50 in flight at once need 100 events, and then no more
        with timed_region("pooled"):
            fake_cuda.launch(0.1)
    assert pool.free == 0
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    assert pool.free == 100
    for _ in range(50):
        with timed_region("pooled"):
            fake_cuda.launch(0.1)
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    assert pool.created == 100
    assert len(captured.regions) == 301
    assert fake_cuda.sync_calls == []


def test_whole_non_sync_flow_never_synchronizes(fake_cuda, captured):
    @profiled("step")
    def step(i):
        with timed_region("load", i=i):
            fake_cuda.launch(1.0)
        fake_cuda.launch(2.0)

    @profiled("gen")
    def batches():
        for _ in range(3):
            fake_cuda.launch(0.5)
            yield

    for i in range(20):
        step(i)
        for _ in batches():
            pass
        if i % 5 == 0:
            fake_cuda.advance(3.0)
            PIPELINE.drain(wait=False)
    fake_cuda.complete_all()
    perfsdk.flush()
    table = perfsdk.summary(show=False)
    assert table["step"].device_total_ms == pytest.approx(20 * 3.0)
    assert table["load"].device_p50_ms == pytest.approx(1.0)
    assert len(captured.named("step")) == 20
    assert all(r.device_ms == 3.0 for r in captured.named("step"))
    assert fake_cuda.queries > 0
    assert fake_cuda.sync_calls == []


def test_result_waits_for_its_own_region_only(fake_cuda, captured):
    with timed_region("mine") as mine:
        fake_cuda.launch(3.0)
    with timed_region("other"):
        fake_cuda.launch(4.0)
    result = mine.result()
    assert result.device_ms == 3.0
    assert mine.device_ms == 3.0
    assert fake_cuda.sync_calls == ["Event.synchronize"]  # never a device-wide synchronize
    assert fake_cuda.gpu_ms == 3.0  # the later work was not waited for
    PIPELINE.drain(wait=False)
    assert [r.name for r in captured.regions] == ["mine"]
    assert captured.regions[0].device_ms == 3.0
    assert pending() == 1
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    assert [r.device_ms for r in captured.regions] == [3.0, 4.0]


def test_sync_true_resolves_at_exit(fake_cuda, captured):
    with timed_region("synced", sync=True) as r:
        fake_cuda.launch(2.0)
    assert r.device_ms == 2.0  # before anything drained
    assert fake_cuda.sync_calls == ["Event.synchronize"]
    PIPELINE.drain(wait=False)
    assert captured.regions[0].device_ms == 2.0


def test_cuda_not_initialized_means_no_events(captured):
    fake = FakeCuda()
    fake.initialized = False
    with use_fake_cuda(fake):
        with timed_region("cpu-only") as r:
            fake.launch(1.0)
        profiled("fn")(lambda: None)()
        PIPELINE.drain(wait=False)
        assert [x.device_ms for x in captured.regions] == [None, None]
        assert r.device_ms is None
        assert fake.events_created == 0
        assert fake.records == 0
        assert fake.queries == 0
        assert fake.sync_calls == []


def test_cuda_initialized_later_is_picked_up(captured):
    fake = FakeCuda()
    fake.initialized = False
    with use_fake_cuda(fake):
        with timed_region("before"):
            pass
        fake.initialized = True  # the application initialized CUDA in the meantime
        with timed_region("after"):
            fake.launch(1.5)
        fake.complete_all()
        PIPELINE.drain(wait=False)
    assert [(r.name, r.device_ms) for r in captured.regions] == [("before", None), ("after", 1.5)]


def test_broken_event_timing_warns_and_leaves_device_ms_empty(captured):
    class NoTiming(FakeCuda):
        def Event(self, enable_timing=False, blocking=False, interprocess=False,
                  external=False):
            return super().Event(False, blocking, interprocess, external)  # elapsed_time raises

    with use_fake_cuda(NoTiming()) as fake:
        with timed_region("broken"):
            fake.launch(1.0)
        fake.complete_all()
        PIPELINE.drain(wait=False)
    assert [r.device_ms for r in captured.regions] == [None]
    assert counts().get("device-timing") == 1


def test_fake_backend_is_restored():
    before = _device.get_backend()
    with use_fake_cuda() as fake:
        assert _device.get_backend() is fake
    assert _device.get_backend() is before


# -- the contract: the fake has torch.cuda's names and signatures -------------------------------
CONTRACT = {
    (FakeCuda, "is_initialized"): torch.cuda.is_initialized,
    (FakeCuda, "is_available"): torch.cuda.is_available,
    (FakeCuda, "device_count"): torch.cuda.device_count,
    (FakeCuda, "current_device"): torch.cuda.current_device,
    (FakeCuda, "get_device_properties"): torch.cuda.get_device_properties,
    (FakeCuda, "is_bf16_supported"): torch.cuda.is_bf16_supported,
    (FakeCuda, "profiler_start"): torch.cuda.profiler.start,
    (FakeCuda, "profiler_stop"): torch.cuda.profiler.stop,
    (FakeCuda, "Event"): torch.cuda.Event.__new__,
    (FakeCuda, "current_stream"): torch.cuda.current_stream,
    (FakeCuda, "synchronize"): torch.cuda.synchronize,
    (FakeCuda, "get_device_name"): torch.cuda.get_device_name,
    (FakeCuda, "memory_allocated"): torch.cuda.memory_allocated,
    (FakeCuda, "memory_reserved"): torch.cuda.memory_reserved,
    (FakeCuda, "max_memory_allocated"): torch.cuda.max_memory_allocated,
    (FakeCuda, "reset_peak_memory_stats"): torch.cuda.reset_peak_memory_stats,
    (FakeCuda, "memory_snapshot"): torch.cuda.memory_snapshot,
    (FakeCuda, "record_memory_history"): torch.cuda.memory._record_memory_history,
    (FakeCuda, "dump_snapshot"): torch.cuda.memory._dump_snapshot,
    (FakeCuda, "get_sync_debug_mode"): torch.cuda.get_sync_debug_mode,
    (FakeCuda, "set_sync_debug_mode"): torch.cuda.set_sync_debug_mode,
    (FakeCuda, "Stream"): torch.cuda.Stream.__new__,
    (FakeCuda, "stream"): torch.cuda.stream,
    (FakeCuda, "CUDAGraph"): torch.cuda.CUDAGraph.__new__,
    (FakeCuda, "graph"): torch.cuda.graph.__init__,
    (FakeEvent, "record"): torch.cuda.Event.record,
    (FakeEvent, "query"): torch.cuda.Event.query,
    (FakeEvent, "elapsed_time"): torch.cuda.Event.elapsed_time,
    (FakeEvent, "synchronize"): torch.cuda.Event.synchronize,
    (FakeEvent, "wait"): torch.cuda.Event.wait,
    (FakeStream, "synchronize"): torch.cuda.Stream.synchronize,
    (FakeStream, "query"): torch.cuda.Stream.query,
    (FakeStream, "wait_stream"): torch.cuda.Stream.wait_stream,
}
TEST_CONTROLS = {"launch", "advance", "complete_all", "alloc", "free", "implicit_sync",
                 "operator_sync", "deliver_held"}


@pytest.mark.parametrize(("fake", "real"), list(CONTRACT.items()),
                         ids=[f"{c.__name__}.{m}" for c, m in CONTRACT])
def test_fake_matches_torch_cuda_signature(fake, real):
    cls, method = fake
    assert_stands_in(params(getattr(cls, method)), params(real))


def test_fake_event_constructor_matches_torch():
    assert params(FakeEvent.__init__, drop=("self", "fake")) == params(torch.cuda.Event.__new__)


def test_every_fake_method_is_under_contract():
    for cls in (FakeCuda, FakeEvent, FakeStream):
        public = {name for name, value in vars(cls).items()
                  if callable(value) and not name.startswith("_")}
        covered = {m for c, m in CONTRACT if c is cls}
        assert public - TEST_CONTROLS == covered, cls.__name__


@pytest.mark.parametrize(("protocol", "fake"), [
    (_device.CudaBackend, FakeCuda), (_device.Event, FakeEvent), (_device.Stream, FakeStream),
    (_device.CudaBackend, _device.TorchCuda),
])
def test_what_perfsdk_calls_exists_on_the_fake(protocol, fake):
    for name, value in vars(protocol).items():
        if name.startswith("_") or not callable(value):
            continue
        implemented = getattr(fake, name)
        wanted = [n for n, _ in params(value)]
        have = [n for n, _ in params(implemented)]
        assert have[:len(wanted)] == wanted, (fake.__name__, name)


def test_every_protocol_member_is_in_torch_cuda():
    """What perfsdk's device interface asks for, the real ``torch.cuda`` has, with the same
    arguments (CONTRACT says where: ``profiler_start`` is ``torch.cuda.profiler.start``)."""
    for name, value in vars(_device.CudaBackend).items():
        if name.startswith("_") or not callable(value):
            continue
        real = CONTRACT.get((FakeCuda, name))
        assert real is not None, f"CudaBackend.{name}: say in CONTRACT where torch.cuda has it"
        wanted = [n for n, _ in params(value)]
        assert [n for n, _ in params(real)][:len(wanted)] == wanted, name


def _torch_stub_fields(cls_name):
    """The attributes torch's type stubs give ``torch._C.<cls_name>`` (a CPU build of torch
    cannot make one to look at)."""
    stub = Path(torch.__file__).parent / "_C" / "__init__.pyi"
    if not stub.exists():
        pytest.skip("this torch install has no type stubs")
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return {n.target.id for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    pytest.fail(f"torch's stubs have no {cls_name}")


def test_device_properties_perfsdk_reads_are_in_torch_and_the_fake():
    wanted = {n for n in vars(_device.DeviceProperties) if not n.startswith("_")}
    assert wanted == {"name", "total_memory", "uuid", "major", "minor"}
    assert wanted <= _torch_stub_fields("_CudaDeviceProperties")
    assert wanted <= {f.name for f in dataclasses.fields(FakeDeviceProperties)}


def test_fake_devices_answer_like_torch_cuda():
    fake = FakeCuda()
    assert (fake.is_available(), fake.device_count(), fake.current_device()) == (True, 1, 0)
    props = fake.get_device_properties()
    assert (props.name, props.total_memory, str(props.uuid)) == ("Fake GPU", 16 << 30, "fake-0")
    for device in ("cuda:0", torch.device("cuda", 0), 0, None):
        assert fake.get_device_properties(device) is props
    assert fake.get_device_name() == "Fake GPU"
    assert fake.is_bf16_supported()
    fake.devices.append(FakeDeviceProperties("Old GPU", 8 << 30, "fake-1", 7, 0))
    fake.device = 1
    assert (fake.get_device_name(), fake.device_count()) == ("Old GPU", 2)
    assert fake.is_bf16_supported()  # emulated
    assert not fake.is_bf16_supported(including_emulation=False)
    with pytest.raises(AssertionError, match="Invalid device id"):
        fake.get_device_properties(2)
    fake.available = False
    assert (fake.is_available(), fake.device_count(), fake.is_bf16_supported()) == (False, 0,
                                                                                    False)


def test_the_device_interface_never_initializes_cuda_for_these_questions():
    backend = _device.TorchCuda()
    backend.is_available()
    backend.is_initialized()
    assert not torch.cuda.is_initialized()


def test_a_later_region_exit_wakes_the_poller_for_a_finished_one(fake_cuda, captured,
                                                                 monkeypatch):
    """Regions resolve at later region exits, not only at the poller's interval."""
    monkeypatch.setattr(PIPELINE, "interval", 3600.0)
    one_pipeline_round()  # the thread now sleeps an hour between rounds unless woken
    with timed_region("first"):
        fake_cuda.launch(3.0)
    PIPELINE.drain(wait=False)  # "first" now waits for the GPU
    assert pending() == 1
    fake_cuda.advance(3.0)
    time.sleep(0.05)
    assert pending() == 1  # nobody looked yet
    with timed_region("second"):
        pass  # its exit queries the oldest waiting region and wakes the thread
    assert wait_until(lambda: [r.name for r in captured.regions][:1] == ["first"])
    assert captured.named("first")[0].device_ms == 3.0
    assert fake_cuda.sync_calls == []
