"""GPU readings reach region spans: the sampler starts on the pipeline thread once CUDA is
initialized, records wait until it has read past their end, and nothing breaks without NVML."""

from __future__ import annotations

import time

import pytest

import perfsdk
from perfsdk import errors
from perfsdk._fake_nvml import FakeGpu, FakeNvml
from perfsdk.config import configure
from perfsdk.gpu import TELEMETRY
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import capture
from tests.waiting import wait_until


@pytest.fixture
def telemetry():
    TELEMETRY.reset()
    yield TELEMETRY
    TELEMETRY.reset()


def test_region_spans_carry_gpu_readings(fake_cuda, telemetry):
    fake = FakeNvml([FakeGpu("GPU-aaaa", power_w=lambda t: 150.0,
                             utilization=lambda t: 80.0, temperature_c=lambda t: 61.0)])
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0.01)
    PIPELINE.start()
    PIPELINE.wake()
    assert wait_until(lambda: telemetry.sampler is not None)
    with capture() as cap:
        with perfsdk.timed_region("gpu.work"):
            time.sleep(0.1)
        fake_cuda.complete_all()
        assert wait_until(lambda: cap.named("gpu.work"), 5.0)  # once the sampler passed its end
    [region] = cap.named("gpu.work")
    attrs = cap.span("gpu.work").attributes
    assert attrs["perfsdk.gpu.uuid"].lower().endswith("aaaa")
    assert attrs["perfsdk.gpu.power_w"] == pytest.approx(150.0)
    assert attrs["hw.gpu.utilization"] == pytest.approx(0.8)
    assert attrs["perfsdk.gpu.temperature_max_c"] == 61.0
    assert attrs["perfsdk.gpu.energy_j"] == pytest.approx(150.0 * region.host_ms / 1000, rel=0.05)
    assert attrs["perfsdk.gpu.samples"] >= 5
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
        assert wait_until(lambda: cap.named("gpu.blip"), 5.0)
    attrs = cap.span("gpu.blip").attributes
    assert attrs["perfsdk.gpu.window_too_short"] is True
    assert "perfsdk.gpu.power_w" not in attrs


def test_no_sampling_without_cuda(telemetry):
    fake = FakeNvml(1)
    telemetry.nvml, telemetry.device_uuids = fake, fake.uuids
    configure(gpu_sample_interval_s=0.01)
    with capture() as cap, perfsdk.timed_region("cpu.only"):
        pass
    PIPELINE.wake()
    time.sleep(0.1)
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
