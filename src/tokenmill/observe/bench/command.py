"""``tokenmill bench`` from the command line: its arguments, and running it from them."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tokenmill.observe.bench.contenders import CONTENDERS
from tokenmill.observe.bench.report import format_report, write_plot
from tokenmill.observe.bench.runner import run, select
from tokenmill.base.io import atomic_write_json

_OPTIONS = (("--seq-len", int, 2048, "tokens per sample"),
            ("--batch-size", int, 8, "samples per batch"),
            ("--steps", int, 200, "simulated training steps"),
            ("--step-ms", float, 20.0, "CPU milliseconds of one simulated step"),
            ("--seconds", float, 3.0, "seconds of drawing batches with no model"),
            ("--seed", int, 0, "sampling seed"))


def add_arguments(parser) -> None:
    """The arguments of ``tokenmill bench`` on an argparse parser."""
    parser.add_argument("store", help="a token store directory")
    for flag, kind, default, what in _OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    parser.add_argument("--json", metavar="FILE", help="write the whole report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated contenders to run, of: {', '.join(CONTENDERS)}")
    parser.add_argument("--skip", metavar="NAMES", help="comma-separated contenders to leave out")


def run_from_args(args) -> int:
    """Run ``tokenmill bench`` from parsed arguments: 0, or 1 if a contender failed."""
    names = select(args.only, args.skip)
    report = run(args.store, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                 step_ms=args.step_ms, seconds=args.seconds, seed=args.seed, names=names,
                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    report["command"] = _command()
    print(format_report(report), flush=True)
    if args.json:
        atomic_write_json(args.json, report)
    if args.plot:
        write_plot(report, args.plot)
    return 1 if any("error" in r for r in report["results"]) else 0


def _command() -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "tokenmill"
    prog = "python -m tokenmill" if prog == "__main__.py" else prog
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])
