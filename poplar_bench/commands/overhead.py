"""`poplar-bench overhead`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse

from ._options import add_output_dir, default_output_dir, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "overhead",
        help="poplar_ext against raw DeepSpeed at the same uniform allocation",
        description="Per-iteration overhead of poplar_ext.initialize against deepspeed.initialize "
        "(poplar_bench/runtime_overhead.py); writes runtime_overhead.json and .md.",
    )
    add_output_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import runtime_overhead

    result = runtime_overhead.run_overhead()
    return print_paths(runtime_overhead.write_report(result, args.output_dir or default_output_dir()))
