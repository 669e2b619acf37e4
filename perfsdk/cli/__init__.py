"""The ``perfsdk`` command: ``run``, ``report``, ``compare`` and ``demo``.

It answers at once: this module imports only the standard library and ``perfsdk._version``, and
``import perfsdk`` is light, so ``perfsdk --help``, an argument error and a missing script are
answered before torch is imported. Only then is torch imported, once, with its "Failed to
initialize NumPy" warning kept out of the output (perfsdk does not use NumPy, and the ``otlp``
install has none). A closed stdout (``perfsdk report DIR | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from perfsdk._version import __version__

__all__ = ["CommandParser", "build_parser", "main"]

RUN_USAGE_EXAMPLE = "perfsdk run train.py --epochs 1"

NUMPY_WARNING = "Failed to initialize NumPy"
"""The start of the warning torch's import gives without NumPy (torch/csrc/utils/tensor_numpy.cpp):
torch works without it, and a tensor's ``.numpy()`` still says clearly that NumPy is missing."""


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that reports unknown arguments with the usage of the subcommand they
    follow (argparse itself reports them with the top-level usage)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.subcommands.get(getattr(parsed, "command", None) or "", self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _percent(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage (10 or 10%)") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a percentage >= 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1 (0.95 for 95%)")
    return value


def build_parser() -> CommandParser:
    """The ``perfsdk`` command's argument parser (its subcommands: demo, run, report,
    compare)."""
    parser = CommandParser(
        prog="perfsdk", description="PyTorch performance instrumentation: NVTX, timings, spans.")
    parser.add_argument("--version", action="version", version=f"perfsdk {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="the course lab's training loop before and after its fixes, measured",
        description="Trains the lab's SimpleNet on synthetic images twice: first as the lab's "
                    "unoptimized script does (small batch, num_workers=0, a sync per step), "
                    "showing perfsdk's summary and the advisor's findings; then tries each fix "
                    "(workers, a larger batch, autocast, channels-last, compile) in a quick "
                    "interleaved A/B on this machine and keeps only those measured faster; runs "
                    "again with the kept fixes; prints the before/after table and writes the "
                    "Perfetto trace, the spans and both runs (for `perfsdk report`) to the "
                    "output directory. With "
                    "OTEL_EXPORTER_OTLP_ENDPOINT set, spans also go to that collector.")
    demo.add_argument("--steps", type=_positive, default=60,
                      help="steps of the lab's loop (60; at least 2)")
    demo.add_argument("--batch-size", type=_positive, default=8,
                      help="the lab's batch size (8); the larger-batch candidate is 4 times that")
    demo.add_argument("--latency-ms", type=float, default=None,
                      help="simulated storage latency per image, in ms (5)")
    demo.add_argument("--image-size", type=_positive, default=32,
                      help="image side, a multiple of 4 (32; the lab uses 224 on a GPU)")
    demo.add_argument("--output-dir", default=None,
                      help="where the trace, spans and runs go (PERFSDK_OUTPUT_DIR, "
                           "./perfsdk-output)")
    demo.add_argument("--exporter", default=None,
                      help="comma list of otlp, console, file, none (file, plus otlp when "
                           "OTEL_EXPORTER_OTLP_ENDPOINT is set); the trace file is always "
                           "written")
    run = commands.add_parser(
        "run", help="run an unmodified training script with perfsdk's regions patched in, then "
                    "print the summary and advice",
        usage="perfsdk run [-h] [--output-dir DIR] [--syncs] SCRIPT [ARGS ...]",
        description="Runs SCRIPT as `python SCRIPT ARGS` would, with every DataLoader batch, the "
                    "model's forward, loss.backward() and optimizer.step() recorded as regions; "
                    "prints the summary and the advisor's findings and writes the Perfetto "
                    "trace, the spans and run.json to the output directory (run.json is "
                    "readable by you alone, and secret-looking values of the command line are "
                    "redacted in it). Exits with the script's exit code. Options go before "
                    f"SCRIPT; what follows it is the script's own, e.g. `{RUN_USAGE_EXAMPLE}`.")
    run.add_argument("--output-dir", default=None, metavar="DIR",
                     help="where the trace, spans and run.json go (PERFSDK_OUTPUT_DIR, "
                          "./perfsdk-output)")
    run.add_argument("--syncs", action="store_true",
                     help="count host-device syncs and name their lines (no_sync_guard('count'); "
                          "about 6 us more per tensor operation)")
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="the script's own arguments")
    report = commands.add_parser("report", help="render a saved run again (summary, advice, "
                                                "trace path)")
    report.add_argument("directory", help="the output directory of `perfsdk run` or `demo`")
    compare = commands.add_parser(
        "compare", help="compare two saved runs region by region; exit 1 when the step got "
                        "slower (a regression gate)",
        description="Compares the runs saved in BASE and NEW (the output directories of `perfsdk "
                    "run`, or the demo-before/ and demo-after/ of `perfsdk demo`) region by "
                    "region: the median of each region's per-call host times in each run "
                    "(its most recent 2,048 calls at most), the ratio new / base with a "
                    "bootstrap confidence interval, and a verdict (faster, slower, no "
                    "significant change). Exits 1 when the step (or a region named with "
                    "--region) is slower by more than --fail-if-slower percent with that "
                    "confidence, 2 on bad input, 0 otherwise; a region with fewer than 5 calls "
                    "in a run is never a regression.")
    compare.add_argument("base", metavar="BASE", help="the run to compare against")
    compare.add_argument("new", metavar="NEW", help="the run under test")
    compare.add_argument("--fail-if-slower", type=_percent, default=None, metavar="PCT",
                         help="the slowdown allowed, in percent (10: exit 1 when the step is "
                              "more than 10%% slower with confidence); default: any slowdown "
                              "the interval shows")
    compare.add_argument("--region", action="append", dest="regions", metavar="NAME",
                         help="gate on this region instead of the step (repeat for more); it "
                              "must be in both runs")
    compare.add_argument("--confidence", type=_fraction, default=0.95, metavar="LEVEL",
                         help="the confidence of the intervals (0.95)")
    parser.subcommands.update(demo=demo, run=run, report=report, compare=compare)
    return parser


def _exporters(text: str, accepted: Sequence[str]) -> tuple[str, ...]:
    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    bad = [name for name in names if name not in accepted]
    if bad or not names:
        raise ValueError(f"unknown exporter {', '.join(map(repr, bad)) or '(empty)'}; accepted "
                         f"values are a comma list of {', '.join(accepted)}")
    return names


def _fail(command: str, message: str) -> int:
    print(f"perfsdk {command}: {message}", file=sys.stderr)
    return 2


def _import_torch() -> None:
    """Import torch (the first time, perfsdk's machinery follows it), without the warning it
    gives when NumPy is missing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
        import torch  # noqa: F401


def _demo(args: argparse.Namespace) -> int:
    from perfsdk.config import EXPORTERS, get_config

    if args.latency_ms is not None and not 0 <= args.latency_ms < math.inf:
        return _fail("demo", f"--latency-ms {args.latency_ms}: accepted values are finite "
                             "numbers >= 0 (milliseconds)")
    if args.steps < 2 or args.image_size % 4:
        return _fail("demo", f"arguments: --steps must be >= 2 and --image-size a multiple of 4; "
                             f"got --steps {args.steps} --image-size {args.image_size}")
    exporters: tuple[str, ...] | None = None
    if args.exporter is not None:
        try:
            exporters = _exporters(args.exporter, EXPORTERS)
        except ValueError as exc:
            return _fail("demo", f"--exporter: {exc}")
    _import_torch()
    from perfsdk.cli.demo import run_demo
    from perfsdk.cli.run import check_output_dir, default_exporters

    directory = Path(args.output_dir or get_config().output_dir)
    problem = check_output_dir(directory)
    if problem is not None:
        return _fail("demo", f"--output-dir {directory}: cannot write there ({problem})")
    options = {} if args.latency_ms is None else {"latency_ms": args.latency_ms}
    run_demo(steps=args.steps, batch_size=args.batch_size, image_size=args.image_size,
             output_dir=directory, exporters=exporters or default_exporters(), **options)
    return 0


def _run(args: argparse.Namespace, usage_error: Callable[[str], NoReturn]) -> int:
    if args.script is None:
        usage_error(f"SCRIPT is missing: name the Python script to run, followed by its own "
                    f"arguments, e.g. `{RUN_USAGE_EXAMPLE}`")
    if not Path(args.script).is_file():
        return _fail("run", f"{args.script}: no such file")
    _import_torch()
    from perfsdk.cli.run import run_script

    return run_script(args.script, args.args, output_dir=args.output_dir, out=sys.stdout,
                      err=sys.stderr, syncs=args.syncs)


def _report(args: argparse.Namespace) -> int:
    if not Path(args.directory).is_dir():
        return _fail("report", f"{args.directory}: no such directory (the output directory of "
                               "`perfsdk run` or `perfsdk demo`, see their --output-dir)")
    _import_torch()
    from perfsdk.cli.run import report

    return report(args.directory, out=sys.stdout, err=sys.stderr)


def _compare(args: argparse.Namespace) -> int:
    for directory in (args.base, args.new):
        if not Path(directory).is_dir():
            return _fail("compare", f"{directory}: no such directory (the output directory of "
                                    "`perfsdk run`, or the demo-before/ or demo-after/ that "
                                    "`perfsdk demo` writes there)")
    _import_torch()
    from perfsdk.cli.compare import compare

    return compare(args.base, args.new, fail_if_slower=args.fail_if_slower,
                   regions=args.regions, confidence=args.confidence, out=sys.stdout,
                   err=sys.stderr)


def _status(exc: SystemExit) -> int:
    """The exit status Python would give ``exc`` (a message is printed, status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _quiet_on_closed_stdout() -> int:
    """stdout's reader has gone (``| head``): send what is left to /dev/null, so that Python's
    own flush at exit does not fail again, and exit as a process killed by SIGPIPE would."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout to redirect: nothing more to write anyway
        pass
    return 141  # 128 + SIGPIPE, what the shell reports for `yes | head`


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``perfsdk`` command with ``argv`` (default ``sys.argv[1:]``); returns its exit
    code."""
    parser = build_parser()
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": lambda a: _run(a, parser.subcommands["run"].error), "report": _report,
        "compare": _compare, "demo": _demo}
    try:
        try:
            args = parser.parse_args(argv)
            code = commands[args.command](args)
        except SystemExit as exc:  # --help, --version and usage errors (argparse exits)
            code = _status(exc)
        sys.stdout.flush()  # here, where a closed pipe can still be answered quietly
    except BrokenPipeError:
        return _quiet_on_closed_stdout()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
