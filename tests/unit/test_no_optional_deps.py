"""perfsdk works without its optional dependencies, and importing it never touches CUDA.

Both run in a fresh interpreter: what ``import perfsdk`` does can only be seen once per process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK_IMPORTS = """
import importlib.abc, sys

BLOCKED = ("nvtx", "pynvml", "opentelemetry")

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked for this test")
        return None

sys.meta_path.insert(0, Blocker())
"""

WATCH_CUDA = """
import torch

CUDA_CALLS = []

def watch(name):
    real = getattr(torch.cuda, name)
    def spy(*args, **kwargs):
        import traceback
        CUDA_CALLS.append((name, "".join(traceback.format_stack(limit=6))))
        return real(*args, **kwargs)
    setattr(torch.cuda, name, spy)

for _name in ("_lazy_init", "init", "is_available", "device_count", "current_device"):
    watch(_name)
"""


def run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PERFSDK_EXPORTER": "",
             "HOME": str(ROOT)},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_works_without_nvtx_pynvml_and_opentelemetry():
    out = run(BLOCK_IMPORTS + """
import asyncio
import warnings

with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import perfsdk
    from perfsdk import context
    from perfsdk.testing import capture

    @perfsdk.profiled("inner")
    def inner(x):
        return x + 1

    @perfsdk.profiled
    def outer(x):
        return inner(x) * 2

    @perfsdk.profiled("agen")
    async def agen():
        yield 1

    async def main():
        async with perfsdk.timed_region("async-block"):
            await asyncio.sleep(0)
        return [x async for x in agen()]

    with capture() as cap:
        assert outer(1) == 4
        with perfsdk.timed_region("block", k=1) as r:
            assert context.current_span() is r
        assert asyncio.run(main()) == [1]
    assert r.host_ms >= 0
    by_name = {x.name: x for x in cap.regions}
    assert by_name["inner"].parent_span_id == by_name["outer"].span_id
    assert by_name["block"].attributes["k"] == 1
    assert cap.spans == []  # no OpenTelemetry: regions only

    table = perfsdk.summary(show=False)
    assert table["outer"].count == 1
    assert table["block"].count == 1
    assert table["agen"].count == 2
    assert "block" in str(table)
    perfsdk.flush()
    info = perfsdk.diagnostics()
    assert info["pending_regions"] == 0

    try:
        perfsdk.configure(exporter="console")
    except ImportError as exc:
        assert isinstance(exc, perfsdk.MissingDependencyError)
        assert "pip install 'perfsdk[otlp]'" in str(exc)
    else:
        raise AssertionError("exporter=console without OpenTelemetry should raise")
    assert perfsdk.get_config().exporters == ()
    perfsdk.configure(exporter="none")  # allowed

leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert leaked == [], leaked
ours = [str(w.message) for w in seen if issubclass(w.category, perfsdk.PerfSDKWarning)]
assert len(ours) == 1 and "nvtx" in ours[0], ours
perfsdk.shutdown()
print("OK")
""")
    assert out.strip().endswith("OK")


def test_import_and_regions_do_not_initialize_cuda():
    out = run(WATCH_CUDA + """
import perfsdk

assert not torch.cuda.is_initialized()

@perfsdk.profiled
def step(x):
    return x * 2

for i in range(3):
    step(torch.ones(2))
    with perfsdk.timed_region("block"):
        pass
perfsdk.flush()
assert perfsdk.summary(show=False)["block"].count == 3
assert not torch.cuda.is_initialized()
perfsdk.shutdown()
assert not torch.cuda.is_initialized()
assert CUDA_CALLS == [], "\\n".join(stack for _, stack in CUDA_CALLS)
print("OK")
""")
    assert out.strip().endswith("OK")


def test_optimize_imports_without_matplotlib_and_plot_names_the_extra():
    out = run(BLOCK_IMPORTS.replace('("nvtx", "pynvml", "opentelemetry")', '("matplotlib",)') + """
import tempfile
import perfsdk.optimize
from perfsdk.optimize import OptimizationReport, StepResult

step = StepResult(name="eager fp32 (baseline)", applied=True, reason="", median_ms=1.0,
                  p95_ms=1.0, samples_per_s=None, speedup=1.0, peak_memory_bytes=None,
                  max_error=0.0, setup_s=0.0)
report = OptimizationReport(mode="inference", steps=(step,), chosen=step.name, budget_s=None,
                            search_s=0.1)
try:
    report.plot(tempfile.mktemp(suffix=".png"))
except perfsdk.MissingDependencyError as exc:
    print("named:", "pip install 'perfsdk[plot]'" in str(exc))
assert not [m for m in sys.modules if m.split(".")[0] == "matplotlib"]
""")
    assert "named: True" in out


def test_configure_imported_alone_still_names_the_missing_exporter_package():
    """``import perfsdk`` is lazy: ``configure`` imported from perfsdk.config before anything
    else must still reach the composition root, which checks the exporter's package."""
    out = run(BLOCK_IMPORTS + """
from perfsdk.config import configure, get_config
from perfsdk.errors import MissingDependencyError

try:
    configure(exporter="otlp")
except MissingDependencyError as exc:
    print("named:", "pip install 'perfsdk[otlp]'" in str(exc), get_config().exporters)
""")
    assert "named: True ()" in out
