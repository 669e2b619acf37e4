"""The README's ```python blocks run, top to bottom, as a reader would run them: one fresh
subprocess, perfsdk enabled and disabled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def script() -> str:
    """The README's python blocks, each on its own line numbers (a traceback's line is the
    README's)."""
    lines = [""] * len(README.read_text().splitlines())
    for match in re.finditer(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S):
        first = README.read_text()[:match.start(1)].count("\n")
        for offset, line in enumerate(match.group(1).splitlines()):
            lines[first + offset] = line
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_readme_blocks_run(tmp_path: Path, enabled: str) -> None:
    code = script()
    assert "PerfsdkProfiler()" in code
    assert "PerfsdkCallback(" in code
    path = tmp_path / "readme.py"
    path.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env.update(PERFSDK_ENABLED=enabled, PERFSDK_OUTPUT_DIR=str(tmp_path / "out"),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr
    assert "PerfSDKWarning" not in proc.stderr
    if enabled == "1":
        assert proc.stdout.count("perfsdk: Lightning fit ended after ") == 2  # callback, profiler
        assert "5 [16, 16, 16, 16, 16]" in proc.stdout
        assert "['backward', 'forward', 'optimizer']" in proc.stdout
    else:
        assert "perfsdk: Lightning fit ended" not in proc.stdout
