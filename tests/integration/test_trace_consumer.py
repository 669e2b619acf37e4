"""perfsdk's trace file read by a real, independent consumer: the trace engine of the Chrome
DevTools Performance panel (npm ``@paulirish/trace_engine``, the model DevTools builds from a
Chrome Trace Event file), run under Node.js.

Why this consumer: it parses the Chrome trace format itself and builds the per-thread slice tree
that a viewer draws. Holistic Trace Analysis needs jupyterlab and ~75 packages; the ``perfetto``
package's trace processor downloads a binary at run time. The test installs the pinned package
once into ``~/.cache/perfsdk-tests`` and skips, saying why, without node/npm or the npm registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import perfsdk
from perfsdk.export.trace import write_trace
from perfsdk.testing import capture

ENGINE = "0.0.65"
PACKAGE = {
    "name": "perfsdk-trace-consumer", "private": True, "type": "module",
    "dependencies": {"@paulirish/trace_engine": ENGINE},
    "overrides": {"third-party-web": "0.30.0", "legacy-javascript": "0.0.1"},
}
READER = r"""
import fs from 'node:fs';
import * as Trace from '@paulirish/trace_engine';
globalThis.DOMRect ??= class { constructor(x = 0, y = 0, w = 0, h = 0) {
  this.x = x; this.y = y; this.width = w; this.height = h; } };
const file = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const model = Trace.TraceModel.Model.createWithAllHandlers();
await model.parse(file.traceEvents);
const renderer = model.parsedTrace().data.Renderer;
const walk = (n) => ({name: n.entry.name, ts: n.entry.ts, dur: n.entry.dur,
                      children: [...n.children].map(walk)});
const threads = [];
for (const [pid, proc] of renderer.processes) {
  for (const [tid, thread] of proc.threads) {
    threads.push({pid, tid, name: thread.name ?? null,
                  roots: thread.tree ? [...thread.tree.roots].map(walk) : []});
  }
}
console.log(JSON.stringify(threads));
"""


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("needs Node.js >= 18 and npm (to run the Chrome DevTools trace engine)")
    major = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    try:
        if int(major.stdout.strip().lstrip("v").split(".")[0]) < 18:
            raise ValueError
    except ValueError:
        pytest.skip(f"needs Node.js >= 18 (found {major.stdout.strip() or 'unknown'})")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = cache / "perfsdk-tests" / f"trace-engine-{ENGINE}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text(json.dumps(PACKAGE))
    (where / "read.mjs").write_text(READER)
    if not (where / "node_modules" / "@paulirish" / "trace_engine").is_dir():
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"],
                              cwd=where, capture_output=True, text=True, timeout=600,
                              check=False)
        if done.returncode != 0:
            pytest.skip(f"could not install @paulirish/trace_engine@{ENGINE} from the npm "
                        f"registry: {done.stderr.strip()[-400:]}")
    return where


def read(engine: Path, trace: Path) -> list[dict[str, Any]]:
    done = subprocess.run(["node", str(engine / "read.mjs"), str(trace)], cwd=engine,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def workload() -> None:
    """Nested regions on the calling thread: step > forward > (layer1, layer2), step > update."""
    with perfsdk.timed_region("step", category="step"):
        with perfsdk.timed_region("forward", category="compute"):
            with perfsdk.timed_region("layer1"):
                time.sleep(0.002)
            with perfsdk.timed_region("layer2"):
                time.sleep(0.001)
        with perfsdk.timed_region("update", category="update"):
            time.sleep(0.001)


def tree_of(regions: list[perfsdk.RegionResult], thread_id: int) -> list[Any]:
    """The expected slice tree of one thread, from the captured regions and their span ids."""
    mine = [r for r in regions if r.thread_id == thread_id]
    spans = {r.span_id for r in mine}

    def node(r: perfsdk.RegionResult) -> Any:
        kids = sorted((c for c in mine if c.parent_span_id == r.span_id),
                      key=lambda c: c.start_ns)
        return (r.name, r.end_ns - r.start_ns, [node(c) for c in kids])

    roots = sorted((r for r in mine if r.parent_span_id not in spans), key=lambda r: r.start_ns)
    return [node(r) for r in roots]


def seen(node: dict[str, Any]) -> Any:
    return (node["name"], round(node["dur"] * 1000),
            [seen(c) for c in sorted(node["children"], key=lambda c: c["ts"])])


def run_two_threads(while_alive: Any = None) -> tuple[list[perfsdk.RegionResult], int]:
    """The workload on the main thread and twice on a thread named ``loader``; ``while_alive``
    runs once the work is done but before ``loader`` ends (a thread's name is read while it
    lives, as a DataLoader's or a server's threads do)."""
    other: list[int] = []
    done, leave = threading.Event(), threading.Event()

    def worker() -> None:
        other.append(threading.get_ident())
        workload()
        workload()
        done.set()
        leave.wait(30)

    with capture() as cap:
        thread = threading.Thread(target=worker, name="loader")
        thread.start()
        workload()
        done.wait(30)
        if while_alive is not None:
            while_alive(cap)
        leave.set()
        thread.join()
    return cap.regions, other[0]


def check(threads: list[dict[str, Any]], regions: list[perfsdk.RegionResult],
          other: int) -> None:
    lanes = {t["name"]: t for t in threads}
    assert {"MainThread", "loader"} <= set(lanes), lanes.keys()
    for name, ident in (("MainThread", threading.get_ident()), ("loader", other)):
        got = [seen(root) for root in lanes[name]["roots"]]
        assert got == tree_of(regions, ident)  # names, durations to the ns, parent/child
    count = sum(1 for t in threads for _ in _walk(t["roots"]))
    assert count == len(regions) == 15


def _walk(nodes: list[dict[str, Any]]) -> Any:
    for n in nodes:
        yield n
        yield from _walk(n["children"])


def test_write_trace_read_by_devtools_engine(engine_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "run.json"

    def write(cap: Any) -> None:
        perfsdk.flush()
        write_trace(trace, cap.regions)

    regions, other = run_two_threads(write)
    check(read(engine_dir, trace), regions, other)


def test_trace_exporter_file_read_by_devtools_engine(engine_dir: Path, tmp_path: Path) -> None:
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    regions, other = run_two_threads(lambda cap: perfsdk.flush())
    [trace] = tmp_path.glob("trace-*.json")
    check(read(engine_dir, trace), regions, other)


def test_a_file_written_in_pieces_reads_as_one_tree(engine_dir: Path, tmp_path: Path) -> None:
    """Flushes inside the step: its children are written before it (the sink renders regions
    as they arrive, in the order they ended); the engine still builds the same tree."""
    perfsdk.configure(exporter="trace", output_dir=tmp_path)
    with capture() as cap, perfsdk.timed_region("step", category="step"):
        with perfsdk.timed_region("forward", category="compute"):
            with perfsdk.timed_region("layer1"):
                time.sleep(0.002)
            perfsdk.flush()
            with perfsdk.timed_region("layer2"):
                time.sleep(0.001)
        perfsdk.flush()
        with perfsdk.timed_region("update", category="update"):
            time.sleep(0.001)
    perfsdk.flush()
    [trace] = tmp_path.glob("trace-*.json")
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert names == ["layer1", "forward", "layer2", "step", "update"]  # written in pieces
    [main] = [t for t in read(engine_dir, trace) if t["name"] == "MainThread"]
    assert [seen(root) for root in main["roots"]] == tree_of(cap.regions, threading.get_ident())
