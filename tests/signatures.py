"""Signatures compared for the fakes' contract tests: a fake stands in for torch's call."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any


def params(fn: Callable[..., Any], drop: Iterable[str] = ("self", "cls")
           ) -> list[tuple[str, Any]]:
    """``fn``'s parameters as (name, default), less ``drop``."""
    dropped = set(drop)
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name not in dropped]


def assert_stands_in(fake: list[tuple[str, Any]], real: list[tuple[str, Any]]) -> None:
    """The fake takes torch's parameters, in torch's order, with torch's defaults; past them
    only optional ones a later torch added (an older torch, 2.11 say, lacks them)."""
    assert fake[:len(real)] == real
    assert all(default is not inspect.Parameter.empty for _, default in fake[len(real):]), fake
