"""The sync detector against a corpus: every syncing operation the issue names is reported once,
with the right kind and at the exact line of this file; nothing in the non-syncing corpus is.

Each case is a small function whose syncing line ends with the marker ``# <- sync``, so the
expected call site is found by reading the source, never hard-coded. The corpus runs three ways:

* on CPU tensors with ``assume_device=True`` (what a CPU-only CI run sees), in ``count`` mode
  (one site, right op, file and line) and in ``error`` mode (``SyncError`` raised at that line,
  naming op and ``file:line``);
* on CPU tensors *without* ``assume_device``: nothing is reported, which proves the detector
  checks the real device of a tensor;
* on perfsdk's fake CUDA tensors (``FakeCudaTensor``/``FakePinnedTensor``), without
  ``assume_device``, for the operations a CPU-only torch build lets through for them: pinned
  non-blocking copies are not flagged, pageable ones are.

The explicit synchronize calls (``torch.cuda.synchronize``, ``Event.synchronize``,
``Stream.synchronize``) and torch's sync debug mode (through the fake CUDA backend) close it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import perfsdk
from perfsdk import SyncError, no_sync_guard
from perfsdk.testing import FakeCuda, FakeCudaTensor, FakePinnedTensor

HERE = __file__
MARK = "# <- sync"


@pytest.fixture(autouse=True)
def _fresh_sites() -> object:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


def marked_line(fn: Callable[..., object]) -> int:
    """The line of ``fn`` that ends with the sync marker (exactly one)."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if text.rstrip().endswith(MARK)]
    assert len(hits) == 1, f"{fn.__name__}: {len(hits)} marked lines"
    return hits[0]


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    run: Callable[[], object]
    then: type[BaseException] | None = None  # what torch raises after the detector let it run

    @property
    def id(self) -> str:
        return self.run.__name__.lstrip("_")


def ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


# -- CPU tensors standing for device tensors (assume_device=True) --------------------------------
def data() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) - 3.5


def reps() -> torch.Tensor:
    return torch.full((8,), 2, dtype=torch.long)


def _item() -> None:
    data().sum().item()  # <- sync


def _int() -> None:
    int(data().argmax())  # <- sync


def _float() -> None:
    float(data().sum())  # <- sync


def _bool() -> None:
    bool(data().sum() > 0)  # <- sync


def _if_tensor() -> None:
    x = data()
    if x.max() > 0:  # <- sync
        x.add_(1)


def _equal() -> None:
    torch.equal(data(), data())  # <- sync


def _allclose() -> None:
    torch.allclose(data(), data())  # <- sync


def _tolist() -> None:
    data().tolist()  # <- sync


def _numpy() -> None:
    data().numpy()  # <- sync


def _np_asarray() -> None:
    np.asarray(data())  # <- sync


def _cpu() -> None:
    data().cpu()  # <- sync


def _print() -> None:
    print(data())  # <- sync


def _str() -> None:
    str(data())  # <- sync


def _format_scalar() -> None:
    _ = f"{data().sum():.3f}"  # <- sync


def _nonzero() -> None:
    torch.nonzero(data())  # <- sync


def _nonzero_method() -> None:
    data().nonzero()  # <- sync


def _where_one_arg() -> None:
    torch.where(data() > 0)  # <- sync


def _argwhere() -> None:
    torch.argwhere(data())  # <- sync


def _masked_select() -> None:
    x = data()
    torch.masked_select(x, x > 0)  # <- sync


def _unique() -> None:
    torch.unique(data())  # <- sync


def _unique_method_dim() -> None:
    data().unique(dim=0)  # <- sync


def _unique_consecutive() -> None:
    torch.unique_consecutive(data())  # <- sync


def _mask_index() -> None:
    x = data()
    x[x > 0]  # <- sync


def _mask_assign() -> None:
    x = data()
    x[x > 0] = 0.0  # <- sync


def _repeat_interleave() -> None:
    torch.repeat_interleave(data(), reps())  # <- sync


def _repeat_interleave_method_dim() -> None:
    data().repeat_interleave(reps(), dim=0)  # <- sync


def _repeat_interleave_counts() -> None:
    torch.repeat_interleave(reps())  # <- sync


CPU_SYNCS = [
    Case("item", _item), Case("item", _int), Case("item", _float), Case("item", _bool),
    Case("item", _if_tensor), Case("item", _equal), Case("item", _allclose),
    Case("tolist", _tolist),
    Case("numpy", _numpy), Case("numpy", _np_asarray), Case("to_host", _cpu),
    Case("print", _print), Case("print", _str), Case("print", _format_scalar),
    Case("nonzero", _nonzero), Case("nonzero", _nonzero_method),
    Case("nonzero", _where_one_arg), Case("nonzero", _argwhere),
    Case("masked_select", _masked_select), Case("unique", _unique),
    Case("unique", _unique_method_dim), Case("unique", _unique_consecutive),
    Case("mask_index", _mask_index), Case("mask_assign", _mask_assign),
    Case("repeat_interleave", _repeat_interleave),
    Case("repeat_interleave", _repeat_interleave_method_dim),
    Case("repeat_interleave", _repeat_interleave_counts),
]


def assert_one_site(guard: no_sync_guard, case: Case) -> None:
    report = guard.report
    assert [(s.file, s.line, s.op, s.count) for s in report.sites] == [
        (HERE, marked_line(case.run), case.op, 1)], str(report)


def assert_raised_here(error: SyncError, case: Case) -> None:
    line = marked_line(case.run)
    assert (error.file, error.line, error.op) == (HERE, line, case.op)
    message = str(error)
    assert f"({case.op}," in message
    assert f"{os.path.basename(HERE)}:{line}" in message


@pytest.mark.parametrize("case", CPU_SYNCS, ids=ids(CPU_SYNCS))
def test_cpu_sync_is_counted_once_at_its_line(case: Case) -> None:
    with no_sync_guard("count", assume_device=True) as guard:
        case.run()
    assert_one_site(guard, case)


@pytest.mark.parametrize("case", CPU_SYNCS, ids=ids(CPU_SYNCS))
def test_cpu_sync_raises_at_its_line(case: Case) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard("error", assume_device=True):
        case.run()
    assert_raised_here(info.value, case)


@pytest.mark.parametrize("case", CPU_SYNCS, ids=ids(CPU_SYNCS))
def test_cpu_tensors_without_assume_device_never_count(case: Case) -> None:
    with no_sync_guard("error") as guard:
        case.run()
    assert guard.report.total == 0
    assert guard.report.allowed == 0


# -- the non-syncing corpus -------------------------------------------------------------------
def _math() -> None:
    x = data()
    ((x * 2 + 1).exp() / (x.abs() + 1)).sum().sqrt()


def _matmul() -> None:
    torch.randn(4, 3) @ torch.randn(3, 2)


def _in_place() -> None:
    data().add_(1).mul_(2).clamp_(min=0)


def _clone() -> None:
    data().clone()


def _copy_within_device() -> None:
    torch.empty(8).copy_(data())


def _shape_queries() -> None:
    x = data()
    (x.shape, x.size(0), x.dim(), x.dtype, x.numel(), len(x), x.device, x.is_contiguous())


def _basic_indexing() -> None:
    x = data()
    (x[0], x[1:3], x[None, :2])


def _masked_fill() -> None:
    x = data()
    x.masked_fill(x > 0, 0.0)


def _where_three_args() -> None:
    x = data()
    torch.where(x > 0, x, torch.zeros_like(x))


def _argmax() -> None:
    data().argmax()


def _to_dtype() -> None:
    data().to(torch.float64)


def _to_device_cpu() -> None:
    device = "cpu"  # documented: on a CPU-only run x.to(device) is read as the upload
    data().to(device)


def _repeat_interleave_output_size() -> None:
    torch.repeat_interleave(data(), reps(), output_size=16)


def _repeat_interleave_int() -> None:
    torch.repeat_interleave(data(), 2)


def _linear_forward_backward() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).square().mean().backward()


def _optimizer_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()


CPU_QUIET = [Case("", fn) for fn in (
    _math, _matmul, _in_place, _clone, _copy_within_device, _shape_queries, _basic_indexing,
    _masked_fill, _where_three_args, _argmax, _to_dtype, _to_device_cpu,
    _repeat_interleave_output_size, _repeat_interleave_int, _linear_forward_backward,
    _optimizer_step)]


@pytest.mark.parametrize("case", CPU_QUIET, ids=ids(CPU_QUIET))
def test_cpu_non_syncing_op_is_not_flagged(case: Case) -> None:
    with no_sync_guard("error", assume_device=True) as guard:
        case.run()
    assert guard.report.total == 0
    assert guard.report.allowed == 0


# -- the fake CUDA device (no assume_device) -------------------------------------------------------
def dev() -> torch.Tensor:
    return FakeCudaTensor(torch.arange(8, dtype=torch.float32) - 3.5)


def _fake_item() -> None:
    dev().sum().item()  # <- sync


def _fake_bool() -> None:
    bool(dev().sum() > 0)  # <- sync


def _fake_if_tensor() -> None:
    if dev().max() > 0:  # <- sync
        pass


def _fake_equal() -> None:
    torch.equal(dev(), dev())  # <- sync


def _fake_numpy() -> None:
    dev().numpy()  # <- sync


def _fake_cpu() -> None:
    dev().cpu()  # <- sync


def _fake_to_cpu() -> None:
    dev().to("cpu")  # <- sync


def _fake_to_cpu_device() -> None:
    dev().to(torch.device("cpu"))  # <- sync


def _fake_copy_to_host() -> None:
    torch.empty(8).copy_(dev())  # <- sync


def _fake_copy_to_pageable_non_blocking() -> None:
    torch.empty(8).copy_(dev(), non_blocking=True)  # <- sync


def _fake_print() -> None:
    print(dev())  # <- sync


def _fake_nonzero() -> None:
    torch.ops.aten.nonzero.default(dev())  # <- sync


def _fake_masked_select() -> None:
    x = dev()
    torch.masked_select(x, x > 0)  # <- sync


def _fake_unique() -> None:
    torch.unique(dev())  # <- sync


def _fake_unique_consecutive() -> None:
    torch.unique_consecutive(dev())  # <- sync


def _fake_mask_index() -> None:
    x = dev()
    torch.ops.aten.index.Tensor(x, [x > 0])  # <- sync


def _fake_mask_assign() -> None:
    x = dev()
    torch.ops.aten.index_put_.default(x, [x > 0], FakeCudaTensor(torch.tensor(0.0)))  # <- sync


def _fake_repeat_interleave() -> None:
    torch.repeat_interleave(dev(), FakeCudaTensor(reps()))  # <- sync


def _fake_pageable_upload() -> None:
    torch.randn(3).to("cuda", non_blocking=True)  # <- sync


def _fake_pageable_upload_like() -> None:
    torch.randn(8).to(dev(), non_blocking=True)  # <- sync


CPU_BUILD_RAISES = AssertionError if torch.version.cuda is None else None
"""What a real copy to "cuda" raises: "Torch not compiled with CUDA enabled" on a CPU-only
build; nothing where torch has CUDA."""

FAKE_SYNCS = [
    Case("item", _fake_item), Case("item", _fake_bool), Case("item", _fake_if_tensor),
    Case("item", _fake_equal),
    Case("numpy", _fake_numpy, then=RuntimeError),  # torch: not supported for subclasses
    Case("to_host", _fake_cpu), Case("to_host", _fake_to_cpu),
    Case("to_host", _fake_to_cpu_device), Case("to_host", _fake_copy_to_host),
    Case("to_host", _fake_copy_to_pageable_non_blocking), Case("print", _fake_print),
    Case("nonzero", _fake_nonzero), Case("masked_select", _fake_masked_select),
    Case("unique", _fake_unique), Case("unique", _fake_unique_consecutive),
    Case("mask_index", _fake_mask_index), Case("mask_assign", _fake_mask_assign),
    Case("repeat_interleave", _fake_repeat_interleave),
    # a CPU-only torch build cannot make the device tensor: it raises after the detector
    Case("pageable_copy", _fake_pageable_upload, then=CPU_BUILD_RAISES),
    Case("pageable_copy", _fake_pageable_upload_like, then=CPU_BUILD_RAISES),
]


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.initializes_cuda) if c.run is _fake_pageable_upload else c
    for c in FAKE_SYNCS], ids=ids(FAKE_SYNCS))  # a real copy to "cuda" initializes it
def test_fake_device_sync_is_counted_once_at_its_line(case: Case) -> None:
    with no_sync_guard("count") as guard:
        if case.then is None:
            case.run()
        else:
            with pytest.raises(case.then):
                case.run()
    assert_one_site(guard, case)


@pytest.mark.parametrize("case", FAKE_SYNCS, ids=ids(FAKE_SYNCS))
def test_fake_device_sync_raises_at_its_line(case: Case) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard("error"):
        case.run()
    assert_raised_here(info.value, case)


def _fake_math() -> None:
    x = dev()
    ((x * 2 + 1).exp() / (x.abs() + 1)).sum().sqrt()


def _fake_matmul() -> None:
    FakeCudaTensor(torch.randn(4, 3)) @ FakeCudaTensor(torch.randn(3, 2))


def _fake_in_place() -> None:
    dev().add_(1).mul_(2).clamp_(min=0)


def _fake_clone() -> None:
    dev().clone()


def _fake_shape_queries() -> None:
    x = dev()
    (x.shape, x.size(0), x.dim(), x.dtype, x.numel(), len(x), x.device)


def _fake_masked_fill() -> None:
    x = dev()
    x.masked_fill(x > 0, 0.0)


def _fake_where_three_args() -> None:
    x = dev()
    torch.where(x > 0, x, torch.zeros_like(x))


def _fake_argmax() -> None:
    dev().argmax()


def _fake_to_dtype() -> None:
    dev().to(torch.float64)


def _fake_repeat_interleave_output_size() -> None:
    torch.repeat_interleave(dev(), FakeCudaTensor(reps()), output_size=16)


def _fake_download_non_blocking() -> None:
    dev().to("cpu", non_blocking=True)  # torch allocates a pinned destination


def _fake_copy_to_pinned_non_blocking() -> None:
    FakePinnedTensor(torch.empty(8)).copy_(dev(), non_blocking=True)


def _fake_pinned_upload() -> None:
    FakePinnedTensor(torch.randn(3)).to("cuda", non_blocking=True)


def _fake_blocking_upload() -> None:
    torch.randn(3).to("cuda")


FAKE_QUIET = [Case("", fn) for fn in (
    _fake_math, _fake_matmul, _fake_in_place, _fake_clone, _fake_shape_queries,
    _fake_masked_fill, _fake_where_three_args, _fake_argmax, _fake_to_dtype,
    _fake_repeat_interleave_output_size, _fake_download_non_blocking,
    _fake_copy_to_pinned_non_blocking)] + [
    # torch, not the guard, stops these on a CPU-only build
    Case("", _fake_pinned_upload, then=CPU_BUILD_RAISES),
    Case("", _fake_blocking_upload, then=CPU_BUILD_RAISES),
]


@pytest.mark.parametrize("case", FAKE_QUIET, ids=ids(FAKE_QUIET))
def test_fake_device_non_syncing_op_is_not_flagged(case: Case) -> None:
    with no_sync_guard("error") as guard:
        if case.then is None:
            case.run()
        else:
            with pytest.raises(case.then) as info:
                case.run()
            assert not isinstance(info.value, SyncError)
            assert "Torch not compiled with CUDA enabled" in str(info.value)
    assert guard.report.total == 0


# -- explicit synchronize calls ---------------------------------------------------------------
def _cuda_synchronize() -> None:
    torch.cuda.synchronize()  # <- sync


def _event_synchronize() -> None:
    torch.cuda.Event.synchronize(None)  # <- sync


def _stream_synchronize() -> None:
    torch.cuda.Stream.synchronize(None)  # <- sync


def _accelerator_synchronize() -> None:
    torch.accelerator.synchronize()  # <- sync


EXPLICIT = [Case("synchronize", _cuda_synchronize),
            Case("event_synchronize", _event_synchronize),
            Case("stream_synchronize", _stream_synchronize),
            Case("synchronize", _accelerator_synchronize)]


@pytest.mark.parametrize("case", EXPLICIT, ids=ids(EXPLICIT))
def test_explicit_synchronize_raises_at_its_line(case: Case) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard("error"):
        case.run()
    assert_raised_here(info.value, case)


def test_synchronize_functions_are_restored_after_the_guard() -> None:
    originals = (torch.cuda.synchronize, torch.cuda.Event.synchronize,
                 torch.cuda.Stream.synchronize, torch.accelerator.synchronize)
    with no_sync_guard("count"):
        assert getattr(torch.cuda.synchronize, "__perfsdk_wrapped__", None) is originals[0]
    after = (torch.cuda.synchronize, torch.cuda.Event.synchronize,
             torch.cuda.Stream.synchronize, torch.accelerator.synchronize)
    assert after == originals
    assert not hasattr(torch.cuda.synchronize, "__perfsdk_wrapped__")
    if torch.version.cuda is None:
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            torch.cuda.synchronize()  # torch's own function again, outside any guard


# -- torch's sync debug mode, through the fake CUDA backend ---------------------------------------
def _fake_cuda_synchronize(fake: FakeCuda) -> None:
    fake.synchronize()  # <- sync


def _fake_event_synchronize(fake: FakeCuda) -> None:
    fake.Event().synchronize()  # <- sync


def _fake_stream_synchronize(fake: FakeCuda) -> None:
    fake.current_stream().synchronize()  # <- sync


def _fake_implicit_sync(fake: FakeCuda) -> None:
    fake.implicit_sync()  # <- sync


def test_debug_mode_syncs_are_reported_at_their_lines(fake_cuda: FakeCuda) -> None:
    calls = (_fake_cuda_synchronize, _fake_event_synchronize, _fake_stream_synchronize,
             _fake_implicit_sync)
    assert fake_cuda.sync_debug_mode == 0
    with no_sync_guard("count") as guard:
        assert fake_cuda.sync_debug_mode == 1
        for call in calls:
            call(fake_cuda)
    assert fake_cuda.sync_debug_mode == 0
    assert sorted((s.file, s.line, s.op, s.count) for s in guard.report.sites) == sorted(
        (HERE, marked_line(call), "cuda", 1) for call in calls)
    assert len(fake_cuda.sync_calls) == 4


def test_debug_mode_set_by_the_program_is_left_alone(fake_cuda: FakeCuda) -> None:
    with pytest.warns(UserWarning, match="prototype"):  # torch's, at the first set
        fake_cuda.set_sync_debug_mode("error")
    with no_sync_guard("count") as guard:
        assert fake_cuda.sync_debug_mode == 2
        with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
            fake_cuda.implicit_sync()  # torch's error mode still applies
    assert fake_cuda.sync_debug_mode == 2
    assert guard.report.total == 0


def test_debug_mode_sync_in_error_mode_raises_at_its_line(fake_cuda: FakeCuda) -> None:
    with pytest.raises(SyncError) as info, no_sync_guard("error"):
        _fake_implicit_sync(fake_cuda)
    assert (info.value.file, info.value.line, info.value.op) == (
        HERE, marked_line(_fake_implicit_sync), "cuda")
    assert fake_cuda.sync_debug_mode == 0



def test_an_item_is_one_sync_though_torchs_debug_mode_reports_it_late(fake_cuda: FakeCuda
                                                                      ) -> None:
    """On a GPU, torch's debug-mode warning for ``.item()`` is raised from C++ and reaches
    Python only as ``Tensor.item`` returns, after the detector has named the sync: it is the
    same sync, not a second one (seen on an H200: every ``.item()`` counted twice). A sync
    only the debug mode sees, after it, still counts."""
    x = FakeCudaTensor(torch.arange(4.0))
    with no_sync_guard("count") as guard:
        x.sum().item()  # <- sync
        assert len(fake_cuda.sync_calls) == 1  # the fake saw the operator's sync
        _fake_implicit_sync(fake_cuda)
    assert sorted((s.line, s.op, s.count) for s in guard.report.sites) == sorted(
        [(marked_line(test_an_item_is_one_sync_though_torchs_debug_mode_reports_it_late),
          "item", 1), (marked_line(_fake_implicit_sync), "cuda", 1)])
    assert guard.report.total == 2


def test_the_guard_keeps_torchs_prototype_warning_to_itself(fake_cuda: FakeCuda) -> None:
    """torch warns once, at the first ``set_sync_debug_mode``, that the mode is a prototype:
    when the guard turns it on, that is perfsdk's business (under ``-W error``, as here, it
    raised after the mode was set and left it on); the program's own first set still warns."""
    with no_sync_guard("count") as guard:
        assert fake_cuda.sync_debug_mode == 1
        _fake_implicit_sync(fake_cuda)
    assert fake_cuda.sync_debug_mode == 0
    assert guard.report.total == 1
    assert fake_cuda._prototype_warned  # torch's one warning was spent, silently
