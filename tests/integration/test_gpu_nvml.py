"""On a real GPU: NVML readings of the GPU this process uses (matched by UUID), an energy
counter that rises while the GPU works, and region spans that carry the readings.

Needs nvidia-ml-py (``pip install 'perfsdk[nvml]'``, in the ``dev`` extra). Skipped without CUDA
(PERFSDK_REQUIRE_GPU=1 turns the skip, and a missing nvidia-ml-py, into a failure).
"""

from __future__ import annotations

import time

import pytest
import torch

import perfsdk
from perfsdk.config import configure
from perfsdk.gpu import TELEMETRY
from perfsdk.nvml import GpuSampler, normalize_uuid, torch_device_uuids
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import capture
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu


@pytest.fixture
def pynvml():
    return pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed "
                                                "(pip install 'perfsdk[nvml]')")


@pytest.fixture
def telemetry():
    TELEMETRY.reset()
    yield TELEMETRY
    TELEMETRY.reset()


def busy(seconds: float) -> None:
    """Keep the GPU computing for about ``seconds`` (host-side waits: test code may sync)."""
    x = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()


def test_the_energy_counter_rises_while_the_gpu_works(pynvml):
    torch.cuda.init()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(pynvml, torch_device_uuids()[0]))
        try:
            before = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError_NotSupported:  # before Volta: perfsdk integrates power instead
            pytest.skip("this GPU has no NVML energy counter")
        busy(0.5)
        after = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    finally:
        pynvml.nvmlShutdown()
    assert after > before  # millijoules


def _nvml_uuid(pynvml, torch_uuid: str) -> str:
    """NVML's spelling (``GPU-...``) of a torch device UUID."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        if normalize_uuid(uuid) == normalize_uuid(torch_uuid):
            return uuid
    raise AssertionError(f"no NVML device has torch's UUID {torch_uuid}")


def test_sampler_window_over_real_work(pynvml):
    torch.cuda.init()
    sampler = GpuSampler(0.02)
    assert sampler.start()
    try:
        assert wait_until(lambda: sampler.overhead().rounds >= 3, timeout=10.0)
        t0 = time.perf_counter_ns()
        busy(0.8)
        t1 = time.perf_counter_ns()
        assert wait_until(lambda: sampler.ready(t1), timeout=10.0)
        attrs = sampler.window(t0, t1)
        first = sampler.latest()[0]
        busy(0.3)
        t2 = time.perf_counter_ns()
        assert wait_until(lambda: sampler.ready(t2), timeout=10.0)
        second = sampler.latest()[0]
    finally:
        assert sampler.stop()
    assert normalize_uuid(attrs["perfsdk.gpu.uuid"]) == normalize_uuid(torch_device_uuids()[0])
    assert attrs["perfsdk.gpu.index"] == 0
    assert attrs["perfsdk.gpu.samples"] >= 10
    assert attrs["perfsdk.gpu.power_w"] > 0
    assert attrs["perfsdk.gpu.energy_j"] > 0
    # the same units: joules against watts x seconds (NVML's power is a 1 s average on recent
    # GPUs, so it lags the counter while the load ramps up; only a factor of 3 is asked for)
    ratio = attrs["perfsdk.gpu.energy_j"] / (attrs["perfsdk.gpu.power_w"] * (t1 - t0) / 1e9)
    assert 1 / 3 < ratio < 3, ratio
    assert attrs["hw.gpu.utilization"] > 0.3  # back-to-back 4096x4096 matmuls
    assert attrs["hw.gpu.memory.usage"] >= 64 * 2**20  # at least the matmuls' tensors
    assert attrs["perfsdk.gpu.temperature_max_c"] > 0
    assert attrs["perfsdk.gpu.sm_clock_mhz"] > 0
    assert second["energy_j"] > first["energy_j"]
    assert sampler.overhead().errors == 0


def test_region_spans_carry_this_gpus_readings(pynvml, telemetry):
    torch.cuda.init()
    configure(gpu_sample_interval_s=0.02)
    PIPELINE.start()
    PIPELINE.wake()
    assert wait_until(lambda: telemetry.sampler is not None, timeout=10.0)
    assert perfsdk.diagnostics()["gpu_sampling"] == "on"
    with capture() as cap:
        with perfsdk.timed_region("gpu.busy"):
            busy(0.5)
        assert wait_until(lambda: cap.named("gpu.busy"), timeout=10.0)
    attrs = cap.span("gpu.busy").attributes
    assert normalize_uuid(attrs["perfsdk.gpu.uuid"]) == normalize_uuid(torch_device_uuids()[0])
    assert attrs["hw.type"] == "gpu"
    assert attrs["perfsdk.gpu.power_w"] > 0
    assert attrs["perfsdk.gpu.energy_j"] > 0
    assert attrs["perfsdk.gpu.energy_source"] in ("counter", "integrated_power")
    assert attrs["hw.gpu.utilization"] > 0
    assert telemetry.sampler.overhead().errors == 0
