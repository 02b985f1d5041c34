"""`poplar-bench search-speed`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse

from poplar_ext.search.cli import parse_positive_int as _positive_int

from ._options import add_output_dir, default_output_dir, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "search-speed",
        help="search time against cluster size and number of device types",
        description="Time search_plan for 8 to 4096 ranks and 1 to 6 device types (median of repeats); "
        "writes search_speed.json and search_speed.md (poplar_bench/search_speed.py). "
        "Each cell: one warm-up search, then the median of --repeats wall times, with a fixed global batch "
        "(32 per rank + 7) and an automatic one. Also each ZeRO stage at global batches 2^22, 10^9 and 2^31 "
        "(4096 synthetic ranks x 6 types, and the shipped example), with the peak of Python allocations, and "
        "the memory levers (8 types x 4 variants x 4096 ranks, stages 0-2). No profile is a measurement: "
        "seeded synthetic profiles and the shipped example's modelled ones. Goals (reported, not in the exit "
        "status): 4096 ranks x 6 types under 1 s, 64 ranks under 50 ms, every large-batch and lever cell under "
        "1 s. About a minute with --repeats 1 on a 2-core VM.",
    )
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed repeats per cell (default 5)")
    p.add_argument(
        "--lever-problems",
        type=_positive_int,
        default=None,
        help="seeded problems (seeds 0..N-1) of the memory-lever cells, 8 types x 4 variants x 4096 ranks "
        "(default: seed 0 only)",
    )
    add_output_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import search_speed

    more = {} if args.lever_problems is None else {"lever_seeds": tuple(range(args.lever_problems))}
    result = search_speed.run_search_speed(repeats=args.repeats, **more)
    return print_paths(search_speed.write_report(result, args.output_dir or default_output_dir()))
