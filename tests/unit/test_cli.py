"""The ``perfsdk`` command's front: its version, usage messages and argument errors, all answered
before torch is imported; the light ``import perfsdk`` that makes that possible; and the rule that
keeps secrets out of ``run.json`` (``demo``, ``run`` and ``report`` are tested end to end in
tests/integration/test_demo.py and test_cli_run.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs ``python -m perfsdk ARGS`` in this interpreter (runpy, as ``-m`` does), then reports on
# stderr whether torch was imported, also when the command ends in SystemExit.
_WATCH = """
import runpy, sys
try:
    runpy.run_module("perfsdk", run_name="__main__", alter_sys=True)
finally:
    sys.stderr.write(f"\\nTORCH-IMPORTED={'torch' in sys.modules}\\n")
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _perfsdk(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "perfsdk", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=_env(), check=False)


def _watched(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    proc = subprocess.run([sys.executable, "-c", _WATCH, *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=_env(), check=False)
    marker = proc.stderr.rstrip().rsplit("\n", 1)[-1]
    assert marker.startswith("TORCH-IMPORTED="), proc.stderr
    return proc, marker == "TORCH-IMPORTED=True"


def test_version(tmp_path):
    import perfsdk

    proc = _perfsdk("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"perfsdk {perfsdk.__version__}"


@pytest.mark.parametrize(("args", "code", "expected"), [
    (["--help"], 0, "usage: perfsdk [-h] [--version] COMMAND"),
    (["--version"], 0, "perfsdk "),
    (["run", "--help"], 0, "usage: perfsdk run [-h] [--output-dir DIR] [--syncs] SCRIPT"),
    ([], 2, "the following arguments are required: COMMAND"),
    (["bogus"], 2, "invalid choice: 'bogus'"),
    (["run"], 2, "SCRIPT is missing"),
    (["run", "--bogus", "train.py"], 2, "perfsdk run: error: unrecognized arguments: --bogus"),
    (["run", "missing.py"], 2, "perfsdk run: missing.py: no such file"),
    (["report", "no-such-dir"], 2, "perfsdk report: no-such-dir: no such directory"),
    (["demo", "--bogus"], 2, "perfsdk demo: error: unrecognized arguments: --bogus"),
    (["demo", "--steps", "x"], 2, "argument --steps: 'x' is not an integer"),
    (["demo", "--steps", "1"], 2, "--steps must be >= 2"),
    (["demo", "--exporter", "jaeger"], 2, "perfsdk demo: --exporter: unknown exporter 'jaeger'"),
    (["demo", "--latency-ms", "-1"], 2, "perfsdk demo: --latency-ms -1.0: accepted values are"),
])
def test_answers_without_importing_torch(tmp_path, args, code, expected):
    """--help, the version, usage and argument errors and a missing script or directory are
    answered before torch (which takes seconds to import) is imported."""
    proc, torch_imported = _watched(*args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert expected in proc.stdout + proc.stderr
    assert not torch_imported


def test_the_watch_sees_torch_when_a_command_runs(tmp_path):
    """The check above would see torch: a script that runs imports it."""
    (tmp_path / "script.py").write_text("print('ran')\n")
    proc, torch_imported = _watched("run", "--output-dir", str(tmp_path / "out"), "script.py",
                                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran" in proc.stdout
    assert torch_imported


def test_python_dash_m_perfsdk_help_imports_no_torch(tmp_path):
    """The real entry, ``python -m perfsdk`` (what the console script calls, perfsdk.cli:main),
    as Python's own import log shows it."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "perfsdk", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env(),
                          check=False)
    assert proc.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "perfsdk.cli" in imported  # the log is complete: the command's own module is in it
    assert "torch" not in imported
    assert not {name for name in imported if name.startswith("torch.")}


def test_usage_messages_name_the_subcommand(tmp_path):
    proc = _perfsdk("run", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: perfsdk run [-h] [--output-dir DIR] [--syncs] SCRIPT "
                                  "[ARGS ...]\n")
    assert "e.g. `perfsdk run train.py --epochs 1`" in proc.stderr
    assert "required: script, args" not in proc.stderr
    proc = _perfsdk("demo", "--bogus", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: perfsdk demo [-h]")
    assert "usage: perfsdk [-h]" not in proc.stderr  # not the top-level usage


def test_import_perfsdk_is_light_and_the_first_name_used_loads_the_rest(tmp_path):
    code = textwrap.dedent("""
        import sys
        import perfsdk
        assert "torch" not in sys.modules, "import perfsdk imported torch"
        assert perfsdk.__version__
        region = perfsdk.timed_region  # any public name: everything behind __all__ loads
        assert "torch" in sys.modules and "perfsdk.lifecycle" in sys.modules
        assert all(hasattr(perfsdk, name) for name in perfsdk.__all__)
        assert set(perfsdk.__all__) <= set(dir(perfsdk))
        try:
            perfsdk.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("perfsdk.no_such_name did not raise AttributeError")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_program_importing_only_submodules_still_gets_the_summary_and_trace(tmp_path):
    """``import perfsdk`` no longer loads the composition root (perfsdk.lifecycle) up front: the
    first region does, so an integration's ``from perfsdk.region import ...`` loses nothing."""
    code = textwrap.dedent("""
        import sys
        from perfsdk.timing import timed_region
        for _ in range(3):
            with timed_region("work"):
                pass
        assert "perfsdk.lifecycle" in sys.modules
        from perfsdk.lifecycle import summary
        print(summary(show=False)["work"].count)
    """)
    env = {**_env(), "PERFSDK_EXPORTER": "trace", "PERFSDK_OUTPUT_DIR": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3"
    assert len(list((tmp_path / "out").glob("trace-*.json"))) == 1


@pytest.mark.parametrize(("name", "secret"), [
    ("--password", True), ("--db-passwd", True), ("--token", True), ("--hf_token", True),
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("--api-key", True), ("--apiKey", True),
    ("--apikey", True), ("--client-secret", True), ("--aws-secret-access-key", True),
    ("db.password", True), ("--auth", True), ("--private-key", True),
    ("--tokenizer", False), ("--max-tokens", False), ("--lr", False), ("--keys", False),
    ("--epochs", False), ("--passes", False), ("--author", False), ("--key", False),
])
def test_secret_names(name, secret):
    from perfsdk.cli.runfile import is_secret_name

    assert is_secret_name(name) is secret


def test_redact_command():
    from perfsdk.cli.runfile import REDACTED, redact_command

    command = ["train.py", "--password=hunter2", "--token", "abc", "--api-key", "-k3y",
               "HF_TOKEN=hf_x", "--db", "postgres://me:pw1@db:5432/x", "--tokenizer", "gpt2",
               "--lr", "0.1", "--secret", "--epochs", "2", "--", "positional"]
    assert redact_command(command) == [
        "train.py", f"--password={REDACTED}", "--token", REDACTED, "--api-key", REDACTED,
        f"HF_TOKEN={REDACTED}", "--db", f"postgres://me:{REDACTED}@db:5432/x", "--tokenizer",
        "gpt2", "--lr", "0.1", "--secret", "--epochs", "2", "--", "positional"]
    assert redact_command(["--token.py", "--token", "x"]) == ["--token.py", "--token", REDACTED]
    assert redact_command([]) == []


def test_the_run_recorder_makes_its_results_when_read_not_on_the_pipeline_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline thread only keeps the records (``to_result`` cost it 6 us a region beside
    the training loop); the report's read makes the results, the same ones, once each, and the
    limit and the count of what it dropped hold."""
    import threading

    import perfsdk
    from perfsdk.export import runfile
    from perfsdk.record import to_result

    made: list[str] = []

    def counted(record):
        made.append(threading.current_thread().name)
        return to_result(record)

    monkeypatch.setattr(runfile, "to_result", counted)
    with runfile.RunRecorder(limit=5) as recorder:
        for i in range(7):
            with perfsdk.timed_region("r", attributes={"i": i}):
                pass
        perfsdk.flush()
        assert made == []
        first = recorder.regions
        assert made == [threading.current_thread().name] * 5
        assert [r.attributes["i"] for r in first] == [0, 1, 2, 3, 4]
        assert recorder.regions == first  # made once: a second read makes none
        assert len(made) == 5
    assert recorder.dropped == 2
    assert recorder.summary()["r"].count == 7


def test_device_memory_comes_from_the_device_interface(fake_cuda) -> None:
    """``perfsdk run``'s device capacity for the advisor: the current device's total memory, read
    only once the application has initialized CUDA."""
    from perfsdk.cli.run import device_memory_bytes

    assert device_memory_bytes() == 16 << 30
    fake_cuda.initialized = False
    assert device_memory_bytes() is None
