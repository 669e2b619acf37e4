"""The docs are executable: every ```python block in README.md and docs/*.md, every
examples/*.py script and every docstring example in perfsdk runs here; docs/reference.md must
name every public name, environment variable and emitted attribute.

Markdown blocks of one file run top to bottom in one fresh subprocess, as a reader would run
them, with the code kept on its own line numbers (a traceback's line is the .md file's line).
A block fenced as ```python no-run is shown but not run. The subprocesses get a real OTLP/HTTP
receiver on 127.0.0.1 as ``OTEL_EXPORTER_OTLP_ENDPOINT``, so the OTLP examples really export.

``python -m tests.test_docs_examples --write-reference`` regenerates the environment-variable
table of docs/reference.md from perfsdk/config.py (``nox -s docs`` does it).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
CONFIG_PY = ROOT / "perfsdk" / "config.py"
MARKDOWN = sorted([README, *ROOT.glob("docs/*.md")])
EXAMPLES = sorted(ROOT.glob("examples/*.py"))
DOCTEST_MODULES = ("decorator", "timing", "phases", "config", "lifecycle", "testing", "sync",
                   "bench", "_progress", "optimize.amp", "optimize.backends",
                   "optimize.channels_last", "optimize.checkpoint", "optimize.dataloader",
                   "optimize.train_step", "auto", "auto.dataloader", "auto.steps", "auto.module",
                   "advisor", "export.trace", "cli.patches", "optimize._marks", "distributed",
                   "flops.count", "flops.peaks")
TIMEOUT = 180

_FENCE_OPEN = re.compile(r"^```python(?P<flags>[ \t]+[\w -]+)?[ \t]*$")
_FENCE_ANY = re.compile(r"^```")


# -- markdown code blocks ------------------------------------------------------------------------
def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(first code line number, code, runnable)`` of each ```python block."""
    blocks: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE_OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        flags = (match.group("flags") or "").split()
        start = i + 1
        end = start
        while end < len(lines) and not _FENCE_ANY.match(lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"unclosed ```python block at line {i + 1}")
        blocks.append((start + 1, "\n".join(lines[start:end]), "no-run" not in flags))
        i = end + 1
    return blocks


def markdown_script(text: str) -> str:
    """The runnable blocks as one script whose lines sit on the markdown file's line numbers."""
    out = [""] * len(text.splitlines())
    for first, code, runnable in python_blocks(text):
        if runnable:
            for offset, line in enumerate(code.splitlines()):
                out[first - 1 + offset] = line
    return "\n".join(out) + "\n"


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without perfsdk's or OpenTelemetry's settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERFSDK_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_python(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=TIMEOUT, check=False,
    )


def assert_clean_run(proc: subprocess.CompletedProcess[str], what: str) -> None:
    detail = f"{what}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"exit code {proc.returncode}: {detail}"
    assert "Traceback" not in proc.stderr, detail
    assert "PerfSDKWarning" not in proc.stderr, f"perfsdk warned: {detail}"


RUNNABLE = [p for p in MARKDOWN if any(r for *_, r in python_blocks(p.read_text()))]
"""The markdown files with at least one block to run."""


@pytest.fixture
def otlp_http() -> Iterator[OTLPReceiver]:
    with OTLPReceiver("http") as receiver:
        yield receiver


# What the docs promise to send over OTLP: (markdown file, span name, resource service.name).
OTLP_PROMISES = {"getting-started.md": ("otlp-demo", "trainer")}


def test_markdown_files_have_python_blocks() -> None:
    counts = {p.name: sum(r for *_, r in python_blocks(p.read_text())) for p in MARKDOWN}
    assert counts.get("README.md", 0) >= 1, counts
    assert counts.get("getting-started.md", 0) >= 5, counts


@pytest.mark.parametrize("md", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_markdown_python_blocks_run(md: Path, tmp_path: Path, otlp_http: OTLPReceiver) -> None:
    script = tmp_path / f"{md.name}.py"  # line N of this file is line N of the .md file
    script.write_text(markdown_script(md.read_text()))
    env = clean_env(
        PERFSDK_OUTPUT_DIR=str(tmp_path / "out"),
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http.base_endpoint,
    )
    proc = run_python([str(script)], cwd=tmp_path, env=env)
    assert_clean_run(proc, f"{md.relative_to(ROOT)} (line numbers are the .md file's)")
    if md.name in OTLP_PROMISES:
        name, service = OTLP_PROMISES[md.name]
        spans = otlp_http.wait_for_spans(1, timeout=10)
        found = [s for s in spans if s.name == name]
        assert found, f"no {name!r} span reached the OTLP receiver: {[s.name for s in spans]}"
        assert found[0].resource.get("service.name") == service


# -- the same code with perfsdk disabled or sampling --------------------------------------------
MODES = {"disabled": {"PERFSDK_ENABLED": "0"}, "sampled": {"PERFSDK_SAMPLE_EVERY": "3"}}
"""The settings a user may launch any of this code under. Run with ``python -O``: the blocks'
``assert`` lines state what the default settings record (20 calls of ``forward``...), which is
not what a disabled or sampled run records; what must hold is that the code itself runs: no
``None`` where it formats a time, no missing handle."""


def run_concurrently(runs: dict[str, tuple[list[str], Path, dict[str, str]]],
                     ) -> dict[str, subprocess.CompletedProcess[str]]:
    """Start ``python *args`` for each ``name: (args, cwd, env)`` at once and wait for all,
    each within ``TIMEOUT`` of the start: one still running then is killed, with the others,
    and the test fails. Output goes to files beside each cwd, not pipes: no run blocks on a
    full pipe while another is waited for."""
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    try:
        for name, (args, cwd, env) in runs.items():
            stdout, stderr = cwd.parent / f"{name}.stdout", cwd.parent / f"{name}.stderr"
            with stdout.open("wb") as out, stderr.open("wb") as err:
                proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env,
                                        stdout=out, stderr=err)
            procs[name] = proc, stdout, stderr
        deadline = time.monotonic() + TIMEOUT
        for name, (proc, _, stderr) in procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                tail = stderr.read_text(errors="replace")[-6000:]
                pytest.fail(f"{name}: still running after {TIMEOUT} s, killed\n"
                            f"--- stderr ---\n{tail}")
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        name: subprocess.CompletedProcess(
            proc.args, proc.returncode, stdout.read_text(errors="replace"),
            stderr.read_text(errors="replace"))
        for name, (proc, stdout, stderr) in procs.items()
    }


@pytest.fixture(scope="session")
def optimized_bytecode(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for the ``python -O`` runs: a bytecode cache of their own, kept for the
    session. ``-O`` reads ``.opt-1.pyc`` files, which the install does not write; without a place
    to write them (``PYTHONDONTWRITEBYTECODE=1`` is common on CI machines) every ``-O`` run
    compiled torch, OpenTelemetry and perfsdk from source again: about 7 s of CPU a run, the same
    bytecode each time. The first run writes the cache (atomically: two runs may write at once),
    the others read it."""
    return {"PYTHONDONTWRITEBYTECODE": "",
            "PYTHONPYCACHEPREFIX": str(tmp_path_factory.mktemp("pycache-O"))}


MODE_FREE = {
    ROOT / "docs" / "compare.md": "its regions are recorded by `perfsdk run` children that set "
    "PERFSDK_ENABLED=1 and PERFSDK_SAMPLE_EVERY=1 themselves; the block's own process records "
    "nothing (it writes a script and reads the runs' files), so a disabled or sampled launch "
    "runs the same code as test_markdown_python_blocks_run, two times over (~45 s)",
    ROOT / "examples" / "lab_unoptimized.py": "it has no perfsdk in it (it is what `perfsdk "
    "run` measures, tests/integration/test_cli_run.py), so no launch setting of perfsdk "
    "changes what it runs (~18 s)",
}
"""Sources whose code does not depend on the launch settings of MODES, and why; they run
once, with the defaults, in the tests above."""


def test_mode_free_sources_still_run_with_the_defaults() -> None:
    assert set(MODE_FREE) <= set(RUNNABLE) | set(EXAMPLES)
    lab = (ROOT / "examples" / "lab_unoptimized.py").read_text()
    assert "import perfsdk" not in lab  # the reason it is there
    assert "from perfsdk" not in lab


@pytest.mark.parametrize("source", [p for p in (*RUNNABLE, *EXAMPLES) if p not in MODE_FREE],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_and_examples_run_disabled_and_sampled(source: Path, tmp_path: Path,
                                                    otlp_http: OTLPReceiver,
                                                    optimized_bytecode: dict[str, str]) -> None:
    """Each mode of MODES in its own subprocess, cwd and output directory; the modes of one
    source run at the same time."""
    runs: dict[str, tuple[list[str], Path, dict[str, str]]] = {}
    for mode, settings in MODES.items():
        cwd = tmp_path / mode
        cwd.mkdir()
        if source.suffix == ".md":
            script = cwd / f"{source.name}.py"
            script.write_text(markdown_script(source.read_text()))
        else:
            script = source
        env = clean_env(PERFSDK_OUTPUT_DIR=str(cwd / "out"),
                        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http.base_endpoint,
                        **optimized_bytecode, **settings)
        runs[mode] = ["-O", str(script)], cwd, env
    for mode, proc in run_concurrently(runs).items():
        assert_clean_run(proc, f"{source.relative_to(ROOT)} {mode} with {MODES[mode]}")


# -- examples --------------------------------------------------------------------------------------
def test_there_are_examples() -> None:
    assert ROOT / "examples" / "train_small.py" in EXAMPLES


def check_train_small(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """train_small.py prints a summary row per region and writes nested spans to ``out``."""
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    for name in ("train_step", "data", "forward", "backward", "optimizer", "epoch"):
        assert name in rows, f"no summary row for {name!r}:\n{proc.stdout}"
    steps = int(rows["train_step"][1])
    assert steps > 0
    assert all(int(rows[n][1]) == steps for n in ("data", "forward", "backward", "optimizer"))
    # The spans file whose path it printed, one JSON span per line, nested as in the code.
    match = re.search(r"spans written to (\S+)", proc.stdout)
    assert match, proc.stdout
    path = Path(match.group(1))
    assert path.parent == out.resolve()
    assert path.name.startswith("spans-")
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {s["context"]["span_id"]: s for s in spans}
    names = [s["name"] for s in spans]
    assert names.count("train_step") == steps
    for name in ("data", "forward", "backward", "optimizer"):
        children = [s for s in spans if s["name"] == name]
        assert len(children) == steps
        assert all(by_id[s["parent_id"]]["name"] == "train_step" for s in children)
    for step in (s for s in spans if s["name"] == "train_step"):
        assert by_id[step["parent_id"]]["name"] == "epoch"
        assert step["attributes"]["perfsdk.host_ms"] > 0
    assert spans[0]["resource"]["attributes"]["service.name"]


def _calls(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """Region name -> calls, from the summary table the script printed."""
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("region "))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows[line.split()[0]] = int(line.split()[1])
    return rows


def check_lab_unoptimized(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """No perfsdk in it: it trains and writes nothing of perfsdk's."""
    assert "training on cpu, batch size 8, 24 batches" in proc.stdout
    assert re.search(r"samples/s$", proc.stdout.strip())
    assert not out.exists()


def check_lab_decorated(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """Steps, data wait and per-layer regions; the advisor counts the steps and names the line
    of the per-step sync; the trace file it names is there. (Whether the data wait outranks it
    is this machine's measurement: data loading and the model share its CPUs.)"""
    calls = _calls(proc)
    assert calls["step"] == calls["data_wait"] == calls["SimpleNet.conv1"] == 24
    assert calls["SimpleNet.conv1.backward"] == 24
    advice = proc.stdout[proc.stdout.index("perfsdk advice"):]
    assert advice.startswith("perfsdk advice: 23 steps after 1 warm-up, ")
    assert "Host-device syncs" in advice
    assert "1.0 per step (23 in 23 steps) at 1 call site" in advice
    assert "lab_decorated.py:60 item (24x in all)" in advice
    assert json.loads(next(out.glob("trace-*.json")).read_text())["traceEvents"]


def check_lab_optimized(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """Six steps of 32 with TrainStep's regions inside, and no host-device sync in the loop."""
    calls = _calls(proc)
    assert calls["step"] == calls["train.forward"] == calls["train.optimizer"] == 6
    assert "host-device syncs" not in proc.stdout


EXAMPLE_CHECKS = {"train_small.py": check_train_small,
                  "lab_unoptimized.py": check_lab_unoptimized,
                  "lab_decorated.py": check_lab_decorated,
                  "lab_optimized.py": check_lab_optimized}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_python([str(script)], cwd=tmp_path, env=clean_env(PERFSDK_OUTPUT_DIR=str(out)))
    assert_clean_run(proc, f"examples/{script.name}")
    check = EXAMPLE_CHECKS.get(script.name)
    if check is not None:
        check(proc, out)


# -- docstring examples ------------------------------------------------------------------------
_DOCTEST_RUNNER = """
import doctest, importlib, json, pkgutil, sys
import perfsdk
names = sorted({"perfsdk"} | {m.name for m in pkgutil.walk_packages(perfsdk.__path__, "perfsdk.")})
results = {}
for name in names:
    module = importlib.import_module(name)
    r = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    results[name] = [r.attempted, r.failed]
print("DOCTEST-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def doctest_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[int]], str]:
    cwd = tmp_path_factory.mktemp("doctest")
    proc = run_python(["-c", _DOCTEST_RUNNER], cwd=cwd,
                      env=clean_env(PERFSDK_OUTPUT_DIR=str(cwd / "out")))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DOCTEST-RESULTS "))
    results: dict[str, list[int]] = json.loads(line.split(" ", 1)[1])
    return results, output


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples(module: str, doctest_results: tuple[dict[str, list[int]], str]) -> None:
    results, output = doctest_results
    attempted, failed = results[f"perfsdk.{module}"]
    assert attempted > 0, f"perfsdk.{module} has no docstring example any more"
    assert failed == 0, output[-6000:]


def test_every_docstring_example_passes(doctest_results: tuple[dict[str, list[int]], str]) -> None:
    results, output = doctest_results
    failing = {name: r for name, r in results.items() if r[1]}
    assert not failing, output[-6000:]


# -- README set-up commands ------------------------------------------------------------------------
def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def test_readme_starts_with_the_two_setup_commands() -> None:
    text = README.read_text()
    head = text.split("\n---\n", 1)[0]
    blocks = bash_blocks(head)
    assert len(blocks) == 2, "README.md must open with exactly two set-up commands"
    run_cmd, test_cmd = (b.strip() for b in blocks)
    for cmd in (run_cmd, test_cmd):
        assert "\n" not in cmd, f"one command per block: {cmd!r}"
        words = shlex.split(cmd)
        pip = words.index("install")
        # torch pinned first in the same pip command: the CPU build, never a CUDA one.
        assert words[pip + 1] == "torch==2.13.0", cmd
        assert "-e" in words[pip:]
    assert "examples/train_small.py" in run_cmd
    assert test_cmd.endswith("-m pytest")


def test_ci_installs_like_the_readme_test_command() -> None:
    test_cmd = bash_blocks(README.read_text())[1].strip()
    install = re.search(r"pip install (.*?) &&", test_cmd)
    assert install, test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"/bin/pip\" install --progress-bar off {install.group(1)}\n" in ci
    assert "-m pytest" in ci
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_pinned_torch_satisfies_the_project_requirement() -> None:
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))
    # So pip keeps the pinned CPU build instead of fetching another (CUDA) torch.
    assert torch_req.specifier.contains("2.13.0"), torch_req


# -- docs/reference.md -----------------------------------------------------------------------------
ENV_BEGIN = "<!-- BEGIN perfsdk env table: generated from perfsdk/config.py -->"
ENV_END = "<!-- END perfsdk env table -->"


def env_var_docs() -> dict[str, str]:
    """``PERFSDK_*`` and ``OTEL_BSP_*`` constants of perfsdk/config.py and the docstring under
    each."""
    tree = ast.parse(CONFIG_PY.read_text())
    found: dict[str, str] = {}
    body = tree.body
    for node, after in zip(body, [*body[1:], None], strict=True):
        target = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target = node.target.id
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
            node.targets[0], ast.Name
        ):
            target = node.targets[0].id
        if not target or not target.startswith(("PERFSDK_", "OTEL_BSP_")):
            continue
        doc = ""
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            doc = after.value.value
        found[target] = doc
    return found


def rst_to_markdown(text: str) -> str:
    text = " ".join(text.split())
    text = re.sub(r":func:`~?([\w.]+)`", r"`\1()`", text)
    text = re.sub(r":(?:data|class|attr|meth|mod|envvar):`~?([\w.]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


OTEL_ARGUMENTS = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "export_queue_size",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "export_batch_size",
    "OTEL_BSP_SCHEDULE_DELAY": "export_delay_s",
    "OTEL_BSP_EXPORT_TIMEOUT": "export_batch_timeout_s",
}
"""OpenTelemetry's own variables perfsdk honours, and the configure() argument for each."""


def render_env_table() -> str:
    import perfsdk

    params = list(inspect.signature(perfsdk.configure).parameters)
    lines = [
        ENV_BEGIN,
        "| variable | `configure()` argument | accepted values, default, unit |",
        "| --- | --- | --- |",
    ]
    for name, doc in env_var_docs().items():
        stem = name.removeprefix("PERFSDK_").lower()
        arg = OTEL_ARGUMENTS.get(name) or next(
            (p for p in params if p == stem or p.startswith(stem + "_")), None)
        lines.append(f"| `{name}` | {f'`{arg}`' if arg else '-'} | {rst_to_markdown(doc)} |")
    lines.append(ENV_END)
    return "\n".join(lines)


def current_env_table(text: str) -> str:
    start, end = text.find(ENV_BEGIN), text.find(ENV_END)
    assert start >= 0, "docs/reference.md lost its generated env-var table's BEGIN marker"
    assert end > start, "docs/reference.md lost its generated env-var table's END marker"
    return text[start:end + len(ENV_END)]


def write_reference() -> bool:
    text = REFERENCE.read_text()
    new = text.replace(current_env_table(text), render_env_table())
    if new != text:
        REFERENCE.write_text(new)
    return new != text


def test_every_env_var_constant_is_documented() -> None:
    import perfsdk.config

    constants = {n for n in vars(perfsdk.config) if n.startswith(("PERFSDK_", "OTEL_BSP_"))}
    assert constants, "perfsdk.config defines no PERFSDK_* constants?"
    assert constants == set(env_var_docs()), "the ast scan disagrees with the module"
    for name in constants:
        assert getattr(perfsdk.config, name) == name
        assert env_var_docs()[name].strip(), f"{name} has no docstring in perfsdk/config.py"
    text = REFERENCE.read_text()
    missing = sorted(n for n in constants if f"`{n}`" not in text)
    assert not missing, f"docs/reference.md does not list {missing}"


def test_env_table_is_generated_from_config() -> None:
    assert current_env_table(REFERENCE.read_text()) == render_env_table(), (
        "docs/reference.md's env-var table is stale: run "
        "`python -m tests.test_docs_examples --write-reference`"
    )


def test_every_public_name_is_documented() -> None:
    import perfsdk
    import perfsdk.advisor
    import perfsdk.auto
    import perfsdk.bench
    import perfsdk.optimize
    import perfsdk.testing

    text = REFERENCE.read_text()
    wanted = [f"perfsdk.{n}" for n in perfsdk.__all__]
    for module in (perfsdk.testing, perfsdk.bench, perfsdk.optimize, perfsdk.auto,
                   perfsdk.advisor, perfsdk.distributed):
        wanted += [f"{module.__name__}.{n}" for n in module.__all__]
    missing = [n for n in wanted if f"`{n}`" not in text]
    assert not missing, f"docs/reference.md does not list {missing}"
    for name in perfsdk.__all__:
        assert hasattr(perfsdk, name), name


def test_every_emitted_attribute_is_documented() -> None:
    """Run a region that sets every optional field and raises; each attribute key of its span,
    its exception event and its resource must be in docs/reference.md."""
    import perfsdk
    from perfsdk.testing import capture

    @perfsdk.profiled("documented", category="cat", payload=3, attributes={"user.key": 1})
    def failing() -> None:
        raise KeyError("boom")

    with capture() as cap, pytest.raises(KeyError):
        failing()
    span = cap.span("documented")
    keys = set(span.attributes) - {"user.key"}
    keys |= {k for event in span.events for k in event.attributes}
    keys |= set(span.resource.attributes)
    assert {"perfsdk.host_ms", "perfsdk.category", "perfsdk.payload", "code.function",
            "exception.type", "service.name"} <= keys
    text = REFERENCE.read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/reference.md does not document {missing}"


def test_documented_units() -> None:
    text = REFERENCE.read_text()
    for key, unit in (("perfsdk.host_ms", "ms"), ("perfsdk.device_ms", "ms")):
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{key}`")), None)
        assert row is not None, f"{key} needs a row in the span attribute table"
        assert f"| {unit} |" in row, f"{key}'s row must give its unit, {unit}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-reference"]:
        changed = write_reference()
        print(f"docs/reference.md: env-var table {'updated' if changed else 'already current'}")
    else:
        sys.exit("usage: python -m tests.test_docs_examples --write-reference")
