"""`poplar-bench overhead`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse

from ._options import add_output_dir, default_output_dir, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "overhead",
        help="poplar_ext against raw DeepSpeed at the same uniform allocation",
        description="Per-iteration overhead of poplar_ext.initialize against deepspeed.initialize "
        "(poplar_bench/runtime_overhead.py); writes runtime_overhead.json and .md. "
        "Two REAL CPU ranks (gloo, no emulation) train the same toy GPT at the same uniform allocation "
        "(micro-batch 4, 2 accumulation steps, ZeRO 1, fp32), the two engines alternating in 30 blocks of 8 "
        "iterations, the order flipped every block. Reported: the overhead ratio, the median over blocks of the "
        "wrapper's block median iteration over the paired raw block's (goal <= 1.02, reported, not in the exit "
        "status); rank 0's CPU-time ratio; and the wrapper's own work timed around a no-op engine, which load "
        "hardly disturbs. About a minute on a 2-core VM.",
    )
    add_output_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import runtime_overhead

    result = runtime_overhead.run_overhead()
    return print_paths(runtime_overhead.write_report(result, args.output_dir or default_output_dir()))
