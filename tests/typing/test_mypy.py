"""Typing golden test (wrapt's tests/mypy style): mypy's verdict on tests/typing/cases.py must
equal tests/typing/expected.txt, error for error.

This proves the decorators keep signatures through ``ParamSpec``: each wrong argument to a
decorated function in cases.py is an error, each right call is not, and ``reveal_type`` shows
the original signature. Comparing the whole output also catches a new false positive.

After an intended change, regenerate the golden file with
``python -m tests.typing.test_mypy --write`` and review the diff.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CASES = HERE / "cases.py"
EXPECTED = HERE / "expected.txt"
CONFIG = HERE / "mypy.ini"

_LINE = re.compile(r"^(?P<path>[^:\n]+\.py):(?P<line>\d+): (?P<kind>error|note): (?P<msg>.*)$")
_MARK = re.compile(r"#\s*E:\s*(?P<codes>[\w, -]+)$")


def run_mypy() -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null",
         "--config-file", str(CONFIG), str(CASES.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )


def normalize(output: str) -> list[str]:
    """Errors and reveal_type notes as ``cases.py:LINE: error: message  [code]``; other notes
    (overload listings, hints) are dropped so unrelated API growth does not churn the file."""
    lines = []
    for raw in output.splitlines():
        match = _LINE.match(raw.strip())
        if not match:
            continue
        kind, msg = match.group("kind"), match.group("msg").rstrip()
        if kind == "note" and not msg.startswith("Revealed type is"):
            continue
        lines.append(f"{Path(match.group('path')).name}:{match.group('line')}: {kind}: {msg}")
    return lines


def test_mypy_output_matches_golden() -> None:
    proc = run_mypy()
    assert proc.returncode in (0, 1), f"mypy crashed:\n{proc.stdout}\n{proc.stderr}"
    actual = normalize(proc.stdout)
    expected = [ln for ln in EXPECTED.read_text().splitlines() if ln.strip()]
    assert actual == expected, (
        "mypy's output on tests/typing/cases.py changed (run `python -m tests.typing.test_mypy "
        "--write` after an intended change):\n" + "\n".join(
            [f"- {ln}" for ln in expected if ln not in actual]
            + [f"+ {ln}" for ln in actual if ln not in expected]
        )
    )


def test_golden_agrees_with_the_marks_in_cases() -> None:
    """Every ``# E: code`` line of cases.py has exactly those errors in expected.txt, and no
    unmarked line has any, so the golden file cannot silently absorb a lost check."""
    marked: dict[int, set[str]] = {}
    for number, line in enumerate(CASES.read_text().splitlines(), start=1):
        mark = _MARK.search(line)
        if mark:
            marked[number] = {c.strip() for c in mark.group("codes").split(",") if c.strip()}
    got: dict[int, set[str]] = {}
    for line in EXPECTED.read_text().splitlines():
        match = _LINE.match(line)
        if match and match.group("kind") == "error":
            code = re.search(r"\[([\w-]+)\]$", match.group("msg"))
            assert code, f"no error code in {line!r}"
            got.setdefault(int(match.group("line")), set()).add(code.group(1))
    assert got == marked
    assert len(marked) >= 10


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.typing.test_mypy --write")
    EXPECTED.write_text("\n".join(normalize(run_mypy().stdout)) + "\n")
    print(f"wrote {EXPECTED.relative_to(ROOT)}")
