"""Running a benchmark script's ``--quick`` mode for the smoke tests, and checking its numbers'
sanity (never their speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: Path, output: Path, extra: Sequence[str] = ()) -> tuple[dict[str, Any], str]:
    """Run ``script --quick --output output *extra``; its JSON results and its stdout."""
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--output", str(output), *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(output.read_text()), proc.stdout


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
