"""A fake ``pynvml`` module for tests: GPUs whose readings move with a clock you control.

:class:`FakeNvml` has the functions, constants and exception classes of nvidia-ml-py that
:mod:`perfsdk.nvml` uses, with the same parameter names (a unit test checks them against the
real module). Each :class:`FakeGpu` reading is a function of the fake's time in seconds; the
energy counter integrates the power function, as the real counter does.

Time comes from :meth:`FakeNvml.clock`: with ``step_ns`` it advances by exactly that much at
each call (give it to the sampler as ``clock=`` and every round lands on a known time),
otherwise it is ``time.perf_counter_ns``.

Example:
    >>> fake = FakeNvml([FakeGpu("GPU-aaaa", power_w=lambda t: 100 + 10 * t)], step_ns=10**9)
    >>> fake.nvmlInit()
    >>> h = fake.nvmlDeviceGetHandleByIndex(0)
    >>> fake.clock(), fake.nvmlDeviceGetPowerUsage(h), fake.nvmlDeviceGetTotalEnergyConsumption(h)
    (1000000000, 110000, 105000)
    >>> fake.fail("nvmlDeviceGetPowerUsage")
    >>> fake.nvmlDeviceGetPowerUsage(h)
    Traceback (most recent call last):
    ...
    perfsdk.testing.fake_nvml.NVMLError_Unknown: Unknown Error
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

__all__ = ["FUNCTIONS", "FakeGpu", "FakeNvml"]

FUNCTIONS = (
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetUUID", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
)
"""The pynvml functions the fake provides."""


class NVMLError(Exception):
    """Like ``pynvml.NVMLError``: carries the NVML return code in ``value``."""

    value = 999
    text = "Unknown Error"

    def __init__(self, value: int | None = None) -> None:
        if value is not None:
            self.value = value
        super().__init__(self.value)

    def __str__(self) -> str:
        return self.text


class NVMLError_Uninitialized(NVMLError):
    value, text = 1, "Uninitialized"


class NVMLError_NotSupported(NVMLError):
    value, text = 3, "Not Supported"


class NVMLError_NotFound(NVMLError):
    value, text = 6, "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):
    value, text = 9, "Driver Not Loaded"


class NVMLError_Unknown(NVMLError):
    value, text = 999, "Unknown Error"


_Error = NVMLError  # for annotations inside FakeNvml, whose NVMLError is a class attribute


@dataclass
class FakeGpu:
    """One fake GPU. Each reading is a function of time in seconds (the fake's clock)."""

    uuid: str
    utilization: Callable[[float], float] = lambda t: 50.0
    """GPU utilization in percent (NVML's ``.gpu``)."""
    memory_used: Callable[[float], float] = lambda t: 2 * 2**30
    """Bytes used."""
    power_w: Callable[[float], float] = lambda t: 100.0
    temperature_c: Callable[[float], float] = lambda t: 40.0
    sm_clock_mhz: Callable[[float], float] = lambda t: 1410.0
    memory_total: int = 80 * 2**30
    energy_supported: bool = True
    """False: ``nvmlDeviceGetTotalEnergyConsumption`` raises ``NVMLError_NotSupported``."""
    energy_at_zero_j: float = 0.0
    """The energy counter at time 0 (the real one counts from driver load)."""
    _energy_j: float = field(default=0.0, init=False)
    _energy_t: float = field(default=0.0, init=False)

    def energy_mj(self, t: float) -> int:
        """The counter at ``t``: the power function integrated from 0 (Simpson's rule, exact
        for power that is a polynomial of degree up to 3), accumulated call by call."""
        if t < self._energy_t:
            raise ValueError("the fake's clock went backwards")
        a, b, n = self._energy_t, t, 16
        h = (b - a) / n
        if h > 0:
            odd = sum(self.power_w(a + i * h) for i in range(1, n, 2))
            even = sum(self.power_w(a + i * h) for i in range(2, n, 2))
            self._energy_j += h / 3 * (self.power_w(a) + 4 * odd + 2 * even + self.power_w(b))
        self._energy_t = t
        return round((self.energy_at_zero_j + self._energy_j) * 1000)


class FakeNvml:
    """A stand-in for the ``pynvml`` module (pass it as ``GpuSampler(nvml=...)``).

    Args:
        gpus: the GPUs in NVML index order, or how many default ones (UUIDs ``GPU-fake-<i>``).
        step_ns: advance the clock by this much at each :meth:`clock` call; None: real time.
        init_error: ``nvmlInit`` raises this NVML error (True: ``NVMLError_DriverNotLoaded``).

    ``calls`` counts calls by function name and ``threads`` records the names of the threads
    that made them; :meth:`fail` scripts errors and :attr:`block` stalls calls.
    """

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Unknown = NVMLError_Unknown

    def __init__(self, gpus: int | Sequence[FakeGpu] = 1, *, step_ns: int | None = None,
                 init_error: bool | type[_Error] = False) -> None:
        self.gpus = ([FakeGpu(f"GPU-fake-{i}") for i in range(gpus)] if isinstance(gpus, int)
                     else list(gpus))
        self.step_ns = step_ns
        self.init_error = init_error
        self.now_ns = 0 if step_ns is not None else time.perf_counter_ns()
        self.init_count = 0
        self.calls: Counter[str] = Counter()
        self.threads: set[tuple[str, str]] = set()
        self.block: threading.Event | None = None
        """While set to an unset Event, reading calls wait on it (a stalled driver)."""
        self.blocked = threading.Event()
        """Set once a call is waiting on :attr:`block`."""
        self._failures: list[tuple[str, int | None, _Error, list[int]]] = []
        self._lock = threading.Lock()

    # -- control -------------------------------------------------------------------------------
    def clock(self) -> int:
        """The time now (ns): ``step_ns`` later than the previous call, or real time."""
        with self._lock:
            if self.step_ns is None:
                self.now_ns = time.perf_counter_ns()
            else:
                self.now_ns += self.step_ns
            return self.now_ns

    def uuids(self) -> list[str]:
        """The GPUs' UUIDs in NVML index order (a ``device_uuids`` for the sampler)."""
        return [g.uuid for g in self.gpus]

    def fail(self, name: str, *, times: int = 1, device: int | None = None,
             error: _Error | None = None) -> None:
        """Make the next ``times`` calls of ``name`` (on ``device``, an NVML index, or any)
        raise ``error`` (default ``NVMLError_Unknown``)."""
        self._failures.append((name, device, error or NVMLError_Unknown(), [times]))

    # -- internals -----------------------------------------------------------------------------
    def _enter(self, name: str, handle: Any = None) -> FakeGpu | None:
        with self._lock:
            self.calls[name] += 1
            self.threads.add((name, threading.current_thread().name))
            if name != "nvmlInit" and self.init_count <= 0:
                raise NVMLError_Uninitialized()
            index = None if handle is None else self._index(handle)
            for fname, device, error, left in self._failures:
                if fname == name and left[0] > 0 and device in (None, index):
                    left[0] -= 1
                    raise error
        block = self.block
        if block is not None and handle is not None:
            self.blocked.set()
            block.wait()
        return None if index is None else self.gpus[index]

    def _index(self, handle: Any) -> int:
        index = getattr(handle, "index", None)
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise NVMLError(2)  # invalid argument
        return index

    def _t(self) -> float:
        with self._lock:
            if self.step_ns is None:
                self.now_ns = time.perf_counter_ns()
            return self.now_ns / 1e9

    # -- the pynvml surface ----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if isinstance(self.init_error, type):
            raise self.init_error()
        if self.init_error:
            raise NVMLError_DriverNotLoaded()
        with self._lock:
            self.init_count += 1  # reference counted, like NVML

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._lock:
            self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == text:
                return SimpleNamespace(index=i)
        raise NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu = self._enter("nvmlDeviceGetUUID", handle)
        assert gpu is not None
        return gpu.uuid

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        return SimpleNamespace(gpu=round(gpu.utilization(self._t())), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        used = round(gpu.memory_used(self._t()))
        return SimpleNamespace(total=gpu.memory_total, free=gpu.memory_total - used, used=used)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        return round(gpu.power_w(self._t()) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        assert gpu is not None
        if not gpu.energy_supported:
            raise NVMLError_NotSupported()
        return gpu.energy_mj(self._t())

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._enter("nvmlDeviceGetTemperature", handle)
        assert gpu is not None
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError_NotSupported()
        return round(gpu.temperature_c(self._t()))

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        gpu = self._enter("nvmlDeviceGetClockInfo", handle)
        assert gpu is not None
        if type != self.NVML_CLOCK_SM:
            raise NVMLError_NotSupported()
        return round(gpu.sm_clock_mhz(self._t()))
