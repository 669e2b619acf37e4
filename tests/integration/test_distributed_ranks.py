"""Two ranks under ``torchrun`` (gloo on the CPU), their spans sent to a real OTLP receiver on
127.0.0.1: every span carries its rank; the ranks agree on a run id with one broadcast, so both
ranks' spans of step N share one trace id (different per step) and the all-reduce nests in its
rank's step; and the straggler report built from the received spans gives each rank's busy time
(its step less its all-reduce), in which rank 1's sleep is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from perfsdk import distributed
from perfsdk.distributed import rank_attributes, step_trace_id, stragglers
from tests.otlp_receiver import OTLPReceiver

SCRIPT = textwrap.dedent("""
    import time

    import torch
    import torch.distributed as dist

    import perfsdk
    from perfsdk import distributed

    dist.init_process_group("gloo")
    run = distributed.share_run_id()  # one broadcast, at start
    runs = [None, None]
    dist.all_gather_object(runs, run)
    assert runs[0] == runs[1], runs
    for step in range(3):
        with perfsdk.step(samples=4):
            t = torch.ones(4) * (dist.get_rank() + 1)
            if dist.get_rank() == 1:
                time.sleep(0.05)  # the straggler
            with perfsdk.timed_region("all_reduce"):
                dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4  # rank 0's ones + rank 1's twos: the collective ran
    perfsdk.flush()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list:
    tmp = tmp_path_factory.mktemp("ranks")
    script = tmp / "ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "MASTER_", "TORCHELASTIC_"))}
    with OTLPReceiver("http") as receiver:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint, PERFSDK_EXPORTER="otlp",
                   OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", str(script)], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return receiver.wait_for_spans(12, timeout=30)


def test_each_ranks_spans_carry_its_rank(two_ranks) -> None:
    seen = sorted((s.name, s.attributes["perfsdk.rank"], s.attributes["perfsdk.local_rank"],
                   s.attributes["perfsdk.world_size"]) for s in two_ranks)
    assert seen == sorted((name, rank, rank, 2) for name in ("step", "all_reduce")
                          for rank in (0, 1) for _ in range(3))
    pids = {s.attributes["perfsdk.rank"]: s.resource["process.pid"] for s in two_ranks}
    assert pids[0] != pids[1]  # two processes


def test_one_trace_per_step_across_ranks(two_ranks) -> None:
    steps = [s for s in two_ranks if s.name == "step"]
    trace_of = {(s.attributes["perfsdk.step"], s.attributes["perfsdk.rank"]): s.trace_id
                for s in steps}
    for step in range(3):
        assert trace_of[(step, 0)] == trace_of[(step, 1)]  # the ranks' lanes of one trace
    assert len({trace_of[(step, 0)] for step in range(3)}) == 3  # a trace per step
    by_span = {s.span_id: s for s in two_ranks}
    for s in two_ranks:
        if s.name == "all_reduce":  # nested in its own rank's step, in the step's trace
            parent = by_span[s.parent_span_id]
            assert parent.name == "step"
            assert parent.attributes["perfsdk.rank"] == s.attributes["perfsdk.rank"]
            assert s.trace_id == parent.trace_id


def test_straggler_report_from_the_received_spans(two_ranks) -> None:
    """The report's numbers are the received spans' own: each rank's busy time is its step less
    the all-reduce inside it. Which rank comes out slowest is a measurement (on a busy machine
    rank 0 can be held up longer than rank 1's sleep); tests/unit/test_distributed.py checks
    the naming on chosen times. What holds on any machine: rank 1's sleep is busy time."""
    regions = [SimpleNamespace(name=s.name, host_ms=s.attributes["perfsdk.host_ms"],
                               span_id=s.span_id, parent_span_id=s.parent_span_id,
                               attributes=s.attributes) for s in two_ranks]
    steps = {(r.attributes["perfsdk.step"], r.attributes["perfsdk.rank"]): r
             for r in regions if r.name == "step"}
    waits = {r.parent_span_id: r.host_ms for r in regions if r.name == "all_reduce"}
    report = stragglers(regions)
    assert [r.step for r in report] == [0, 1, 2]
    for r in report:
        assert sorted(r.busy_ms_by_rank) == [0, 1]
        for rank in (0, 1):
            step = steps[(r.step, rank)]
            assert r.step_ms_by_rank[rank] == step.host_ms
            assert r.busy_ms_by_rank[rank] == pytest.approx(step.host_ms - waits[step.span_id],
                                                            rel=1e-12)
        busy = r.busy_ms_by_rank
        assert r.slowest_rank == max(busy, key=busy.__getitem__)
        assert r.spread_ms == pytest.approx(abs(busy[0] - busy[1]), rel=1e-12)
        assert busy[1] >= 50.0  # its 50 ms sleep: in the step, outside the all-reduce


def test_rank_attributes_from_torchrun_variables() -> None:
    assert rank_attributes({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}) == {
        "perfsdk.rank": 3, "perfsdk.local_rank": 1, "perfsdk.world_size": 8}
    assert rank_attributes({"RANK": "0", "WORLD_SIZE": "2"}) == {"perfsdk.rank": 0,
                                                                "perfsdk.world_size": 2}
    assert rank_attributes({"RANK": "x", "WORLD_SIZE": "2"}) == {}
    assert rank_attributes({}) == {}


def test_step_trace_ids_follow_torchruns_run_id(monkeypatch) -> None:
    monkeypatch.setattr(distributed, "_run_id", None)
    monkeypatch.setattr(distributed, "_env_run_id", None)  # read once per process: again
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert step_trace_id(0) is None  # no run id: each rank keeps its own random trace
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setattr(distributed, "_env_run_id", None)
    assert step_trace_id(5) == step_trace_id(5, "job-42")
    assert step_trace_id(5) != step_trace_id(6)
    assert 0 < step_trace_id(5) < 2 ** 128
