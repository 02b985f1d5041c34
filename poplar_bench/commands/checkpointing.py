"""`poplar-bench checkpointing`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse

from ._options import add_cache_dir, add_output_dir, add_positive_int, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "checkpointing",
        help="activation checkpointing chosen per device type: measured against the best plan without it",
        description="The demo's emulated 3-rank cluster at ZeRO stage 2 with a GPT of larger activations, profiled "
        "without and with activation checkpointing, in two cases: 'tight' (the fastest type has the least memory) and "
        "'roomy'. In each, poplar with the choice and poplar without checkpointing train in alternating rounds; "
        "writes checkpointing.json and checkpointing.md (poplar_bench.checkpointing). About 10-15 minutes on "
        "a 2-core VM "
        "the first time (profiling both ways), less with the profiles cached.",
    )
    add_output_dir(p)
    add_positive_int(p, "--rounds", 3, "alternating training rounds per plan")
    add_cache_dir(p, "profile cache root, one folder per case (default: beside the demo's cache)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import checkpointing

    return print_paths(
        checkpointing.run_checkpointing(out_dir=args.output_dir, cache_dir=args.cache_dir, rounds=args.rounds)
    )
