"""The GPU run: every ``gpu`` test with ``PERFSDK_REQUIRE_GPU=1`` (a skip is a failure), then the
GPU benchmarks with small budgets, and a short report.

Usage (on a machine with an NVIDIA GPU, in an environment with a CUDA build of torch and
``pip install -e '.[dev]'``)::

    python .ci/gpu.py                      # or .ci/gpu, or nox -s gpu
    python .ci/gpu.py --no-bench           # the tests only
    python .ci/gpu.py -- -k cuda_graphs    # arguments after -- go to pytest

It writes, under ``--output-dir`` (default ``benchmarks/results/gpu``): ``report.md`` and
``report.json`` (device, driver, torch and CUDA versions; passed / failed / skipped counts and
each failure; the benchmarks' headline numbers), ``junit.xml`` and ``pytest.log`` (the test
run), ``optimize-cuda.json`` and ``gpu_regions.json`` (the benchmarks' full results). The exit
status is 0 only when CUDA is available, at least one gpu test ran, none failed or was skipped
(an expected failure, ``xfail``, is allowed and listed) and every benchmark ran. Without a GPU
it still runs the tests, which then fail at once, and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "gpu"
PYTEST_TIMEOUT_S = 3600


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT,
                   help="where the report and the raw results go (default %(default)s)")
    p.add_argument("--no-bench", action="store_true", help="run the gpu tests only")
    p.add_argument("--budget", type=float, default=120.0,
                   help="optimize()'s budget_s in the optimize benchmark (default %(default)s)")
    p.add_argument("pytest_args", nargs="*",
                   help="extra pytest arguments (after --), e.g. -k cuda_graphs or test paths")
    return p.parse_args(argv)


# -- the environment ----------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Python, torch, CUDA, the GPUs and the driver, perfsdk and the git commit."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": None, "cuda_available": False, "devices": [], "driver": None,
        "perfsdk": _perfsdk_version(), "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "perfsdk", "tests")),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        env["cuda_available"] = bool(torch.cuda.is_available())
        if env["cuda_available"]:
            env["cudnn"] = torch.backends.cudnn.version()
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                env["devices"].append({"index": i, "name": props.name,
                                       "capability": f"{props.major}.{props.minor}",
                                       "memory_gib": round(props.total_memory / 2**30, 1)})
    except Exception as exc:  # a broken driver: say so in the report
        env["cuda_error"] = f"{type(exc).__name__}: {exc}"
    env["driver"] = _driver_version()
    return env


def _perfsdk_version() -> str | None:
    try:
        sys.path.insert(0, str(ROOT))
        from perfsdk import __version__
        return str(__version__)
    except Exception:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30, check=True)
            return out.stdout.strip().splitlines()[0] or None
        except (OSError, subprocess.SubprocessError, IndexError):
            return None
    return None


# -- the tests ----------------------------------------------------------------------------------
def pytest_command(junit: Path, extra: list[str]) -> list[str]:
    # -n 0: one process (pyproject's addopts run two xdist workers), so no two tests share
    # the GPU at once and device-wide readings (NVML, the allocator) are each test's own.
    return [sys.executable, "-m", "pytest", "-n", "0", "-m", "gpu", "--run-slow", "-rA",
            f"--junitxml={junit}", *extra]


def run_tests(out: Path, extra: list[str]) -> dict[str, Any]:
    """Run the gpu tests with PERFSDK_REQUIRE_GPU=1; their outcome, from the JUnit XML."""
    junit, log = out / "junit.xml", out / "pytest.log"
    junit.unlink(missing_ok=True)
    command = pytest_command(junit, extra)
    env = {**os.environ, "PERFSDK_REQUIRE_GPU": "1", "PYTHONPATH": _pythonpath()}
    print(f"$ PERFSDK_REQUIRE_GPU=1 {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    rc = _tee(command, env, log, PYTEST_TIMEOUT_S)
    result = parse_junit(junit) if junit.exists() else empty_counts()
    result.update(returncode=rc, wall_s=round(time.monotonic() - started, 1),
                  command="PERFSDK_REQUIRE_GPU=1 " + " ".join(["python", *command[1:]]))
    return result


def _pythonpath() -> str:
    current = os.environ.get("PYTHONPATH")
    return str(ROOT) if not current else f"{ROOT}{os.pathsep}{current}"


def _tee(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run ``command``, its output both printed and written to ``log``; its exit status (124
    when it ran past ``timeout`` seconds and was killed)."""
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        timer = threading.Timer(timeout, proc.kill)  # also when it hangs without output
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            rc = proc.wait()
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
        if timed_out and rc != 0:
            f.write(f"\n[killed after {timeout:.0f} s]\n")
            return 124
        return rc


def empty_counts() -> dict[str, Any]:
    return {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0,
            "problems": [], "expected_failures": []}


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failed, errored and skipped tests of a pytest JUnit XML file (an xfail is
    a ``skipped`` element of type ``pytest.xfail``, counted apart)."""
    counts = empty_counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        counts["total"] += 1
        outcome = "passed"
        message = ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, "skipped")
                message = child.get("message") or (child.text or "").strip()
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                if child.tag in ("failure", "error"):
                    break  # a test that failed and then errored in teardown: failed
        counts[outcome] += 1
        first = message.strip().splitlines()[0][:300] if message.strip() else ""
        if outcome in ("failed", "errors", "skipped"):
            counts["problems"].append({"test": node, "outcome": outcome, "message": first})
        elif outcome == "xfailed":
            counts["expected_failures"].append({"test": node, "message": first})
    return counts


# -- the benchmarks -----------------------------------------------------------------------------
def run_benchmarks(out: Path, budget: float) -> dict[str, Any]:
    """The GPU benchmarks, small: their exit status, wall time and headline numbers."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    runs = {
        "gpu_regions": ([sys.executable, "benchmarks/gpu_regions.py", "--quick",
                         "--output", str(out / "gpu_regions.json")], headline_gpu_regions),
        "optimize": ([sys.executable, "benchmarks/optimize.py", "--quick", "--device", "cuda",
                      "--budget", f"{budget:g}", "--output", str(out / "optimize-cuda.json")],
                     headline_optimize),
    }
    results: dict[str, Any] = {}
    for name, (command, headline) in runs.items():
        output = Path(command[-1])
        output.unlink(missing_ok=True)
        print(f"\n$ {' '.join(['python', *command[1:]])}", flush=True)
        started = time.monotonic()
        rc = _tee(command, env, out / f"{name}.log", 1800)
        entry: dict[str, Any] = {"returncode": rc, "wall_s": round(time.monotonic() - started, 1),
                                 "output": str(output)}
        if rc == 0 and output.exists():
            try:
                entry["headline"] = headline(json.loads(output.read_text()))
            except Exception as exc:  # the numbers are there; the summary of them is not
                entry["headline_error"] = f"{type(exc).__name__}: {exc}"
        results[name] = entry
    return results


def headline_optimize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload: optimize's pick and its speedup, the best by hand, the fraction of it."""
    rows = []
    for name, w in result["workloads"].items():
        o, t = w["optimize"], w["targets"]
        rows.append({"workload": name, "chosen": o["chosen"],
                     "speedup": round(o["speedup_in_comparison"], 2),
                     "best_by_hand": w["best_by_hand"],
                     "best_by_hand_speedup": round(w["best_by_hand_speedup"], 2),
                     "fraction_of_best": round(t["fraction_of_best"]["value"], 3),
                     "search_s": round(o["search_s"], 1)})
    return rows


def headline_gpu_regions(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"measure": k, **v} for k, v in result["headline"].items()]


# -- the report ---------------------------------------------------------------------------------
def verdict(env: dict[str, Any], tests: dict[str, Any], bench: dict[str, Any] | None
            ) -> list[str]:
    """Why the run failed; [] when it passed."""
    reasons = []
    if not env["cuda_available"]:
        reasons.append(f"no CUDA GPU: torch.cuda.is_available() is False (torch {env['torch']}, "
                       f"CUDA build {env['torch_cuda']})"
                       + (f"; {env['cuda_error']}" if env.get("cuda_error") else ""))
    if tests["returncode"] not in (0, 5):
        reasons.append(f"pytest exited with {tests['returncode']}")
    if tests["passed"] == 0:
        reasons.append("no gpu test passed")
    for key, what in (("failed", "failed"), ("errors", "errored"),
                      ("skipped", "skipped (a skip is a failure here)")):
        if tests[key]:
            reasons.append(f"{tests[key]} gpu test(s) {what}")
    for name, entry in (bench or {}).items():
        if entry["returncode"] != 0:
            reasons.append(f"benchmark {name} exited with {entry['returncode']}")
    return reasons


def markdown(report: dict[str, Any]) -> str:
    env, tests, bench = report["environment"], report["tests"], report["benchmarks"]
    devices = ", ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)"
                        for d in env["devices"]) or "none"
    lines = [
        f"# perfsdk GPU run: {report['status']}", "",
        f"- created: {env['created']}; commit {env['git_commit']}"
        + (" (perfsdk/ or tests/ modified)" if env["git_dirty"] else ""),
        f"- GPU: {devices}; driver {env['driver'] or '?'}",
        f"- torch {env['torch']}, CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}; "
        f"Python {env['python']}; perfsdk {env['perfsdk']}",
    ]
    if report["reasons"]:
        lines += ["", "**Failed because:**", *(f"- {r}" for r in report["reasons"])]
    lines += ["", "## Tests", "", f"`{tests['command']}` ({tests['wall_s']} s)", "",
              "| passed | failed | errors | skipped | xfailed | total |",
              "|---:|---:|---:|---:|---:|---:|",
              f"| {tests['passed']} | {tests['failed']} | {tests['errors']} | "
              f"{tests['skipped']} | {tests['xfailed']} | {tests['total']} |"]
    if tests["problems"]:
        lines += ["", "| test | outcome | message |", "|---|---|---|"]
        lines += [f"| `{p['test']}` | {p['outcome']} | {_cell(p['message'])} |"
                  for p in tests["problems"][:50]]
        if len(tests["problems"]) > 50:
            lines.append(f"\n... and {len(tests['problems']) - 50} more (see junit.xml)")
    if tests["expected_failures"]:
        lines += ["", "Expected failures (xfail; each is a known gap, see its reason):"]
        lines += [f"- `{x['test']}`: {_cell(x['message'])}" for x in tests["expected_failures"]]
    lines += ["", "## Benchmarks", ""]
    if bench is None:
        lines.append("Not run" + (" (--no-bench)." if report["no_bench"] else
                                  ": no CUDA GPU."))
    else:
        for name, entry in bench.items():
            lines.append(f"**{name}**: exit {entry['returncode']}, {entry['wall_s']} s, "
                         f"results in `{Path(entry['output']).name}`")
            rows = entry.get("headline")
            if rows:
                keys = list(rows[0])
                lines += ["", "| " + " | ".join(keys) + " |",
                          "|" + "---|" * len(keys)]
                lines += ["| " + " | ".join(_cell(str(r.get(k, ""))) for k in keys) + " |"
                          for r in rows]
            elif entry.get("headline_error"):
                lines.append(f"(headline unavailable: {entry['headline_error']})")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(f"GPU run: torch {env['torch']} (CUDA build {env['torch_cuda']}), "
          f"devices: {[d['name'] for d in env['devices']] or 'none'}", flush=True)
    if not env["cuda_available"]:
        print("No CUDA GPU here: the gpu tests will fail at once (PERFSDK_REQUIRE_GPU=1), and "
              "the benchmarks are not run.", flush=True)
    tests = run_tests(out, args.pytest_args)
    bench = None
    if env["cuda_available"] and not args.no_bench:
        bench = run_benchmarks(out, args.budget)
    reasons = verdict(env, tests, bench)
    report = {"status": "FAIL" if reasons else "PASS", "reasons": reasons,
              "no_bench": args.no_bench, "environment": env, "tests": tests,
              "benchmarks": bench}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / "report.md").write_text(text)
    print("\n" + text)
    print(f"wrote {out / 'report.md'} and report.json, junit.xml, pytest.log there")
    return 0 if not reasons else 1


if __name__ == "__main__":
    sys.exit(main())
