"""The ``perfsdk`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from perfsdk._version import __version__

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
        "demo", help="train a small model with instrumented steps and print the summary")
    demo.add_argument("--steps", type=_positive, default=200, help="training steps (200)")
    demo.add_argument("--batch-size", type=_positive, default=64, help="batch size (64)")
    demo.add_argument("--output-dir", default=None,
                      help="where spans-<pid>.jsonl goes (PERFSDK_OUTPUT_DIR, ./perfsdk-output)")
    demo.add_argument("--exporter", default="file",
                      help="comma list of otlp, console, file, none (file)")
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
                          err=sys.stderr)
    if args.command == "report":
        from perfsdk._cli_run import report

        return report(args.directory, out=sys.stdout, err=sys.stderr)
    if args.command == "demo":
        from perfsdk.config import _parse_exporters
        from perfsdk.demo import run_demo

        try:
            exporters = _parse_exporters(args.exporter)
        except ValueError as exc:
            print(f"perfsdk demo: --exporter: {exc}", file=sys.stderr)
            return 2
        run_demo(steps=args.steps, batch_size=args.batch_size, output_dir=args.output_dir,
                 exporters=exporters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
