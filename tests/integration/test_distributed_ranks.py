"""Two ranks under ``torchrun`` (gloo on the CPU): every span each rank exports to a real OTLP
receiver on 127.0.0.1 carries its ``perfsdk.rank``, ``perfsdk.local_rank`` and
``perfsdk.world_size``. (The rest of issue 7, one trace per step across ranks, is not built yet.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from perfsdk.distributed import rank_attributes
from tests.otlp_receiver import OTLPReceiver

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    import perfsdk

    dist.init_process_group("gloo")
    for step in range(2):
        with perfsdk.timed_region("step", category="step", step=step):
            t = torch.ones(4) * (dist.get_rank() + 1)
            with perfsdk.timed_region("all_reduce"):
                dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4  # rank 0's ones + rank 1's twos: the collective really ran
    perfsdk.flush()
    dist.destroy_process_group()
""")


def test_each_ranks_spans_carry_its_rank(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "MASTER_"))}
    with OTLPReceiver("http") as receiver:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint, PERFSDK_EXPORTER="otlp",
                   OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        spans = receiver.wait_for_spans(8, timeout=30)
    seen = sorted((s.name, s.attributes["perfsdk.rank"], s.attributes["perfsdk.local_rank"],
                   s.attributes["perfsdk.world_size"]) for s in spans)
    assert seen == sorted([(name, rank, rank, 2) for name in ("step", "step", "all_reduce",
                                                               "all_reduce") for rank in (0, 1)])
    pids = {s.attributes["perfsdk.rank"]: s.resource["process.pid"] for s in spans}
    assert pids[0] != pids[1]  # two processes


def test_rank_attributes_from_torchrun_variables() -> None:
    assert rank_attributes({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}) == {
        "perfsdk.rank": 3, "perfsdk.local_rank": 1, "perfsdk.world_size": 8}
    assert rank_attributes({"RANK": "0", "WORLD_SIZE": "2"}) == {"perfsdk.rank": 0,
                                                                "perfsdk.world_size": 2}
    assert rank_attributes({"RANK": "x", "WORLD_SIZE": "2"}) == {}
    assert rank_attributes({}) == {}
