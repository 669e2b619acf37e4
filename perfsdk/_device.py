"""The device interface: the only path from perfsdk to CUDA events, streams and counters.

Everything that touches CUDA goes through :class:`CudaBackend`, so tests can swap in a fake
(:class:`perfsdk.testing.FakeCuda`) that behaves like ``torch.cuda``. perfsdk never initializes
CUDA itself: device timing is used only once the application has initialized CUDA, so importing
perfsdk or running a region on a CPU-only job cannot poison a later ``fork``.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["CudaBackend", "DeviceProperties", "Event", "Graph", "Stream", "active", "get_backend",
           "set_backend"]


class Stream(Protocol):
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def wait_stream(self, stream: Any) -> None: ...


class Graph(Protocol):
    """The subset of ``torch.cuda.CUDAGraph`` perfsdk uses (captured by ``CudaBackend.graph``)."""

    def replay(self) -> None: ...
    def reset(self) -> None: ...
    def pool(self) -> Any: ...


class Event(Protocol):
    """The subset of ``torch.cuda.Event`` perfsdk uses."""

    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: Any) -> float: ...
    def synchronize(self) -> None: ...


class DeviceProperties(Protocol):
    """The subset of ``torch.cuda.get_device_properties()``'s answer perfsdk reads."""

    @property
    def name(self) -> str: ...
    @property
    def total_memory(self) -> int: ...
    @property
    def uuid(self) -> Any: ...  # torch: a _CUuuid, its str() the UUID without "GPU-"
    @property
    def major(self) -> int: ...
    @property
    def minor(self) -> int: ...


class CudaBackend(Protocol):
    """What perfsdk needs from ``torch.cuda`` (names and signatures match it)."""

    def is_initialized(self) -> bool: ...
    # devices: is_available() asks the driver (it does not initialize CUDA, but a fork after it
    # can still fail: call it only where the user asked for CUDA or for a choice of device)
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def current_device(self) -> int: ...
    def get_device_properties(self, device: Any = None) -> DeviceProperties: ...
    def is_bf16_supported(self, including_emulation: bool = True) -> bool: ...
    def Event(self, enable_timing: bool = False, blocking: bool = False,
              interprocess: bool = False) -> Event: ...
    def current_stream(self, device: Any = None) -> Stream: ...
    def synchronize(self, device: Any = None) -> None: ...
    def get_device_name(self, device: Any = None) -> str: ...
    def memory_allocated(self, device: Any = None) -> int: ...
    def memory_reserved(self, device: Any = None) -> int: ...
    def max_memory_allocated(self, device: Any = None) -> int: ...
    def reset_peak_memory_stats(self, device: Any = None) -> None: ...
    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> Any: ...
    def record_memory_history(self, enabled: str | None = "all", context: str | None = "all",
                              stacks: str = "all", max_entries: int = 2**63 - 1,
                              device: Any = None, clear_history: bool = False,
                              compile_context: bool = False,
                              global_record_annotations: bool = False,
                              skip_actions: list[str] | None = None) -> None: ...
    def dump_snapshot(self, filename: str = "dump_snapshot.pickle",
                      augment_with_fx_traces: bool = False) -> None: ...
    def get_sync_debug_mode(self) -> int: ...
    def set_sync_debug_mode(self, debug_mode: int | str) -> None: ...
    # CUDA graphs (apply_cuda_graphs): side streams, capture, replay
    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream: ...
    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def CUDAGraph(self, keep_graph: bool = False) -> Graph: ...
    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global") -> AbstractContextManager[Any]: ...
    # capture ranges for nsys --capture-range=cudaProfilerApi (torch.cuda.profiler.start/stop)
    def profiler_start(self) -> None: ...
    def profiler_stop(self) -> None: ...


_QUICK_EVENT: list[Any] = []  # [the type, or None where torch lacks what it needs]


def _quick_event_type() -> Any:
    """``torch.cuda.Event`` with a quicker ``record()``: the current stream read with two C
    calls and its ``Stream`` object reused, where ``torch.cuda.current_stream()`` runs Python
    (device index, environment lookups, a new ``Stream``): on an H200's host 4.3 us of a
    5.9 us ``record()``, twice a region. The same stream: torch's own current stream, found
    as ``current_stream()`` finds it (CUDA is initialized before any event is recorded)."""
    if _QUICK_EVENT:
        return _QUICK_EVENT[0]
    C: Any = torch._C
    base: Any = getattr(C, "_CudaEventBase", None)
    get_stream: Any = getattr(C, "_cuda_getCurrentStream", None)
    get_device: Any = getattr(C, "_cuda_getDevice", None)
    if base is None or get_stream is None or get_device is None:
        _QUICK_EVENT.append(None)
        return None
    streams: dict[Any, Any] = {}
    record = base.record
    make_stream: Any = torch.cuda.Stream

    class QuickEvent(torch.cuda.Event):
        __doc__ = torch.cuda.Event.__doc__

        def record(self, stream: Any = None) -> None:
            if stream is None:
                data = get_stream(get_device())
                stream = streams.get(data)
                if stream is None:
                    if len(streams) >= 256:  # streams come and go: keep the map bounded
                        streams.clear()
                    stream = streams[data] = make_stream(
                        stream_id=data[0], device_index=data[1], device_type=data[2])
            record(self, stream)

    _QUICK_EVENT.append(QuickEvent)
    return QuickEvent


class TorchCuda:
    """The real backend: ``torch.cuda`` itself, never initialized by perfsdk."""

    def is_initialized(self) -> bool:
        return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def get_device_properties(self, device: Any = None) -> DeviceProperties:
        return torch.cuda.get_device_properties(device)

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # the argument only where asked: torch < 2.4 has none
        if including_emulation:
            return bool(torch.cuda.is_bf16_supported())
        return bool(torch.cuda.is_bf16_supported(including_emulation))

    def Event(self, enable_timing: bool = False, blocking: bool = False,
              interprocess: bool = False) -> Event:
        event_type: Any = _quick_event_type() or torch.cuda.Event
        return event_type(  # type: ignore[no-any-return]
            enable_timing=enable_timing, blocking=blocking, interprocess=interprocess
        )

    def current_stream(self, device: Any = None) -> Stream:
        return torch.cuda.current_stream(device)

    def synchronize(self, device: Any = None) -> None:
        torch.cuda.synchronize(device)

    def get_device_name(self, device: Any = None) -> str:
        return torch.cuda.get_device_name(device)

    # Allocator counters: host-side bookkeeping in the caching allocator, no device sync.
    def memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> Any:
        return torch.cuda.memory_snapshot(mempool_id, include_traces)  # type: ignore[no-untyped-call]

    def record_memory_history(self, enabled: str | None = "all", context: str | None = "all",
                              stacks: str = "all", max_entries: int = 2**63 - 1,
                              device: Any = None, clear_history: bool = False,
                              compile_context: bool = False,
                              global_record_annotations: bool = False,
                              skip_actions: list[str] | None = None) -> None:
        torch.cuda.memory._record_memory_history(
            enabled,  # type: ignore[arg-type]
            context, stacks, max_entries, device, clear_history, compile_context,
            global_record_annotations, skip_actions)

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle",
                      augment_with_fx_traces: bool = False) -> None:
        torch.cuda.memory._dump_snapshot(  # type: ignore[no-untyped-call]
            filename, augment_with_fx_traces)

    # torch's sync debug mode: 0 off, 1 warn, 2 error on each synchronizing CUDA call
    def get_sync_debug_mode(self) -> int:
        return int(torch.cuda.get_sync_debug_mode())

    def set_sync_debug_mode(self, debug_mode: int | str) -> None:
        torch.cuda.set_sync_debug_mode(debug_mode)

    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        return torch.cuda.Stream(device, priority, **kwargs)  # type: ignore[no-untyped-call]

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def CUDAGraph(self, keep_graph: bool = False) -> Graph:
        # keep_graph only where asked: torch < 2.7 has no such argument
        return torch.cuda.CUDAGraph(keep_graph) if keep_graph else torch.cuda.CUDAGraph()

    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global") -> AbstractContextManager[Any]:
        return torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                                capture_error_mode=capture_error_mode)

    def profiler_start(self) -> None:
        torch.cuda.profiler.start()  # type: ignore[no-untyped-call]

    def profiler_stop(self) -> None:
        torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]


_lock = threading.Lock()
_backend: CudaBackend = TorchCuda()
_listeners: list[Any] = []


def get_backend() -> CudaBackend:
    return _backend


def set_backend(backend: CudaBackend) -> CudaBackend:
    """Swap the CUDA backend (tests use a fake); returns the previous one."""
    global _backend
    with _lock:
        previous, _backend = _backend, backend
    for listener in list(_listeners):
        listener()
    return previous


def on_change(listener: Any) -> None:
    _listeners.append(listener)


def active() -> CudaBackend | None:
    """The backend when the application has initialized CUDA, else None. Never initializes it."""
    backend = _backend
    return backend if backend.is_initialized() else None


def initialized() -> bool:
    """Whether the application has initialized CUDA (one call on the hot path)."""
    return bool(_is_initialized())


def _bind() -> None:
    global _is_initialized
    # For the real backend, torch's own function: no extra Python frame per region.
    _is_initialized = (torch.cuda.is_initialized if isinstance(_backend, TorchCuda)
                       else _backend.is_initialized)


_is_initialized: Any = torch.cuda.is_initialized
on_change(_bind)

TORCH_CUDA: Any = torch.cuda
"""``torch.cuda`` itself, for the compiled hot path (``perfsdk._fastpath.bind_region``): while
``_is_initialized`` is ``torch.cuda.is_initialized`` it reads that module's ``_initialized``
flag instead of calling it."""
