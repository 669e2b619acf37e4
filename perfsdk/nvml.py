"""GPU readings from NVML, sampled in the background and summarized per region.

One daemon thread (``perfsdk-nvml``) reads utilization, memory used, power, the energy counter,
temperature and SM clock of the GPUs this process uses every ``interval_s`` seconds and keeps
them in a bounded ring. NVML calls take a driver lock and can stall, so they happen on that
thread only, never on the caller's: :meth:`GpuSampler.window` and :meth:`GpuSampler.latest`
only read the ring. Torch device indices map to NVML devices by UUID, so
``CUDA_VISIBLE_DEVICES`` reordering is honoured. perfsdk never initializes CUDA: until the
application has, the sampler has no devices and asks again at every round.

No NVML library, no driver or an NVML error: one :class:`~perfsdk.errors.PerfSDKWarning`, no
readings, nothing breaks.
"""

from __future__ import annotations

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

_READINGS = ("utilization", "memory", "power", "energy", "temperature", "sm_clock")


class _Sample(NamedTuple):
    """One round's readings for one device; ``None`` where the reading failed."""

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

    cpu_s: float
    """CPU time of the sampler thread (``time.thread_time`` inside it)."""
    wall_s: float
    """Wall time the sampler thread has been running."""
    rounds: int
    errors: int
    """NVML calls that failed (each skipped for its round)."""

    @property
    def core_fraction(self) -> float:
        """CPU time as a fraction of one core over the sampler's lifetime."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class _Device:
    def __init__(self, index: int, uuid: str, handle: Any, maxlen: int) -> None:
        self.index = index
        self.uuid = uuid
        self.handle = handle
        self.samples: deque[_Sample] = deque(maxlen=maxlen)
        self.unsupported: set[str] = set()
        self.integrated_j: float | None = None  # energy from power, when the counter is absent
        self.last_power: tuple[int, float] | None = None


def normalize_uuid(uuid: str | bytes) -> str:
    """``GPU-1A2B...`` (NVML), ``1a2b...`` (torch) and bytes all compare equal once normalized."""
    text = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().strip("\0").lower()
    return text[4:] if text.startswith("gpu-") else text


def torch_device_uuids() -> list[str]:
    """UUIDs of this process's CUDA devices in torch order; [] until the app initialized CUDA."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]


_SAMPLERS: weakref.WeakSet[GpuSampler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sampler in list(_SAMPLERS):
        sampler._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class GpuSampler:
    """Background NVML sampler for the GPUs this process uses.

    Args:
        interval_s: seconds between rounds.
        nvml: the NVML bindings (the ``pynvml`` module of nvidia-ml-py by default; tests pass
            :class:`perfsdk._fake_nvml.FakeNvml`).
        device_uuids: returns the UUIDs of this process's GPUs in torch device order; by
            default read from torch once the application has initialized CUDA.
        history_s: how much history the ring keeps.
        clock: the timestamp source for samples, ``time.perf_counter_ns`` (the clock of region
            records) unless a test drives time itself.

    Example:
        >>> sampler = GpuSampler(interval_s=0.1)
        >>> if sampler.start():  # False, with one warning, where there is no NVML
        ...     attrs = sampler.window(t0_ns, t1_ns)  # from a background thread, later
        ...     sampler.stop()
    """

    def __init__(self, interval_s: float = 0.1, *, nvml: Any = None,
                 device_uuids: Callable[[], list[str]] | None = None,
                 history_s: float = 600.0,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        if not interval_s > 0:
            raise ValueError(f"GpuSampler: interval_s must be > 0 seconds, got {interval_s!r}")
        if not history_s >= interval_s:
            raise ValueError(f"GpuSampler: history_s must be >= interval_s ({interval_s!r}), "
                             f"got {history_s!r}")
        self.interval_s = float(interval_s)
        self.interval_ns = int(interval_s * 1e9)
        self._nvml_arg = nvml
        self._device_uuids = device_uuids or torch_device_uuids
        self._maxlen = int(history_s / interval_s) + 2
        self._clock = clock
        self._devices: list[_Device] = []
        self._init_state()
        _SAMPLERS.add(self)

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running = False
        self._started_ok = False
        self._rounds = 0
        self._errors = 0
        self._cpu_s = 0.0
        self._t_start = 0.0
        self._t_last = 0.0
        self._last_round_ns: int | None = None
        self._last_round_mono = 0.0

    def _reset_after_fork(self) -> None:
        # The child has no sampler thread (and the parent's may have held the lock): stopped,
        # startable again. The parent's samples stay readable; NVML is not shut down here.
        self._init_state()
        self._started_ok = bool(self._devices)

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
        self._stop = threading.Event()
        self._rounds = self._errors = 0
        self._cpu_s = 0.0
        self._last_round_ns = None
        self._t_start = self._t_last = self._last_round_mono = time.monotonic()
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
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            warn_once("nvml-stop-timeout", f"perfsdk: the NVML sampler did not stop within "
                      f"{timeout_s:g} s (an NVML call is stalled); leaving it to end on its own.")
            return False
        return True

    # -- the sampler thread ----------------------------------------------------------------
    def _run(self, nvml: Any, stop: threading.Event) -> None:
        cpu0 = time.thread_time()
        deadline = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    self._round(nvml)
                except Exception as exc:  # our own bug: report, keep sampling
                    warn_once("nvml-sampler-error", f"perfsdk: NVML sampling round failed "
                              f"({exc!r}); continuing.")
                self._cpu_s = time.thread_time() - cpu0
                now = self._t_last = time.monotonic()
                deadline = max(deadline + self.interval_s, now)
                stop.wait(deadline - now)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:
                logger.debug("nvmlShutdown failed: %r", exc)

    def _round(self, nvml: Any) -> None:
        if not self._devices:
            devices = self._discover(nvml)
            with self._lock:
                self._devices = devices
        t_ns = self._clock()
        for dev in self._devices:
            sample = self._read(nvml, dev, t_ns)
            with self._lock:
                dev.samples.append(sample)
        self._rounds += 1
        self._last_round_ns = t_ns
        self._last_round_mono = time.monotonic()

    def _discover(self, nvml: Any) -> list[_Device]:
        try:
            wanted = list(self._device_uuids())
        except Exception as exc:
            warn_once("nvml-device-lookup", f"perfsdk: could not list this process's CUDA "
                      f"devices ({exc!r}); no GPU readings yet.")
            return []
        if not wanted:
            return []
        by_uuid: dict[str, tuple[str, Any]] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                if isinstance(uuid, bytes):
                    uuid = uuid.decode("ascii", "replace")
                by_uuid[normalize_uuid(uuid)] = (str(uuid), handle)
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
                  f"{type(exc).__name__}: {exc}); skipping it for that round.")

    def _call(self, nvml: Any, dev: _Device, reading: str, fn: Callable[[], Any]) -> Any:
        if reading in dev.unsupported:
            return None
        try:
            return fn()
        except nvml.NVMLError_NotSupported:
            dev.unsupported.add(reading)  # a property of the GPU: don't ask again
            logger.info("NVML: %s is not supported on GPU %s", reading, dev.uuid)
        except nvml.NVMLError as exc:
            self._error(reading, exc)
        return None

    def _read(self, nvml: Any, dev: _Device, t_ns: int) -> _Sample:
        h = dev.handle
        util = self._call(nvml, dev, "utilization",
                          lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
        mem = self._call(nvml, dev, "memory", lambda: float(nvml.nvmlDeviceGetMemoryInfo(h).used))
        power = self._call(nvml, dev, "power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        energy = self._call(nvml, dev, "energy",
                            lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)
        if "energy" in dev.unsupported:
            energy = self._integrate(dev, t_ns, power)
        elif energy is not None:
            dev.integrated_j = energy  # a later fallback continues from the counter
        temp = self._call(nvml, dev, "temperature",
                          lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        clock = self._call(nvml, dev, "sm_clock",
                           lambda: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        return _Sample(t_ns, util, mem, power, energy, temp, clock)

    @staticmethod
    def _integrate(dev: _Device, t_ns: int, power: float | None) -> float | None:
        """Energy counter from power (trapezoids between successive power readings)."""
        if power is None:
            return None
        if dev.last_power is None or dev.integrated_j is None:
            dev.integrated_j = dev.integrated_j or 0.0
        else:
            t0, p0 = dev.last_power
            dev.integrated_j += (p0 + power) / 2 * (t_ns - t0) / 1e9
        dev.last_power = (t_ns, power)
        return dev.integrated_j

    # -- readers (any thread) ----------------------------------------------------------------
    def devices(self) -> dict[int, str]:
        """Torch device index to NVML UUID, for the devices found so far."""
        with self._lock:
            return {d.index: d.uuid for d in self._devices}

    def ready(self, end_ns: int) -> bool:
        """Whether :meth:`window` ending at ``end_ns`` can be answered now: a round at or after
        ``end_ns`` was taken, or the sampler is stopped or stalled (then it never will be)."""
        if not self._running:
            return True
        last = self._last_round_ns
        if last is not None and last >= end_ns:
            return True
        stalled_s = max(1.0, 5 * self.interval_s)
        return time.monotonic() - self._last_round_mono > stalled_s

    def latest(self) -> dict[int, dict[str, float]]:
        """The newest reading per device: ``utilization`` (0..1), ``memory_used_bytes``,
        ``power_w``, ``energy_j``, ``temperature_c``, ``sm_clock_mhz``, ``t_ns``; a failed
        reading is absent."""
        if not self._started_ok:
            return {}
        out: dict[int, dict[str, float]] = {}
        with self._lock:
            for dev in self._devices:
                if dev.samples:
                    s = dev.samples[-1]
                    values = zip(("utilization", "memory_used_bytes", "power_w", "energy_j",
                                  "temperature_c", "sm_clock_mhz"), s[1:], strict=True)
                    out[dev.index] = {k: v for k, v in values if v is not None}
                    out[dev.index]["t_ns"] = float(s.t_ns)
        return out

    def overhead(self) -> SamplerStats:
        """The sampler thread's own CPU time and rounds so far."""
        end = time.monotonic() if self._running else self._t_last
        return SamplerStats(cpu_s=self._cpu_s, wall_s=max(0.0, end - self._t_start),
                            rounds=self._rounds, errors=self._errors)

    def window(self, start_ns: int, end_ns: int, device: int = 0) -> dict[str, Any]:
        """Span attributes for a region that ran between two ``perf_counter_ns`` readings.

        Averages are time-weighted over ``[start_ns, end_ns]`` (samples joined by straight
        lines, cut at the edges); energy is the counter's rise, interpolated to the edges;
        maxima are over the samples inside the window. A window shorter than the interval, or
        without a sample at or before its start and one at or after its end, gives only
        ``perfsdk.gpu.samples`` and ``perfsdk.gpu.window_too_short``. While the sampler runs
        and has not yet sampled past ``end_ns`` (see :meth:`ready`), the answer is
        ``perfsdk.gpu.pending``. Never started, no NVML or no such device: ``{}``.
        """
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
        attrs: dict[str, Any] = {
            "hw.id": dev.uuid, "hw.type": "gpu", "perfsdk.gpu.uuid": dev.uuid,
            "perfsdk.gpu.index": dev.index, "perfsdk.gpu.samples": len(used),
        }
        averages = {"utilization": "hw.gpu.utilization", "power": "perfsdk.gpu.power_w",
                    "sm_clock": "perfsdk.gpu.sm_clock_mhz"}
        for field, key in averages.items():
            avg = _average([(s.t_ns, getattr(s, field)) for s in used], start_ns, end_ns)
            if avg is not None:
                attrs[key] = avg
        for field, key in (("memory", "hw.gpu.memory.usage"),
                           ("temperature", "perfsdk.gpu.temperature_max_c")):
            peak = _peak([(s.t_ns, getattr(s, field)) for s in used], start_ns, end_ns)
            if peak is not None:
                attrs[key] = int(peak) if field == "memory" else peak
        energy = _delta([(s.t_ns, s.energy) for s in used], start_ns, end_ns)
        if energy is not None:
            attrs["perfsdk.gpu.energy_j"] = energy
            attrs["perfsdk.gpu.energy_source"] = ("integrated_power" if "energy" in
                                                  dev.unsupported else "counter")
        return attrs


def _points(series: list[tuple[int, float | None]], start: int, end: int,
            ) -> list[tuple[int, float]] | None:
    """The series cut to ``[start, end]``, with values interpolated at both edges; None unless
    a reading exists at or before ``start`` and at or after ``end``."""
    known = [(t, v) for t, v in series if v is not None]
    if not known or known[0][0] > start or known[-1][0] < end:
        return None

    def at(t: int) -> float:
        for (t0, v0), (t1, v1) in zip(known, known[1:], strict=False):
            if t0 <= t <= t1:
                return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return known[0][1]  # one reading exactly at both edges

    return [(start, at(start)), *((t, v) for t, v in known if start < t < end), (end, at(end))]


def _average(series: list[tuple[int, float | None]], start: int, end: int) -> float | None:
    pts = _points(series, start, end)
    if pts is None or end <= start:
        return None
    area = sum((v0 + v1) / 2 * (t1 - t0) for (t0, v0), (t1, v1) in zip(pts, pts[1:],
                                                                          strict=False))
    return area / (end - start)


def _peak(series: list[tuple[int, float | None]], start: int, end: int) -> float | None:
    inside = [v for t, v in series if v is not None and start <= t <= end]
    if inside:
        return max(inside)
    pts = _points(series, start, end)  # no reading inside: the bracketing readings bound it
    known = [v for _, v in series if v is not None]
    return max(known) if pts is not None and known else None


def _delta(series: list[tuple[int, float | None]], start: int, end: int) -> float | None:
    pts = _points(series, start, end)
    if pts is None:
        return None
    rise = pts[-1][1] - pts[0][1]
    return rise if rise >= 0 else None  # a counter reset (driver reload): no number
