"""`poplar-bench`: the benchmark harness's command line.

Each command is a module of `poplar_bench.commands` (registers its parser, imports the module doing the work
only when it runs: ``simulate`` never imports torch). Exit codes: 0 success, 1 the benchmark failed, 2 bad
input (which option or file).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from poplar_ext.plan.errors import FormatError
from poplar_ext.search.cli_common import CommandParser, printing

from .commands import (
    calibration,
    checkpointing,
    clean_exit,
    demo,
    drift,
    gpu,
    overhead,
    pipeline,
    predictions,
    search_speed,
    simulate,
)
from .commands._options import check_output_dir, checkout_root, default_output_dir

COMMANDS = (
    demo,
    predictions,
    calibration,
    drift,
    checkpointing,
    pipeline,
    simulate,
    search_speed,
    overhead,
    clean_exit,
    gpu,
)
"""The commands in the order --help lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="poplar-bench",
        description="poplar-ext benchmarks: the emulated-cluster demo, prediction error across stages and rank counts, "
        "cached profiles checked at start, "
        "re-balancing under drift, activation checkpointing per device type, ZeRO against pipelines, "
        "large-cluster simulation, search speed, runtime overhead, clean exit, the CUDA path on a GPU.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    subparsers.metavar = "{" + ",".join(subparsers.choices) + "}"  # also what a missing command's error names
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``poplar-bench`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    defaulted = getattr(args, "output_dir", False) is None
    if defaulted:  # a command's --output-dir left out
        args.output_dir = default_output_dir()
    try:
        if getattr(args, "output_dir", None) is not None:  # refused now, not after the run's minutes of work
            check_output_dir(Path(args.output_dir))
        code = printing(f"poplar-bench {args.command}", args.run, args)  # stdout's failures as every CLI's
    except (ValueError, FormatError) as exc:
        print(f"poplar-bench {args.command}: {exc}", file=sys.stderr)
        return 2
    says_it = args.command == "demo" and getattr(args, "repetitions", 1) == 1  # the demo's own line says it
    root = checkout_root()
    if code == 0 and defaulted and not says_it and root is not None and args.output_dir == root / "bench" / "results":
        print(
            f"poplar-bench {args.command}: the report went into this checkout's bench/results ({args.output_dir}), "
            "replacing the committed one (git diff bench/results shows the change; --output-dir DIR writes elsewhere)",
            file=sys.stderr,
        )
    return code


__all__ = ["COMMANDS", "build_parser", "default_output_dir", "main"]


if __name__ == "__main__":
    sys.exit(main())
