"""perfsdk itself adds no host-device syncs (DESIGN.md rule 1), checked by its own detector.

A full training step of a small model, instrumented with every perfsdk feature (a profiled step
function, nested regions with attributes and events, memory tracking, sampling, span export to a
file and in memory, metrics, NVTX, device timing and NVML readings on the fake GPU), runs under
``no_sync_guard("error", assume_device=True)``: any operation of perfsdk's that would synchronize
on a GPU raises. The same step under a ``count`` guard reports nothing, and the fake GPU saw no
synchronizing call from any thread. A control proves the detector would have seen perfsdk's
own sync: a region that asks for one (``sync=True``) is reported at the user's line, through
perfsdk/pipeline.py.
"""

from __future__ import annotations

import json
import linecache
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import perfsdk
from perfsdk import no_sync_guard
from perfsdk.config import configure
from perfsdk.gpu import TELEMETRY
from perfsdk.pipeline import PIPELINE
from perfsdk.testing import FakeCuda, capture
from perfsdk.testing.fake_nvml import FakeGpu, FakeNvml
from tests.waiting import wait_until

PERFSDK_DIR = os.path.dirname(perfsdk.__file__) + os.sep


@pytest.fixture(autouse=True)
def _fresh_sites() -> Any:
    perfsdk.sync.reset()
    yield
    perfsdk.sync.reset()


@pytest.fixture
def telemetry(fake_cuda: FakeCuda) -> Any:
    TELEMETRY.reset()
    nvml = FakeNvml([FakeGpu("GPU-5ync", power_w=lambda t: 120.0)])
    TELEMETRY.nvml, TELEMETRY.device_uuids = nvml, nvml.uuids
    yield nvml
    TELEMETRY.reset()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    @perfsdk.profiled("net.forward", attributes={"layers": 3})
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def make_step(model: nn.Module, fake: FakeCuda) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    @perfsdk.profiled("optimizer", every=2)  # sampled: every other call is recorded
    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    @perfsdk.profiled("train.step", category="train", payload=7, memory=True)
    def step(batch: torch.Tensor, target: torch.Tensor, i: int) -> torch.Tensor:
        with perfsdk.timed_region("data"):
            time.sleep(0.03)  # long enough for the NVML sampler to read it
        with perfsdk.timed_region("forward", attributes={"batch": len(batch)}) as region:
            out = model(batch)
            loss = loss_fn(out, target)
            region.set_attribute("step", i)
            region.add_event("loss.ready", {"step": i})
        fake.launch(1.0)  # the GPU is behind: a sync would have to wait for it
        with perfsdk.timed_region("backward", memory=True):
            loss.backward()
        optimizer_step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_steps(step: Any, n: int) -> torch.Tensor:
    torch.manual_seed(0)
    batch, target = torch.randn(16, 32), torch.randint(0, 10, (16,))
    running = torch.zeros(())
    for i in range(n):
        running += step(batch, target, i)  # accumulated on the device, read once at the end
    return running


def test_a_fully_instrumented_training_step_has_no_sync(
    fake_cuda: FakeCuda, telemetry: FakeNvml, tmp_path: Path
) -> None:
    configure(exporter="file", output_dir=tmp_path, memory=True, gpu_sample_interval_s=0.01)
    PIPELINE.start()
    PIPELINE.wake()
    assert wait_until(lambda: TELEMETRY.sampler is not None)
    step = make_step(Net(), fake_cuda)
    with capture() as cap:
        with no_sync_guard("error", assume_device=True) as strict:
            running = run_steps(step, 4)
        with no_sync_guard("count", assume_device=True) as counting:
            run_steps(step, 4)
        fake_cuda.complete_all()
        perfsdk.flush()
    assert strict.report.total == 0
    assert counting.report.total == 0, str(counting.report)
    assert perfsdk.sync.sites() == ()
    assert fake_cuda.sync_calls == []  # nor on the pipeline or sampler threads
    assert torch.isfinite(running)

    # every feature really ran: regions resolved with device time, memory, GPU readings, spans
    names = [r.name for r in cap.regions]
    assert names.count("train.step") == 8
    assert names.count("net.forward") == 8
    assert names.count("optimizer") == 4  # every=2
    step_span = next(s for s in cap.spans if s.name == "train.step")
    assert step_span.attributes["perfsdk.category"] == "train"
    assert "perfsdk.syncs" not in step_span.attributes
    assert all(r.device_ms is not None for r in cap.regions)
    assert any(r.memory for r in cap.named("backward"))
    assert any("perfsdk.gpu.power_w" in s.attributes for s in cap.spans if s.name == "data")
    files = list(tmp_path.glob("spans-*.jsonl"))
    assert files
    assert any(json.loads(line)["name"] == "train.step"
                         for line in files[0].read_text().splitlines())
    rows = {row.name: row for row in perfsdk.summary(show=False)}
    assert rows["train.step"].syncs == 0


def test_the_detector_would_name_perfsdk_itself(fake_cuda: FakeCuda) -> None:
    """Control: a region that asks for a sync (``sync=True``) makes perfsdk wait on the end
    event, on the calling thread; the guard reports that sync at the user's line that asked for
    it, and names perfsdk's own line it went through."""
    with no_sync_guard("count") as guard:
        fake_cuda.launch(2.0)
        with perfsdk.timed_region("waits", sync=True):  # <- the user's line
            fake_cuda.launch(1.0)
    [site] = guard.report.sites
    assert site.op == "cuda"
    assert (site.file, site.code) == (__file__, 'with perfsdk.timed_region("waits", sync=True):'
                                      "  # <- the user's line")
    via, _, line = site.via.rpartition(":")
    assert via.startswith(PERFSDK_DIR), site
    assert Path(via).name == "pipeline.py"
    assert "synchronize" in linecache.getline(via, int(line))
    assert fake_cuda.sync_calls == ["Event.synchronize"]
