"""Two jobs of two ranks each under plain ``torchrun`` (``--master-port``, no ``--rdzv-id``, no
``--standalone``: ``TORCHELASTIC_RUN_ID`` is ``none``), gloo on the CPU, at the same time: both
ranks of a job give step N one trace id, the two jobs' trace ids differ (they agreed on a run id
through their own job's store, not on a constant), and every slice of each rank's trace file
carries its ``perfsdk.rank``, ``perfsdk.local_rank`` and ``perfsdk.world_size``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

SCRIPT = textwrap.dedent("""
    import json
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist

    import perfsdk
    from perfsdk import distributed
    from perfsdk.testing import capture

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(0.5)  # the ranks ask the store at different moments
    with capture() as cap:
        for step in range(3):
            with perfsdk.step(samples=4):
                t = torch.ones(4)
                with perfsdk.timed_region("all_reduce"):
                    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 4
    perfsdk.flush()
    steps = {r.attributes["perfsdk.step"]: r.trace_id for r in cap.regions if r.name == "step"}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "torchelastic_run_id": os.environ["TORCHELASTIC_RUN_ID"],
                   "run_id": distributed.run_id(), "pid": os.getpid(), "steps": steps}, f)
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("run_id")
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PERFSDK_EXPORTER="trace",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
    jobs = []
    for name in ("a", "b"):  # both at once: two jobs of one user, side by side
        out = tmp / name
        out.mkdir()
        jobs.append((out, subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
             "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), str(out)],
            cwd=tmp, env={**env, "PERFSDK_OUTPUT_DIR": str(out)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)))
    done = []
    for out, proc in jobs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-6000:]
        done.append((out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]))
    return done


def test_plain_torchrun_gives_no_run_id(two_jobs) -> None:
    for _, ranks in two_jobs:  # the case this file is about
        assert [r["torchelastic_run_id"] for r in ranks] == ["none", "none"]


def test_both_ranks_of_a_job_share_each_steps_trace(two_jobs) -> None:
    for _, (rank0, rank1) in two_jobs:
        assert rank0["run_id"] == rank1["run_id"] not in (None, "none")
        assert rank0["steps"] == rank1["steps"]
        assert len(set(rank0["steps"].values())) == 3  # a trace per step


def test_two_jobs_never_share_a_trace(two_jobs) -> None:
    (_, a), (_, b) = two_jobs
    assert a[0]["run_id"] != b[0]["run_id"]
    assert not set(a[0]["steps"].values()) & set(b[0]["steps"].values())


def test_trace_file_slices_carry_the_rank(two_jobs) -> None:
    for out, ranks in two_jobs:
        for r in ranks:
            data = json.loads((out / f"trace-{r['pid']}.json").read_text())
            slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
            assert sorted(e["name"] for e in slices) == ["all_reduce"] * 3 + ["step"] * 3
            for e in slices:
                assert (e["args"]["perfsdk.rank"], e["args"]["perfsdk.local_rank"],
                        e["args"]["perfsdk.world_size"]) == (r["rank"], r["rank"], 2)
