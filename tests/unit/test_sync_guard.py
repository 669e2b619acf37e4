"""``no_sync_guard`` behaviour: its modes, argument checks, ``allow``, nesting, restoring state on
exceptions, use as a decorator, the report, and how syncs reach regions, spans and the summary.

Syncing lines end with a ``# <- sync`` marker (or ``# <- sync:NAME`` where a test has several);
expected call sites are read from the source, never hard-coded.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import perfsdk
from perfsdk import SyncError, SyncReport, SyncWarning, configure, lifecycle, no_sync_guard
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import Capture

HERE = __file__


def short(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def line_of(name: str = "") -> int:
    """The line of the caller's function that ends with ``# <- sync`` (``# <- sync:NAME``)."""
    fn = sys._getframe(1).f_code
    lines, start = inspect.getsourcelines(fn)
    mark = f"# <- sync:{name}" if name else "# <- sync"
    hits = [start + i for i, text in enumerate(lines) if text.rstrip().endswith(mark)]
    assert len(hits) == 1, f"{fn.co_name}: {len(hits)} lines marked {mark!r}"
    return hits[0]


def stacks_empty() -> bool:
    return _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []


@pytest.fixture(autouse=True)
def _fresh_sites() -> Iterator[None]:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32)


# -- modes ----------------------------------------------------------------------------------
def test_warn_once_per_call_site_at_the_users_line(x: torch.Tensor) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            with no_sync_guard("warn", assume_device=True) as guard:
                for _ in range(3):
                    x.sum().item()  # <- sync:a
                x.tolist()  # <- sync:b
    ours = [w for w in seen if issubclass(w.category, SyncWarning)]
    assert [(w.filename, w.lineno) for w in ours] == [(HERE, line_of("a")), (HERE, line_of("b"))]
    assert "(item, aten::_local_scalar_dense)" in str(ours[0].message)
    assert f"{short(HERE)}:{line_of('a')}" in str(ours[0].message)
    assert guard.report.total == 4  # the last use of the guard: 3 item + 1 tolist
    assert len(seen) == 2


def test_warn_is_the_default_mode(x: torch.Tensor) -> None:
    with pytest.warns(SyncWarning, match=r"host-device sync \(item"):  # noqa: SIM117
        with no_sync_guard(assume_device=True):
            x.sum().item()


def test_count_is_silent(x: torch.Tensor) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with no_sync_guard("count", assume_device=True) as guard:
            x.sum().item()
            x.sum().item()
    assert seen == []
    assert guard.report.total == 2


def test_off_records_nothing_and_pushes_no_modes(x: torch.Tensor) -> None:
    before = (list(_get_current_dispatch_mode_stack()), list(_get_current_function_mode_stack()))
    with no_sync_guard("off", assume_device=True) as guard:
        inside = (list(_get_current_dispatch_mode_stack()),
                  list(_get_current_function_mode_stack()))
        assert not hasattr(torch.cuda.synchronize, "__perfsdk_wrapped__")
        value = x.sum().item()
    assert inside == before
    assert value == 15.0
    assert guard.report.total == 0
    assert perfsdk.sync.sites() == ()


def test_error_raises_at_the_line_with_a_fix(x: torch.Tensor) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard("error", assume_device=True):
        x.sum().item()  # <- sync
    error = info.value
    assert (error.file, error.line, error.op, error.operator) == (
        HERE, line_of(), "item", "aten::_local_scalar_dense")
    assert "x.sum().item()" in str(error)
    assert "allow=('item',)" in str(error)
    assert isinstance(error, RuntimeError)


# -- bad arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "names"), [
    ({"mode": "loud"}, ("mode='loud'", "'warn'", "'error'", "'count'", "'off'")),
    ({"assume_device": "yes"}, ("assume_device='yes'", "True or False")),
    ({"allow": ("bogus",)}, ("allow", "'bogus'", "'item'", "'file.py:line'")),
], ids=["mode", "assume_device", "allow"])
def test_bad_argument_names_itself_and_the_accepted_values(kwargs: dict[str, object],
                                                          names: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="no_sync_guard") as info:
        no_sync_guard(**kwargs)  # type: ignore[arg-type]
    for name in names:
        assert name in str(info.value)


# -- allow ------------------------------------------------------------------------------------
@pytest.mark.parametrize("allow", [("item",), ("test_sync_guard.py:*",), "item"],
                         ids=["op", "call-site", "bare-string"])
def test_allowed_syncs_are_counted_apart_and_not_raised(x: torch.Tensor,
                                                       allow: tuple[str, ...] | str) -> None:
    with no_sync_guard("error", assume_device=True, allow=allow) as guard:
        value = x.sum().item()
    assert value == 15.0
    assert guard.report.total == 0
    assert guard.report.allowed == 1
    assert "(1 more allowed)" in str(guard.report)


def test_allowing_one_op_still_raises_for_another(x: torch.Tensor) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard(  # noqa: PT012
            "error", assume_device=True, allow=("item",)) as guard:
        x.sum().item()
        x.tolist()  # <- sync
    assert (info.value.op, info.value.line) == ("tolist", line_of())
    assert guard.report.allowed == 1


def test_allowing_an_exact_line(x: torch.Tensor) -> None:
    allowed = f"test_sync_guard.py:{line_of()}"
    with no_sync_guard("error", assume_device=True, allow=(allowed,)) as guard:
        x.sum().item()  # <- sync
    assert guard.report.allowed == 1
    with pytest.raises(SyncError), no_sync_guard("error", assume_device=True, allow=(allowed,)):
        x.sum().item()  # another line: raised


# -- nesting and restoring ---------------------------------------------------------------------
def test_innermost_guard_decides_and_every_open_guard_counts(x: torch.Tensor) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard(  # noqa: PT012
            "error", assume_device=True) as outer:
        with no_sync_guard("count", assume_device=True) as inner:
            x.sum().item()  # <- sync:inner
        assert inner.report.total == 1
        assert outer.report.total == 1
        x.sum().item()  # <- sync:outer
    assert info.value.line == line_of("outer")
    assert [(s.line, s.count) for s in inner.report.sites] == [(line_of("inner"), 1)]
    assert sorted(s.line for s in outer.report.sites) == [line_of("inner"), line_of("outer")]
    assert stacks_empty()


def test_inner_allow_does_not_hide_from_outer(x: torch.Tensor) -> None:
    with no_sync_guard("count", assume_device=True) as outer, no_sync_guard(
            "error", assume_device=True, allow=("item",)) as inner:
        x.sum().item()
    assert (inner.report.total, inner.report.allowed) == (0, 1)
    assert outer.report.total == 1


def test_an_inner_guard_without_assume_device_does_not_blind_the_outer(x: torch.Tensor) -> None:
    """A library's own plain guard inside the caller's CPU-CI guard: the CPU-only sync is the
    outer guard's to count and decide (it raises); the inner guard, which counts real device
    syncs only, records nothing."""
    with pytest.raises(SyncError) as info, no_sync_guard(
            "error", assume_device=True) as outer, no_sync_guard("count") as inner:
        x.sum().item()  # <- sync:blind
    assert info.value.line == line_of("blind")
    assert inner.report.total == 0
    assert outer.report.total == 1


def test_an_inner_off_guard_is_inert_and_does_not_silence_the_outer(x: torch.Tensor) -> None:
    with pytest.raises(SyncError), no_sync_guard("error", assume_device=True), \
            no_sync_guard("off"):
        x.sum().item()


def test_state_is_restored_after_an_exception(x: torch.Tensor) -> None:
    with pytest.raises(KeyError), no_sync_guard("error", assume_device=True):  # noqa: PT012
        x.sum()
        raise KeyError("boom")
    assert stacks_empty()
    assert not hasattr(torch.cuda.synchronize, "__perfsdk_wrapped__")
    assert x.sum().item() == 15.0  # outside any guard: not recorded
    assert perfsdk.sync.sites() == ()


def test_state_is_restored_after_a_sync_error(x: torch.Tensor) -> None:
    with pytest.raises(SyncError), no_sync_guard("error", assume_device=True):
        x.sum().item()
    assert stacks_empty()
    x.tolist()
    assert [s.op for s in perfsdk.sync.sites()] == ["item"]


# -- decorator --------------------------------------------------------------------------------
def test_decorated_function_accumulates_across_calls(x: torch.Tensor) -> None:
    guard = no_sync_guard("count", assume_device=True)

    @guard
    def step(t: torch.Tensor) -> float:
        """One step."""
        return t.sum().item()  # <- sync

    assert step(x) == step(x) == 15.0
    assert (step.__name__, step.__doc__) == ("step", "One step.")
    assert step.__wrapped__ is not None  # type: ignore[attr-defined]
    assert [(s.line, s.count) for s in guard.report.sites] == [(line_of(), 2)]
    assert stacks_empty()


def test_decorated_async_function_accumulates_across_calls(x: torch.Tensor) -> None:
    guard = no_sync_guard("count", assume_device=True)

    @guard
    async def step(t: torch.Tensor) -> float:
        """One async step."""
        await asyncio.sleep(0)
        return t.sum().item()  # <- sync

    assert inspect.iscoroutinefunction(step)
    assert asyncio.run(step(x)) == asyncio.run(step(x)) == 15.0
    assert (step.__name__, step.__doc__) == ("step", "One async step.")
    assert [(s.line, s.count) for s in guard.report.sites] == [(line_of(), 2)]
    assert stacks_empty()


def test_decorated_function_raises_in_error_mode(x: torch.Tensor) -> None:
    @no_sync_guard("error", assume_device=True)
    def step(t: torch.Tensor) -> list[float]:
        return t.tolist()  # type: ignore[no-any-return]  # <- sync

    with pytest.raises(SyncError) as info:
        step(x)
    assert (info.value.op, info.value.line) == ("tolist", line_of())


def test_async_with_counts_the_block(x: torch.Tensor) -> None:
    async def step() -> float:
        async with no_sync_guard("count", assume_device=True) as guard:
            await asyncio.sleep(0)
            value = x.sum().item()  # <- sync
        assert [(s.line, s.count) for s in guard.report.sites] == [(line_of(), 1)]
        return value

    assert asyncio.run(step()) == 15.0
    assert stacks_empty()


def test_generator_functions_are_refused_as_decorator_targets() -> None:
    def gen() -> Iterator[int]:
        yield 1

    with pytest.raises(ValueError, match="generator function"):
        no_sync_guard("count")(gen)


# -- the report -------------------------------------------------------------------------------
def test_report_total_dicts_and_table(x: torch.Tensor) -> None:
    with no_sync_guard("count", assume_device=True) as guard:
        for _ in range(2):
            x.sum().item()  # <- sync:a
        x.tolist()  # <- sync:b
    report = guard.report
    assert isinstance(report, SyncReport)
    assert report.total == guard.total == 3
    dicts = report.as_dicts()
    times = [d.pop("outside_ns") for d in dicts]  # outside any region: each sync's time kept
    assert dicts == [
        {"file": HERE, "line": line_of("a"), "op": "item", "operator": "aten::_local_scalar_dense",
         "count": 2, "code": "x.sum().item()  # <- sync:a", "via": "", "outside": 2},
        {"file": HERE, "line": line_of("b"), "op": "tolist", "operator": "Tensor.tolist",
         "count": 1, "code": "x.tolist()  # <- sync:b", "via": "", "outside": 1},
    ]
    assert [len(t) for t in times] == [2, 1]
    assert times[0][0] <= times[0][1] <= times[1][0]
    text = str(report)
    assert text.startswith("host-device syncs: 3 at 2 call sites")
    assert f"{short(HERE)}:{line_of('a')}" in text
    assert "| x.sum().item()  # <- sync:a" in text
    assert report.sites[0].where == f"{HERE}:{line_of('a')}"


def test_report_header_singular_and_empty(x: torch.Tensor) -> None:
    with no_sync_guard("count", assume_device=True) as guard:
        x.sum().item()
    assert str(guard.report).startswith("host-device syncs: 1 at 1 call site\n")
    with no_sync_guard("count", assume_device=True) as quiet:
        x.sum()
    assert str(quiet.report) == "host-device syncs: 0 at 0 call sites"


# -- regions, spans and the summary ---------------------------------------------------------------
def test_syncs_are_attached_to_the_enclosing_region(x: torch.Tensor, captured: Capture) -> None:
    with no_sync_guard("count", assume_device=True) as guard, perfsdk.timed_region("step"):
        x.sum().item()  # <- sync:a
        x.max().item()  # <- sync:b
        for _ in range(2):
            x.sum().item()  # <- sync:c
    PIPELINE.drain(wait=True)
    sites = (f"{short(HERE)}:{line_of('a')} item", f"{short(HERE)}:{line_of('b')} item",
             f"{short(HERE)}:{line_of('c')} item")
    (region,) = captured.named("step")
    assert region.attributes["perfsdk.syncs"] == 4
    assert tuple(region.attributes["perfsdk.sync_sites"]) == sites
    assert tuple(region.attributes["perfsdk.sync_counts"]) == (1, 1, 2)
    assert [s.outside for s in guard.report.sites] == [0, 0, 0]  # all inside the region
    assert [s.label for s in guard.report.sites] == [sites[2], sites[0], sites[1]]
    span = captured.span("step")
    assert span.attributes["perfsdk.syncs"] == 4
    assert tuple(span.attributes["perfsdk.sync_sites"]) == sites
    assert tuple(span.attributes["perfsdk.sync_counts"]) == (1, 1, 2)


def test_summary_counts_syncs_per_region_and_lists_the_sites(x: torch.Tensor) -> None:
    PIPELINE.drain(wait=True)
    lifecycle.SUMMARY.reset()
    try:
        with no_sync_guard("count", assume_device=True):
            for _ in range(2):
                with perfsdk.timed_region("step"):
                    x.sum().item()  # <- sync
        table = perfsdk.summary(show=False)
        assert table["step"].syncs == 2
        assert [(s.line, s.count) for s in table.sync_sites] == [(line_of(), 2)]
        text = str(table)
        assert "host-device syncs: 2 at 1 call site" in text
        assert f"{short(HERE)}:{line_of()}" in text
    finally:
        PIPELINE.drain(wait=True)
        lifecycle.SUMMARY.reset()


# -- perfsdk disabled, torch.compile ----------------------------------------------------------
def test_disabled_perfsdk_makes_the_guard_inert(x: torch.Tensor) -> None:
    configure(enabled=False)
    with no_sync_guard("error", assume_device=True) as guard:
        assert stacks_empty()
        value = x.sum().item()
    assert value == 15.0
    assert guard.report.total == 0


def test_compiled_function_still_computes_and_its_sync_is_reported() -> None:
    def body(t: torch.Tensor) -> float:
        y = t * 2 + 1
        return y.sum().item()  # <- sync

    compiled = torch.compile(body, backend="eager")
    try:
        with no_sync_guard("count", assume_device=True) as guard:
            value = compiled(torch.arange(4, dtype=torch.float32))
    finally:
        torch._dynamo.reset()
    assert value == 16.0
    assert [(s.file, s.line, s.op) for s in guard.report.sites] == [(HERE, line_of(), "item")]
    assert stacks_empty()


# -- what is on the host: copies to it, and what is computed from them alone -------------------
def test_a_host_copy_is_read_without_another_sync(x: torch.Tensor) -> None:
    with no_sync_guard("count", assume_device=True) as guard:
        values = x.cpu().tolist()  # <- sync:a
        array = x.cpu().numpy()  # <- sync:b
        total = x.cpu().sum().item()  # <- sync:c
        host = x.cpu()  # <- sync:d
        described = f"{host.max():.1f}"
    assert values == x.tolist()
    assert array.tolist() == x.tolist()
    assert (total, described) == (15.0, "5.0")
    lines = [line_of("a"), line_of("b"), line_of("c"), line_of("d")]
    assert [(s.line, s.op, s.count) for s in sorted(guard.report.sites, key=lambda s: s.line)] \
        == [(line, "to_host", 1) for line in lines]


def test_the_source_of_a_host_copy_stays_on_the_device(x: torch.Tensor) -> None:
    with no_sync_guard("count", assume_device=True) as guard:
        host = x.cpu()  # <- sync:a
        x.sum().item()  # <- sync:b
        (host + x).sum().item()  # <- sync:c
    assert [(s.line, s.op) for s in sorted(guard.report.sites, key=lambda s: s.line)] == [
        (line_of("a"), "to_host"), (line_of("b"), "item"), (line_of("c"), "item")]
    assert torch.equal(host, x)


def test_a_host_copy_keeps_autograd_and_parameters_keep_their_identity() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    with no_sync_guard("count", assume_device=True) as guard:
        assert w.cpu() is w  # module code (Module.cpu()) relies on it
        copy = (w * 2).cpu()
        copy.sum().backward()
    assert w.grad is not None
    assert w.grad.tolist() == [2.0, 2.0, 2.0]
    assert guard.report.total == 2  # the two .cpu(), nothing for reading the copy


def test_a_device_tensor_copied_to_the_host_is_read_without_another_sync() -> None:
    from perfsdk.testing import FakeCudaTensor

    dev = FakeCudaTensor(torch.arange(4.0))
    with no_sync_guard("count", assume_device=True) as guard:
        by_cpu = dev.cpu()  # <- sync:a
        by_to = dev.to("cpu")  # <- sync:b
        values = by_cpu.tolist() + by_to.tolist()
        by_to.sum().item()
    assert values == [0.0, 1.0, 2.0, 3.0] * 2
    assert [(s.line, s.op) for s in sorted(guard.report.sites, key=lambda s: s.line)] == [
        (line_of("a"), "to_host"), (line_of("b"), "to_host")]


# -- perfsdk's own helpers: the site is the user's line -----------------------------------------
def _train_step() -> perfsdk.optimize.TrainStep:
    import perfsdk.optimize

    model = torch.nn.Linear(4, 1)
    step = perfsdk.optimize.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      torch.nn.functional.mse_loss)
    for _ in range(2):
        step(torch.ones(2, 4), target=torch.zeros(2, 1))
    return step


def test_a_sync_inside_a_perfsdk_helper_is_reported_at_the_users_line() -> None:
    step = _train_step()
    with no_sync_guard("count", assume_device=True) as guard:
        history = step.loss_history()  # <- sync
    assert len(history) == 2
    [site] = guard.report.sites  # one transfer: .cpu(), then .tolist() of the host copy
    assert (site.file, site.line, site.op, site.count) == (HERE, line_of(), "to_host", 1)
    assert site.code == "history = step.loss_history()  # <- sync"
    perfsdk_dir = os.path.dirname(perfsdk.__file__) + os.sep
    assert site.via.startswith(perfsdk_dir + os.path.join("optimize", "train_step.py") + ":")
    assert not any(s.file.startswith(perfsdk_dir) for s in perfsdk.sync.sites())
    assert f"{short(HERE)}:{line_of()}" in str(guard.report)
    assert "(in perfsdk at perfsdk/optimize/train_step.py:" in str(guard.report)


def test_a_perfsdk_helper_raises_and_warns_at_the_users_line() -> None:
    step = _train_step()
    with pytest.raises(SyncError) as info, no_sync_guard("error", assume_device=True):
        step.loss_history()  # <- sync:a
    assert (info.value.file, info.value.line) == (HERE, line_of("a"))
    assert "in perfsdk at perfsdk/optimize/train_step.py:" in str(info.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with no_sync_guard("warn", assume_device=True):
            step.loss_history()  # <- sync:b
    [warning] = [w for w in caught if issubclass(w.category, SyncWarning)]
    assert (warning.filename, warning.lineno) == (HERE, line_of("b"))
