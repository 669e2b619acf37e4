"""A real ``DataLoader`` with worker processes (fork and spawn) inside instrumented code.

The script runs in a subprocess with the ``file`` exporter: it must yield the right batches,
exit with status 0 without hanging, and leave the main process's regions, correctly nested,
in ``spans-<main pid>.jsonl``. Two epochs with a :func:`perfsdk.flush` between them make the
second epoch's workers start from a parent whose exporter is already set up and writing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    import torch
    from torch.utils.data import DataLoader, Dataset

    import perfsdk


    class Squares(Dataset):
        def __len__(self):
            return 16

        @perfsdk.profiled("dl.getitem")
        def __getitem__(self, i):
            with perfsdk.timed_region("dl.load", index=i):
                return torch.tensor([i, i * i])


    @perfsdk.profiled("dl.epoch")
    def epoch(context):
        loader = DataLoader(Squares(), batch_size=4, num_workers=2,
                            multiprocessing_context=context)
        batches = []
        for batch in loader:
            with perfsdk.timed_region("dl.step"):
                batches.append(batch.tolist())
        return batches


    if __name__ == "__main__":
        first = epoch(sys.argv[1])
        perfsdk.flush()  # the parent's exporter is now open when the next workers start
        second = epoch(sys.argv[1])
        print(json.dumps({"pid": os.getpid(), "first": first, "second": second}))
''')

EXPECTED = [[[i, i * i] for i in range(b, b + 4)] for b in range(0, 16, 4)]


def _read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=["fork", "spawn"])
def run_script(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    """One run per start method, shared by the tests below."""
    context = request.param
    tmp_path = tmp_path_factory.mktemp(f"dataloader_{context}")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    env = dict(os.environ)
    env.update(PERFSDK_EXPORTER="file", PERFSDK_OUTPUT_DIR=str(out_dir), PERFSDK_ENABLED="1")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, str(script), context], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the DataLoader script ({context}) hung for 120 s:\n{exc.stderr!r}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0]), out_dir


def test_batches_and_clean_exit(run_script: tuple[dict[str, Any], Path]) -> None:
    result, _ = run_script
    assert result["first"] == EXPECTED
    assert result["second"] == EXPECTED


def test_main_process_spans_file(run_script: tuple[dict[str, Any], Path]) -> None:
    result, out_dir = run_script
    main_file = out_dir / f"spans-{result['pid']}.jsonl"
    assert main_file.is_file(), sorted(p.name for p in out_dir.iterdir())
    spans = _read_spans(main_file)
    main = [s for s in spans if s["name"] in ("dl.epoch", "dl.step")]
    assert Counter(s["name"] for s in main) == {"dl.epoch": 2, "dl.step": 8}
    epochs = {s["context"]["span_id"]: s for s in main if s["name"] == "dl.epoch"}
    for step in (s for s in main if s["name"] == "dl.step"):
        assert step["parent_id"] in epochs
        assert step["context"]["trace_id"] == epochs[step["parent_id"]]["context"]["trace_id"]
    for s in main:
        assert s["resource"]["attributes"]["process.pid"] == result["pid"]


def test_worker_spans_are_not_attributed_to_the_main_process(
    run_script: tuple[dict[str, Any], Path],
) -> None:
    """``__getitem__`` runs only in the workers. Whatever worker spans get written must carry
    the worker's own pid and go to the worker's own file, never the parent's."""
    result, out_dir = run_script
    for path in sorted(out_dir.glob("spans-*.jsonl")):
        pid = int(path.stem.split("-", 1)[1])
        for span in _read_spans(path):
            assert span["resource"]["attributes"]["process.pid"] == pid, (path.name, span["name"])
            if pid == result["pid"]:
                assert span["name"] not in ("dl.getitem", "dl.load"), (
                    f"a worker's {span['name']!r} span landed in the main process's file")
            else:
                assert span["name"] in ("dl.getitem", "dl.load"), (path.name, span["name"])
