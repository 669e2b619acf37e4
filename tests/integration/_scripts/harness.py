"""Run a script in a fresh interpreter with a clean perfsdk/OTel environment; read spans back.

perfsdk installs the global OpenTelemetry TracerProvider once per process, so every export
scenario runs in its own subprocess while the receiver (or the file it writes) stays here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.otlp_receiver import ReceivedSpan

SCRIPTS = Path(__file__).resolve().parent

# The protocol as the test receiver names it, and as OTEL_EXPORTER_OTLP_PROTOCOL spells it.
PROTOCOLS = {"grpc": "grpc", "http": "http/protobuf"}

# What nested_app.py computes: its results must not change because it is instrumented.
NESTED_VALUES = [120, 240, 360, 480]
# nested_app.py's regions, sorted by name (leaf runs three times).
NESTED_NAMES = ["explode", "leaf", "leaf", "leaf", "level2.a", "level2.b", "root"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    result: dict[str, Any]

    def check(self) -> Run:
        assert self.returncode == 0, (
            f"script failed (rc={self.returncode})\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )
        return self


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any PERFSDK_* / OTEL_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_script(script: str, *args: str, env: dict[str, str], result: Path,
               cwd: Path | None = None, timeout: float = 60) -> Run:
    """Run ``_scripts/<script>`` with ``result`` as its first argument; parse what it wrote."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), str(result), *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )
    wall = time.monotonic() - t0
    data = json.loads(result.read_text(encoding="utf-8")) if result.exists() else {}
    return Run(proc.returncode, proc.stdout, proc.stderr, wall, data)


def marker_line(path: str | Path, name: str) -> int:
    """1-based line of the ``# LINE: name`` marker in a script."""
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if re.search(rf"# LINE: {re.escape(name)}$", line):
            return number
    raise AssertionError(f"no '# LINE: {name}' marker in {path}")


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every top-level JSON object in ``text`` (the console exporter prints them one after
    another, each spread over several lines)."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        start = text.find("{", i)
        if start < 0:
            return out
        obj, i = decoder.raw_decode(text, start)
        out.append(obj)


@dataclass
class Exported:
    """The spans one script run produced, and the run."""

    run: Run
    spans: list[ReceivedSpan]
    protocol: str = ""

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> ReceivedSpan:
        found = self.named(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r}: {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(s.name for s in self.spans)

    def regions(self) -> list[ReceivedSpan]:
        """perfsdk's spans (everything but the user's own ``user.*`` spans)."""
        return [s for s in self.spans if not s.name.startswith("user.")]


def check_tree(exported: Exported) -> None:
    """nested_app.py's regions arrived once each, with the parents its code nests them in."""
    regions = exported.regions()
    assert sorted(s.name for s in regions if s.name != "warmup") == NESTED_NAMES, exported.names()
    assert len({s.span_id for s in exported.spans}) == len(exported.spans), "duplicate span ids"
    root, explode = exported.one("root"), exported.one("explode")
    a, b = exported.one("level2.a"), exported.one("level2.b")
    leaves = sorted(exported.named("leaf"), key=lambda s: s.start_ns)
    assert root.is_root
    assert explode.is_root
    assert a.parent_span_id == root.span_id
    assert b.parent_span_id == root.span_id
    assert [leaf.parent_span_id for leaf in leaves] == [a.span_id, a.span_id, b.span_id]
    for span in (a, b, *leaves):
        assert span.trace_id == root.trace_id
    assert explode.trace_id != root.trace_id
    # Siblings ran one after the other.
    assert leaves[0].end_ns <= leaves[1].start_ns
    assert a.end_ns <= b.start_ns
    for span in regions:
        assert len(span.trace_id) == 32
        assert len(span.span_id) == 16
        assert int(span.span_id, 16) != 0


def _iso_ns(text: str) -> int:
    when = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    return int((when - datetime(1970, 1, 1)).total_seconds()) * 10**9 + when.microsecond * 1000


def _hex(value: str | None, width: int) -> str:
    return "" if not value else f"{int(value, 16):0{width}x}"


def span_from_json(obj: dict[str, Any]) -> ReceivedSpan:
    """A span as OpenTelemetry's ``ReadableSpan.to_json()`` writes it (console and file
    exporters), in the receiver's shape. Times there have microsecond resolution."""
    status = obj["status"]
    return ReceivedSpan(
        name=obj["name"],
        trace_id=_hex(obj["context"]["trace_id"], 32),
        span_id=_hex(obj["context"]["span_id"], 16),
        parent_span_id=_hex(obj["parent_id"], 16),
        start_ns=_iso_ns(obj["start_time"]),
        end_ns=_iso_ns(obj["end_time"]),
        attributes=dict(obj["attributes"]),
        status_code=status["status_code"],
        status_message=status.get("description") or "",
        events=[(ev["name"], dict(ev["attributes"])) for ev in obj["events"]],
        resource=dict(obj["resource"]["attributes"]),
        kind={"SpanKind.INTERNAL": 1}.get(obj["kind"], 0),
    )
