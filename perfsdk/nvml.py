"""GPU readings from NVML, sampled in the background and summarized per region.

One daemon thread (``perfsdk-nvml``) reads utilization, memory used, power, the energy counter,
temperature and SM clock of this process's GPUs every ``interval_s`` into a bounded ring. NVML
calls take a driver lock and can stall, so only that thread makes them; :meth:`GpuSampler.window`
and :meth:`GpuSampler.latest` only read the ring. Torch devices map to NVML devices by UUID
(``CUDA_VISIBLE_DEVICES`` reordering is honoured). perfsdk never initializes CUDA: until the
application has, there are no devices and each round asks again. No NVML library, no driver or
an NVML error: one :class:`~perfsdk.errors.PerfSDKWarning`, no readings, nothing breaks.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from perfsdk.errors import warn_once

try:  # optional: pip install 'perfsdk[nvml]'
    import pynvml
except ImportError:
    pynvml = None

__all__ = ["GpuSampler", "SamplerStats"]

logger = logging.getLogger(__name__)


class _Sample(NamedTuple):  # one round, one device; None where the reading failed
    t_ns: int
    utilization: float | None  # ratio 0..1
    memory: float | None  # bytes used
    power: float | None  # W
    energy: float | None  # J, cumulative (counter, or integrated power)
    temperature: float | None  # degrees C
    sm_clock: float | None  # MHz


@dataclass(frozen=True)
class SamplerStats:
    """What the sampler itself has cost so far (see :meth:`GpuSampler.overhead`)."""

    cpu_s: float  # CPU time of the sampler thread (time.thread_time inside it)
    wall_s: float  # wall time it has been running
    rounds: int
    errors: int  # NVML calls that failed (each skipped for its round)

    @property
    def core_fraction(self) -> float:  # of one core, over the sampler's lifetime
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class _Device:
    def __init__(self, index: int, uuid: str, handle: Any, maxlen: int) -> None:
        self.index, self.uuid, self.handle = index, uuid, handle
        self.samples: deque[_Sample] = deque(maxlen=maxlen)
        self.unsupported: set[str] = set()  # readings this GPU answered NotSupported to
        self.integrated_j: float | None = None  # energy from power, when the counter is absent
        self.last_power: tuple[int, float] | None = None


def normalize_uuid(uuid: str | bytes) -> str:
    """``GPU-1A2B...`` (NVML), ``1a2b...`` (torch) and bytes all compare equal once normalized."""
    text = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().strip("\0").lower()
    return text[4:] if text.startswith("gpu-") else text


def torch_device_uuids() -> list[str]:
    """UUIDs of this process's CUDA devices in torch order; [] until the app initialized CUDA."""
    from perfsdk import _device  # imports torch: only once a sampler looks for devices

    backend = _device.get_backend()
    if not backend.is_initialized():
        return []
    return [str(backend.get_device_properties(i).uuid) for i in range(backend.device_count())]


_SAMPLERS: weakref.WeakSet[GpuSampler] = weakref.WeakSet()


def _after_fork_in_child() -> None:  # the child has no sampler thread: stopped, startable
    for sampler in list(_SAMPLERS):
        sampler._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class GpuSampler:
    """Background NVML sampler for the GPUs this process uses.

    Args:
        interval_s: seconds between rounds.
        nvml: the NVML bindings: nvidia-ml-py's ``pynvml`` by default, or a test's
            :class:`perfsdk.testing.FakeNvml`.
        device_uuids: this process's GPU UUIDs in torch device order (default: from torch,
            once the application has initialized CUDA).
        history_s: how much history the ring keeps.
        clock: timestamps of samples: ``time.perf_counter_ns``, the clock of region records.

    Example:
        >>> from perfsdk.testing import FakeNvml
        >>> fake = FakeNvml(1, step_ns=10_000_000)  # one GPU drawing 100 W; rounds 10 ms apart
        >>> sampler = GpuSampler(0.01, nvml=fake, device_uuids=fake.uuids, clock=fake.clock)
        >>> sampler.start()  # False, with one warning, where there is no NVML
        True
        >>> while sampler.overhead().rounds < 5:
        ...     time.sleep(0.01)
        >>> sampler.stop()
        True
        >>> attrs = sampler.window(15_000_000, 35_000_000)  # a region's perf_counter_ns
        >>> attrs["perfsdk.gpu.power_w"], round(attrs["perfsdk.gpu.energy_j"], 9)
        (100.0, 2.0)
    """

    def __init__(self, interval_s: float = 0.1, *, nvml: Any = None,
                 device_uuids: Callable[[], list[str]] | None = None, history_s: float = 600.0,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        if not interval_s > 0:
            raise ValueError(f"GpuSampler: interval_s must be > 0 seconds, got {interval_s!r}")
        if not history_s >= interval_s:
            raise ValueError(f"GpuSampler: history_s must be >= interval_s, got {history_s!r}")
        self.interval_s, self.interval_ns = float(interval_s), int(interval_s * 1e9)
        self._nvml_arg, self._clock = nvml, clock
        self._device_uuids = device_uuids or torch_device_uuids
        self._maxlen = int(history_s / interval_s) + 2
        self._devices: list[_Device] = []
        self._started_ok = False  # samples to read: started once, successfully
        self._reset_after_fork()
        _SAMPLERS.add(self)

    def _reset_after_fork(self) -> None:  # also in a forked child: the lock may be held there
        self._lock = threading.Lock()
        self._init_state()

    def _init_state(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop, self._running = threading.Event(), False
        self._rounds, self._errors, self._cpu_s = 0, 0, 0.0
        self._t_start = self._t_last = self._last_round_mono = time.monotonic()
        self._last_round_ns: int | None = None

    @property
    def running(self) -> bool:
        return self._running

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> bool:
        """Initialize NVML and start the sampler thread; False (one warning) if NVML is missing
        or fails. Costs one ``nvmlInit``: call it off the hot path."""
        if self._running:
            return True
        nvml = pynvml if self._nvml_arg is None else self._nvml_arg
        if nvml is None:
            warn_once("nvml-unavailable", "perfsdk: GPU readings are off: nvidia-ml-py is not "
                      "installed. Install it with: pip install 'perfsdk[nvml]'")
            return False
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError (no driver, no GPU), or a broken library
            warn_once("nvml-unavailable", f"perfsdk: GPU readings are off: NVML could not "
                      f"start ({type(exc).__name__}: {exc}).")
            return False
        with self._lock:
            self._devices = []
        self._init_state()
        self._running = self._started_ok = True
        self._thread = threading.Thread(target=self._run, args=(nvml, self._stop),
                                        name="perfsdk-nvml", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop sampling; wait at most ``timeout_s`` for the thread, which shuts NVML down as
        it ends. True if it ended in time (a thread stuck in the driver ends on its own later).
        Samples taken so far stay readable until the next :meth:`start`."""
        self._running = False
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                warn_once("nvml-stop-timeout", f"perfsdk: the NVML sampler did not stop within "
                          f"{timeout_s:g} s (an NVML call is stalled); it will end on its own.")
                return False
        return True

    # -- the sampler thread ----------------------------------------------------------------
    def _run(self, nvml: Any, stop: threading.Event) -> None:
        cpu0 = time.thread_time()
        deadline = time.monotonic()
        while not stop.is_set():
            try:
                self._round(nvml, stop)
            except Exception as exc:  # our own bug: report, keep sampling
                warn_once("nvml-sampler-error", f"perfsdk: NVML sampling failed ({exc!r}).")
            self._cpu_s = time.thread_time() - cpu0
            now = self._t_last = time.monotonic()
            deadline = max(deadline + self.interval_s, now)  # behind: skip, don't burst
            stop.wait(deadline - now)
        try:  # NVML's init is reference counted: this undoes start()'s
            nvml.nvmlShutdown()
        except Exception as exc:
            logger.debug("nvmlShutdown failed: %r", exc)

    def _round(self, nvml: Any, stop: threading.Event) -> None:
        if not self._devices:
            devices = self._discover(nvml)
            with self._lock:
                if stop.is_set():
                    return
                self._devices = devices
        t_ns = self._clock()
        for dev in self._devices:
            sample = self._read(nvml, dev, t_ns)
            with self._lock:
                if stop.is_set():  # stopped (and maybe restarted) while NVML answered
                    return
                dev.samples.append(sample)
        self._rounds += 1
        self._last_round_ns, self._last_round_mono = t_ns, time.monotonic()

    def _discover(self, nvml: Any) -> list[_Device]:
        try:
            wanted = list(self._device_uuids())
        except Exception as exc:
            warn_once("nvml-device-lookup", f"perfsdk: listing this process's CUDA devices "
                      f"failed ({exc!r}); no GPU readings yet.")
            wanted = []
        by_uuid: dict[str, tuple[str, Any]] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount() if wanted else 0):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
                by_uuid[normalize_uuid(uuid)] = (uuid, handle)
        except nvml.NVMLError as exc:
            self._error("device-list", exc)
        devices = []
        for index, raw in enumerate(wanted):
            found = by_uuid.get(normalize_uuid(raw))
            if found is None:  # e.g. a MIG instance: NVML finds it by its own UUID only
                try:
                    found = (str(raw), nvml.nvmlDeviceGetHandleByUUID(str(raw)))
                except nvml.NVMLError:
                    warn_once("nvml-device-unmapped", f"perfsdk: CUDA device {index} (UUID "
                              f"{raw}) has no NVML device; no GPU readings for it.")
                    continue
            devices.append(_Device(index, found[0], found[1], self._maxlen))
        return devices

    def _error(self, reading: str, exc: BaseException) -> None:
        self._errors += 1
        warn_once("nvml-reading-failed", f"perfsdk: an NVML reading failed ({reading}: "
                  f"{type(exc).__name__}: {exc}); skipped for that round.")

    def _call(self, nvml: Any, dev: _Device, reading: str, fn: Callable[[], Any]) -> Any:
        try:
            return None if reading in dev.unsupported else fn()
        except nvml.NVMLError_NotSupported:
            dev.unsupported.add(reading)  # a property of the GPU: don't ask again
            logger.info("NVML: %s is not supported on GPU %s", reading, dev.uuid)
        except nvml.NVMLError as exc:
            self._error(reading, exc)
        return None

    def _read(self, nvml: Any, dev: _Device, t_ns: int) -> _Sample:
        n, h, call = nvml, dev.handle, self._call  # % -> ratio, mW -> W, mJ -> J
        util = call(n, dev, "utilization", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu / 100)
        mem = call(n, dev, "memory", lambda: float(n.nvmlDeviceGetMemoryInfo(h).used))
        power = call(n, dev, "power", lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3)
        energy = call(n, dev, "energy", lambda: n.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3)
        if energy is not None:
            dev.integrated_j = energy
        elif "energy" in dev.unsupported and power is not None:  # no counter: trapezoids
            if dev.last_power is not None and dev.integrated_j is not None:
                t0, p0 = dev.last_power
                dev.integrated_j += (p0 + power) / 2 * (t_ns - t0) / 1e9
            dev.integrated_j = dev.integrated_j or 0.0  # a fallback goes on from the counter
            dev.last_power = (t_ns, power)
            energy = dev.integrated_j
        sensor, sm = n.NVML_TEMPERATURE_GPU, n.NVML_CLOCK_SM
        temp = call(n, dev, "temperature", lambda: n.nvmlDeviceGetTemperature(h, sensor))
        clock = call(n, dev, "sm_clock", lambda: n.nvmlDeviceGetClockInfo(h, sm))
        return _Sample(t_ns, util, mem, power, energy, temp, clock)

    # -- readers (any thread) ----------------------------------------------------------------
    def devices(self) -> dict[int, str]:
        """Torch device index to NVML UUID, for the devices found so far."""
        with self._lock:
            return {d.index: d.uuid for d in self._devices}

    def ready(self, end_ns: int) -> bool:
        """Whether :meth:`window` ending at ``end_ns`` can be answered now: a round at or after
        ``end_ns`` was taken, or the sampler is stopped or stalled (then it never will be)."""
        last = self._last_round_ns
        return (not self._running or (last is not None and last >= end_ns)
                or time.monotonic() - self._last_round_mono > max(1.0, 5 * self.interval_s))

    def latest(self) -> dict[int, dict[str, float]]:
        """The newest reading per device: ``utilization`` (0..1), ``memory_used_bytes``,
        ``power_w``, ``energy_j``, ``temperature_c``, ``sm_clock_mhz``, ``t_ns``; a failed
        reading is absent."""
        if not self._started_ok:
            return {}
        names = ("t_ns", "utilization", "memory_used_bytes", "power_w", "energy_j",
                 "temperature_c", "sm_clock_mhz")
        with self._lock:
            newest = [(d.index, d.samples[-1]) for d in self._devices if d.samples]
        return {i: {k: float(v) for k, v in zip(names, s, strict=True) if v is not None}
                for i, s in newest}

    def overhead(self) -> SamplerStats:
        """The sampler thread's own CPU time and rounds so far."""
        end = time.monotonic() if self._running else self._t_last
        return SamplerStats(cpu_s=self._cpu_s, wall_s=max(0.0, end - self._t_start),
                            rounds=self._rounds, errors=self._errors)

    def window(self, start_ns: int, end_ns: int, device: int = 0) -> dict[str, Any]:
        """Span attributes for a region that ran between two ``perf_counter_ns`` readings.

        Averages are time-weighted over ``[start_ns, end_ns]`` (samples joined by straight
        lines, cut at the edges); energy is the counter's rise interpolated to the edges; maxima
        are over the samples inside. Shorter than the interval, or no sample at or before the
        start and at or after the end: only ``perfsdk.gpu.samples`` and
        ``perfsdk.gpu.window_too_short``. Not yet sampled past ``end_ns`` (see :meth:`ready`):
        ``perfsdk.gpu.pending``. Never started, no NVML or no such device: ``{}``."""
        if not self._started_ok:
            return {}
        with self._lock:
            dev = next((d for d in self._devices if d.index == device), None)
            if dev is None or not dev.samples:
                return {}
            used: list[_Sample] = []  # newest first, down to the first sample <= start_ns
            for s in reversed(dev.samples):
                used.append(s)
                if s.t_ns <= start_ns:
                    break
        used.reverse()
        inside = sum(1 for s in used if start_ns <= s.t_ns <= end_ns)
        if used[-1].t_ns < end_ns and self._running:
            return {"perfsdk.gpu.samples": inside, "perfsdk.gpu.pending": True}
        while len(used) > 1 and used[-2].t_ns >= end_ns:
            used.pop()  # keep one sample at or after the end
        if (end_ns - start_ns < self.interval_ns or used[0].t_ns > start_ns
                or used[-1].t_ns < end_ns or len(used) < 2):
            return {"perfsdk.gpu.samples": inside, "perfsdk.gpu.window_too_short": True}
        attrs: dict[str, Any] = {"hw.id": dev.uuid, "hw.type": "gpu", "perfsdk.gpu.uuid": dev.uuid,
                                 "perfsdk.gpu.index": dev.index, "perfsdk.gpu.samples": len(used)}
        for field, key, kind in _ATTRIBUTES:
            known = [(s.t_ns, v) for s in used if (v := getattr(s, field)) is not None]
            value = _summary(known, start_ns, end_ns, kind)
            if value is not None:
                attrs[key] = int(value) if field == "memory" else value
        if "perfsdk.gpu.energy_j" in attrs:
            attrs["perfsdk.gpu.energy_source"] = ("integrated_power" if "energy" in
                                                  dev.unsupported else "counter")
        return attrs


_ATTRIBUTES = (  # sample field, span attribute, how a window summarizes it
    ("utilization", "hw.gpu.utilization", "average"),  # ratio 0..1, as OTel's semconv
    ("memory", "hw.gpu.memory.usage", "max"),  # bytes
    ("power", "perfsdk.gpu.power_w", "average"),
    ("energy", "perfsdk.gpu.energy_j", "rise"),
    ("temperature", "perfsdk.gpu.temperature_max_c", "max"),
    ("sm_clock", "perfsdk.gpu.sm_clock_mhz", "average"),
)


def _summary(known: list[tuple[int, float]], start: int, end: int, kind: str) -> float | None:
    """One reading over ``[start, end]``, from readings joined by straight lines; None unless
    one was taken at or before ``start`` and one at or after ``end``."""
    if not known or known[0][0] > start or known[-1][0] < end:
        return None
    if kind == "max":  # over the readings inside; none inside: the bracketing ones bound it
        return max((v for t, v in known if start <= t <= end), default=max(v for _, v in known))

    def at(t: int) -> float:
        for (t0, v0), (t1, v1) in itertools.pairwise(known):
            if t0 <= t <= t1:
                return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return known[0][1]  # a single reading, exactly at both edges

    pts = [(start, at(start)), *((t, v) for t, v in known if start < t < end), (end, at(end))]
    if kind == "rise":
        rise = pts[-1][1] - pts[0][1]
        return rise if rise >= 0 else None  # the counter was reset (driver reload): no number
    area = sum((v0 + v1) / 2 * (t1 - t0) for (t0, v0), (t1, v1) in itertools.pairwise(pts))
    return area / (end - start) if end > start else None
