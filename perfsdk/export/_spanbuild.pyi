"""Types of the optional compiled module built from ``perfsdk/export/_spanbuild.c``."""

from collections.abc import Callable, Sequence
from typing import Any

class SpanBuilder:
    """``perfsdk.export.spans.build_spans_python``, compiled: plain region records become
    ``ReadableSpan`` objects field for field; other records go to ``slow``."""

    def __init__(self, span_type: type, context_type: type, flags: Any, state: Any,
                 template: dict[str, Any], specs: list[Any],
                 slow: Callable[[tuple[Any, ...], Any, Any], Any]) -> None: ...
    def __call__(self, items: Sequence[Any], resource: Any, ranks: dict[str, Any],
                 anchor: int, /) -> list[Any]: ...
