"""The fake CUDA device behind :func:`perfsdk.testing.use_fake_cuda`: its devices and their
properties, events that complete when the test moves the fake GPU clock, streams, CUDA graphs
that replay the recorded operators, the caching allocator's counters and torch's sync debug mode.
Same names and signatures as ``torch.cuda`` (held to them by a contract test)."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["FakeCuda", "FakeDeviceProperties", "FakeEvent", "FakeGraph", "FakeStream"]


@dataclasses.dataclass(frozen=True)
class FakeDeviceProperties:
    """Stands in for what ``torch.cuda.get_device_properties()`` returns (the fields perfsdk
    reads). ``uuid`` is written as torch's ``str(props.uuid)`` is: without NVML's ``GPU-``
    prefix; the default device's ``fake-0`` is the first GPU of :class:`FakeNvml` ``(1)``."""

    name: str = "Fake GPU"
    total_memory: int = 16 << 30
    uuid: str = "fake-0"
    major: int = 8
    minor: int = 0


class FakeStream:
    """Stands in for ``torch.cuda.Stream``."""

    def __init__(self, fake: FakeCuda) -> None:
        self._fake = fake

    def synchronize(self) -> None:
        self._fake._synced("Stream.synchronize")
        self._fake.gpu_ms = max(self._fake.gpu_ms, self._fake.queued_ms)

    def query(self) -> bool:
        return self._fake.gpu_ms >= self._fake.queued_ms

    def wait_stream(self, stream: Any) -> None:
        pass  # one timeline: work is already ordered


_CAPTURING = "CUDA error: operation not permitted when stream is capturing"
_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


def _on_cuda(values: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
               for t in tree_leaves(values))


def _storage_key(t: torch.Tensor) -> int:
    return int(getattr(t, "_data", t).untyped_storage().data_ptr())


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records, during a capture, every operator that reads or writes a CUDA tensor."""

    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        on_cuda = _on_cuda((args, kwargs))
        to_host = (func is torch.ops.aten._to_copy.default
                   and kwargs.get("device") is not None
                   and torch.device(kwargs["device"]).type == "cpu")
        if on_cuda and (func in _SYNC_OPS or to_host):  # a sync: not allowed in a capture
            self.graph._invalid = True
            raise RuntimeError(_CAPTURING)
        out = func(*args, **kwargs)
        if on_cuda or _on_cuda(out):
            self.graph._ops.append((func, args, kwargs, out))
        return out


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``, capturing with :meth:`FakeCuda.graph`.

    Like a real capture, it records the operators on CUDA tensors (:class:`FakeCudaTensor`)
    and leaves the tensors they allocated holding garbage (NaN); :meth:`replay` runs the
    recorded operators again on the same tensors, so results follow what was copied into the
    static inputs. Operators on CPU tensors run once, at capture, and are not replayed, and a
    synchronizing call during the capture raises and invalidates it, as on a GPU.
    """

    def __init__(self, fake: FakeCuda, keep_graph: bool = False) -> None:
        self._fake = fake
        self._ops: list[tuple[Any, Any, Any, Any]] = []
        self._mode: _Recorder | None = None
        self._invalid = False
        self.captured = False
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        if self._fake.capturing is not None:
            raise RuntimeError(_CAPTURING)
        self._ops, self._invalid, self.captured = [], False, False
        self._fake.capturing = self
        self._mode = _Recorder(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]

    def capture_end(self) -> None:
        mode, self._mode = self._mode, None
        self._fake.capturing = None
        if mode is not None:
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        if self._invalid:
            self._ops = []
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture")
        self.captured = True
        self._fake.graphs_captured += 1
        external: set[int] = set()
        for _, args, kwargs, out in self._ops:  # what the capture allocated: garbage until replay
            external.update(_storage_key(t) for t in tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor) and t.numel())
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point()
                        and _storage_key(t) not in external):
                    t.fill_(float("nan"))

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        with torch.no_grad():
            for func, args, kwargs, out in self._ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_leaves(out), tree_leaves(fresh), strict=True):
                    if isinstance(old, torch.Tensor) and old is not new:
                        torch.ops.aten.copy_.default(old, new)
        self.replays += 1
        self._fake.replays += 1

    def reset(self) -> None:
        self._ops, self.captured = [], False

    def pool(self) -> Any:
        return (0, id(self))


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: completes when the fake GPU clock passes it."""

    def __init__(self, fake: FakeCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        self._fake = fake
        self.enable_timing = enable_timing
        self.at_ms: float | None = None

    def record(self, stream: Any = None) -> None:
        fake = self._fake
        self.at_ms = max(fake.queued_ms, fake.gpu_ms)
        fake.records += 1

    def query(self) -> bool:
        self._fake.queries += 1
        return self.at_ms is not None and self._fake.gpu_ms >= self.at_ms

    def elapsed_time(self, end_event: Any) -> float:
        if not self.enable_timing or not end_event.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("CUDA error: device not ready")
        assert self.at_ms is not None
        assert end_event.at_ms is not None
        return float(end_event.at_ms - self.at_ms)

    def synchronize(self) -> None:
        self._fake._synced("Event.synchronize")
        if self.at_ms is not None:
            self._fake.gpu_ms = max(self._fake.gpu_ms, self.at_ms)

    def wait(self, stream: Any = None) -> None:
        pass


class FakeCuda:
    """A fake ``torch.cuda`` for the device interface: work is queued with :meth:`launch` and
    finishes as the test moves the GPU clock with :meth:`advance` or :meth:`complete_all`.

    ``sync_calls`` lists every synchronizing call made, so tests can assert there was none.
    """

    def __init__(self) -> None:
        self.initialized = True
        self.available = True  # is_available(): a fake GPU is there (even before initialized)
        self.devices = [FakeDeviceProperties()]
        self.device = 0  # current_device()
        self.gpu_ms = 0.0
        self.queued_ms = 0.0
        self.sync_calls: list[str] = []
        self.events_created = 0
        self.records = 0
        self.queries = 0
        # the caching allocator's counters (bytes)
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.history: list[dict[str, Any]] | None = None
        self.sync_debug_mode = 0
        self._prototype_warned = False  # torch warns at the first set_sync_debug_mode
        self._held: list[str] = []  # operators' debug-mode warnings not yet delivered
        # streams and CUDA graphs
        self.default_stream = FakeStream(self)
        self._streams = [self.default_stream]
        self.capturing: FakeGraph | None = None
        self.graphs_captured = 0
        self.replays = 0
        self.profiler_calls: list[str] = []  # "start" / "stop" (cudaProfilerStart/Stop)

    # the torch.cuda subset
    def is_initialized(self) -> bool:
        return self.initialized

    def is_available(self) -> bool:
        return self.available and bool(self.devices)

    def device_count(self) -> int:
        return len(self.devices) if self.available else 0

    def current_device(self) -> int:
        return self.device

    def get_device_properties(self, device: Any = None) -> FakeDeviceProperties:
        return self.devices[self._index(device)]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        if not self.is_available():
            return False
        return self.get_device_properties().major >= 8 or including_emulation

    def Event(self, enable_timing: bool = False, blocking: bool = False,
              interprocess: bool = False, external: bool = False) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self, enable_timing, blocking, interprocess, external)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._streams[-1]

    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> FakeStream:
        return FakeStream(self)

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        self._streams.append(stream if stream is not None else self._streams[-1])
        try:
            yield
        finally:
            self._streams.pop()

    def CUDAGraph(self, keep_graph: bool = False) -> FakeGraph:
        return FakeGraph(self, keep_graph)

    @contextlib.contextmanager
    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global", enable_annotations: bool = False,
              check_input_liveness: bool = False) -> Iterator[None]:
        self.synchronize()  # torch.cuda.graph synchronizes before capturing
        side = self.stream(stream if stream is not None else FakeStream(self))
        side.__enter__()
        cuda_graph.capture_begin(pool, capture_error_mode=capture_error_mode)
        try:
            yield
        finally:
            # as torch.cuda.graph's __exit__: when ending the capture raises (it was
            # invalidated), the capture stream is left the current one
            cuda_graph.capture_end()
            side.__exit__(None, None, None)

    def profiler_start(self) -> None:
        self.profiler_calls.append("start")

    def profiler_stop(self) -> None:
        self.profiler_calls.append("stop")

    def synchronize(self, device: Any = None) -> None:
        self._synced("synchronize")
        self.complete_all()

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated

    def memory_reserved(self, device: Any = None) -> int:
        return self.reserved

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak = self.allocated

    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> Any:
        free = self.reserved - self.allocated
        blocks = [{"size": self.allocated, "requested_size": self.allocated,
                   "state": "active_allocated"}]
        if free:
            blocks.append({"size": free, "requested_size": 0, "state": "inactive"})
        return [{"device": 0, "address": 0, "total_size": self.reserved,
                 "allocated_size": self.allocated, "active_size": self.allocated,
                 "requested_size": self.allocated, "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "is_expandable": False, "blocks": blocks}]

    def record_memory_history(self, enabled: str | None = "all", context: str | None = "all",
                              stacks: str = "all", max_entries: int = 2**63 - 1,
                              device: Any = None, clear_history: bool = False,
                              compile_context: bool = False,
                              global_record_annotations: bool = False,
                              skip_actions: list[str] | None = None) -> None:
        self.history = [] if enabled else None

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle",
                      augment_with_fx_traces: bool = False) -> None:
        """Writes what ``torch.cuda.memory._dump_snapshot`` writes: the pickle
        pytorch.org/memory_viz reads (segments and per-device allocation traces)."""
        snapshot = {"segments": self.memory_snapshot(), "device_traces": [self.history or []],
                    "allocator_settings": {}}
        with open(filename, "wb") as f:
            pickle.dump(snapshot, f)

    def get_sync_debug_mode(self) -> int:
        return self.sync_debug_mode

    def set_sync_debug_mode(self, debug_mode: int | str) -> None:
        modes = {"default": 0, "warn": 1, "error": 2}
        if isinstance(debug_mode, str):
            if debug_mode not in modes:
                raise RuntimeError("invalid value of debug_mode, expected one of `default`, "
                                   "`warn`, `error`")
            debug_mode = modes[debug_mode]
        self.sync_debug_mode = int(debug_mode)
        if not self._prototype_warned:  # as torch: once (a process), after the mode is set
            self._prototype_warned = True
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations", UserWarning, stacklevel=2)

    def _index(self, device: Any) -> int:
        """torch's device argument (None, an index, ``"cuda:1"``, a ``torch.device``) as an
        index; out of range raises as torch does."""
        if device is None:
            index = self.device
        elif isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            index = self.device if device.index is None else device.index
        if not 0 <= index < self.device_count():
            raise AssertionError("Invalid device id")
        return index

    def _synced(self, name: str) -> None:
        """A synchronizing call: recorded, and reported the way torch's sync debug mode does."""
        if self.capturing is not None:
            self.capturing._invalid = True
            raise RuntimeError(_CAPTURING)
        self.sync_calls.append(name)
        if self.sync_debug_mode == 1:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=3)
        elif self.sync_debug_mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")

    def operator_sync(self, name: str) -> None:
        """A sync inside an ATen operator (``.item()``'s ``_local_scalar_dense``, ``nonzero``),
        as torch's debug mode reports it from C++: ``error`` raises at once, but ``warn``'s
        warning reaches Python only when the outermost torch call returns (``Tensor.item``),
        after the operator: :meth:`deliver_held` delivers it then (fake tensors call both)."""
        if self.capturing is not None:
            self.capturing._invalid = True
            raise RuntimeError(_CAPTURING)
        self.sync_calls.append(name)
        if self.sync_debug_mode == 1:
            self._held.append(name)
        elif self.sync_debug_mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")

    def deliver_held(self) -> None:
        """The held debug-mode warnings, delivered as a torch call returning to Python does."""
        while self._held:
            self._held.pop(0)
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=3)

    # the test's controls
    def implicit_sync(self, name: str = "cudaMemcpy") -> None:
        """A synchronization inside some operator, visible only to torch's sync debug mode."""
        self._synced(name)

    def alloc(self, nbytes: int) -> None:
        """Allocate ``nbytes`` through the fake caching allocator."""
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        segment = 2 << 20
        self.reserved = max(self.reserved, -(-self.allocated // segment) * segment)
        if self.history is not None:
            self.history.append({"action": "alloc", "addr": 0, "size": nbytes, "stream": 0,
                                 "frames": []})

    def free(self, nbytes: int) -> None:
        """Free ``nbytes`` (reserved memory stays cached, as in torch)."""
        self.allocated -= nbytes
        if self.history is not None:
            self.history.append({"action": "free_completed", "addr": 0, "size": nbytes,
                                 "stream": 0, "frames": []})

    def launch(self, ms: float) -> None:
        """Queue ``ms`` of GPU work on the current stream."""
        self.queued_ms = max(self.queued_ms, self.gpu_ms) + ms

    def advance(self, ms: float) -> None:
        """Let the GPU run for ``ms``."""
        self.gpu_ms = min(self.gpu_ms + ms, max(self.queued_ms, self.gpu_ms + ms))

    def complete_all(self) -> None:
        """Let the GPU finish everything queued."""
        self.gpu_ms = max(self.gpu_ms, self.queued_ms)
