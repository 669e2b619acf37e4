"""perfsdk.testing: the in-memory capture, the fake CUDA device and the fake host clock, as users
would use them."""

from __future__ import annotations

import doctest
import time

import pytest

import perfsdk
from perfsdk import _device, clocks, profiled, region, timed_region
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import Capture, FakeClock, FakeCuda, capture, use_fake_clock, use_fake_cuda


def test_capture_collects_regions_and_spans_of_its_block_only():
    @profiled("c.fn")
    def fn():
        pass

    fn()  # before: not captured
    with capture() as cap:
        fn()
        with timed_region("c.block", k=1):
            fn()
    fn()  # after: not captured
    PIPELINE.drain(wait=True)
    assert [r.name for r in cap.regions] == ["c.fn", "c.fn", "c.block"]
    assert [s.name for s in cap.spans] == ["c.fn", "c.fn", "c.block"]
    block = cap.span("c.block")
    assert block.attributes["k"] == 1
    assert block.context.span_id == cap.named("c.block")[0].span_id
    inner = [s for s in cap.spans if s.name == "c.fn"][1]
    assert inner.parent.span_id == block.context.span_id
    assert cap not in PIPELINE.sinks


def test_capture_resolves_everything_by_the_end_of_the_block():
    with capture() as cap:
        for _ in range(10):
            with timed_region("c.many"):
                pass
    assert len(cap.named("c.many")) == 10  # no drain needed after the block


def test_span_lookup_errors_say_what_was_found():
    with capture() as cap:
        for _ in range(2):
            with timed_region("c.twice"):
                pass
        with timed_region("c.once"):
            pass
    assert cap.span("c.once").name == "c.once"
    with pytest.raises(AssertionError, match=r"expected one span 'c.twice', found 2"):
        cap.span("c.twice")
    with pytest.raises(AssertionError, match=r"found 0: \['c.once', 'c.twice', 'c.twice'\]"):
        cap.span("missing")


def test_nested_captures_both_see_inner_regions():
    with capture() as outer:
        with timed_region("c.a"):
            pass
        with capture() as inner, timed_region("c.b"):
            pass
    assert [r.name for r in outer.regions] == ["c.a", "c.b"]
    assert [r.name for r in inner.regions] == ["c.b"]


def test_capture_sink_is_removed_even_on_error():
    with pytest.raises(KeyError), capture() as cap:
        raise KeyError
    assert cap not in PIPELINE.sinks
    assert isinstance(cap, Capture)


def test_captured_fixture(captured):
    with timed_region("c.fixture"):
        pass
    PIPELINE.drain(wait=True)
    assert [r.name for r in captured.regions] == ["c.fixture"]


def test_span_resource_names_the_service():
    perfsdk.configure(service_name="unit-svc")
    with capture() as cap, timed_region("c.res"):
        pass
    resource = cap.span("c.res").resource.attributes
    assert resource["service.name"] == "unit-svc"
    assert "process.pid" in resource
    assert "host.name" in resource


# -- the fake GPU -------------------------------------------------------------------------------
def test_fake_gpu_clock():
    fake = FakeCuda()
    start = fake.Event(enable_timing=True)
    end = fake.Event(enable_timing=True)
    start.record()
    fake.launch(2.0)
    fake.launch(3.0)
    end.record()
    assert start.query()
    assert not end.query()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    fake.advance(4.0)
    assert not end.query()
    fake.advance(1.0)
    assert end.query()
    assert start.elapsed_time(end) == 5.0
    assert fake.sync_calls == []
    fake.advance(10.0)  # an idle GPU does not run ahead of its queue
    late = fake.Event(enable_timing=True)
    late.record()
    fake.launch(1.0)
    late_end = fake.Event(enable_timing=True)
    late_end.record()
    fake.complete_all()
    assert late.elapsed_time(late_end) == 1.0


def test_fake_synchronizing_calls_are_recorded():
    fake = FakeCuda()
    event = fake.Event(enable_timing=True)
    fake.launch(1.0)
    event.record()
    event.synchronize()
    assert event.query()
    fake.launch(1.0)
    fake.current_stream().synchronize()
    fake.launch(1.0)
    fake.synchronize()
    assert fake.gpu_ms == fake.queued_ms == 3.0
    assert fake.sync_calls == ["Event.synchronize", "Stream.synchronize", "synchronize"]
    assert fake.current_stream().query()


def test_fake_events_need_enable_timing_like_torch():
    fake = FakeCuda()
    a, b = fake.Event(), fake.Event(enable_timing=True)
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        a.elapsed_time(b)
    assert fake.get_device_name() == "Fake GPU"
    assert fake.events_created == 2
    assert fake.records == 2


def test_use_fake_cuda_restores_the_backend_on_error():
    before = _device.get_backend()
    with pytest.raises(ValueError, match="in the block"), use_fake_cuda():
        raise ValueError("in the block")
    assert _device.get_backend() is before


def test_fake_cuda_fixture(fake_cuda):
    assert _device.get_backend() is fake_cuda
    assert isinstance(fake_cuda, FakeCuda)


@pytest.mark.parametrize("module", [
    "perfsdk.testing", "perfsdk.config", "perfsdk.decorator", "perfsdk.timing",
    "perfsdk.lifecycle",
])
def test_docstring_examples_run(module):
    import importlib

    mod = importlib.import_module(module)
    failures, tried = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert tried > 0
    assert failures == 0


def test_fake_clock_times_regions_spans_and_steps_exactly_and_is_put_back():
    with use_fake_clock(FakeClock(5_000_000_000)) as clock, capture() as cap, \
            timed_region("outer"):
        clock.advance(2.5)
        with timed_region("inner"):
            clock.advance(1)
        with perfsdk.step(samples=10):
            clock.advance(4)
    outer, inner, step = cap.named("outer")[0], cap.named("inner")[0], cap.named("step")[0]
    assert (outer.host_ms, inner.host_ms, step.host_ms) == (7.5, 1.0, 4.0)
    assert inner.start_ns == clocks.epoch_ns(5_000_000_000 + 2_500_000)
    assert cap.span("inner").start_time == inner.start_ns  # the span has the same times
    assert cap.span("outer").end_time - cap.span("outer").start_time == 7_500_000
    assert step.attributes["perfsdk.samples_per_s"] == 10 / 0.004
    before = time.perf_counter_ns()
    now = region.now_ns()
    assert before <= now <= time.perf_counter_ns()  # the real clock again
    with pytest.raises(ValueError, match="ms="):
        clock.advance(-1)
