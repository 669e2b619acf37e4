"""``perfsdk run`` on unmodified scripts and ``perfsdk report`` on what it saved, as a user runs
them: a subprocess, real files, the script's own exit code and traceback."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfsdk.cli.runfile import load_run
from perfsdk.instrumentor import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "examples" / "lab_unoptimized.py"
SCRIPTS = Path(__file__).resolve().parent / "_scripts"
ITEM_LINE = next(i for i, line in enumerate(LAB.read_text().splitlines(), 1)
                 if "total += loss.item()" in line)


def perfsdk(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing fetched from the Hub
    return subprocess.run([sys.executable, "-m", "perfsdk.cli", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env=env, check=False)


def summary_rows(text: str, last: bool = False) -> dict[str, int]:
    """Region name -> calls, from the (first or last) summary table in ``text``."""
    rows = {}
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("region ")]
    start = starts[-1] if last else starts[0]
    for line in lines[start + 2:]:
        if not line.strip():
            break
        name, calls = line.split()[:2]
        rows[name] = int(calls)
    return rows


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("run")
    proc = perfsdk("run", "--output-dir", str(tmp / "out"), str(LAB), "--steps", "12",
                   cwd=tmp)
    return proc, tmp / "out"


def test_run_measures_an_unmodified_script(lab_run) -> None:
    proc, out = lab_run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "training on cpu, batch size 8, 12 batches" in proc.stdout  # the script's own output
    assert f"perfsdk run: {LAB} exited with 0 after" in proc.stdout
    rows = summary_rows(proc.stdout)
    assert rows["SimpleNet.forward"] == 12
    assert rows["backward"] == 12
    assert rows["optimizer"] == 12
    assert rows["data_wait"] == 12
    assert rows["step"] == 12  # each batch starts a step
    assert "perfsdk advice" in proc.stdout
    trace = json.loads(next(out.glob("trace-*.json")).read_text())
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert names.count("SimpleNet.forward") == 12
    assert (out / "run.json").is_file()
    assert f"perfsdk report {out}" in proc.stdout


def test_report_renders_the_saved_run_again(lab_run) -> None:
    first, out = lab_run
    proc = perfsdk("report", str(out), cwd=out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"perfsdk report: {LAB} --steps 12 exited with 0 after ")
    assert summary_rows(proc.stdout) == summary_rows(first.stdout)
    advice = lambda text: text[text.index("perfsdk advice"):text.index("files:")]  # noqa: E731
    assert advice(proc.stdout) == advice(first.stdout)  # derived again from the saved regions
    assert "trace-" in proc.stdout


def test_run_with_syncs_names_the_per_step_item(tmp_path) -> None:
    proc = perfsdk("run", "--syncs", "--output-dir", str(tmp_path / "out"), str(LAB),
                   "--steps", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    advice = proc.stdout[proc.stdout.index("perfsdk advice"):]
    assert "Host-device syncs" in advice
    assert f"{LAB}:{ITEM_LINE} item (8x in all)" in advice
    assert "host-device syncs: none recorded" not in advice
    again = perfsdk("report", str(tmp_path / "out"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout[again.stdout.index("perfsdk advice"):].split("\nfiles:")[0] == \
        advice.split("\nfiles:")[0]  # the saved run keeps its sync sites


def test_saved_run_keeps_the_sync_sites(tmp_path) -> None:
    from perfsdk.cli.runfile import load_run, save_run
    from perfsdk.export.summary import Summary
    from perfsdk.sync import SyncSite

    site = SyncSite("train.py", 7, "item", "aten::_local_scalar_dense", 3, "loss.item()",
                    outside=2, outside_ns=(10, 20))
    save_run(tmp_path, command=["train.py"], exit_code=0, wall_s=1.0, files={},
             summary=Summary((), (site,)), regions=())
    assert load_run(tmp_path).summary.sync_sites == (site,)


def test_run_defers_to_the_scripts_own_instrumentation(tmp_path) -> None:
    """On the decorated lab script (its own steps, data wait, layers and sync guard) the
    patches add no second step, wait or backward per batch."""
    script = ROOT / "examples" / "lab_decorated.py"
    proc = perfsdk("run", "--output-dir", str(tmp_path / "out"), str(script), "--steps", "6",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = summary_rows(proc.stdout, last=True)
    assert rows["data_wait"] == rows["backward"] == rows["optimizer"] == 6
    assert rows["SimpleNet.forward"] == rows["SimpleNet"] == 6
    assert rows["step"] == 7  # the script's 6, and the first batch's wait before its first


@pytest.mark.parametrize(("framework", "script", "expected", "phases"), [
    ("lightning", "lightning_fit.py",
     {"epoch": 2, "step": 6, "forward": 6, "backward": 6, "optimizer": 6, "validation": 1,
      "sanity_check": 1, "Tiny.forward": 10},  # the model: 6 steps, 2 + 2 validation batches
     ("forward", "backward", "optimizer")),
    ("transformers", "hf_train.py",
     {"epoch": 2, "step": 4, "microbatch": 8, "optimizer": 4,
      "BertForSequenceClassification.forward": 8},  # 2 micro-batches a step
     ("microbatch", "optimizer")),
])
def test_a_trainer_gets_each_step_and_its_optimizer_once(tmp_path, framework, script,
                                                         expected, phases) -> None:
    """An unmodified Lightning or Hugging Face Trainer script: ``perfsdk.instrument_all()``
    gives the Trainer the integration's callback, and the run's own patches step aside while it
    draws the steps. Lightning's ``optimizer.step()`` holds the whole closure: timed by the
    patches as well, each step had two ``optimizer`` regions, and the sanity check's batches
    were steps."""
    pytest.importorskip(framework)
    if not any(ep.name == framework for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)):
        pytest.skip(f"perfsdk-{framework} is not installed: run reads its entry point")
    proc = perfsdk("run", "--output-dir", str(tmp_path / "out"), str(SCRIPTS / script),
                   str(tmp_path / "trainer"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"optimizer steps: {expected['step']}" in proc.stdout
    assert " ended after " not in proc.stdout  # no report of the callback's: the run's alone
    run = load_run(tmp_path / "out")
    names = [r.name for r in run.regions]
    counts = {name: names.count(name) for name in set(names)}
    assert {row.name: row.count for row in run.summary.rows} == counts
    waits = counts.pop("data_wait")
    assert counts == expected
    assert waits >= expected["step"]
    by_id = {r.span_id: r for r in run.regions}
    for region in run.regions:  # each phase once, inside its step
        if region.name in phases:
            assert by_id[region.parent_span_id].name == "step", region.name


def write(tmp_path: Path, code: str) -> Path:
    script = tmp_path / "script.py"
    script.write_text(code)
    return script


def test_the_scripts_exception_is_shown_and_its_exit_code_kept(tmp_path) -> None:
    script = write(tmp_path, "import sys, torch\n"
                             "print('args', sys.argv[1:], __name__)\n"
                             "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
                             "def fail():\n"
                             "    raise ValueError('boom')\n"
                             "fail()\n")
    proc = perfsdk("run", "--output-dir", str(tmp_path / "out"), str(script), "-x", "--y",
                   cwd=tmp_path)
    assert proc.returncode == 1
    assert "args ['-x', '--y'] __main__" in proc.stdout
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert f'File "{script}", line 6, in <module>' in proc.stderr
    assert "runpy" not in proc.stderr
    assert os.path.join("perfsdk", "cli", "run.py") not in proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: boom")
    assert summary_rows(proc.stdout) == {"Linear.forward": 1}  # measured up to the error
    assert "exited with 1" in proc.stdout


@pytest.mark.parametrize(("code", "expected", "stderr"), [
    ("raise SystemExit(3)", 3, ""), ("import sys; sys.exit('bad config')", 1, "bad config\n"),
    ("import sys; sys.exit()", 0, "")])
def test_sys_exit_codes_are_kept(tmp_path, code, expected, stderr) -> None:
    proc = perfsdk("run", "--output-dir", str(tmp_path / "out"), str(write(tmp_path, code)),
                   cwd=tmp_path)
    assert proc.returncode == expected
    assert proc.stderr == stderr


def test_clear_errors_for_a_missing_script_and_an_unwritable_directory(tmp_path) -> None:
    proc = perfsdk("run", str(tmp_path / "nope.py"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == f"perfsdk run: {tmp_path / 'nope.py'}: no such file\n"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = write(tmp_path, "print('never runs')")
    proc = perfsdk("run", "--output-dir", str(blocker / "out"), str(script), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"perfsdk run: --output-dir {blocker / 'out'}: cannot write "
                                  "there (")
    assert "never runs" not in proc.stdout
    proc = perfsdk("report", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "run.json does not exist" in proc.stderr
    (tmp_path / "run.json").write_text("{}")
    proc = perfsdk("report", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "is not a perfsdk run file" in proc.stderr


def test_a_closed_stdout_ends_report_quietly(lab_run) -> None:
    """``perfsdk report DIR | head``: the reader is gone before the report is written."""
    _, out = lab_run
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    proc = subprocess.Popen([sys.executable, "-m", "perfsdk", "report", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=out, env=env)
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()  # as `head` does once it has its lines
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=180) == 141  # 128 + SIGPIPE, as for a process SIGPIPE ended
    assert stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit


def test_run_json_keeps_no_secret_and_is_private(tmp_path) -> None:
    script = write(tmp_path, "import sys\nprint('argv', sys.argv[1:])\n")
    out = tmp_path / "out"
    out.mkdir()
    for stale in (out / "run.json", out / "run.json.tmp"):  # world-readable leftovers
        stale.write_text("{}")
        stale.chmod(0o644)
    args = ["--password=hunter2", "--token", "tok-123", "HF_TOKEN=hf_abc", "--tokenizer", "gpt2",
            "--url", "https://me:pw-9@example.org/x"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    proc = subprocess.run([sys.executable, "-m", "perfsdk", "run", "--output-dir", str(out),
                           str(script), *args], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=env, check=False, umask=0)
    assert proc.returncode == 0, proc.stderr
    assert f"argv {args}" in proc.stdout  # the script itself sees its real arguments
    run_file = out / "run.json"
    assert run_file.stat().st_mode & 0o777 == 0o600  # even with umask 0 and a 0644 file there
    text = run_file.read_text()
    for secret in ("hunter2", "tok-123", "hf_abc", "pw-9"):
        assert secret not in text
    assert json.loads(text)["command"] == [
        str(script), "--password=<redacted>", "--token", "<redacted>", "HF_TOKEN=<redacted>",
        "--tokenizer", "gpt2", "--url", "https://me:<redacted>@example.org/x"]
    report = perfsdk("report", str(out), cwd=tmp_path)
    assert report.stdout.startswith(f"perfsdk report: {script} --password=<redacted> --token "
                                    "<redacted> HF_TOKEN=<redacted> --tokenizer gpt2")


BLOCK_NUMPY = """
import importlib.abc, runpy, sys

class NoNumpy(importlib.abc.MetaPathFinder):  # as in an install without numpy ([otlp])
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "numpy":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoNumpy())
if sys.argv[1:2] == ["--bare"]:
    import torch
else:
    runpy.run_module("perfsdk", run_name="__main__", alter_sys=True)
"""


def test_no_numpy_warning_from_torch_reaches_the_output(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    bare = subprocess.run([sys.executable, "-c", BLOCK_NUMPY, "--bare"], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env=env, check=False)
    assert "Failed to initialize NumPy" in bare.stderr  # torch alone warns without numpy
    script = write(tmp_path, "import torch\nprint('sum', int(torch.ones(3).sum()))\n")
    proc = subprocess.run([sys.executable, "-c", BLOCK_NUMPY, "run", "--output-dir",
                           str(tmp_path / "out"), str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "sum 3" in proc.stdout
    assert "NumPy" not in proc.stderr
    assert proc.stderr == ""


TINY_TRAINING = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(48, 32), torch.randint(0, 4, (48,)))
for x, y in DataLoader(data, batch_size=8):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_run_counts_a_steps_flops_and_reports_mfu(tmp_path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY_TRAINING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PERFSDK_PEAK_FLOPS"] = "1e9"
    proc = subprocess.run([sys.executable, "-m", "perfsdk.cli", "run", "--output-dir",
                           str(tmp_path / "out"), str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    # one step's model FLOPs: forward 2*8*(32*64 + 64*4), the weights' gradients as much again,
    # and the input gradient of the second layer (the batch needs none)
    per_step = 2 * (2 * 8 * (32 * 64 + 64 * 4)) + 2 * 8 * 64 * 4
    assert "FLOPs: step" in proc.stdout
    assert "from PERFSDK_PEAK_FLOPS" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.startswith("region "))
    assert header.split()[-2:] == ["FLOP/s", "MFU"]
    run = load_run(tmp_path / "out")
    steps = sorted((r for r in run.regions if r.name == "step"),
                   key=lambda r: r.attributes["perfsdk.step"])
    assert [r.attributes.get("perfsdk.flops") for r in steps] == [None, None, *[per_step] * 4]
    for r in steps[3:]:
        assert r.attributes["perfsdk.mfu"] == pytest.approx(
            r.attributes["perfsdk.flops_per_s"] / 1e9, rel=1e-12)
    row = run.summary["step"]
    assert row.mfu is not None
    assert row.flops_per_s is not None
    assert row.mfu == pytest.approx(row.flops_per_s / 1e9, rel=1e-9)
