"""Types of the optional compiled module built from ``perfsdk/_fastpath.c``."""

from collections.abc import Callable
from typing import Any, Final

HAVE_NVTX: Final[int]
"""1 when the module was built with the NVTX headers (``NvtxCall`` exists), else 0."""

def host_times(records: list[Any], spec: int, t0: int, t1: int, device_ms: int, error: int,
               attrs: int, keys: tuple[str, ...]) -> tuple[dict[int, list[float]], list[Any]]:
    """The summary's pass over a chunk of records: ``({spec index: [host ms]}, [records with a
    device time, an error or one of ``keys`` among their attributes])``
    (``perfsdk.export.summary._host_times_python``)."""

def maxrss() -> int:
    """The process's peak resident set size in bytes (``getrusage``'s ``ru_maxrss``)."""

class RssPeak:
    """``memory=True``'s peak-RSS readings on the host (``perfsdk.memory._RssPeakPython``,
    compiled)."""

    def __init__(self, reuse_ns: int) -> None: ...
    @property
    def last(self) -> tuple[int, int]:
        """The latest reading (bytes) and when it began (ns)."""
    def baseline(self) -> int:
        """The latest reading if it began at most ``reuse_ns`` ago, else a new one."""
    def read(self) -> int:
        """A reading now, kept as the latest."""
    def host_exit(self, rss0: int, /) -> tuple[None, None, None, int, int]:
        """A host region's exit: ``(None, None, None, rss1 - rss0, rss1)``."""
    def reset(self) -> None:
        """Forget the latest reading (after fork)."""

class NvtxCall:
    """A region's NVTX range, built once; only present when ``HAVE_NVTX``."""

    def __init__(self, domain: str, message: str, color: int, category: int = 0,
                 payload: int | None = None) -> None: ...
    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any] | None, /) -> Any:
        """``fn(*args, **kwargs)`` inside the NVTX range (popped also when ``fn`` raises)."""

def new_id(bits: int, /) -> int:
    """The next id of the compiled generator: a span id (64 bits) or a trace id (128), never 0.
    Compiled entries draw from it while ``perfsdk.region._getrandbits`` is the one bound."""

def bind_inner(globals: dict[str, Any], inner: type, region: type, null_region: object,
               state: object, fork: object, context: type | None, /) -> Any:
    """Hand ``perfsdk.region``'s globals and types over; return the compiled
    ``InnerRegion.exit`` (a method descriptor of ``inner``)."""

def bind_backward(globals: dict[str, Any], /) -> None:
    """Hand ``perfsdk.auto.backward``'s globals over, for :class:`NodeHook`."""

class InnerGate:
    """``InnerGate(spec)()`` is ``spec.open_inner()`` (after :func:`bind_inner`)."""

    def __init__(self, spec: Any, /) -> None: ...
    def __call__(self) -> Any: ...

class NodeHook:
    """``NodeHook(seq, entries)(grad)`` is ``perfsdk.auto.backward._on_node(seq, entries,
    grad)`` (after :func:`bind_backward`)."""

    def __init__(self, seq: int, entries: list[list[Any]], /) -> None: ...
    def __call__(self, grad: Any, /) -> None: ...

def track(open_: Callable[[], Any], first: int, inputs: Any, output: Any, /) -> bool:
    """``perfsdk.auto.backward.track``, compiled for an output that is a plain tensor (after
    :func:`bind_backward`)."""

def bind_module(globals: dict[str, Any], /) -> None:
    """Hand ``perfsdk.auto.module``'s globals over, for :class:`ModuleCall`."""

class ModuleCall:
    """``ModuleCall(probe, inner)(module, args, kwargs)``: the body of an instrumented module's
    forward wrapper past its ``torch.compile`` check (``perfsdk.auto.module``), compiled (after
    :func:`bind_inner`, :func:`bind_backward` and :func:`bind_module`)."""

    def __init__(self, probe: Any, inner: Callable[..., Any] | None, /) -> None: ...
    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                 /) -> Any: ...

def bind_region(current: Any, device_globals: dict[str, Any], cuda: Any, /) -> None:
    """Hand ``perfsdk.context.CURRENT`` (or None), ``perfsdk._device``'s globals and
    ``torch.cuda`` over, for :class:`RegionStart` and :func:`region_exit` (after
    :func:`bind_inner`)."""

class RegionStart:
    """``RegionStart(spec)(attributes)`` is ``perfsdk.region._start_python(spec, attributes)``:
    a fresh Region, entered; compiled for an entry on the host (after :func:`bind_region`).
    ``RegionStart(spec, gate=True)(attributes=None)`` is ``spec.open(attributes)``: the gate
    too (enabled, unsampled and timed: compiled; anything else: ``spec.open``)."""

    def __init__(self, spec: Any, gate: bool = False) -> None: ...
    def __call__(self, attributes: dict[str, Any] | None = None, /) -> Any: ...

def region_exit(region: Any, error: BaseException | None, t1: int, /) -> None:
    """``region.exit(error, t1)``, compiled for what :class:`RegionStart` enters on its fast
    path, ending without an error."""


def bind_phase(phase: type, enter: Callable[..., Any], exit: Callable[..., Any], /
               ) -> tuple[Any, Any]:
    """``phase``'s compiled ``__enter__`` and ``__exit__`` (method descriptors), which call an
    instance's ``_enter`` / ``_exit`` and, for an instance without them, ``enter`` / ``exit``."""


def step_methods() -> tuple[Any, Any]:
    """``Step``'s compiled ``__enter__`` and ``__exit__`` (method descriptors; after
    :func:`bind_steps`), for :class:`TwinMethod`."""


class TwinMethod:
    """A class attribute: an instance's lookup gives a bound method that calls ``compiled``
    (no Python frame) and whose ``__func__`` is ``python``, which ``torch.compile`` traces; the
    class's lookup gives ``python``."""

    def __init__(self, compiled: Callable[..., Any], python: Callable[..., Any], /) -> None: ...
    def __get__(self, obj: object, objtype: type | None = None, /) -> Any: ...


def bind_steps(steps_globals: dict[str, Any], distributed_globals: dict[str, Any],
               steps_type: type, step_type: type, /) -> None:
    """Hand ``perfsdk.auto.steps``'s and ``perfsdk.distributed``'s globals, ``Steps`` and
    ``Step`` over, for :func:`step_start` and :func:`step_end` (after :func:`bind_region`)."""


def step_start(steps: Any, samples: int | None, flops: float | None, implicit: bool,
               /) -> Any:
    """``perfsdk.auto.steps._step_python(steps, samples, flops, implicit)``: a step started,
    compiled for a loop without a schedule, listeners, flops or a torchrun run id."""


def step_end(steps: Any, step: Any, error: BaseException | None, /) -> None:
    """``steps._end(step, error)``, compiled where :func:`step_start`'s steps end."""

