"""`poplar-bench calibration`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse

from ._options import (
    Given,
    add_cache_dir,
    add_output_dir,
    add_positive_int,
    default_output_dir,
    print_paths,
    refuse_ignored,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibration",
        help="what checking cached profiles at start costs and finds (three demo runs)",
        description="Three runs of the demo on one profile cache: profiled afresh, cached and unchecked, cached and "
        "checked at start (poplar_bench.calibration_cost); reports the check's time, what it found per device type and "
        "each run's prediction error. Writes calibration.json and .md, and each run's demo report under "
        "calibration/. About 2 minutes per run on a 2-core VM.",
    )
    add_positive_int(p, "--rounds", 2, "rounds per run", action=Given)
    add_cache_dir(p, "the profile cache (default: a fresh temporary one)")
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only the check's cost: the demo's ranks profile once, then run the start-up check --repeats times "
        "(calibration_check.json and .md; about a minute)",
    )
    add_positive_int(p, "--repeats", 3, "checks timed with --check-only", action=Given)
    add_output_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import calibration_cost

    out_dir = args.output_dir or default_output_dir()
    if args.check_only and refuse_ignored(
        "calibration",
        args,
        "with --check-only",
        ("--rounds",),
        "--check-only runs no demo; --rounds counts the demo runs' rounds",
    ):
        return 2
    if not args.check_only and refuse_ignored(
        "calibration", args, "without --check-only", ("--repeats",), "--repeats counts the checks --check-only times"
    ):
        return 2
    if args.check_only:
        paths = calibration_cost.run_check_cost(out_dir=out_dir, repeats=args.repeats, cache_dir=args.cache_dir)
    else:
        paths = calibration_cost.run_calibration_check(out_dir=out_dir, rounds=args.rounds, cache_dir=args.cache_dir)
    return print_paths(paths)
