"""``perfsdk compare`` on runs that ``perfsdk run`` saved, as a CI job runs it: a rerun of the
same script passes, a script made clearly slower fails.

The slowdown is a sleep per step (80 ms more than the base's 20 ms): a sleep lasts at least what
it asks for on a busy machine too, so the slow run's steps take 100 ms or more whatever the load,
and it fails the 100% threshold unless the base's median step is held up 30 ms beyond its sleep;
a rerun would need its median step held up 20 ms more than the base's to fail. Only exit codes
and verdicts are asserted, not a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset

extra = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in DataLoader(TensorDataset(torch.randn(30, 4)), batch_size=1):
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.020 + extra)
"""


def perfsdk(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "perfsdk", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env=env, check=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three saved runs: base, a rerun of the same script, and the slow variant."""
    tmp = tmp_path_factory.mktemp("compare")
    (tmp / "train.py").write_text(SCRIPT)
    for name, args in (("base", []), ("rerun", []), ("slow", ["0.080"])):
        proc = perfsdk("run", "--output-dir", name, "train.py", *args, cwd=tmp)
        assert proc.returncode == 0, proc.stderr
    return tmp


def test_a_rerun_of_the_same_script_passes(saved: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from perfsdk.cli import main

    code = main(["compare", str(saved / "base"), str(saved / "rerun"), "--fail-if-slower", "100"])
    out = capsys.readouterr().out
    assert code == 0, out
    step = next(line for line in out.splitlines() if line.startswith("step "))
    assert step.split()[1:2] == ["30"]  # a step per batch, all compared
    assert step.endswith("<- gate")
    assert out.rstrip().splitlines()[-1].startswith("no regression (step: ")


def test_a_clearly_slower_script_fails(saved: Path) -> None:
    """Through the real entry point, ``python -m perfsdk``: its exit status is 1."""
    proc = perfsdk("compare", "base", "slow", "--fail-if-slower", "100", cwd=saved)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    step = next(line for line in proc.stdout.splitlines() if line.startswith("step "))
    assert step.endswith("slower  <- gate")
    assert "REGRESSION: step " in proc.stdout
    for region in ("data_wait", "Linear.forward", "backward", "optimizer"):
        assert any(line.startswith(f"{region} ") for line in proc.stdout.splitlines())


def test_the_same_in_python(saved: Path) -> None:
    from perfsdk.bench import compare_runs

    assert compare_runs(saved / "slow", saved / "base")["step"].verdict == "faster"
    assert compare_runs(saved / "base", saved / "slow", fail_if_slower=100).regressed
    assert not compare_runs(saved / "base", saved / "rerun", fail_if_slower=100).regressed
