"""The test harness itself: --run-slow, gpu auto-skip (a failure under PERFSDK_REQUIRE_GPU=1),
distributed deselection. Runs pytest with tests/conftest.py as a plugin, in this process
(pytester): a subprocess for each run paid torch's import again (~4 s of CPU) for nothing the
tests check."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

import tests.conftest as harness

ROOT = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]

SAMPLE = '''
import pytest

def test_plain():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.distributed
def test_distributed():
    pass

def test_fixtures(fake_cuda, captured, nvtx_lib):
    from perfsdk import _device
    assert _device.get_backend() is fake_cuda
'''


# A GPU runner, as far as the harness can tell: its CUDA check says yes (the tests below check
# what a gpu test that skips by itself becomes; none of them touches CUDA).
GPU_SKIPS = '''
import pytest

import tests.conftest as harness

harness._cuda_available = lambda: True

@pytest.mark.gpu
def test_gpu_skips_itself():
    pytest.skip("pynvml is not installed")

@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_slow():
    pass

@pytest.mark.gpu
def test_gpu_runs():
    pass

def test_cpu_skips_itself():
    pytest.skip("not a gpu test")
'''


def run_pytest(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str,
               sample: str = SAMPLE, **env: str) -> dict[str, str]:
    test_file = pytester.path / "test_sample.py"
    test_file.write_text(sample)
    with monkeypatch.context() as mp:
        for name in ("WORLD_SIZE", "PERFSDK_REQUIRE_GPU", "PYTEST_ADDOPTS"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        # The run shares this process's tests.conftest module: GPU_SKIPS replaces its CUDA
        # check, and a fresh cache is what a new process would start with.
        mp.setattr(harness, "_cuda_available",
                   functools.cache(harness._cuda_available.__wrapped__))
        result = pytester.runpytest_inprocess(
            "-p", "tests.conftest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
            str(pytester.path), "-rA", "-q", "-n", "0", "-p", "no:cacheprovider",
            "-p", "no:benchmark", str(test_file), *args)
    stdout = result.stdout.str()
    outcomes = {}
    for line in stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR) test_sample\.py::(?:\w+::)?(test_\w+)", line)
        if m:
            outcomes[m.group(2)] = m.group(1)
        m = re.match(r"^SKIPPED \[\d+\] \S+:\d+: (.*)$", line)
        if m:
            outcomes.setdefault("_skip_reasons", "")
            outcomes["_skip_reasons"] += m.group(1) + "\n"
    outcomes["_out"] = stdout + result.stderr.str()
    return outcomes


cpu_only = pytest.mark.skipif(torch.version.cuda is not None,
                              reason="gpu skip rules are checked on CPU-only builds")


@cpu_only
def test_defaults_skip_slow_and_gpu_and_deselect_distributed(pytester, monkeypatch):
    result = run_pytest(pytester, monkeypatch)
    out = result["_out"]
    assert result.get("test_plain") == "PASSED", out
    assert "test_distributed" not in result, out
    assert "1 deselected" in out, out
    assert "slow test: run with --run-slow" in result["_skip_reasons"], out
    assert "needs a CUDA GPU" in result["_skip_reasons"], out
    assert re.search(r"\b2 skipped\b", out), out
    # fixtures: fake_cuda, captured and nvtx_lib (skips only if no C compiler / NVTX headers)
    assert result.get("test_fixtures") in ("PASSED", None), out


@cpu_only
def test_run_slow_world_size_and_require_gpu(pytester, monkeypatch):
    result = run_pytest(pytester, monkeypatch, "--run-slow", WORLD_SIZE="2",
                        PERFSDK_REQUIRE_GPU="1")
    out = result["_out"]
    assert result.get("test_slow") == "PASSED", out
    assert result.get("test_distributed") == "PASSED", out
    assert result.get("test_gpu") in ("FAILED", "ERROR"), out  # fails in setup
    assert "PERFSDK_REQUIRE_GPU=1 but torch.cuda.is_available() is False" in out


def test_a_gpu_test_that_skips_itself_fails_only_under_require_gpu(pytester, monkeypatch):
    result = run_pytest(pytester, monkeypatch, sample=GPU_SKIPS)
    out = result["_out"]
    assert result.get("test_gpu_runs") == "PASSED", out
    assert re.search(r"\b3 skipped\b", out), out
    result = run_pytest(pytester, monkeypatch, sample=GPU_SKIPS, PERFSDK_REQUIRE_GPU="1")
    out = result["_out"]
    assert result.get("test_gpu_runs") == "PASSED", out
    assert result.get("test_gpu_skips_itself") == "FAILED", out
    assert result.get("test_gpu_slow") in ("FAILED", "ERROR"), out  # slow, no --run-slow
    assert "this gpu test was skipped (pynvml is not installed)" in out, out
    assert "not a gpu test" in result["_skip_reasons"], out  # other tests may still skip
    result = run_pytest(pytester, monkeypatch, "--run-slow", sample=GPU_SKIPS,
                        PERFSDK_REQUIRE_GPU="1")
    assert result.get("test_gpu_slow") == "PASSED", result["_out"]


CUDA_TOUCHED = '''
import pytest
import torch


@pytest.fixture(scope="class")
def uninitialized():  # set up before, and put back after, the function-scoped guard
    was = torch.cuda._initialized  # True where an earlier test initialized a real GPU
    torch.cuda._initialized = False
    yield
    torch.cuda._initialized = was


@pytest.mark.usefixtures("uninitialized")
class TestInitializes:
    def test_initializes(self):
        torch.cuda._initialized = True  # what torch's lazy init leaves behind


@pytest.mark.usefixtures("uninitialized")
class TestMarked:
    @pytest.mark.initializes_cuda
    def test_marked(self):
        torch.cuda._initialized = True


@pytest.mark.usefixtures("uninitialized")
class TestAlone:
    def test_leaves_it_alone(self):
        pass
'''


def test_a_test_that_initializes_cuda_fails_unless_marked(pytester, monkeypatch):
    """On a GPU machine, a CPU test that initialized CUDA changed every later test in its
    worker (the real GPU sampler started, the compiled fast paths stood aside)."""
    before = torch.cuda.is_initialized()
    result = run_pytest(pytester, monkeypatch, sample=CUDA_TOUCHED)
    out = result["_out"]
    assert result.get("test_initializes") == "ERROR", out
    assert "this test, not marked gpu, initialized CUDA" in out, out
    assert result.get("test_marked") == "PASSED", out
    assert result.get("test_leaves_it_alone") == "PASSED", out
    assert torch.cuda.is_initialized() == before
