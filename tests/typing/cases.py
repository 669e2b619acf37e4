"""mypy golden cases for perfsdk's decorators (wrapt's tests/mypy style).

``tests/typing/test_mypy.py`` runs mypy on this file and compares its output with
``expected.txt``. The lines marked ``# E:`` must fail: a wrong argument to a decorated function
is a type error, because ``@profiled`` and ``timed_region`` keep the signature (ParamSpec). The
other lines must type-check cleanly. This file is only type-checked, never run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from typing_extensions import reveal_type

from perfsdk import Region, profiled, timed_region


@profiled
def bare(x: int, *, scale: float = 1.0) -> float:
    return x * scale


@profiled("named", every=2)
def named(name: str) -> str:
    return name.upper()


def plain(a: int, b: str) -> bool:
    return bool(a) and bool(b)


wrapped = profiled(plain)


@timed_region("region-decorated", domain="io")
def region_decorated(values: list[int]) -> int:
    return sum(values)


@profiled
async def fetch(n: int) -> bytes:
    return bytes(n)


@profiled("numbers")
def numbers(n: int) -> Iterator[int]:
    yield from range(n)


@profiled
async def stream(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


class Model:
    @profiled
    def step(self, lr: float) -> float:
        return lr

    @classmethod
    @profiled
    def create(cls, size: int) -> Model:
        return cls()

    @staticmethod
    @profiled
    def helper(tag: str) -> str:
        return tag


# -- correct use: no errors ---------------------------------------------------------------------
ok_bare: float = bare(1, scale=2.0)
ok_named: str = named("x")
ok_wrapped: bool = wrapped(1, "b")
ok_region: int = region_decorated([1, 2])
ok_step: float = Model().step(0.1)
ok_create: Model = Model.create(3)
ok_helper: str = Model.helper("t")
ok_numbers: list[int] = list(numbers(3))


async def use_async() -> bytes:
    async with timed_region("load", batch=3) as region:
        ok_items = [i async for i in stream(2)]
    host_ms: float = region.host_ms
    assert ok_items
    assert host_ms == host_ms or not region.recorded
    return await fetch(4)


with timed_region("block", rows=10) as handle:
    pass
ok_handle: Region = handle
reveal_type(bare)
reveal_type(wrapped)
reveal_type(Model().step)

# -- wrong use: each line must be an error ---------------------------------------------------
bare("one")  # E: arg-type
bare(1, scale="x")  # E: arg-type
bare(1, 2)  # E: call-arg
bare(y=1)  # E: call-arg
named(3)  # E: arg-type
wrapped(1, 2)  # E: arg-type
region_decorated(["a"])  # E: list-item
fetch("x")  # E: arg-type, unused-coroutine
Model().step("fast")  # E: arg-type
Model.create("big")  # E: arg-type
Model.helper(1)  # E: arg-type
wrong_return: str = bare(1)  # E: assignment
profiled(42)  # E: call-overload
profiled("x", every="2")  # E: call-overload
timed_region("x", color=1.5)  # E: arg-type
