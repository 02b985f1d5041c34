"""`poplar-bench predictions`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._options import (
    Given,
    add_output_dir,
    add_positive_int,
    default_output_dir,
    print_paths,
    refuse_ignored,
    warn_if_no_figure,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predictions",
        help="prediction error of the CPU demo on cases drawn from a seed (stages 0-3, 2-4 ranks)",
        description="Run the demo once per case, each profiled afresh, and summarise, per case and policy, the median "
        "over the measured repetitions of |predicted - measured| / measured iteration time "
        "(poplar_bench/prediction_check.py). The cases are drawn from --seed (ZeRO stage 0-3, 2-4 ranks, slowdowns "
        "whose sum of 1/slowdown spans the emulation's validity range, a global batch), or with --fixed the "
        "fixed cases of issue 15 (stages 0-3 on the default 3 ranks, stage 1 on 2, stage 2 on 4). Writes "
        "prediction_check.json and .md, and each case's demo report under prediction_check/. "
        "About 2-3 minutes per case on a 2-core VM. A case whose ranks fail is named in the summary as failed, "
        "the others still run, and the exit status is 1.",
    )
    p.add_argument("--seed", type=int, default=27, action=Given, help="what the cases are drawn from (default 27)")
    add_positive_int(p, "--cases", 6, "cases to draw", action=Given)
    p.add_argument("--fixed", action="store_true", help="run the fixed cases instead of drawing them")
    p.add_argument(
        "--calibration",
        choices=("always", "off"),
        default="off",
        help="off (default): predictions from the profiles as measured, at whose times emulated compute is "
        "steady; always: each fresh profile is checked against micro-steps timed as training runs them and "
        "rescaled beyond 10%%",
    )
    add_output_dir(p)
    add_positive_int(p, "--rounds", 3, "rounds per case, each one measured iteration per policy: the repetitions")
    p.add_argument("--cache-dir", type=Path, default=None, help="the demo's profile cache (default: the demo's)")
    p.add_argument(
        "--reuse-profiles",
        action="store_true",
        help="take cached profiles where they exist (default: every case profiles afresh, so that the error "
        "measures the cost model, not a profile taken on another day)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import prediction_check

    if args.fixed and refuse_ignored(
        "predictions",
        args,
        "with --fixed",
        ("--seed", "--cases"),
        "--fixed runs the fixed cases; --seed and --cases draw cases",
    ):
        return 2
    warn_if_no_figure("demo")
    try:
        paths = prediction_check.run_prediction_check(
            prediction_check.DEFAULT_CASES if args.fixed else prediction_check.draw_cases(args.seed, args.cases),
            out_dir=args.output_dir or default_output_dir(),
            rounds=args.rounds,
            cache_dir=args.cache_dir,
            force_profile=not args.reuse_profiles,
            seed=None if args.fixed else args.seed,
            calibration=args.calibration,
        )
    except prediction_check.CasesFailed as exc:  # the ranks' tracebacks are above; the summary was written
        print(f"poplar-bench predictions: {exc}", file=sys.stderr)
        return 1
    return print_paths(paths)
