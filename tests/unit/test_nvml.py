"""nvml: the background GPU sampler, against a fake pynvml whose counters move and against the
real nvidia-ml-py on this driverless machine.

Most tests give the sampler the fake's stepping clock (``step_ns`` = the interval): round k
is stamped k * STEP exactly and every reading is the fake's function at that time, so the
expected numbers are computed here from the functions, not from the samples.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import perfsdk.nvml
from perfsdk import errors
from perfsdk.errors import PerfSDKWarning
from perfsdk.nvml import GpuSampler
from perfsdk.testing.fake_nvml import FUNCTIONS, FakeGpu, FakeNvml, NVMLError_NotSupported
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.005
STEP = 5_000_000  # ns: one round of the stepping clock
UUID_A = "GPU-1a2b3c4d-0000-1111-2222-333344445555"
UUID_B = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "perfsdk-nvml"]


@pytest.fixture(autouse=True)
def no_sampler_left() -> Iterator[None]:
    yield
    for thread in sampler_threads():
        thread.join(60)
    assert sampler_threads() == [], "a test left the sampler thread running"


@pytest.fixture
def make() -> Iterator[Callable[..., GpuSampler]]:
    """GpuSampler factory; every sampler is stopped at teardown."""
    made: list[GpuSampler] = []

    def factory(fake: FakeNvml, **kwargs: object) -> GpuSampler:
        kwargs.setdefault("device_uuids", fake.uuids)
        if fake.step_ns is not None:
            kwargs.setdefault("clock", fake.clock)
        sampler = GpuSampler(INTERVAL, nvml=fake, **kwargs)  # type: ignore[arg-type]
        made.append(sampler)
        return sampler

    yield factory
    for sampler in made:
        sampler.stop()


def wait_rounds(sampler: GpuSampler, n: int, timeout: float = 60.0) -> None:
    """Until the sampler made ``n`` rounds (the timeout guards against a hang; not a timing)."""
    deadline = time.monotonic() + timeout
    while sampler.overhead().rounds < n:
        assert time.monotonic() < deadline, f"sampler made {sampler.overhead().rounds} rounds"
        time.sleep(0.002)


def run_rounds(sampler: GpuSampler, n: int) -> None:
    assert sampler.start() is True
    wait_rounds(sampler, n)
    assert sampler.stop() is True


def ours(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, PerfSDKWarning)]


# -- the fake is shaped like nvidia-ml-py -----------------------------------------------------
def test_fake_has_the_real_pynvml_signatures_constants_and_errors():
    import pynvml

    fake = FakeNvml()
    for name in FUNCTIONS:
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        ours_ = list(inspect.signature(getattr(fake, name)).parameters)
        assert ours_ == real, name
    assert fake.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    for name in ("NVMLError_NotSupported", "NVMLError_Uninitialized", "NVMLError_NotFound",
                 "NVMLError_DriverNotLoaded", "NVMLError_Unknown"):
        assert issubclass(getattr(pynvml, name), pynvml.NVMLError)
        assert issubclass(getattr(fake, name), fake.NVMLError)
        assert getattr(fake, name)().value == getattr(pynvml, name)(0).value
    # The structs the sampler reads fields of.
    assert [f for f, _ in pynvml.c_nvmlUtilization_t._fields_] == ["gpu", "memory"]
    assert {"total", "free", "used"} <= {f for f, _ in pynvml.c_nvmlMemory_t._fields_}
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert set(vars(fake.nvmlDeviceGetUtilizationRates(handle))) == {"gpu", "memory"}
    assert set(vars(fake.nvmlDeviceGetMemoryInfo(handle))) == {"total", "free", "used"}


# -- per-region numbers ----------------------------------------------------------------------
def temperature(t: float) -> float:
    return 95 if abs(t - 0.050) < 1e-9 else 80 if abs(t - 0.100) < 1e-9 else 50


def ramp_gpu(uuid: str = UUID_A, **kwargs: object) -> FakeGpu:
    """Readings that move: linear ramps, a temperature spike at rounds 10 and 20, a memory peak
    at round 20. Round k is at t = k * 0.005 s."""
    return FakeGpu(uuid, utilization=lambda t: 10 + 200 * t, power_w=lambda t: 100 + 1000 * t,
                   sm_clock_mhz=lambda t: 1000 + 4000 * t, temperature_c=temperature,
                   memory_used=lambda t: 2**30 + 2**20 * (100 - abs(t * 1000 - 100)),
                   **kwargs)  # type: ignore[arg-type]


def energy_j(a: float, b: float) -> float:
    """Integral of 100 + 1000 t watts over [a, b] seconds."""
    return 100 * (b - a) + 500 * (b * b - a * a)


def test_window_averages_energy_and_maxima(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    sampler = make(fake)
    run_rounds(sampler, 40)
    start, end = int(10.5 * STEP), int(30.25 * STEP)
    a, b = start / 1e9, end / 1e9
    attrs = sampler.window(start, end)
    assert attrs["hw.id"] == attrs["perfsdk.gpu.uuid"] == UUID_A
    assert attrs["hw.type"] == "gpu"
    assert attrs["perfsdk.gpu.index"] == 0
    assert attrs["perfsdk.gpu.samples"] == 22  # rounds 11..30 inside, 10 and 31 bracketing
    assert attrs["hw.gpu.utilization"] == pytest.approx((10 + 200 * (a + b) / 2) / 100)
    assert 0 < attrs["hw.gpu.utilization"] < 1  # a ratio, not percent
    assert attrs["perfsdk.gpu.power_w"] == pytest.approx(100 + 1000 * (a + b) / 2)
    assert attrs["perfsdk.gpu.sm_clock_mhz"] == pytest.approx(1000 + 4000 * (a + b) / 2)
    # The counter's rise between the bracketing rounds, interpolated to the edges (a straight
    # line through a quadratic counter: off by at most 500 * (STEP/2)^2 per edge).
    assert attrs["perfsdk.gpu.energy_j"] == pytest.approx(energy_j(a, b), abs=0.01)
    assert attrs["perfsdk.gpu.energy_source"] == "counter"
    assert attrs["perfsdk.gpu.temperature_max_c"] == 80  # the 95 at round 10 brackets, outside
    assert attrs["hw.gpu.memory.usage"] == 2**30 + 100 * 2**20
    assert isinstance(attrs["hw.gpu.memory.usage"], int)


def test_latest_is_the_newest_reading_in_si_units(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    sampler = make(fake)
    run_rounds(sampler, 10)
    latest = sampler.latest()
    assert list(latest) == [0]
    reading = latest[0]
    k = sampler.overhead().rounds
    t = k * STEP / 1e9
    assert reading["t_ns"] == k * STEP
    assert reading["utilization"] == pytest.approx((10 + 200 * t) / 100)
    assert reading["power_w"] == pytest.approx(100 + 1000 * t)
    assert reading["energy_j"] == pytest.approx(energy_j(0, t), abs=1e-3)
    assert reading["memory_used_bytes"] == 2**30 + 2**20 * (100 - abs(t * 1000 - 100))
    assert reading["temperature_c"] == temperature(t)
    assert reading["sm_clock_mhz"] == pytest.approx(1000 + 4000 * t)


def test_energy_falls_back_to_integrating_power(make):
    fake = FakeNvml([ramp_gpu(energy_supported=False)], step_ns=STEP)
    sampler = make(fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_rounds(sampler, 40)
    assert ours(seen) == []  # no counter is normal on some GPUs: no warning
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # not asked again
    start, end = int(3.2 * STEP), int(37.9 * STEP)
    attrs = sampler.window(start, end)
    assert attrs["perfsdk.gpu.energy_j"] == pytest.approx(energy_j(start / 1e9, end / 1e9),
                                                          abs=0.01)
    assert attrs["perfsdk.gpu.energy_source"] == "integrated_power"


def test_short_windows_say_so_and_invent_nothing(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    sampler = make(fake)
    run_rounds(sampler, 20)
    too_short = {"perfsdk.gpu.window_too_short": True}
    # Shorter than the interval, with and without a sample inside.
    assert sampler.window(int(10.1 * STEP), int(10.9 * STEP)) == {
        "perfsdk.gpu.samples": 0, **too_short}
    assert sampler.window(int(9.9 * STEP), int(10.5 * STEP)) == {
        "perfsdk.gpu.samples": 1, **too_short}
    # Long enough, but began before the first sample / ends after the last one.
    assert sampler.window(0, int(4.5 * STEP)) == {"perfsdk.gpu.samples": 4, **too_short}
    last = sampler.latest()[0]["t_ns"]
    assert sampler.window(int(last) - 3 * STEP, int(last) + STEP) == {
        "perfsdk.gpu.samples": 4, **too_short}
    # The shortest window that is answered: one interval, bracketed.
    assert "perfsdk.gpu.power_w" in sampler.window(10 * STEP, 11 * STEP)


def test_window_not_yet_sampled_is_pending_until_ready(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    sampler = make(fake)
    assert sampler.start()
    wait_rounds(sampler, 3)
    far = 10**15  # ns, far beyond any round of this test
    assert sampler.ready(far) is False
    assert sampler.window(STEP, far) == {"perfsdk.gpu.samples": sampler.window(STEP, far)[
        "perfsdk.gpu.samples"], "perfsdk.gpu.pending": True}
    assert sampler.ready(2 * STEP) is True
    assert sampler.window(STEP, 2 * STEP)["perfsdk.gpu.samples"] == 2
    assert sampler.stop()
    assert sampler.ready(far) is True  # stopped: no sample will ever come
    assert sampler.window(STEP, far)["perfsdk.gpu.window_too_short"] is True


# -- which GPU -------------------------------------------------------------------------------
def test_uuid_mapping_follows_torch_order_not_nvml_order(make):
    # NVML index order A, B; CUDA_VISIBLE_DEVICES=1,0 makes torch device 0 the physical B.
    # torch prints UUIDs without NVML's "GPU-" prefix; case may differ too.
    fake = FakeNvml([FakeGpu(UUID_A, power_w=lambda t: 100.0),
                     FakeGpu(UUID_B, power_w=lambda t: 300.0)], step_ns=STEP)
    sampler = make(fake, device_uuids=lambda: [UUID_B[4:], UUID_A.upper()])
    run_rounds(sampler, 10)
    assert sampler.devices() == {0: UUID_B, 1: UUID_A}
    dev0 = sampler.window(2 * STEP, 8 * STEP, device=0)
    dev1 = sampler.window(2 * STEP, 8 * STEP, device=1)
    assert (dev0["hw.id"], dev0["perfsdk.gpu.power_w"]) == (UUID_B, 300.0)
    assert (dev1["hw.id"], dev1["perfsdk.gpu.power_w"]) == (UUID_A, 100.0)
    assert sampler.window(2 * STEP, 8 * STEP, device=2) == {}
    assert sorted(sampler.latest()) == [0, 1]
    assert sampler.latest()[0]["power_w"] == 300.0


def test_a_cuda_device_nvml_does_not_know_is_skipped_with_one_warning(make):
    fake = FakeNvml([FakeGpu(UUID_A)], step_ns=STEP)
    sampler = make(fake, device_uuids=lambda: ["GPU-00000000-dead-beef-0000-000000000000",
                                               UUID_A])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_rounds(sampler, 5)
    assert len(ours(seen)) == 1
    assert "CUDA device 0" in ours(seen)[0]
    assert sampler.devices() == {1: UUID_A}
    assert sampler.window(STEP, 4 * STEP, device=0) == {}
    assert sampler.window(STEP, 4 * STEP, device=1)["hw.id"] == UUID_A


def test_devices_are_looked_up_again_until_cuda_is_initialized(make):
    fake = FakeNvml([FakeGpu(UUID_A)], step_ns=STEP)
    cuda_up = threading.Event()
    lookups: list[int] = []

    def device_uuids() -> list[str]:
        lookups.append(1)
        return [UUID_A] if cuda_up.is_set() else []

    sampler = make(fake, device_uuids=device_uuids)
    assert sampler.start()
    wait_rounds(sampler, 3)
    assert sampler.latest() == {}
    assert sampler.devices() == {}
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 0
    cuda_up.set()
    rounds = sampler.overhead().rounds
    wait_rounds(sampler, rounds + 3)
    assert sampler.devices() == {0: UUID_A}
    found_at = len(lookups)
    wait_rounds(sampler, sampler.overhead().rounds + 3)
    assert sampler.stop()
    assert len(lookups) == found_at  # once found, not asked again
    assert found_at >= 4
    assert sampler.latest()[0]["power_w"] == 100.0


def test_default_device_lookup_never_initializes_cuda(make, monkeypatch):
    import torch

    # torch's own lazy init, counted: on a GPU machine an earlier test in the worker may have
    # initialized CUDA already, so a call that finds it uninitialized is what would be wrong
    finding: list[bool] = []
    lazy_init = torch.cuda._lazy_init
    monkeypatch.setattr(torch.cuda, "_lazy_init",
                        lambda: finding.append(torch.cuda.is_initialized()) or lazy_init())
    was = torch.cuda.is_initialized()
    fake = FakeNvml([FakeGpu(UUID_A)], step_ns=STEP)
    sampler = make(fake, device_uuids=None)
    run_rounds(sampler, 3)
    assert False not in finding
    assert torch.cuda.is_initialized() == was
    if not was:
        assert sampler.devices() == {}  # CUDA not initialized: nothing to sample yet


def test_default_device_lookup_asks_the_device_interface(make, fake_cuda):
    """torch's device UUIDs come through perfsdk's device interface: the fake CUDA device's
    default UUID is the fake NVML's first GPU."""
    assert perfsdk.nvml.torch_device_uuids() == ["fake-0"]
    fake = FakeNvml(1, step_ns=STEP)
    sampler = make(fake, device_uuids=None)
    run_rounds(sampler, 3)
    assert sampler.devices() == {0: "GPU-fake-0"}
    fake_cuda.initialized = False
    assert perfsdk.nvml.torch_device_uuids() == []


# -- errors ----------------------------------------------------------------------------------
def test_an_nvml_error_in_one_call_is_survived_and_warned_once(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    fake.fail("nvmlDeviceGetPowerUsage", times=3)  # rounds 1-3 lose their power reading
    sampler = make(fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_rounds(sampler, 20)
    assert len(ours(seen)) == 1
    assert "power" in ours(seen)[0]
    assert "Unknown Error" in ours(seen)[0]
    assert errors.counts()["nvml-reading-failed"] == 3
    assert sampler.overhead().errors == 3
    early = sampler.window(int(1.5 * STEP), 6 * STEP)
    assert "perfsdk.gpu.power_w" not in early  # no power reading at or before the start
    assert early["hw.gpu.utilization"] == pytest.approx((10 + 200 * (0.0075 + 0.03) / 2) / 100)
    later = sampler.window(4 * STEP, 10 * STEP)
    assert later["perfsdk.gpu.power_w"] == pytest.approx(100 + 1000 * 0.035)


def test_an_unsupported_reading_is_not_asked_again(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    fake.fail("nvmlDeviceGetTemperature", error=NVMLError_NotSupported())
    sampler = make(fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_rounds(sampler, 10)
    assert ours(seen) == []
    assert fake.calls["nvmlDeviceGetTemperature"] == 1
    attrs = sampler.window(2 * STEP, 8 * STEP)
    assert "perfsdk.gpu.temperature_max_c" not in attrs
    assert "perfsdk.gpu.power_w" in attrs


def test_init_failure_one_warning_no_thread_no_readings(make):
    fake = FakeNvml([FakeGpu(UUID_A)], init_error=True)
    sampler = make(fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert sampler.start() is False
        assert sampler.start() is False
    assert len(ours(seen)) == 1
    assert "NVML could not start" in ours(seen)[0]
    assert "Driver Not Loaded" in ours(seen)[0]
    assert errors.counts()["nvml-unavailable"] == 2
    assert sampler_threads() == []
    assert sampler.running is False
    assert sampler.window(0, 10**12) == {}
    assert sampler.latest() == {}
    assert sampler.ready(10**12) is True
    assert dict(fake.calls) == {"nvmlInit": 2}
    assert sampler.stop() is True


def test_cpu_path_with_the_real_nvidia_ml_py():
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a machine with a driver: the CPU path cannot be exercised here
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    sampler = GpuSampler()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert sampler.start() is False
        assert sampler.window(0, 10**12) == {}
        assert sampler.latest() == {}
        assert sampler.stop() is True
    assert len(ours(seen)) == 1
    assert "GPU readings are off" in ours(seen)[0]
    assert sampler_threads() == []


def test_without_nvidia_ml_py_the_warning_says_how_to_install(monkeypatch):
    monkeypatch.setattr(perfsdk.nvml, "pynvml", None)
    with pytest.warns(PerfSDKWarning, match=r"pip install 'perfsdk\[nvml\]'"):
        assert GpuSampler().start() is False


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="interval_s"):
        GpuSampler(0)
    with pytest.raises(ValueError, match="history_s"):
        GpuSampler(1.0, history_s=0.5)


# -- threads ---------------------------------------------------------------------------------
def test_nvml_is_called_only_from_the_sampler_thread_and_never_blocks_readers(make):
    fake = FakeNvml([ramp_gpu()])  # real time
    sampler = make(fake)
    t0 = time.perf_counter_ns()
    assert sampler.start()
    wait_rounds(sampler, 5)
    fake.block = threading.Event()  # the driver stalls inside the next reading
    assert fake.blocked.wait(60)
    t1 = time.perf_counter_ns()
    answers: dict[str, object] = {}

    def read() -> None:
        answers["window"] = sampler.window(t0, t1)
        answers["latest"] = sampler.latest()
        answers["ready"] = sampler.ready(t1)
        answers["devices"] = sampler.devices()
        answers["overhead"] = sampler.overhead()

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(60)  # a guard against a hang, not a timing
    assert not reader.is_alive(), "a reader waited for the stalled NVML call"
    assert answers["latest"][0]["power_w"] > 0  # type: ignore[index]
    assert answers["devices"] == {0: UUID_A}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert sampler.stop(timeout_s=0.05) is False  # bounded while the driver is stuck
    assert "did not stop" in ours(seen)[0]
    assert fake.calls["nvmlShutdown"] == 0
    fake.block.set()
    for thread in sampler_threads():
        thread.join(60)
    assert fake.calls["nvmlShutdown"] == 1
    assert fake.init_count == 0
    callers = {thread for name, thread in fake.threads if name != "nvmlInit"}
    assert callers == {"perfsdk-nvml"}
    assert {thread for name, thread in fake.threads if name == "nvmlInit"} == {
        threading.current_thread().name}


def test_window_while_running_and_restart(make):
    """Real time, as with nvidia-ml-py: a window over two of the sampler's own rounds (so what
    it holds does not depend on when this thread looked), its readings bounded by causality."""
    fake = FakeNvml([ramp_gpu()])  # real time
    sampler = make(fake)
    t0 = time.perf_counter_ns()
    assert sampler.start()
    wait_rounds(sampler, 1)
    ta = int(sampler.latest()[0]["t_ns"])  # the stamp of a round, read at or after it
    wait_rounds(sampler, sampler.overhead().rounds + 4)  # 4 rounds later, at least
    tb = int(sampler.latest()[0]["t_ns"])
    tc = time.perf_counter_ns()  # tb's readings were taken before this
    assert wait_until(lambda: sampler.ready(tb), 60)  # its round is counted just after
    assert sampler.running
    # The first round ran after t0: that window began before the first sample.
    assert sampler.window(t0, tb).get("perfsdk.gpu.window_too_short") is True
    attrs = sampler.window(ta, tb)
    assert attrs["perfsdk.gpu.samples"] >= 5  # the rounds at ta and tb and those between
    assert 100 + 1000 * (ta / 1e9) <= attrs["perfsdk.gpu.power_w"] <= 100 + 1000 * (tc / 1e9)
    assert sampler.stop() is True
    assert fake.calls["nvmlShutdown"] == 1
    assert sampler.window(ta, tb) == attrs  # readable after stop
    assert sampler.start() is True  # startable again; the old samples are dropped
    assert sampler.window(ta, tb) in ({}, {"perfsdk.gpu.samples": 0,
                                           "perfsdk.gpu.window_too_short": True})
    wait_rounds(sampler, 2)
    assert sampler.stop() is True
    assert fake.calls["nvmlInit"] == 2
    assert fake.init_count == 0


def test_history_is_bounded(make):
    fake = FakeNvml([ramp_gpu()], step_ns=STEP)
    sampler = make(fake, history_s=0.05)  # about 10 rounds
    run_rounds(sampler, 40)
    assert sampler.window(STEP, 5 * STEP)["perfsdk.gpu.window_too_short"] is True  # evicted
    assert sampler.window(35 * STEP, 38 * STEP)["perfsdk.gpu.samples"] == 4


def test_overhead_reports_cpu_time_and_rounds(make):
    fake = FakeNvml([ramp_gpu(), ramp_gpu(UUID_B)])
    sampler = make(fake)
    run_rounds(sampler, 20)
    stats = sampler.overhead()
    assert stats.rounds >= 20
    assert stats.cpu_s > 0
    assert stats.wall_s > 0
    assert stats.errors == 0
    print(f"\nsampler: {stats.rounds} rounds, {stats.cpu_s * 1e6 / stats.rounds:.0f} us CPU per "
          f"round (2 fake GPUs), {stats.core_fraction:.2%} of a core at {INTERVAL} s")


def test_fork_child_has_a_stopped_sampler_that_can_start_again():
    code = textwrap.dedent("""
        import os, time
        from perfsdk.testing.fake_nvml import FakeNvml
        from perfsdk.nvml import GpuSampler

        def wait(s, n):
            deadline = time.monotonic() + 60  # a hang guard
            while s.overhead().rounds < n:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
            return True

        fake = FakeNvml(1)
        s = GpuSampler(0.005, nvml=fake, device_uuids=fake.uuids)
        assert s.start() and wait(s, 3)
        pid = os.fork()
        if pid == 0:
            ok = s.running is False and s.start() is True and wait(s, 3)
            ok = ok and s.stop() is True and 0 in s.latest()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert s.running and wait(s, s.overhead().rounds + 2)
        assert s.stop()
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "OK"
