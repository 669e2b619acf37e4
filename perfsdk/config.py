"""Configuration: one frozen :class:`Config`, read from ``PERFSDK_*`` variables, changed by
:func:`configure`.

Precedence: an explicit :func:`configure` argument beats an environment variable, which beats
the default. A bad argument raises :class:`ValueError` naming it and the accepted values; a bad
environment variable warns once, naming the variable, and falls back to the default (whoever
launches the job sets those, and a typo must not kill a training run).

The standard ``OTEL_*`` variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL``,
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_RESOURCE_ATTRIBUTES`` ...) are not read here: they reach
OpenTelemetry's own exporters untouched.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from perfsdk.errors import warn_once

__all__ = [
    "EXPORTERS",
    "MAX_SECONDS",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_SCHEDULE_DELAY",
    "PERFSDK_DISABLE_EXTENSIONS",
    "PERFSDK_ENABLED",
    "PERFSDK_EXPORTER",
    "PERFSDK_EXPORT_BACKOFF_MAX",
    "PERFSDK_EXPORT_BACKOFF_MIN",
    "PERFSDK_EXPORT_TIMEOUT",
    "PERFSDK_GPU_SAMPLE_INTERVAL",
    "PERFSDK_MEMORY",
    "PERFSDK_MEMORY_SNAPSHOTS",
    "PERFSDK_NVTX",
    "PERFSDK_OUTPUT_DIR",
    "PERFSDK_PEAK_FLOPS",
    "PERFSDK_SAMPLE_EVERY",
    "PERFSDK_SERVICE_NAME",
    "PERFSDK_SYNC_GUARD",
    "PERFSDK_TIMING",
    "PERFSDK_TRACE_MAX_REGIONS",
    "SYNC_GUARD_MODES",
    "Config",
    "configure",
    "extensions_enabled",
    "get_config",
]

PERFSDK_ENABLED: Final = "PERFSDK_ENABLED"
"""Turn all instrumentation on or off: ``1``/``0`` (also ``true``/``false``, ``yes``/``no``,
``on``/``off``). Default ``1``. With ``0`` at decoration time, ``@profiled`` returns the function
itself; at run time each call costs one flag test."""

PERFSDK_EXPORTER: Final = "PERFSDK_EXPORTER"
"""Where spans and metrics go: a comma list of ``otlp``, ``console``, ``file``, ``trace``, or
``none``. ``trace`` writes every region to a Chrome / Perfetto JSON trace,
``<output_dir>/trace-<pid>.json``, rewritten whole at each flush and at exit (see docs/trace.md);
it needs no OpenTelemetry package.
Default: ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or its ``_TRACES_`` / ``_METRICS_``
variant) is set, else
``none`` (the in-process summary still works). Ignored when the application installed its own
OpenTelemetry TracerProvider: perfsdk then uses that provider and adds nothing of its own (the
``trace`` file is still written)."""

PERFSDK_OUTPUT_DIR: Final = "PERFSDK_OUTPUT_DIR"
"""Directory for files perfsdk writes (the ``file`` exporter's ``spans-<pid>.jsonl``, the
``trace`` exporter's ``trace-<pid>.json``).
Default ``./perfsdk-output``; created on first write."""

PERFSDK_SAMPLE_EVERY: Final = "PERFSDK_SAMPLE_EVERY"
"""Record every N-th call of each decorated function or region (an integer >= 1). Default ``1``.
An explicit ``every=`` on ``@profiled`` wins. With ``PERFSDK_TIMING=0`` the same entries are the
ones that emit NVTX ranges."""

PERFSDK_NVTX: Final = "PERFSDK_NVTX"
"""Emit NVTX ranges: ``1``/``0``. Default ``1``. NVTX costs ~60 ns a range when no tool is
attached."""

PERFSDK_TIMING: Final = "PERFSDK_TIMING"
"""Measure regions: ``1``/``0``. Default ``1``. With ``0`` a region only emits its NVTX range
(the lightest mode, for ``nsys profile`` runs where Nsight does the timing): no host or device
time, no span, no summary row, no torch.profiler annotation."""

PERFSDK_DISABLE_EXTENSIONS: Final = "PERFSDK_DISABLE_EXTENSIONS"
"""Ignore perfsdk's optional compiled hot path (``perfsdk._fastpath``, built at install when a C
compiler is present) and use the pure-Python paths: ``1``/``0``. Default ``0``. Read once, at
import. The compiled path runs NVTX-only mode's push, call and pop in one C call, reads
memory=True's RSS without building a ``struct_rusage``, and runs ``instrument_module``'s
per-module entries and backward hooks in C; the export threads build spans with
``perfsdk.export._spanbuild``; both paths record the same ranges, regions, readings and
spans."""

PERFSDK_MEMORY: Final = "PERFSDK_MEMORY"
"""Record memory per region by default: ``1``/``0``. Default ``0``. On CUDA: allocated and
reserved bytes and the region's true peak (perfsdk then resets torch's process-wide peak counter
at each region's enter, so read peaks from perfsdk, not ``max_memory_allocated``); everywhere:
growth of the process's peak RSS. About 1.1 us a region on CPU (1.4 us without perfsdk's compiled
module; docs/memory.md). ``memory=`` on a region wins."""

PERFSDK_MEMORY_SNAPSHOTS: Final = "PERFSDK_MEMORY_SNAPSHOTS"
"""Record CUDA allocation history so an out-of-memory error inside a region writes a snapshot
(``<output_dir>/oom-<pid>-<n>.pickle``, for pytorch.org/memory_viz): ``1``/``0``. Default ``0``.
Recording history slows every CUDA allocation; turn it on to chase an OOM."""

PERFSDK_GPU_SAMPLE_INTERVAL: Final = "PERFSDK_GPU_SAMPLE_INTERVAL"
"""Seconds between NVML readings of the GPUs this process uses (utilization, memory, power,
energy, temperature, SM clock), a float >= 0; ``0`` turns GPU sampling off. Default ``0.1``.
Sampling starts, on a background thread, once the application has initialized CUDA and
``nvidia-ml-py`` can talk to a driver."""

PERFSDK_SERVICE_NAME: Final = "PERFSDK_SERVICE_NAME"
"""``service.name`` of perfsdk's OpenTelemetry resource. Default: ``OTEL_SERVICE_NAME`` if set,
else ``service.name`` from ``OTEL_RESOURCE_ATTRIBUTES`` if set there, else ``perfsdk``."""

PERFSDK_EXPORT_TIMEOUT: Final = "PERFSDK_EXPORT_TIMEOUT"
"""Seconds that :func:`perfsdk.flush` and :func:`perfsdk.shutdown` wait at most, and that
interpreter exit adds at most in total (resolving, exporting spans, metrics and the trace file
share this one budget), a float > 0 and <= 86400. Default ``5``. Also each batch's exporter
timeout unless ``OTEL_BSP_EXPORT_TIMEOUT`` is set. A DataLoader worker (a multiprocessing
child) waits at most ``min(this, 0.5)`` s at its exit. An unreachable collector never hangs
exit: what is not sent by then is counted as lost (reason ``shutdown``)."""

OTEL_BSP_MAX_QUEUE_SIZE: Final = "OTEL_BSP_MAX_QUEUE_SIZE"
"""Spans waiting for export, per exporter, at most (OpenTelemetry's BatchSpanProcessor variable),
an integer from 1 to 1,000,000. Default ``2048``. Beyond it a span is dropped and counted
(``queue_full``, or ``backing_off`` while the collector is being retried); the summary still
counts the region."""

OTEL_BSP_MAX_EXPORT_BATCH_SIZE: Final = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
"""Spans per export call at most, an integer from 1 to ``OTEL_BSP_MAX_QUEUE_SIZE``. Default
``512``. A full batch is exported at once, without waiting for the schedule delay."""

OTEL_BSP_SCHEDULE_DELAY: Final = "OTEL_BSP_SCHEDULE_DELAY"
"""Milliseconds between exports of a partial batch, from 0 to 86,400,000. Default ``5000``."""

OTEL_BSP_EXPORT_TIMEOUT: Final = "OTEL_BSP_EXPORT_TIMEOUT"
"""Milliseconds one export call may take (given to the OTLP exporter as its timeout), > 0 and
<= 86,400,000. Default: ``PERFSDK_EXPORT_TIMEOUT``. ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT``,
when set, still reaches the OTLP exporter itself."""

PERFSDK_EXPORT_BACKOFF_MIN: Final = "PERFSDK_EXPORT_BACKOFF_MIN"
"""Seconds of rest after the first failed export, a float > 0 and <= 86400. Default ``0.5``.
Each further failure in a row doubles the rest, up to ``PERFSDK_EXPORT_BACKOFF_MAX``, with full
jitter (a random rest between half and all of it); the first success ends the backoff. Spans
produced meanwhile wait in the bounded queue."""

PERFSDK_EXPORT_BACKOFF_MAX: Final = "PERFSDK_EXPORT_BACKOFF_MAX"
"""The longest rest between export attempts while a collector fails, in seconds, a float
>= ``PERFSDK_EXPORT_BACKOFF_MIN`` and <= 86400. Default ``30``."""

PERFSDK_TRACE_MAX_REGIONS: Final = "PERFSDK_TRACE_MAX_REGIONS"
"""Regions the ``trace`` exporter's file holds at most (their text kept in memory: about
170 bytes each), an integer from 1 to 100,000,000. Default ``250000``. Later regions are
counted in the file's ``otherData`` (``perfsdk.dropped_regions``) and in
:func:`perfsdk.diagnostics`."""

PERFSDK_SYNC_GUARD: Final = "PERFSDK_SYNC_GUARD"
"""Override the mode of every :func:`perfsdk.no_sync_guard`: ``off``, ``count``, ``warn`` or
``error``. Default: unset (each guard keeps its own mode). Leave guards in the code and set
``error`` in CI, ``off`` in production."""

PERFSDK_PEAK_FLOPS: Final = "PERFSDK_PEAK_FLOPS"
"""The device's peak FLOP/s, the denominator of ``perfsdk.mfu`` (:func:`perfsdk.peak_flops`),
for every dtype: a positive number (``989e12``) or one with a K/M/G/T/P suffix (``989T``).
Default: unset (a GPU's dense tensor-core peak from perfsdk's table by its name, a CPU's
measured GEMM peak; docs/flops.md). A bad value warns once and is ignored. Read at each
:func:`perfsdk.peak_flops` call."""

SYNC_GUARD_MODES: Final = ("off", "count", "warn", "error")
"""The accepted values of :data:`PERFSDK_SYNC_GUARD` and of ``configure(sync_guard=...)``."""

EXPORTERS: Final = ("otlp", "console", "file", "none", "trace")
"""The accepted values of :data:`PERFSDK_EXPORTER` and of ``configure(exporter=...)``."""

MAX_SECONDS: Final = 86_400.0
"""The longest duration any setting accepts (a day): larger values are typos or ``inf``."""

OTLP_ENDPOINT_VARS: Final = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
"""OpenTelemetry's endpoint variables: with any of them set, the default exporters add OTLP."""
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclasses.dataclass(frozen=True)
class Config:
    """perfsdk's settings. Build one with :func:`configure`; read it with :func:`get_config`."""

    enabled: bool = True
    exporters: tuple[Any, ...] = ()
    output_dir: Path = Path("perfsdk-output")
    sample_every: int = 1
    nvtx: bool = True
    timing: bool = True
    memory: bool = False
    memory_snapshots: bool = False
    gpu_sample_interval_s: float = 0.1
    service_name: str = "perfsdk"
    export_timeout_s: float = 5.0
    sync_guard: str | None = None
    export_queue_size: int = 2048
    export_batch_size: int = 512
    export_delay_s: float = 5.0
    export_batch_timeout_s: float | None = None
    """None: ``export_timeout_s``."""
    export_backoff_min_s: float = 0.5
    export_backoff_max_s: float = 30.0
    trace_max_regions: int = 250_000

    def __post_init__(self) -> None:
        if self.export_batch_size > self.export_queue_size:
            raise ValueError(f"export_batch_size={self.export_batch_size} is larger than "
                             f"export_queue_size={self.export_queue_size}; accepted values are "
                             "batch sizes from 1 to the queue size")
        if self.export_backoff_max_s < self.export_backoff_min_s:
            raise ValueError(f"export_backoff_max_s={self.export_backoff_max_s:g} is less than "
                             f"export_backoff_min_s={self.export_backoff_min_s:g}; accepted "
                             "values are a maximum >= the minimum")

    @property
    def batch_timeout_s(self) -> float:
        """One export call's timeout: ``export_batch_timeout_s``, else ``export_timeout_s``."""
        explicit = self.export_batch_timeout_s
        return self.export_timeout_s if explicit is None else explicit

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read the ``PERFSDK_*`` variables; each bad value warns once and uses the default."""
        env = os.environ if environ is None else environ
        default = cls()
        otlp_env = any(env.get(k) for k in OTLP_ENDPOINT_VARS)
        return cls(
            enabled=_env(env, PERFSDK_ENABLED, _parse_bool, default.enabled),
            exporters=_env(env, PERFSDK_EXPORTER, _parse_exporters, ("otlp",) if otlp_env else ()),
            output_dir=_env(env, PERFSDK_OUTPUT_DIR, _parse_path, default.output_dir),
            sample_every=_env(env, PERFSDK_SAMPLE_EVERY, _parse_every, default.sample_every),
            nvtx=_env(env, PERFSDK_NVTX, _parse_bool, default.nvtx),
            timing=_env(env, PERFSDK_TIMING, _parse_bool, default.timing),
            memory=_env(env, PERFSDK_MEMORY, _parse_bool, default.memory),
            memory_snapshots=_env(env, PERFSDK_MEMORY_SNAPSHOTS, _parse_bool,
                                  default.memory_snapshots),
            gpu_sample_interval_s=_env(env, PERFSDK_GPU_SAMPLE_INTERVAL, _parse_interval,
                                       default.gpu_sample_interval_s),
            service_name=_env(env, PERFSDK_SERVICE_NAME, _parse_name, _otel_service_name(env)),
            export_timeout_s=_env(
                env, PERFSDK_EXPORT_TIMEOUT, _parse_timeout, default.export_timeout_s
            ),
            sync_guard=_env(env, PERFSDK_SYNC_GUARD, _parse_sync_guard, default.sync_guard),
            **_batch_settings(env, default),
        )


def _batch_settings(env: Mapping[str, str], default: Config) -> dict[str, Any]:
    """The export queue's settings from ``OTEL_BSP_*`` and ``PERFSDK_EXPORT_BACKOFF_*``; a batch
    size above the queue size, or a maximum rest below the minimum, warns and is clamped."""
    out: dict[str, Any] = {
        "export_queue_size": _env(env, OTEL_BSP_MAX_QUEUE_SIZE, _parse_queue_size,
                                  default.export_queue_size),
        "export_batch_size": _env(env, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, _parse_queue_size,
                                  default.export_batch_size),
        "export_delay_s": _env(env, OTEL_BSP_SCHEDULE_DELAY, _parse_delay_ms,
                               default.export_delay_s),
        "export_batch_timeout_s": _env(env, OTEL_BSP_EXPORT_TIMEOUT, _parse_timeout_ms,
                                       default.export_batch_timeout_s),
        "export_backoff_min_s": _env(env, PERFSDK_EXPORT_BACKOFF_MIN, _parse_timeout,
                                     default.export_backoff_min_s),
        "export_backoff_max_s": _env(env, PERFSDK_EXPORT_BACKOFF_MAX, _parse_timeout,
                                     default.export_backoff_max_s),
        "trace_max_regions": _env(env, PERFSDK_TRACE_MAX_REGIONS, _parse_trace_max,
                                  default.trace_max_regions),
    }
    if out["export_batch_size"] > out["export_queue_size"] and (
            env.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, "").strip()):
        warn_once(f"env:{OTEL_BSP_MAX_EXPORT_BATCH_SIZE}",
                  f"perfsdk: {OTEL_BSP_MAX_EXPORT_BATCH_SIZE}={out['export_batch_size']} is "
                  f"larger than the queue ({out['export_queue_size']}); accepted values are 1 "
                  f"to {OTEL_BSP_MAX_QUEUE_SIZE}. Using {out['export_queue_size']}.")
    out["export_batch_size"] = min(out["export_batch_size"], out["export_queue_size"])
    if out["export_backoff_max_s"] < out["export_backoff_min_s"]:
        warn_once(f"env:{PERFSDK_EXPORT_BACKOFF_MAX}",
                  f"perfsdk: {PERFSDK_EXPORT_BACKOFF_MAX}={out['export_backoff_max_s']:g} is "
                  f"less than the minimum rest ({out['export_backoff_min_s']:g} s); accepted "
                  f"values are >= {PERFSDK_EXPORT_BACKOFF_MIN}. Using the minimum.")
        out["export_backoff_max_s"] = out["export_backoff_min_s"]
    return out


def _otel_service_name(env: Mapping[str, str]) -> str:
    """OpenTelemetry's own choice of service name, so perfsdk's resource does not override it."""
    if env.get("OTEL_SERVICE_NAME"):
        return env["OTEL_SERVICE_NAME"].strip()
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.name" and value.strip():
            return value.strip()
    return "perfsdk"


def _env(env: Mapping[str, str], name: str, parse: Callable[[str], Any], default: Any) -> Any:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        warn_once(
            f"env:{name}",
            f"perfsdk: ignoring {name}={raw!r}: {exc}. Using the default, {_show(default)}.",
        )
        return default


def extensions_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether to use the compiled hot path (``PERFSDK_DISABLE_EXTENSIONS`` unset or false)."""
    return not _env(os.environ if env is None else env, PERFSDK_DISABLE_EXTENSIONS,
                    _parse_bool, False)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(v if isinstance(v, str) else type(v).__name__ for v in value) or "none"
    return str(value)


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("accepted values are 1/0, true/false, yes/no, on/off")


def _is_exporter(item: Any) -> bool:
    """An OpenTelemetry exporter or metric reader instance (export or collect, and shutdown)."""
    return (callable(getattr(item, "export", None)) or callable(getattr(item, "collect", None))
            ) and callable(getattr(item, "shutdown", None))


def _parse_exporters(raw: Any) -> tuple[Any, ...]:
    if _is_exporter(raw):
        return (raw,)
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    instances = [item for item in items if _is_exporter(item)]
    items = [item for item in items if not _is_exporter(item)]
    names = [str(item).strip().lower() for item in items if str(item).strip()]
    if instances and not names:
        return tuple(instances)
    bad = [n for n in names if n not in EXPORTERS]
    if bad or not names:
        raise ValueError(
            f"unknown exporter {', '.join(map(repr, bad)) or '(empty)'}; accepted values are a "
            f"comma list of {', '.join(EXPORTERS)}, or OpenTelemetry SpanExporter instances"
        )
    if "none" in names and len(names) + len(instances) > 1:
        raise ValueError("'none' cannot be combined with other exporters")
    return (*dict.fromkeys(n for n in names if n != "none"), *instances)


def _parse_path(raw: str | os.PathLike[str]) -> Path:
    return Path(raw).expanduser()


def _number(raw: Any, accepted: str, low: float, high: float, *, integer: bool = False,
            low_open: bool = False) -> float:
    """``raw`` as a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``), else
    ValueError with ``accepted`` (what the values may be) in its message."""
    if isinstance(raw, bool):
        raise ValueError(f"accepted values are {accepted}")
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise ValueError(f"accepted values are {accepted}") from None
    if (not math.isfinite(value) or value > high or value < low or (low_open and value == low)
            or (integer and value != int(value))):
        raise ValueError(f"accepted values are {accepted}")
    return value


def _parse_every(raw: str | int) -> int:
    return int(_number(raw, "integers from 1 to 1,000,000,000", 1, 1e9, integer=True))


def _parse_queue_size(raw: str | int) -> int:
    return int(_number(raw, "integers from 1 to 1,000,000", 1, 1e6, integer=True))


def _parse_trace_max(raw: str | int) -> int:
    return int(_number(raw, "integers from 1 to 100,000,000", 1, 1e8, integer=True))


def _parse_delay_ms(raw: str) -> float:
    return _number(raw, "milliseconds from 0 to 86400000 (a day)", 0, MAX_SECONDS * 1000) / 1000


def _parse_timeout_ms(raw: str) -> float:
    return _number(raw, "milliseconds > 0 and <= 86400000 (a day)", 0, MAX_SECONDS * 1000,
                   low_open=True) / 1000


def _parse_name(raw: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("accepted values are non-empty strings")
    return raw.strip()


def _parse_timeout(raw: str | float) -> float:
    return _number(raw, "numbers of seconds > 0 and <= 86400 (a day)", 0, MAX_SECONDS,
                   low_open=True)


def _parse_optional_timeout(raw: str | float | None) -> float | None:
    return None if raw is None else _parse_timeout(raw)


def _parse_delay(raw: str | float) -> float:
    return _number(raw, "numbers of seconds from 0 to 86400 (a day)", 0, MAX_SECONDS)


def _parse_sync_guard(raw: str | None) -> str | None:
    if raw is None:
        return None
    value = raw.strip().lower() if isinstance(raw, str) else raw
    if value not in SYNC_GUARD_MODES:
        raise ValueError(f"accepted values are None (each guard's own mode) or "
                         f"{', '.join(repr(m) for m in SYNC_GUARD_MODES)}")
    return str(value)


def _parse_interval(raw: str | float) -> float:
    return _number(raw, "numbers of seconds from 0 (off) to 86400 (a day)", 0, MAX_SECONDS)


class _HotState:
    """The few settings read on every call, as plain attributes (one attribute load each)."""

    __slots__ = ("enabled", "memory", "nvtx", "nvtx_only", "sample_every", "timing")

    def __init__(self, config: Config) -> None:
        self.enabled = config.enabled
        self.nvtx = config.nvtx
        self.sample_every = config.sample_every
        self.timing = config.timing
        self.memory = config.memory
        self.nvtx_only = _nvtx_only(config)


def _nvtx_only(config: Config) -> bool:
    """NVTX-only mode with every entry recorded: ``@profiled``'s shortest path (one load)."""
    return not config.timing and config.nvtx and config.sample_every == 1


_lock = threading.Lock()
_config = Config.from_env()
state = _HotState(_config)
_listeners: list[Callable[[Config, Config], None]] = []
_UNSET: Any = object()


def get_config() -> Config:
    """The settings in force now."""
    return _config


def configure(
    *,
    enabled: bool = _UNSET,
    exporter: str | Iterable[Any] | Any = _UNSET,
    output_dir: str | os.PathLike[str] = _UNSET,
    sample_every: int = _UNSET,
    nvtx: bool = _UNSET,
    timing: bool = _UNSET,
    memory: bool = _UNSET,
    memory_snapshots: bool = _UNSET,
    gpu_sample_interval_s: float = _UNSET,
    service_name: str = _UNSET,
    export_timeout_s: float = _UNSET,
    sync_guard: str | None = _UNSET,
    export_queue_size: int = _UNSET,
    export_batch_size: int = _UNSET,
    export_delay_s: float = _UNSET,
    export_batch_timeout_s: float | None = _UNSET,
    export_backoff_min_s: float = _UNSET,
    export_backoff_max_s: float = _UNSET,
    trace_max_regions: int = _UNSET,
) -> Config:
    """Change perfsdk's settings; arguments left out keep their current value.

    Args:
        enabled: turn instrumentation on or off at run time.
        exporter: ``otlp``, ``console``, ``file``, ``trace`` or ``none``, or a list / comma
            string of them; OpenTelemetry ``SpanExporter`` instances are accepted too (alone or
            in a list). ``trace`` writes a Chrome / Perfetto trace file.
        output_dir: where the ``file`` exporter writes ``spans-<pid>.jsonl`` and the ``trace``
            exporter ``trace-<pid>.json``.
        sample_every: record every N-th call of each region (N >= 1).
        nvtx: emit NVTX ranges.
        timing: measure regions; False leaves only their NVTX ranges (see PERFSDK_TIMING).
        memory: record memory per region by default (see PERFSDK_MEMORY).
        memory_snapshots: record CUDA allocation history for OOM snapshots.
        gpu_sample_interval_s: seconds between NVML readings; 0 turns GPU sampling off.
        service_name: ``service.name`` of perfsdk's OpenTelemetry resource.
        export_timeout_s: the longest :func:`perfsdk.flush` waits, and the most that exit
            adds in total (seconds, > 0 and <= 86400).
        sync_guard: the mode every :func:`perfsdk.no_sync_guard` uses (``off``, ``count``,
            ``warn``, ``error``), or None to let each guard keep its own.
        export_queue_size: spans waiting for export per exporter at most (1 to 1,000,000;
            ``OTEL_BSP_MAX_QUEUE_SIZE``); beyond it spans are dropped and counted.
        export_batch_size: spans per export call (1 to the queue size;
            ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``).
        export_delay_s: seconds between exports of a partial batch (0 to 86400;
            ``OTEL_BSP_SCHEDULE_DELAY``, which is in milliseconds).
        export_batch_timeout_s: one export call's timeout in seconds, or None for
            ``export_timeout_s`` (``OTEL_BSP_EXPORT_TIMEOUT``, in milliseconds).
        export_backoff_min_s: the first rest after a failed export (seconds).
        export_backoff_max_s: the longest rest between attempts while exports fail.
        trace_max_regions: regions the ``trace`` file holds at most (1 to 100,000,000).

    Raises:
        ValueError: an argument has a value outside those accepted; the message names both.

    Example:
        >>> import perfsdk
        >>> perfsdk.configure(exporter="none", sample_every=1).sample_every
        1
    """
    changes: dict[str, Any] = {}
    if enabled is not _UNSET:
        changes["enabled"] = _arg_bool("enabled", enabled)
    if nvtx is not _UNSET:
        changes["nvtx"] = _arg_bool("nvtx", nvtx)
    if timing is not _UNSET:
        changes["timing"] = _arg_bool("timing", timing)
    if memory is not _UNSET:
        changes["memory"] = _arg_bool("memory", memory)
    if memory_snapshots is not _UNSET:
        changes["memory_snapshots"] = _arg_bool("memory_snapshots", memory_snapshots)
    parsers: tuple[tuple[str, str, Any, Callable[[Any], Any]], ...] = (
        ("exporter", "exporters", exporter, _parse_exporters),
        ("output_dir", "output_dir", output_dir, _parse_path),
        ("sample_every", "sample_every", sample_every, _parse_every),
        ("service_name", "service_name", service_name, _parse_name),
        ("export_timeout_s", "export_timeout_s", export_timeout_s, _parse_timeout),
        ("gpu_sample_interval_s", "gpu_sample_interval_s", gpu_sample_interval_s,
         _parse_interval),
        ("sync_guard", "sync_guard", sync_guard, _parse_sync_guard),
        ("export_queue_size", "export_queue_size", export_queue_size, _parse_queue_size),
        ("export_batch_size", "export_batch_size", export_batch_size, _parse_queue_size),
        ("export_delay_s", "export_delay_s", export_delay_s, _parse_delay),
        ("export_batch_timeout_s", "export_batch_timeout_s", export_batch_timeout_s,
         _parse_optional_timeout),
        ("export_backoff_min_s", "export_backoff_min_s", export_backoff_min_s, _parse_timeout),
        ("export_backoff_max_s", "export_backoff_max_s", export_backoff_max_s, _parse_timeout),
        ("trace_max_regions", "trace_max_regions", trace_max_regions, _parse_trace_max),
    )
    for arg, field, value, parse in parsers:
        if value is _UNSET:
            continue
        try:
            changes[field] = parse(value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"configure({arg}={value!r}): {exc}") from None
    if "export_queue_size" in changes and "export_batch_size" not in changes:
        changes["export_batch_size"] = min(_config.export_batch_size,
                                           changes["export_queue_size"])
    try:
        new = dataclasses.replace(_config, **changes)
    except ValueError as exc:  # settings that must agree with each other (Config.__post_init__)
        raise ValueError(f"configure(): {exc}") from None
    # The composition root must hear of the change (to build, check or close the exporters),
    # also when a program imported this module alone (``import perfsdk`` is lazy).
    importlib.import_module("perfsdk.lifecycle")
    return _replace(new)


def reset_from_env() -> Config:
    """Forget :func:`configure` calls and read the environment again (for tests and workers)."""
    return _replace(Config.from_env())


def _arg_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"configure({name}={value!r}): accepted values are True or False")
    return value


def _replace(new: Config) -> Config:
    global _config
    with _lock:
        for listener in list(_listeners):
            listener(_config, new)  # may raise (e.g. a missing exporter): nothing changed then
        _config = new
        state.enabled, state.nvtx, state.sample_every = new.enabled, new.nvtx, new.sample_every
        state.timing, state.memory = new.timing, new.memory
        state.nvtx_only = _nvtx_only(new)
    return new


def on_change(listener: Callable[[Config, Config], None]) -> None:
    """Call ``listener(old, new)`` before each change takes effect; raising cancels it."""
    _listeners.append(listener)
