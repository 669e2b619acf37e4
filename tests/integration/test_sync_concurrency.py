"""A ``no_sync_guard`` belongs to the thread or asyncio task that entered it: syncs anywhere else
are neither reported to it nor raised by it, however the guards of different threads and tasks
overlap, and the torch mode stacks are empty again once every guard has closed. The same holds
for syncs that only torch's CUDA sync debug mode sees (through the fake CUDA backend).
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import perfsdk
from perfsdk import SyncError, no_sync_guard
from perfsdk.testing import FakeCuda

TIMEOUT = 60.0  # hang guards (barriers, joins): a busy machine may be slow, never this slow


@pytest.fixture(autouse=True)
def _fresh_sites() -> Iterator[None]:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


def stacks_empty() -> bool:
    return _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []


def run_thread(target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    """Start ``target`` in a thread; whatever it raises lands in ``errors``."""
    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "thread did not finish"


# -- threads ------------------------------------------------------------------------------------
def test_error_guard_in_one_thread_ignores_another_thread() -> None:
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    done = threading.Event()
    errors: list[BaseException] = []
    guard = no_sync_guard("error", assume_device=True)
    seen: dict[str, object] = {}
    values: list[float] = []

    def guarded() -> None:
        with guard:
            barrier.wait()  # B starts its syncs while this guard is open
            assert done.wait(TIMEOUT)
            seen["total_before_own"] = guard.report.total
            try:
                torch.ones(3).sum().item()
            except SyncError as exc:
                seen["error"] = exc
                raise

    def unguarded() -> None:
        barrier.wait()
        try:
            for _ in range(100):
                values.append(torch.ones(3).sum().item())
            with pytest.raises(AssertionError, match="not compiled with CUDA"):
                torch.cuda.synchronize()  # torch's own function for this thread
        finally:
            done.set()

    a = run_thread(guarded, errors)
    b = run_thread(unguarded, errors)
    join(a, b)
    assert values == [3.0] * 100
    assert seen["total_before_own"] == 0
    assert [type(e) for e in errors] == [SyncError]  # only A's own sync raised
    assert isinstance(seen["error"], SyncError)
    assert guard.report.total == 1
    assert [s.op for s in perfsdk.sync.sites()] == ["item"]
    assert not hasattr(torch.cuda.synchronize, "__perfsdk_wrapped__")


def test_each_thread_counts_only_its_own_syncs() -> None:
    n = 8
    barrier = threading.Barrier(n, timeout=TIMEOUT)
    guards = [no_sync_guard("count", assume_device=True) for _ in range(n)]
    errors: list[BaseException] = []

    def work(i: int) -> Callable[[], None]:
        def body() -> None:
            with guards[i]:
                barrier.wait()  # every guard is open at once
                for _ in range(i + 1):
                    torch.ones(2).sum().item()
                barrier.wait()  # and stays open until all have synced
        return body

    threads = [run_thread(work(i), errors) for i in range(n)]
    join(*threads)
    assert errors == []
    assert [g.report.total for g in guards] == [i + 1 for i in range(n)]
    assert sum(s.count for s in perfsdk.sync.sites()) == n * (n + 1) // 2


# -- asyncio tasks ----------------------------------------------------------------------------
def test_error_guard_in_one_task_ignores_another_task() -> None:
    guard = no_sync_guard("error", assume_device=True)

    async def guarded(entered: asyncio.Event, gate: asyncio.Event) -> int:
        with guard:
            entered.set()
            await gate.wait()
            return guard.report.total

    async def unguarded(entered: asyncio.Event, gate: asyncio.Event) -> list[float]:
        await entered.wait()  # every sync below happens while A's guard is open
        values = []
        for _ in range(10):
            values.append(torch.ones(3).sum().item())
            await asyncio.sleep(0)
        gate.set()
        return values

    async def main() -> tuple[int, list[float]]:
        entered, gate = asyncio.Event(), asyncio.Event()
        b = asyncio.create_task(unguarded(entered, gate))  # created outside A's guard
        a = asyncio.create_task(guarded(entered, gate))
        return await asyncio.wait_for(asyncio.gather(a, b), TIMEOUT)

    total, values = asyncio.run(main())
    assert total == 0
    assert values == [3.0] * 10
    assert guard.report.total == 0
    assert stacks_empty()


def test_interleaved_task_guards_count_their_own_and_leave_no_modes() -> None:
    guard_a = no_sync_guard("count", assume_device=True)
    guard_b = no_sync_guard("count", assume_device=True)
    order: list[str] = []

    async def task(name: str, guard: no_sync_guard, syncs: int, entered: asyncio.Event,
                   other_entered: asyncio.Event, may_exit: asyncio.Event,
                   exited: asyncio.Event) -> None:
        with guard:
            order.append(f"{name} enter")
            entered.set()
            await other_entered.wait()
            for _ in range(syncs):
                torch.ones(2).sum().item()
                await asyncio.sleep(0)  # the other task syncs in between
            await may_exit.wait()
        order.append(f"{name} exit")
        exited.set()

    async def main() -> None:
        a_in, b_in, a_out, b_out = (asyncio.Event() for _ in range(4))
        go = asyncio.Event()
        go.set()
        a = asyncio.create_task(task("A", guard_a, 2, a_in, b_in, go, a_out))
        await a_in.wait()
        b = asyncio.create_task(task("B", guard_b, 5, b_in, a_in, a_out, b_out))
        await asyncio.wait_for(asyncio.gather(a, b), TIMEOUT)

    asyncio.run(main())
    assert order == ["A enter", "B enter", "A exit", "B exit"]
    assert guard_a.report.total == 2
    assert guard_b.report.total == 5
    assert _get_current_dispatch_mode_stack() == []
    assert _get_current_function_mode_stack() == []


# -- torch's sync debug mode (fake CUDA) ------------------------------------------------------
def test_debug_mode_sync_in_another_thread_is_neither_reported_nor_shown(
        fake_cuda: FakeCuda) -> None:
    errors: list[BaseException] = []
    with warnings.catch_warnings(record=True) as shown:
        with no_sync_guard("count") as guard:
            join(run_thread(fake_cuda.implicit_sync, errors))
            fake_cuda.implicit_sync()
        assert fake_cuda.sync_debug_mode == 0
    assert errors == []  # pytest's filterwarnings=error would have raised it in the thread
    assert [str(w.message) for w in shown] == []
    assert fake_cuda.sync_calls == ["cudaMemcpy", "cudaMemcpy"]  # both syncs did happen
    assert [(s.op, s.count) for s in guard.report.sites] == [("cuda", 1)]
    assert guard.report.sites[0].code == "fake_cuda.implicit_sync()"
