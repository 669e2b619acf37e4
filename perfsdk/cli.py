"""The ``perfsdk`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from perfsdk._version import __version__
from perfsdk.config import get_config

__all__ = ["main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perfsdk", description="PyTorch performance instrumentation: NVTX, timings, spans.")
    parser.add_argument("--version", action="version", version=f"perfsdk {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="the course lab's training loop before and after its fixes, measured",
        description="Trains the lab's SimpleNet on synthetic images twice: first as the lab's "
                    "unoptimized script does (small batch, num_workers=0, a sync per step), "
                    "showing perfsdk's summary and the advisor's findings, then with the fixes; "
                    "prints the before/after table and writes the Perfetto trace, the spans "
                    "and both runs (for `perfsdk report`) to the output directory. With "
                    "OTEL_EXPORTER_OTLP_ENDPOINT set, spans also go to that collector.")
    demo.add_argument("--steps", type=_positive, default=60,
                      help="steps of the lab's loop (60; at least 2)")
    demo.add_argument("--batch-size", type=_positive, default=8,
                      help="the lab's batch size (8); the fixed run uses 4 times that")
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
        description="Runs SCRIPT as `python SCRIPT ARGS` would, with every DataLoader batch, the "
                    "model's forward, loss.backward() and optimizer.step() recorded as regions; "
                    "prints the summary and the advisor's findings and writes the Perfetto "
                    "trace, the spans and run.json to the output directory. Exits with the "
                    "script's exit code.")
    run.add_argument("--output-dir", default=None,
                     help="where the trace, spans and run.json go (PERFSDK_OUTPUT_DIR, "
                          "./perfsdk-output)")
    run.add_argument("--syncs", action="store_true",
                     help="count host-device syncs and name their lines (no_sync_guard('count'); "
                          "about 6 us more per tensor operation)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    report = commands.add_parser("report", help="render a saved run again (summary, advice, "
                                                "trace path)")
    report.add_argument("directory", help="the output directory of `perfsdk run` or `demo`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        from perfsdk._cli_run import run_script

        return run_script(args.script, args.args, output_dir=args.output_dir, out=sys.stdout,
                          err=sys.stderr, syncs=args.syncs)
    if args.command == "report":
        from perfsdk._cli_run import report

        return report(args.directory, out=sys.stdout, err=sys.stderr)
    if args.command == "demo":
        from perfsdk._cli_run import check_output_dir, default_exporters
        from perfsdk.config import _parse_exporters
        from perfsdk.demo import run_demo

        try:
            exporters = _parse_exporters(args.exporter or ",".join(default_exporters()))
            run = dict(steps=args.steps, batch_size=args.batch_size, image_size=args.image_size)
            if args.steps < 2 or args.image_size % 4:
                raise ValueError("--steps must be >= 2 and --image-size a multiple of 4; got "
                                 f"--steps {args.steps} --image-size {args.image_size}")
        except ValueError as exc:
            flag = "--exporter" if "exporter" in str(exc) else "arguments"
            print(f"perfsdk demo: {flag}: {exc}", file=sys.stderr)
            return 2
        directory = Path(args.output_dir or get_config().output_dir)
        problem = check_output_dir(directory)
        if problem is not None:
            print(f"perfsdk demo: --output-dir {directory}: cannot write there ({problem})",
                  file=sys.stderr)
            return 2
        run_demo(**run, output_dir=directory, exporters=exporters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
