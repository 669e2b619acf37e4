"""The callback's options, checked without importing Lightning (so that :func:`instrument`
names a bad one even before the framework is imported)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["check_options"]


def check_options(where: str, *, batch_size: int | Callable[[Any], int] | None,
                  memory: bool | None, report: bool) -> None:
    """Raise ValueError naming the first of the options with a value outside those accepted."""
    if not (batch_size is None or callable(batch_size) or (
            isinstance(batch_size, int) and not isinstance(batch_size, bool)
            and batch_size >= 1)):
        raise ValueError(f"{where}: batch_size={batch_size!r}; accepted values are None "
                         "(inferred from the batch), an integer >= 1 or a function of the batch")
    if memory is not None and not isinstance(memory, bool):
        raise ValueError(f"{where}: memory={memory!r}; accepted values are None (the "
                         "configured default), True or False")
    if not isinstance(report, bool):
        raise ValueError(f"{where}: report={report!r}; accepted values are True (print the "
                         "summary and advice when fit ends) or False")
