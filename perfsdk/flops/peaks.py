"""The peak FLOP/s of the device a process runs on: the denominator of MFU.

Three sources, in this order:

1. ``PERFSDK_PEAK_FLOPS`` (FLOP/s, e.g. ``989e12`` or ``989T``): whoever launches the job knows
   the hardware best (a power-capped GPU, a part missing from the table, a TPU-like device).
2. On a GPU, :data:`GPUS`: dense (no sparsity) tensor-core peaks from each vendor's datasheet,
   by the name the device interface reports (``perfsdk._device``: never ``torch.cuda``).
3. On a CPU, a short measured GEMM peak (``torch.mm`` of a few sizes, the best of a few repeats,
   at most about 0.3 s once per process and dtype): *measured*, not a specification, with the
   process's ``torch.get_num_threads()`` threads.

An unknown GPU has no peak (None) and warns once, naming ``PERFSDK_PEAK_FLOPS``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import threading
import time
from typing import Any, Final

import torch

from perfsdk import _device
from perfsdk.config import PERFSDK_PEAK_FLOPS
from perfsdk.errors import warn_once

__all__ = ["DTYPES", "GPUS", "CPU_BUDGET_S", "DeviceSpec", "Peak", "clear_peak_cache",
           "find_peak", "measure_cpu_peak", "peak_flops"]

DTYPES: Final = ("bf16", "fp16", "tf32", "fp32")
"""The precisions the table knows, by the names :func:`peak_flops` accepts (with their torch
dtypes and long names: ``torch.bfloat16``, ``"bfloat16"``, ``"half"``, ``"float32"`` ...)."""

_ALIASES: Final = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}

CPU_BUDGET_S: Final = 0.3
"""Seconds the CPU GEMM measurement takes at most (once per process and dtype)."""

_CPU_SIZES: Final = (256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One row of :data:`GPUS`: dense peak FLOP/s by precision, and where they come from.

    ``tf32`` is None where the part has no TF32 tensor cores (its FP32 matmuls run at ``fp32``),
    ``bf16`` None where it has no bfloat16 ones (V100, T4)."""

    name: str
    pattern: str
    """Regular expression matched (case-insensitively) against the reported device name; the
    first row that matches wins, so variants come before their family."""
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    source: str


def _tf(x: float) -> float:
    return x * 1e12


_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"

GPUS: Final[tuple[DeviceSpec, ...]] = (
    # NVIDIA's Hopper and Blackwell datasheets give tensor-core peaks with sparsity only: the
    # dense values here are half of those (as the datasheets' footnotes say).
    DeviceSpec("NVIDIA GB200", r"\bgb200\b", _tf(2500), _tf(2500), _tf(1250), _tf(90),
               "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (per GPU: half of a "
               "superchip)"),
    DeviceSpec("NVIDIA B200", r"\bb200\b", _tf(2250), _tf(2250), _tf(1125), _tf(75),
               "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU: an eighth)"),
    DeviceSpec("NVIDIA GH200", r"\bgh200\b", _tf(989.5), _tf(989.5), _tf(494.5), _tf(67),
               "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/"),
    DeviceSpec("NVIDIA H200 NVL", r"\bh200\b.*\bnvl\b", _tf(835.5), _tf(835.5), _tf(417.5), _tf(60),
               _H200),
    DeviceSpec("NVIDIA H200 SXM", r"\bh200\b", _tf(989.5), _tf(989.5), _tf(494.5), _tf(67),
               _H200),
    DeviceSpec("NVIDIA H100 NVL", r"\bh100\b.*\bnvl\b", _tf(835.5), _tf(835.5), _tf(417.5), _tf(60),
               _H100),
    DeviceSpec("NVIDIA H100 PCIe", r"\bh100\b.*\bpcie\b", _tf(756.5), _tf(756.5), _tf(378), _tf(51),
               _H100),
    DeviceSpec("NVIDIA H100 SXM", r"\bh100\b", _tf(989.5), _tf(989.5), _tf(494.5), _tf(67),
               _H100),
    # Ampere and Ada datasheets list dense and sparse values; these are the dense ones.
    DeviceSpec("NVIDIA A100 (SXM and PCIe)", r"\ba100\b", _tf(312), _tf(312), _tf(156), _tf(19.5),
               "https://www.nvidia.com/en-us/data-center/a100/"),
    DeviceSpec("NVIDIA L40S", r"\bl40s\b", _tf(362.05), _tf(362.05), _tf(183), _tf(91.6),
               "https://www.nvidia.com/en-us/data-center/l40s/"),
    DeviceSpec("NVIDIA L40", r"\bl40\b", _tf(181.05), _tf(181.05), _tf(90.5), _tf(90.5),
               "https://www.nvidia.com/en-us/data-center/l40/"),
    DeviceSpec("NVIDIA L4", r"\bl4\b", _tf(121), _tf(121), _tf(60), _tf(30.3),
               "https://www.nvidia.com/en-us/data-center/l4/ (sparse values halved)"),
    DeviceSpec("NVIDIA A40", r"\ba40\b", _tf(149.7), _tf(149.7), _tf(74.8), _tf(37.4),
               "https://www.nvidia.com/en-us/data-center/a40/"),
    DeviceSpec("NVIDIA A10", r"\ba10\b", _tf(125), _tf(125), _tf(62.5), _tf(31.2),
               "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    # GeForce: the whitepapers' FP16/BF16 tensor peaks with FP32 accumulate (what torch's
    # matmuls use), half of the FP16-accumulate peak on these parts.
    DeviceSpec("NVIDIA GeForce RTX 4090", r"\brtx 4090\b", _tf(165.2), _tf(165.2), _tf(82.6),
               _tf(82.6), "NVIDIA Ada GPU Architecture whitepaper, appendix table (RTX 4090)"),
    DeviceSpec("NVIDIA GeForce RTX 3090", r"\brtx 3090\b", _tf(71), _tf(71), _tf(35.6), _tf(35.6),
               "NVIDIA Ampere GA102 GPU Architecture whitepaper, table 9 (RTX 3090)"),
    # Volta and Turing: FP16 tensor cores only (no bfloat16, no TF32).
    DeviceSpec("NVIDIA V100S PCIe", r"\bv100s\b", None, _tf(130), None, _tf(16.4),
               "https://www.nvidia.com/en-us/data-center/v100/"),
    DeviceSpec("NVIDIA V100 PCIe", r"\bv100\b.*\bpcie\b", None, _tf(112), None, _tf(14),
               "https://www.nvidia.com/en-us/data-center/v100/"),
    DeviceSpec("NVIDIA V100 SXM2", r"\bv100\b", None, _tf(125), None, _tf(15.7),
               "https://www.nvidia.com/en-us/data-center/v100/"),
    DeviceSpec("NVIDIA T4", r"\bt4\b", None, _tf(65), None, _tf(8.1),
               "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
    # AMD Instinct (ROCm builds of torch report these names through the same interface).
    DeviceSpec("AMD Instinct MI300X", r"\bmi300x\b", _tf(1307.4), _tf(1307.4), _tf(653.7),
               _tf(163.4),
               "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    DeviceSpec("AMD Instinct MI250X", r"\bmi250x\b", _tf(383), _tf(383), None, _tf(95.7),
               "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"),
)
"""Dense peak FLOP/s of common GPUs, first match wins (docs/flops.md shows it as a table).
Peaks at the boost clock: a sustained run reaches less, which is what MFU measures."""


@dataclasses.dataclass(frozen=True)
class Peak:
    """A peak and where it came from (:func:`find_peak`)."""

    flops: float
    """FLOP/s."""
    dtype: str
    """``bf16``, ``fp16``, ``tf32`` or ``fp32``."""
    device: str
    """The device's name (``cpu`` on a CPU)."""
    source: str
    """``PERFSDK_PEAK_FLOPS``, ``measured`` (a CPU), or the datasheet of the table's row."""


_lock = threading.Lock()
_cpu_peaks: dict[str, float] = {}


def clear_peak_cache() -> None:
    """Forget the measured CPU peaks (the next :func:`peak_flops` on a CPU measures again)."""
    with _lock:
        _cpu_peaks.clear()


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    key = str(dtype).strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(f"peak_flops: dtype={dtype!r}; accepted values are None, torch.bfloat16, "
                     "torch.float16, torch.float32, or 'bf16', 'fp16', 'tf32', 'fp32'")


_SUFFIX: Final = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_NUMBER: Final = re.compile(r"^\s*([0-9.eE+\-]+?)\s*([kKmMgGtTpP]?)\s*(?:flop/?s|flops)?\s*$",
                            re.IGNORECASE)


def parse_peak(raw: str) -> float:
    """``PERFSDK_PEAK_FLOPS``'s value: a positive FLOP/s, plain (``989e12``) or with an SI
    suffix (``989T``, ``1.2P``, ``500G``); ValueError naming the accepted values otherwise."""
    accepted = ("a positive number of FLOP/s, e.g. 989e12, or with a K/M/G/T/P suffix, "
                "e.g. 989T")
    match = _NUMBER.match(raw)
    if match is None:
        raise ValueError(f"accepted values are {accepted}")
    number, suffix = match.groups()
    try:
        value = float(number) * _SUFFIX[suffix.lower()]
    except ValueError:
        raise ValueError(f"accepted values are {accepted}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"accepted values are {accepted}")
    return value


@functools.lru_cache(maxsize=16)
def _parsed(raw: str) -> tuple[float | None, str]:
    try:
        return parse_peak(raw), ""
    except ValueError as exc:
        return None, str(exc)


def _override() -> float | None:
    """``PERFSDK_PEAK_FLOPS``, read at each call (a step's end asks: parsed once per value)."""
    raw = os.environ.get(PERFSDK_PEAK_FLOPS)
    if not raw:
        return None
    value, problem = _parsed(raw)
    if problem and raw.strip():
        warn_once(f"env:{PERFSDK_PEAK_FLOPS}",
                  f"perfsdk: ignoring {PERFSDK_PEAK_FLOPS}={raw!r}: {problem}. Using the device "
                  "table (a GPU) or a measured peak (a CPU) instead.")
    return value


@functools.lru_cache(maxsize=64)
def spec_for(name: str) -> DeviceSpec | None:
    """The row of :data:`GPUS` for a reported device name, or None."""
    for spec in GPUS:
        if re.search(spec.pattern, name, re.IGNORECASE):
            return spec
    return None


def _gpu_index(device: Any) -> int | None:
    """The CUDA device index ``device`` names; None for the CPU. ``None`` means: the current
    CUDA device if the application has initialized CUDA (perfsdk never does), else the CPU."""
    if device is None:
        if not _device.initialized():
            return None
        return int(_device.get_backend().current_device())
    if isinstance(device, bool):
        raise ValueError(f"peak_flops: device={device!r}; accepted values are None, 'cpu', "
                         "'cuda', 'cuda:N', an int or a torch.device")
    if isinstance(device, int):
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"peak_flops: device={device!r}; accepted values are None, 'cpu', "
                         "'cuda', 'cuda:N', an int or a torch.device") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"peak_flops: device={device!r}: no peak for {dev.type!r} devices; "
                         f"set {PERFSDK_PEAK_FLOPS}")
    return dev.index if dev.index is not None else int(_device.get_backend().current_device())


_peak = functools.lru_cache(maxsize=256)(Peak)
"""One Peak per answer: a step's end asks for the peak, and gets it without building one."""


def find_peak(dtype: Any = None, device: Any = None) -> Peak | None:
    """The peak FLOP/s for ``dtype`` on ``device``, with its source; None for an unknown GPU.

    See :func:`peak_flops` for the arguments.
    """
    name = _dtype_name(dtype)
    override = _override()
    index = _gpu_index(device)
    if index is None:
        wanted = "fp32" if name in (None, "tf32") else name  # a CPU has no TF32
        if override is not None:
            return _peak(override, wanted, "cpu", PERFSDK_PEAK_FLOPS)
        return _peak(_cpu_peak(wanted), wanted, "cpu", "measured")
    device_name = str(_device.get_backend().get_device_name(index))
    spec = spec_for(device_name)
    wanted = name or ("bf16" if spec is None or spec.bf16 is not None else "fp16")
    if override is not None:
        return _peak(override, wanted, device_name, PERFSDK_PEAK_FLOPS)
    value = None if spec is None else getattr(spec, wanted)
    if value is None and spec is not None and wanted == "tf32":
        value = spec.fp32  # no TF32 tensor cores: FP32 matmuls run at the FP32 peak
    if value is None:
        why = ("is not in perfsdk's table" if spec is None
               else f"has no {wanted} peak in perfsdk's table (no {wanted} tensor cores)")
        warn_once(f"peak-flops:{device_name}:{wanted}",
                  f"perfsdk: GPU {device_name!r} {why}, so MFU is left out; set "
                  f"{PERFSDK_PEAK_FLOPS} to its dense peak in FLOP/s (e.g. "
                  f"{PERFSDK_PEAK_FLOPS}=312e12)")
        return None
    return _peak(value, wanted, device_name, spec.source)  # type: ignore[union-attr]


def peak_flops(dtype: Any = None, device: Any = None) -> float | None:
    """The device's peak FLOP/s for ``dtype``: the denominator of MFU.

    ``PERFSDK_PEAK_FLOPS`` wins when set (for any dtype). On a GPU the dense tensor-core peak of
    :data:`GPUS` by the device's name (None, with one warning naming ``PERFSDK_PEAK_FLOPS``, for
    a GPU that is not there); on a CPU a measured GEMM peak (at most about
    :data:`CPU_BUDGET_S` seconds, once per process and dtype).

    Args:
        dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``, or ``"bf16"``,
            ``"fp16"``, ``"tf32"``, ``"fp32"``. None: on a GPU the bf16 peak (fp16 where the
            part has no bf16), the usual denominator of MFU; on a CPU the fp32 one.
        device: None (the current CUDA device when the application has initialized CUDA,
            else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int or a ``torch.device``.

    Raises:
        ValueError: an unknown ``dtype`` or ``device``.

    Example:
        >>> import os
        >>> import perfsdk
        >>> os.environ["PERFSDK_PEAK_FLOPS"] = "989e12"
        >>> perfsdk.peak_flops()
        989000000000000.0
        >>> del os.environ["PERFSDK_PEAK_FLOPS"]
    """
    peak = find_peak(dtype, device)
    return None if peak is None else peak.flops


def _cpu_peak(dtype: str) -> float:
    value = _cpu_peaks.get(dtype)
    if value is not None:
        return value
    with _lock:  # one measurement per dtype, also when threads ask at once
        value = _cpu_peaks.get(dtype)
        if value is None:
            value = _cpu_peaks[dtype] = measure_cpu_peak(dtype)
        return value


_TORCH_DTYPES: Final = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                        "tf32": torch.float32}


def measure_cpu_peak(dtype: Any = "fp32", *, budget_s: float = CPU_BUDGET_S) -> float:
    """The best FLOP/s of ``torch.mm`` on this CPU: square matrices of a few sizes (256, 512,
    1024; a size is skipped when the one before it took a quarter of the budget), each timed a
    few times, within about ``budget_s`` seconds. Measured with the process's
    ``torch.get_num_threads()`` threads; uncached (:func:`peak_flops` caches it)."""
    torch_dtype = _TORCH_DTYPES[_dtype_name(dtype) or "fp32"]
    deadline = time.perf_counter() + budget_s
    best = 0.0
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in _CPU_SIZES:
            a = torch.randn(n, n, generator=generator).to(torch_dtype)
            b = torch.randn(n, n, generator=generator).to(torch_dtype)
            torch.mm(a, b)  # warm-up: the first call pays for allocation and dispatch
            seconds = math.inf
            for _ in range(5):
                start = time.perf_counter()
                torch.mm(a, b)
                seconds = min(seconds, time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
            if seconds > 0:
                best = max(best, 2.0 * n ** 3 / seconds)
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or seconds * 8 * 2 > remaining:  # the next size: ~8x the work
                break
    return best
