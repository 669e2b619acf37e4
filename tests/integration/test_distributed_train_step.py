"""TrainStep's gradient accumulation under real DDP with two ranks (``torchrun
--nproc_per_node=2``, gloo on the CPU): one all-reduce per optimizer step, and the same weights as
one process training on both ranks' data without accumulation; every rank's regions reach a real
OTLP receiver on 127.0.0.1 with its rank.

``test_two_ranks_under_torchrun`` is the driver: it runs this file's ``distributed`` test under
torchrun (``pytest -m distributed``; ``tests/conftest.py`` selects those tests only when
``WORLD_SIZE`` > 1) and checks what both ranks sent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from tests.otlp_receiver import OTLPReceiver

MICRO = 8  # micro-batches per rank
ACCUMULATE = 4
SIZE = 4  # samples per micro-batch


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def micro_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(SIZE, 6, generator=gen), torch.randn(SIZE, 3, generator=gen))
            for _ in range(MICRO)]


@pytest.mark.distributed
def test_ddp_accumulation_all_reduces_once_per_optimizer_step() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import perfsdk
    from perfsdk.optimize import TrainStep

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world == 2
        ddp = nn.parallel.DistributedDataParallel(make_model())
        calls = [0]

        def counting(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting)
        train = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), functional.mse_loss,
                          accumulate=ACCUMULATE)
        for x, y in micro_batches(rank):
            with perfsdk.step(samples=SIZE):
                train(x, target=y)
        assert train.step_count == MICRO // ACCUMULATE
        assert calls[0] == MICRO // ACCUMULATE  # not one per micro-batch

        # one process, both ranks' data, no accumulation: the mean over 2 x 4 micro-batches
        ref = make_model()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        data = [micro_batches(r) for r in range(world)]
        for k in range(MICRO // ACCUMULATE):
            opt.zero_grad()
            chunk = [b for r in range(world) for b in data[r][k * ACCUMULATE:(k + 1) * ACCUMULATE]]
            loss = sum(functional.mse_loss(ref(x), y) for x, y in chunk) / len(chunk)
            loss.backward()
            opt.step()
        for got, want in zip(ddp.module.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        perfsdk.flush()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="the driver itself")
def test_two_ranks_under_torchrun(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERFSDK_", "OTEL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "MASTER_", "TORCHELASTIC_"))}
    with OTLPReceiver("http") as receiver:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint, PERFSDK_EXPORTER="otlp",
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                            env.get("PYTHONPATH")])))
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "pytest", "-q", "-n", "0", "-m", "distributed", "-p", "no:cacheprovider",
             str(Path(__file__).relative_to(root))],
            cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        assert proc.stdout.count("1 passed") == 2  # the test ran, and passed, on both ranks
        spans = receiver.wait_for_spans(2 * (3 * MICRO + MICRO // ACCUMULATE), timeout=30)
    by_rank: dict[int, list[str]] = {}
    for s in spans:
        by_rank.setdefault(int(s.attributes["perfsdk.rank"]), []).append(s.name)
    assert sorted(by_rank) == [0, 1]
    for names in by_rank.values():
        assert names.count("step") == MICRO
        assert names.count("train.forward") == names.count("train.backward") == MICRO
        assert names.count("train.optimizer") == MICRO // ACCUMULATE
