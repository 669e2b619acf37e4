"""flush, shutdown, diagnostics: the process-wide ends of the pipeline."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import perfsdk
from perfsdk import timed_region
from perfsdk.pipeline import PIPELINE

ROOT = Path(__file__).resolve().parents[2]


def test_flush_waits_for_the_gpu_one_event_at_a_time(fake_cuda, captured):
    for ms in (1.0, 2.0, 3.0):
        with timed_region("flushed"):
            fake_cuda.launch(ms)
    PIPELINE.drain(wait=False)
    assert captured.regions == []  # all three still on the GPU
    perfsdk.flush(timeout=60.0)  # a bound on waiting for the pipeline lock; never reached
    assert [r.device_ms for r in captured.regions] == [1.0, 2.0, 3.0]
    assert PIPELINE.pending == 0
    # flush waited on the regions' own end events, never on the whole device
    assert "synchronize" not in fake_cuda.sync_calls
    assert set(fake_cuda.sync_calls) <= {"Event.synchronize"}


def test_diagnostics(fake_cuda):
    with timed_region("diag"):
        fake_cuda.launch(1.0)
    PIPELINE.drain(wait=False)
    info = perfsdk.diagnostics()
    assert info["pending_regions"] == 1
    assert isinstance(info["warnings"], dict)
    assert info["span_mode"] in ("off", "owned", "user", "undecided")
    fake_cuda.complete_all()
    PIPELINE.drain(wait=False)
    assert perfsdk.diagnostics()["pending_regions"] == 0


def test_shutdown_then_keep_going():
    code = textwrap.dedent("""
        import perfsdk

        @perfsdk.profiled("before")
        def before():
            pass

        @perfsdk.profiled("after")
        def after():
            pass

        before()
        perfsdk.shutdown(timeout=2)
        assert perfsdk.summary(show=False)["before"].count == 1
        perfsdk.shutdown(timeout=2)  # twice is fine
        after()  # instrumentation keeps working after an explicit shutdown
        perfsdk.flush()
        assert perfsdk.summary(show=False)["after"].count == 1
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    assert proc.stderr == ""


def test_the_composition_root_registers_the_sinks_in_its_documented_order() -> None:
    import perfsdk.lifecycle as lifecycle
    from perfsdk.gpu import TELEMETRY
    from perfsdk.pipeline import PIPELINE

    ours = [s for s in PIPELINE.sinks if s in (TELEMETRY, lifecycle.SUMMARY, lifecycle.TRACE,
                                               lifecycle.SPANS, lifecycle.METRICS)]
    expected = [TELEMETRY, lifecycle.SUMMARY, lifecycle.TRACE, lifecycle.SPANS, lifecycle.METRICS]
    assert ours == [s for s in expected if s is not None]
    assert PIPELINE.sinks[:3] == [TELEMETRY, lifecycle.SUMMARY, lifecycle.TRACE]
    assert PIPELINE.on_round.count(TELEMETRY.tick) == 1


def test_testing_reset_puts_process_wide_state_back() -> None:
    import perfsdk
    from perfsdk.testing import reset

    perfsdk.configure(sample_every=5)
    with perfsdk.no_sync_guard("count", assume_device=True), perfsdk.timed_region("before"):
        torch.ones(2).sum().item()
    assert perfsdk.summary(show=False).sync_sites
    reset()
    assert perfsdk.get_config().sample_every == 1
    assert len(perfsdk.summary(show=False)) == 0
    assert perfsdk.summary(show=False).sync_sites == ()
