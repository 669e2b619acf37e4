"""Types of the optional compiled module built from ``perfsdk/_fastpath.c``."""

from collections.abc import Callable
from typing import Any, Final

HAVE_NVTX: Final[int]
"""1 when the module was built with the NVTX headers (``NvtxCall`` exists), else 0."""

def maxrss() -> int:
    """The process's peak resident set size in bytes (``getrusage``'s ``ru_maxrss``)."""

class NvtxCall:
    """A region's NVTX range, built once; only present when ``HAVE_NVTX``."""

    def __init__(self, domain: str, message: str, color: int, category: int = 0,
                 payload: int | None = None) -> None: ...
    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any] | None, /) -> Any:
        """``fn(*args, **kwargs)`` inside the NVTX range (popped also when ``fn`` raises)."""
