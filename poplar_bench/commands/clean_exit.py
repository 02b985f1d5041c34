"""`poplar-bench clean-exit`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import sys

from ._options import add_output_dir, add_positive_int, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "clean-exit",
        help="every rank's exit code over many launches of a script that ends with a plain return",
        description="Launch a script that ends with a plain return many times under a busy CPU and count every "
        "rank's exit code: torch and gloo alone (group left up, or destroyed by the script), and "
        "poplar_ext.initialize without and with poplar-ext's exit handler (poplar_bench/clean_exit.py). "
        "Writes clean_exit.json and .md.",
    )
    add_positive_int(p, "--launches", 30, "launches per case")
    add_positive_int(p, "--ranks", 3, "ranks per launch")
    p.add_argument("--busy-processes", type=int, default=2, help="spinning processes beside the ranks (default 2)")
    from ..clean_exit import CASES  # no torch: cheap at --help

    p.add_argument(
        "--case",
        action="append",
        dest="cases",
        help=f"a case to run (repeatable; default: all): {', '.join(CASES)}",
    )
    add_output_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import clean_exit

    if args.busy_processes < 0:
        raise ValueError(f"--busy-processes: expected 0 or more, found {args.busy_processes}")
    report = clean_exit.run_clean_exit(
        launches=args.launches,
        world_size=args.ranks,
        busy_processes=args.busy_processes,
        cases=tuple(args.cases or clean_exit.CASES),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return print_paths(clean_exit.write_report(report, args.output_dir))
