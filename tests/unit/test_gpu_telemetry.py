"""GPU readings reach region spans: the sampler starts on the pipeline thread once CUDA is
initialized, records wait until it has read past their end, and nothing breaks without NVML."""

from __future__ import annotations

import pytest

import perfsdk
from perfsdk import errors
from perfsdk.config import configure
from perfsdk.gpu import TELEMETRY
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import FakeClock, capture, use_fake_clock
from perfsdk.testing.fake_nvml import FakeGpu, FakeNvml
from tests.waiting import one_pipeline_round, wait_until


@pytest.fixture
def telemetry():
    TELEMETRY.reset()
    yield TELEMETRY
    TELEMETRY.reset()


STEP = 10_000_000  # ns: the fake NVML's clock moves this much at each sampling round


def test_region_spans_carry_gpu_readings(fake_cuda, telemetry):
    """The sampler and the regions read one fake clock, which each sampling round moves by STEP:
    the region spans whole rounds, so its readings are exact."""
    fake = FakeNvml([FakeGpu("GPU-aaaa", power_w=lambda t: 150.0,
                             utilization=lambda t: 80.0, temperature_c=lambda t: 61.0)],
                    step_ns=STEP)
    host = FakeClock(0)

    def sampler_clock() -> int:  # a round's stamp is the regions' time from then on
        host.ns = fake.clock()
        return host.ns

    telemetry.nvml, telemetry.device_uuids, telemetry.clock = fake, fake.uuids, sampler_clock
    configure(gpu_sample_interval_s=0.01)
    PIPELINE.start()
    PIPELINE.wake()
    assert wait_until(lambda: telemetry.sampler is not None)
    sampler = telemetry.sampler
    assert wait_until(lambda: sampler.overhead().rounds >= 1)
    with use_fake_clock(host), capture() as cap:
        with perfsdk.timed_region("gpu.work"):
            rounds = sampler.overhead().rounds
            assert wait_until(lambda: sampler.overhead().rounds >= rounds + 5)
        fake_cuda.complete_all()
        assert wait_until(lambda: cap.named("gpu.work"))  # once the sampler passed its end
    [region] = cap.named("gpu.work")
    attrs = cap.span("gpu.work").attributes
    rounds_spanned = round(region.host_ms * 1e6 / STEP)
    assert region.host_ms == rounds_spanned * STEP / 1e6
    assert rounds_spanned >= 4
    assert attrs["perfsdk.gpu.uuid"].lower().endswith("aaaa")
    assert attrs["perfsdk.gpu.power_w"] == pytest.approx(150.0)
    assert attrs["hw.gpu.utilization"] == pytest.approx(0.8)
    assert attrs["perfsdk.gpu.temperature_max_c"] == 61.0
    assert attrs["perfsdk.gpu.energy_j"] == pytest.approx(150.0 * region.host_ms / 1000)
    assert attrs["perfsdk.gpu.samples"] == rounds_spanned + 1  # the rounds at both ends too
    # NVML is read only on the sampler's own thread, never the caller's
    assert {t for n, t in fake.threads if n.startswith("nvmlDeviceGet")} == {"perfsdk-nvml"}
    assert perfsdk.diagnostics()["gpu_sampling"] == "on"


def test_short_regions_say_so(fake_cuda, telemetry):
    fake = FakeNvml(1)
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0.05)
    PIPELINE.start()
    PIPELINE.wake()
    assert wait_until(lambda: telemetry.sampler is not None)
    with capture() as cap:
        with perfsdk.timed_region("gpu.blip"):
            pass
        fake_cuda.complete_all()
        assert wait_until(lambda: cap.named("gpu.blip"))
    attrs = cap.span("gpu.blip").attributes
    assert attrs["perfsdk.gpu.window_too_short"] is True
    assert "perfsdk.gpu.power_w" not in attrs


@pytest.mark.usefixtures("no_cuda")
def test_no_sampling_without_cuda(telemetry):
    fake = FakeNvml(1)
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0.01)
    with capture() as cap, perfsdk.timed_region("cpu.only"):
        pass
    one_pipeline_round()  # its hook asks whether to start sampling: not without CUDA
    assert telemetry.sampler is None
    assert fake.calls["nvmlInit"] == 0
    assert not any(k.startswith("perfsdk.gpu") for k in cap.span("cpu.only").attributes)


def test_interval_zero_turns_sampling_off(fake_cuda, telemetry):
    fake = FakeNvml(1)
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0)
    telemetry.tick()
    assert telemetry.sampler is None
    assert fake.calls["nvmlInit"] == 0


def test_without_a_driver_one_warning_and_regions_still_flow(fake_cuda, telemetry):
    telemetry.nvml = FakeNvml(1, init_error=True)
    configure(gpu_sample_interval_s=0.01)
    telemetry.tick()
    telemetry.tick()  # not retried
    assert telemetry.sampler is None
    assert errors.counts().get("nvml-unavailable") == 1
    with capture() as cap:
        with perfsdk.timed_region("still.here"):
            pass
        fake_cuda.complete_all()
    assert [r.name for r in cap.regions] == ["still.here"]


def test_bad_interval_is_named():
    with pytest.raises(ValueError, match=r"gpu_sample_interval_s=-1.*from 0 \(off\) to 86400"):
        configure(gpu_sample_interval_s=-1)


def test_metric_gauges_read_the_running_sampler(fake_cuda, telemetry):
    """perfsdk's MetricsSink is wired to the sampler's latest readings."""
    from perfsdk.lifecycle import METRICS

    assert METRICS.gpu_readings() == {}  # nothing sampled yet
    fake = FakeNvml([FakeGpu("GPU-bbbb", power_w=lambda t: 42.0)])
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0.01)
    telemetry.tick()
    assert wait_until(lambda: METRICS.gpu_readings().get(0, {}).get("power_w") == 42.0)


def test_a_fake_device_without_a_fake_nvml_is_not_sampled(fake_cuda, telemetry):
    """perfsdk.testing's fake GPU has nothing for the real NVML to read: no sampler, no
    'NVML could not start' warning in users' tests."""
    configure(gpu_sample_interval_s=0.01)
    telemetry.tick()
    assert telemetry.sampler is None
    assert "nvml-unavailable" not in errors.counts()


def test_reset_waits_for_a_tick_under_way(telemetry):
    """A round's tick holds the lock from reading the settings to keeping its sampler: reset()
    waits for it, so it cannot start a sampler from a fake NVML just after reset() cleared it
    (what made a later test see a sampler it never asked for)."""
    import threading

    done = threading.Event()
    with telemetry._lock:  # a tick under way on the pipeline thread
        worker = threading.Thread(target=lambda: (telemetry.reset(), done.set()))
        worker.start()
        assert not done.wait(0.2)
        telemetry.nvml = "left by the tick"
    assert done.wait(10)
    worker.join(10)
    assert telemetry.nvml is None
