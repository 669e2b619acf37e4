"""The ``perfsdk`` command: its version and argument errors (``demo``, ``run`` and ``report``
are tested end to end in tests/integration/test_demo.py and test_cli_run.py)."""

from __future__ import annotations

import subprocess
import sys


def _perfsdk(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "perfsdk.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, check=False)


def test_version(tmp_path):
    import perfsdk

    proc = _perfsdk("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"perfsdk {perfsdk.__version__}"
