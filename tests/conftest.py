"""Shared test set-up: markers, auto-skip rules and perfsdk fixtures.

* ``slow`` tests run only with ``--run-slow``.
* torch runs one intra-op thread here and in the scripts tests start (``OMP_NUM_THREADS=1``
  unless set): two per process on a busy 2-core machine spin in OpenMP barriers.
* ``gpu`` tests skip when ``torch.cuda.is_available()`` is False; with ``PERFSDK_REQUIRE_GPU=1``
  (set on GPU runners, by ``.ci/gpu``) that skip, and any other skip of a ``gpu`` test, is a
  failure, so a broken CUDA install or a missing package cannot pass silently.
* ``distributed`` tests are deselected unless ``WORLD_SIZE`` > 1 (they run under ``torchrun``).
* pytest-xdist runs the suite in two worker processes, each test file whole on one of them
  (``-n 2 --dist loadfile`` in pyproject.toml's ``addopts``): a module-scoped fixture (a
  benchmark's run, a torchrun job, the demo) runs once, and a file's tests keep their order.
  A pytest that a test starts itself passes ``-n 0``.
* A ``gpu`` test that leaves torch's CUDA sync debug mode changed fails (and it is put back).
* On a GPU machine, a test not marked ``gpu`` that initializes CUDA fails unless it is marked
  ``initializes_cuda`` (torch does it there: torch.compile, torch.profiler, a copy to "cuda");
  after one has, later tests not marked ``gpu`` run on a fake device without a GPU.
* Fixtures: ``fake_cuda`` (perfsdk's fake CUDA backend), ``no_cuda`` (the same, as a machine
  without a GPU), ``captured`` (in-memory capture of
  resolved regions and spans) and the autouse ``fresh_config`` that restores perfsdk's settings
  and warning counts and drains the pipeline after every test. ``nvtx_lib`` (the NVTX recording
  injection library) comes from ``tests.nvtx_injection.fixtures``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Generator, Iterator

import pytest

from perfsdk.testing import Capture, FakeCuda, capture, reset, use_fake_cuda

pytest_plugins = ["tests.nvtx_injection.fixtures"]


def pytest_configure(config: pytest.Config) -> None:
    # torch runs one intra-op thread in the tests and in every script they start (which
    # inherit the variable): on a 2-core machine that runs anything else, two threads per
    # process spend their time in OpenMP's spinning barriers (docs/optimize.md's blocks took
    # 206 s beside two busy processes with two threads, 44 s with one; the same 19 s on a
    # quiet machine). An OMP_NUM_THREADS set by whoever runs the tests is kept.
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked 'slow'")


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@functools.cache
def _cuda_available() -> bool:
    # Asked only when a gpu test is about to run: on a GPU machine the question itself touches
    # the driver, which must not happen in runs that fork (DataLoader workers) without one.
    import torch

    return bool(torch.cuda.is_available())


def _require_gpu() -> bool:
    return os.environ.get("PERFSDK_REQUIRE_GPU", "").strip().lower() in {"1", "true", "yes", "on"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _world_size() <= 1:
        deselected = [item for item in items if item.get_closest_marker("distributed")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("distributed")]
    if not config.getoption("--run-slow"):
        skip_slow = pytest.mark.skip(reason="slow test: run with --run-slow")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip_slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not _cuda_available():
        if _require_gpu():
            pytest.fail("PERFSDK_REQUIRE_GPU=1 but torch.cuda.is_available() is False",
                        pytrace=False)
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under ``PERFSDK_REQUIRE_GPU=1`` a ``gpu`` test that skips for any reason (a missing
    package, ``slow`` without ``--run-slow``, ``pytest.skip`` in the test) fails instead: on a
    GPU runner every GPU path must really have run."""
    report = yield
    if (report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu")
            and _require_gpu()):
        reason = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                  else str(report.longrepr)).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (f"PERFSDK_REQUIRE_GPU=1: this gpu test was skipped ({reason}); "
                           "on a GPU runner a skip is a failure")
    return report


@pytest.fixture(autouse=True)
def fresh_config() -> Iterator[None]:
    """After each test: an open step ended, settings from the environment again, warning counts,
    the summary and the sync sites cleared, and every finished region handed to the sinks (so
    nothing leaks into the next test's capture or summary)."""
    yield
    reset()


@pytest.fixture(autouse=True)
def _gpu_state_put_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``gpu`` test that leaves torch's CUDA sync debug mode changed fails, and the mode is
    put back: left at ``error`` it made every later test's ``model.to("cuda")`` raise."""
    if request.node.get_closest_marker("gpu") is None or not _cuda_available():
        yield
        return
    import torch

    try:
        before = torch.cuda.get_sync_debug_mode()
    except (AssertionError, RuntimeError):  # CUDA that only says it is there (a test's fake)
        yield
        return
    yield
    after = torch.cuda.get_sync_debug_mode()
    if after != before:
        torch.cuda.set_sync_debug_mode(before)
        pytest.fail(f"this test left torch's CUDA sync debug mode at {after} (it was {before}); "
                    "put back for the next test", pytrace=False)


@pytest.fixture(autouse=True)
def _cuda_left_alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a GPU machine, tests not marked ``gpu`` see a machine without one, as on CPU CI:

    * a test that initializes CUDA fails, unless it is marked ``initializes_cuda`` (torch
      itself does it there: torch.compile, torch.profiler, a copy to "cuda"). perfsdk must
      never initialize CUDA on its own;
    * once such a test has initialized it in the worker, each later test runs on a fake
      device without a GPU (``no_cuda``): otherwise its regions recorded device events, the GPU
      sampler started, and the compiled fast paths stood aside.

    Only ``torch.cuda.is_initialized()`` is asked, which does not touch the driver."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        request.getfixturevalue("no_cuda")  # torn down with the test's own fixtures
        yield
        return
    yield
    if (torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            and request.node.get_closest_marker("initializes_cuda") is None):
        pytest.fail("this test, not marked gpu, initialized CUDA; every later test in this "
                    "process runs with it initialized", pytrace=False)


def _real_gpu_sampler_stopped() -> None:
    """A GPU sampler reading the real NVML (on a GPU machine, started once an earlier test
    initialized CUDA) is stopped: it held records and gave spans readings. None starts again
    while the device is a fake."""
    from perfsdk.gpu import TELEMETRY

    if TELEMETRY.sampler is not None and TELEMETRY.nvml is None:
        TELEMETRY.reset()


@pytest.fixture
def fake_cuda() -> Iterator[FakeCuda]:
    """perfsdk's device interface routed to a fake GPU for the test."""
    with use_fake_cuda() as fake:
        _real_gpu_sampler_stopped()
        yield fake


@pytest.fixture
def no_cuda() -> Iterator[FakeCuda]:
    """perfsdk's device interface routed to a machine without a GPU, on any machine: a test of
    CPU behaviour must not depend on whether an earlier test initialized CUDA (on a GPU
    machine one did, and regions recorded device events)."""
    fake = FakeCuda()
    fake.initialized = fake.available = False
    fake.devices = []
    with use_fake_cuda(fake):
        _real_gpu_sampler_stopped()
        yield fake


@pytest.fixture
def captured() -> Iterator[Capture]:
    """Regions (and their spans) that resolve during the test."""
    with capture() as cap:
        yield cap
