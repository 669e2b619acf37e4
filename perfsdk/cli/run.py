"""``perfsdk run SCRIPT [ARGS...]`` and ``perfsdk report DIR``.

``run`` executes an unmodified script as ``python SCRIPT ARGS`` would (``sys.argv``,
``sys.path[0]``, ``__name__ == "__main__"``) with :class:`~perfsdk.cli.patches.RunPatches`
installed, so its DataLoader iteration, forward, backward and optimizer steps become regions
(a Lightning or Hugging Face Trainer's steps are the installed integrations' instead:
:func:`perfsdk.instrument_all`); then prints the summary and the advisor's findings, and keeps
the run in the output directory: the Perfetto trace, the spans (JSON lines) and ``run.json``,
which ``report`` renders again. The script's own exit code is the command's; an exception it
raises prints its traceback (the script's frames, not perfsdk's) and exits 1, as Python does.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import perfsdk
from perfsdk import _device
from perfsdk.advisor import Advice, advise
from perfsdk.cli.patches import RunPatches
from perfsdk.cli.runfile import RUN_FILE, RunRecorder, SavedRun, load_run, save_run
from perfsdk.config import OTLP_ENDPOINT_VARS
from perfsdk.export.summary import format_flops, format_mfu, render

__all__ = ["check_output_dir", "default_exporters", "device_memory_bytes", "flops_line",
           "output_files", "print_report", "rank_directory", "render_report", "report",
           "run_script"]


def check_output_dir(directory: Path) -> str | None:
    """Why ``directory`` cannot take the run's files, or None when it can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".perfsdk-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _exit_code(exc: SystemExit, err: TextIO) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    err.write(f"{code}\n")  # sys.exit("message"): Python prints it and exits 1
    return 1


def _print_traceback(exc: BaseException, script: Path, err: TextIO) -> None:
    """The traceback from the script's first frame on (runpy's and ours left out)."""
    tb = exc.__traceback__
    target = str(script.resolve())
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    err.write("".join(traceback.format_exception(type(exc), exc,
                                                  tb or exc.__traceback__)))


def default_exporters() -> tuple[str, ...]:
    """``file`` and ``trace``, plus ``otlp`` when an OTLP endpoint variable is set."""
    names: tuple[str, ...] = ("file", "trace")
    if any(os.environ.get(var) for var in OTLP_ENDPOINT_VARS):
        names += ("otlp",)
    return names


def device_memory_bytes() -> int | None:
    """The current CUDA device's total memory, for the advisor; None before CUDA is in use."""
    if not _device.initialized():
        return None
    backend = _device.get_backend()
    return int(backend.get_device_properties(backend.current_device()).total_memory)


def _sync_guard(on: bool) -> contextlib.AbstractContextManager[Any]:
    """``--syncs``: a counting guard; on a CPU-only build of torch it counts what would sync on
    a GPU (``assume_device``), with a GPU only real syncs."""
    if not on:
        return contextlib.nullcontext()
    import torch

    cuda_build = bool(torch.version.cuda or torch.version.hip)
    return perfsdk.no_sync_guard("count", assume_device=not cuda_build)


def rank_directory(directory: Path, env: Mapping[str, str] | None = None) -> Path:
    """Where this process saves its run: ``directory`` itself, or ``directory/rank<N>`` in a job
    of several ranks (``WORLD_SIZE`` > 1 and ``RANK`` set, as ``torchrun`` does), so the ranks
    sharing one ``--output-dir`` never write over each other's ``run.json``.

    Example:
        >>> rank_directory(Path("out"), {"RANK": "1", "WORLD_SIZE": "2"}).as_posix()
        'out/rank1'
        >>> rank_directory(Path("out"), {}).as_posix()
        'out'
    """
    env = os.environ if env is None else env
    rank, world = env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip()
    if rank.isdigit() and world.isdigit() and int(world) > 1:
        return directory / f"rank{int(rank)}"
    return directory


def run_script(script: str, args: Sequence[str], *, output_dir: str | None, out: TextIO,
               err: TextIO, syncs: bool = False) -> int:
    """Run ``script`` instrumented; returns its exit code (2 when it could not be started).
    With ``syncs``, host-device syncs are counted and named (:func:`perfsdk.no_sync_guard`)."""
    path = Path(script)
    if not path.is_file():
        err.write(f"perfsdk run: {script}: no such file\n")
        return 2
    directory = rank_directory(Path(output_dir or perfsdk.get_config().output_dir))
    problem = check_output_dir(directory)
    if problem is not None:
        err.write(f"perfsdk run: --output-dir {directory}: cannot write there ({problem})\n")
        return 2
    perfsdk.configure(exporter=default_exporters(), output_dir=directory)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    code = 0
    started = time.perf_counter()
    with RunRecorder() as recorder:
        patches = RunPatches().install()
        # The installed integrations (Lightning, Hugging Face): their callbacks time the
        # framework's steps and phases, and the patches step aside meanwhile
        # (FRAMEWORK_STEPS). No report of their own: the run's follows.
        frameworks = [r.instrumentor for r in perfsdk.instrument_all(report=False)
                      if r.instrumented and r.instrumentor is not None]
        try:
            with _sync_guard(syncs):
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            code = _exit_code(exc, err)
        except KeyboardInterrupt:
            err.write("perfsdk run: interrupted\n")
            code = 130
        except BaseException as exc:  # the script's own error: shown as Python would
            _print_traceback(exc, path, err)
            code = 1
        finally:
            for instrumentor in frameworks:
                if instrumentor.is_instrumented:  # unless the script undid it
                    instrumentor.uninstrument()
            patches.remove()
            sys.argv, sys.path[:] = saved_argv, saved_path
        wall_s = time.perf_counter() - started
        perfsdk.flush()
    summary = perfsdk.summary(show=False)
    advice = advise(recorder.regions, summary=summary, device_memory_bytes=device_memory_bytes())
    files = output_files(directory)
    run_file = save_run(directory, command=[str(path), *args], exit_code=code, wall_s=wall_s,
                        files=files, summary=summary, regions=recorder.regions,
                        dropped=recorder.dropped)
    out.write(f"\nperfsdk run: {path} exited with {code} after {wall_s:.2f} s\n\n")
    mfu = flops_line(summary)
    if mfu:
        out.write(mfu + "\n\n")
    render_report(summary, advice, out, {**files, "run": str(run_file)})
    return code


def flops_line(summary: perfsdk.Summary) -> str | None:
    """One line on the steps' FLOPs: achieved FLOP/s, MFU and the peak it is of (where that
    peak comes from); None when no step had FLOPs (``perfsdk run`` counts them at step
    :data:`~perfsdk.cli.patches.FLOPS_STEP`)."""
    from perfsdk.flops import find_peak

    row = next((r for r in summary.rows if r.flops_per_s is not None), None)
    if row is None or row.flops_per_s is None:
        return None
    rate = row.flops_per_s
    line = f"FLOPs: {row.name} {format_flops(rate)} achieved (model FLOPs)"
    if row.mfu is None:
        return line + "; no MFU: the peak of this device is unknown (set PERFSDK_PEAK_FLOPS)"
    peak = find_peak()
    where = "" if peak is None else (
        " measured on this CPU" if peak.source == "measured" else
        f" from {peak.source}" if peak.source == "PERFSDK_PEAK_FLOPS" else
        f" ({peak.device}, {peak.dtype} datasheet)")
    return (line + f", MFU {format_mfu(row.mfu)} of a peak of "
            f"{format_flops(rate / row.mfu)}{where}")


def output_files(directory: Path) -> dict[str, str]:
    """The trace and spans files this process wrote in ``directory`` (those that exist)."""
    from perfsdk.lifecycle import TRACE

    files: dict[str, str] = {}
    if TRACE.path is not None and TRACE.path.is_file():
        files["trace"] = str(TRACE.path)
    spans = directory / f"spans-{os.getpid()}.jsonl"
    if spans.is_file():
        files["spans"] = str(spans)
    return files


def render_report(summary: perfsdk.Summary, advice: Advice, out: TextIO,
                  files: dict[str, str] | None = None) -> None:
    """Write the summary table, the advice and (when given) the files of a run to ``out``."""
    out.write((render(summary.rows) if summary.rows else "no regions were recorded") + "\n\n")
    out.write(f"{advice}\n")
    if files is None:
        return
    out.write("\n")
    notes = {"trace": "open in https://ui.perfetto.dev or chrome://tracing",
             "run": f"perfsdk report {Path(files['run']).parent}" if "run" in files else ""}
    width = max(map(len, files), default=0)
    out.write("files:\n")
    for kind, where in files.items():
        note = notes.get(kind, "")
        out.write(f"  {kind:<{width}}  {where}" + (f"  ({note})" if note else "") + "\n")


def print_report(recorder: RunRecorder, out: TextIO, *, title: str) -> Advice:
    """Write ``title``, the summary of the regions ``recorder`` saw and the advisor's findings on
    them to ``out``; return the advice. What the Lightning and Hugging Face callbacks print at
    the end of training."""
    advice = advise(recorder.regions, summary=perfsdk.summary(show=False),
                    device_memory_bytes=device_memory_bytes())
    out.write(f"\n{title}\n\n")
    render_report(recorder.summary(), advice, out)
    out.flush()
    return advice


def report(directory: str, *, out: TextIO, err: TextIO) -> int:
    """Render a saved run again: the command, the summary, the advice (derived anew from the
    saved regions) and the files."""
    try:
        run: SavedRun = load_run(directory)
    except (FileNotFoundError, ValueError) as exc:
        err.write(f"perfsdk report: {exc}\n")
        return 2
    out.write(f"perfsdk report: {' '.join(run.command)} exited with {run.exit_code} after "
              f"{run.wall_s:.2f} s ({len(run.regions)} regions"
              + (f", {run.dropped} more not kept" if run.dropped else "") + ")\n\n")
    advice = advise(run.regions, summary=run.summary)  # its syncs outside regions, too
    files = {k: v for k, v in run.files.items() if Path(v).exists()}
    files["run"] = str(Path(directory) / RUN_FILE)
    render_report(run.summary, advice, out, files)
    return 0
