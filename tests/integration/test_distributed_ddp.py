"""Stragglers under plain DDP: two ranks under ``torchrun`` (gloo on the CPU), rank 1 sleeping
in every forward. The fast rank waits for it inside ``backward()``, in DDP's bucket all-reduce,
and only :func:`perfsdk.distributed.instrument_ddp`'s ``ddp.all_reduce`` regions show that wait,
so :func:`~perfsdk.distributed.stragglers` can name rank 1.

- ``test_instrument_ddp_names_the_slow_rank`` runs under torchrun (``distributed``, driven by
  ``test_two_ranks_with_instrument_ddp``): a DDP loop with ``instrument_ddp`` and
  ``perfsdk.step()``; the ranks gather their regions and the report names rank 1.
- ``test_perfsdk_run_names_the_slow_rank_of_an_unmodified_script``: an unmodified DDP script
  (no perfsdk in it) under ``torchrun ... perfsdk run``, each rank saving its run in a
  directory of its own; the report over both saved runs names rank 1.

What is asserted is the rank named by most steps, never a time: the sleep (0.3 s a step) is
what makes rank 1 the straggler, and a busy machine may still hold rank 0 up in some step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
SLEEP_S = 0.3


def named_by_most_steps(regions: list[Any]) -> int:
    from perfsdk.distributed import stragglers

    report = stragglers(regions)
    assert [r.step for r in report] == list(range(STEPS))
    return Counter(r.slowest_rank for r in report).most_common(1)[0][0]


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)  # the straggler
        out: torch.Tensor = self.layers(x)
        return out


@pytest.mark.distributed
def test_instrument_ddp_names_the_slow_rank() -> None:
    import perfsdk
    from perfsdk.distributed import DDP_REGION, instrument_ddp
    from perfsdk.testing import capture

    dist.init_process_group("gloo")
    try:
        assert dist.get_world_size() == 2
        model = instrument_ddp(nn.parallel.DistributedDataParallel(Slow()))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with capture() as cap:
            for _ in range(STEPS):
                with perfsdk.step():
                    opt.zero_grad()
                    model(torch.ones(4, 8)).sum().backward()
                    opt.step()
        mine = [SimpleNamespace(name=r.name, host_ms=r.host_ms, span_id=r.span_id,
                                parent_span_id=r.parent_span_id, start_ns=r.start_ns,
                                end_ns=r.end_ns, attributes=dict(r.attributes))
                for r in cap.regions if r.name in ("step", DDP_REGION)]
        assert sum(r.name == DDP_REGION for r in mine) == STEPS  # one bucket a step
        everyone: list[list[Any]] = [[], []]
        dist.all_gather_object(everyone, mine)
        assert named_by_most_steps([r for regions in everyone for r in regions]) == 1

        # perfsdk's all-reduce averages the ranks' gradients as DDP's own does
        torch.manual_seed(0)
        plain = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
        torch.manual_seed(0)
        ours = instrument_ddp(nn.parallel.DistributedDataParallel(nn.Linear(8, 2)))
        x = torch.full((4, 8), float(dist.get_rank() + 1))  # each rank its own data
        for m in (plain, ours):
            m(x).square().sum().backward()
        for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    finally:
        dist.destroy_process_group()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="the driver itself")
def test_two_ranks_with_instrument_ddp() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "pytest", "-q", "-n", "0", "-m", "distributed", "-p", "no:cacheprovider",
         str(Path(__file__).relative_to(ROOT))],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert proc.stdout.count("1 passed") == 2  # the test ran, and passed, on both ranks


SCRIPT = textwrap.dedent(f"""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            if dist.get_rank() == 1:
                time.sleep({SLEEP_S})  # the straggler
            return self.layers(x)

    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(Slow())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.ones({4 * STEPS}, 8)), batch_size=4)
    for (x,) in data:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    dist.destroy_process_group()
""")

LAUNCH = textwrap.dedent("""
    import os
    import sys

    from perfsdk.cli import main

    # one --output-dir: each rank's perfsdk run saves its own run.json in out/rank<N>
    sys.exit(main(["run", "--output-dir", "out", "train.py"]))
""")


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="the driver itself")
def test_perfsdk_run_names_the_slow_rank_of_an_unmodified_script(tmp_path: Path) -> None:
    from perfsdk.distributed import DDP_REGION
    from perfsdk.export.runfile import load_run

    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "launch.py").write_text(LAUNCH)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "launch.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    regions = []
    for rank in (0, 1):
        saved = load_run(tmp_path / "out" / f"rank{rank}").regions
        assert {r.attributes.get("perfsdk.rank") for r in saved} == {rank}
        steps = {r.span_id for r in saved if r.name == "step"}
        backward = {r.span_id: r.parent_span_id for r in saved if r.name == "backward"}
        ddp = [r for r in saved if r.name == DDP_REGION]
        assert len(steps) == len(ddp) == STEPS  # one bucket a step
        assert all(backward[r.parent_span_id] in steps for r in ddp)  # backward, in its step
        regions += saved
    assert named_by_most_steps(regions) == 1
