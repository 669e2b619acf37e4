"""Developer sessions: ``nox -s tests``, ``integrations``, ``lint``, ``typecheck``, ``bench``,
``examples``, ``docs``, ``stress`` (the tests beside two busy processes) and ``gpu`` (on a GPU
machine: every CUDA path, with a report).

CI does not need nox: ``.ci/run`` does the same with a plain venv. Arguments after ``--`` reach
the tool each session runs, e.g. ``nox -s tests -- -k otlp -x``.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"  # the CPU build; naming it first keeps pip from pulling a CUDA build

nox.options.sessions = ["lint", "typecheck", "tests", "integrations", "integration_template",
                        "examples"]
nox.options.reuse_existing_virtualenvs = True


def install(session: nox.Session, extras: str = "dev") -> None:
    """Install torch first (so perfsdk's ``torch>=2.2`` is already met), then perfsdk."""
    session.install(TORCH, "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (what .ci/run runs last)."""
    install(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
@nox.parametrize("name", ["lightning", "transformers"])
def integrations(session: nox.Session, name: str) -> None:
    """One integration package (integrations/<name>) with its framework, and its tests."""
    install(session)
    session.install("-e", f"integrations/{name}[test]")
    session.run("python", "-m", "pytest", f"integrations/{name}/tests", *session.posargs)


@nox.session
def integration_template(session: nox.Session) -> None:
    """The skeleton in integrations/_template (copy it to start an integration), from source."""
    install(session)
    session.run("python", "-m", "pytest", "integrations/_template/tests", *session.posargs,
                env={"PYTHONPATH": str(ROOT / "integrations" / "_template" / "src")})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", *(session.posargs or ["."]))


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict) on perfsdk, then the typing golden test (tests/typing)."""
    install(session)
    session.run("python", "-m", "mypy", *session.posargs)
    session.run("python", "-m", "pytest", "tests/typing", "-q")


@nox.session
def bench(session: nox.Session) -> None:
    """The overhead benchmark: prints a table and writes JSON under benchmarks/results/."""
    install(session)
    session.run("python", "benchmarks/overhead.py", *session.posargs)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every examples/*.py on the CPU, writing to a temporary output directory."""
    install(session, "otlp")
    out = session.create_tmp()
    scripts = sorted(ROOT.glob("examples/*.py"))
    if not scripts:
        session.error("no examples/*.py found")
    for script in scripts:
        session.run("python", str(script.relative_to(ROOT)), *session.posargs,
                    env={"PERFSDK_OUTPUT_DIR": str(Path(out) / script.stem)})


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate the env-var table in docs/reference.md, then run every docs code block."""
    install(session)
    session.run("python", "-m", "tests.test_docs_examples", "--write-reference")
    session.run("python", "-m", "pytest", "tests/test_docs_examples.py", "-q", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a GPU machine: every gpu test with PERFSDK_REQUIRE_GPU=1 (a skip is a failure), then
    the GPU benchmarks; writes benchmarks/results/gpu/report.md (.ci/gpu.py). Runs in the
    current environment, which needs a CUDA build of torch and ``pip install -e '.[dev]'``:
    installing here would pull the CPU build. ``nox -s gpu -- --no-bench -- -k graphs``."""
    session.run("python", ".ci/gpu.py", *session.posargs, external=True)


@nox.session
def stress(session: nox.Session) -> None:
    """The test suite with two CPU-bound processes beside it (``.ci/stress``): timing must not
    decide any test. Arguments go to pytest: ``nox -s stress -- tests/unit -x``."""
    install(session)
    session.run(str(ROOT / ".ci" / "stress"), *session.posargs,
                env={"PYTHON": str(Path(session.bin) / "python")}, external=True)
