"""Live markers on the calling thread: NVTX ranges and torch.profiler annotations.

Attributes are resolved once, when a region is declared (decoration or ``timed_region(...)``),
so entering a region costs one NVTX push and, only while a torch profiler is recording, one
fast record-function.

NVTX goes through the ``nvtx`` package. Where perfsdk's optional compiled module is built with
the NVTX headers (see ``setup.py``) and a tool is attached, each marker also gets
:attr:`NvtxMarker.call`, the same range in C: ``call(fn, args, kwargs)`` pushes it, calls the
function and pops it in one C call, which ``@profiled`` uses in NVTX-only mode. Its ranges land
in the same domain, with the same message, color, category id and payload.
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Any

import torch

from perfsdk.config import extensions_enabled
from perfsdk.errors import warn_once

try:  # optional at run time: perfsdk works without it, minus NVTX ranges
    import nvtx as _nvtx
except Exception:
    _nvtx = None

_fastpath: Any = None
if extensions_enabled():
    try:  # optional: built at install where a C compiler is found
        import perfsdk._fastpath as _fastpath
    except ImportError:
        _fastpath = None

__all__ = ["COLORS", "NvtxMarker", "color_for", "parse_color", "record_function"]

COLORS: dict[str, int] = {
    "green": 0xFF008000,
    "blue": 0xFF0000FF,
    "yellow": 0xFFFFFF00,
    "purple": 0xFF800080,
    "cyan": 0xFF00FFFF,
    "red": 0xFFFF0000,
    "white": 0xFFFFFFFF,
    "darkgreen": 0xFF006400,
    "orange": 0xFFFFA500,
    "magenta": 0xFFFF00FF,
    "gray": 0xFF808080,
    "black": 0xFF000000,
}
"""Named colors accepted by ``color=`` (besides ``#RRGGBB`` strings and ``0xAARRGGBB`` ints)."""

# Distinguishable on Nsight's dark and light timelines; a name always maps to the same one.
_PALETTE = (
    0xFF4E79A7, 0xFFF28E2B, 0xFFE15759, 0xFF76B7B2, 0xFF59A14F,
    0xFFEDC948, 0xFFB07AA1, 0xFFFF9DA7, 0xFF9C755F, 0xFFBAB0AC,
)
_HEX = re.compile(r"^#?([0-9a-fA-F]{6}|[0-9a-fA-F]{8})$")


def color_for(name: str) -> int:
    """The stable ARGB color for a region name (the same in every run and process)."""
    return _PALETTE[zlib.crc32(name.encode()) % len(_PALETTE)]


def parse_color(color: str | int | None, name: str) -> int:
    """``color=`` as ARGB; None picks :func:`color_for`. Raises ValueError naming the argument."""
    if color is None:
        return color_for(name)
    if isinstance(color, int) and not isinstance(color, bool):
        if 0 <= color <= 0xFFFFFF:
            return 0xFF000000 | color
        if 0 <= color <= 0xFFFFFFFF:
            return color
    elif isinstance(color, str):
        key = color.strip().lower()
        if key in COLORS:
            return COLORS[key]
        match = _HEX.match(key)
        if match:
            digits = match.group(1)
            return int(digits, 16) | (0xFF000000 if len(digits) == 6 else 0)
    raise ValueError(
        f"color={color!r} is not a color; accepted values are one of "
        f"{', '.join(sorted(COLORS))}, a '#RRGGBB' string or a 0xRRGGBB / 0xAARRGGBB integer"
    )


@functools.cache
def _domain(name: str) -> Any:
    assert _nvtx is not None
    return _nvtx.get_domain(name)


def compiled_nvtx() -> bool:
    """Whether markers built now get the compiled :attr:`NvtxMarker.call` (when a tool is
    attached): the extension is built with NVTX and ``PERFSDK_DISABLE_EXTENSIONS`` is not set."""
    return _fastpath is not None and bool(getattr(_fastpath, "HAVE_NVTX", 0))


class NvtxMarker:
    """A domain and pre-built event attributes; ``push``/``pop`` are the only per-call work.

    ``call`` is the compiled range (``call(fn, args, kwargs)``: push, call, pop), or None: no
    compiled module, no NVTX in it, or no real domain (no tool attached, ``NVTX_DISABLE``).

    Without a tool (the nvtx package hands out its dummy domain: a process's NVTX tool is
    loaded at its first NVTX call or never) ``domain`` is None, as without the nvtx package:
    regions push nothing, and their exits take the compiled path, which closes real ranges
    only.
    """

    __slots__ = ("attributes", "call", "domain")

    def __init__(
        self, domain: str, message: str, color: int, category: str | None, payload: int | None
    ) -> None:
        self.domain: Any = None
        self.attributes: Any = None
        self.call: Any = None
        if _nvtx is None:
            warn_once("nvtx-missing", "perfsdk: the 'nvtx' package is not installed; regions "
                      "emit no NVTX ranges. Install it with: pip install nvtx")
            return
        try:
            dom = _domain(domain)
            if not hasattr(dom, "handle"):  # the dummy domain: no tool listens, nor ever will
                return
            self.attributes = dom.get_event_attributes(
                message=message,
                color=color,
                category=category if category else None,
                payload=payload,
            )
            self.domain = dom
            if compiled_nvtx():
                self.call = _fastpath.NvtxCall(
                    domain, message, color,
                    dom.get_category_id(category) if category else 0, payload)
        except Exception as exc:
            warn_once(f"nvtx-error:{domain}:{message}",
                      f"perfsdk: NVTX unavailable for {message!r} ({exc!r}); no NVTX range.")


record_function: Any = torch.autograd.profiler.record_function
"""Used only while a profiler records. torch's fast path (``_RecordFunctionFast``, 0.6 us) files
regions as ``cpu_op``; ``record_function`` (5 us) makes them user annotations, which is what the
profiler's views (and, on CUDA, the ``gpu_user_annotation`` track) show as the user's ranges."""
