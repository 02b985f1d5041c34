"""`poplar-bench drift`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import sys

from ._options import add_cache_dir, add_output_dir, add_positive_int, print_paths, warn_if_no_figure


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..drift import DriftSettings

    defaults = DriftSettings()
    p = subparsers.add_parser(
        "drift",
        help="static poplar against adaptive re-balancing while one emulated device slows down and recovers",
        description="The demo's emulated 3-rank cluster and model: rank 0 (the fastest, with the most samples) runs "
        "--factor times slower from step --drift-at to --recover-at. Four runs in one launch (static and adaptive, "
        "with and without the drift); per-iteration samples/s against the ideal of that moment, re-plans, and the "
        "re-balancing's own cost. Writes drift.json, drift.md and drift.png (poplar_bench.drift). About 6-8 "
        "minutes on a "
        "2-core VM with the demo's profiles cached. With --trainer the runs go through PoplarTrainer "
        "(drift_trainer.*).",
    )
    add_output_dir(p)
    p.add_argument(
        "--trainer",
        action="store_true",
        help="train through PoplarTrainer (the Hugging Face Trainer) on a GPT-2 of the demo model's shape, in its "
        "automatic mode; writes drift_trainer.json, .md and .png (poplar_bench/drift_trainer.py; needs the hf extra)",
    )
    p.add_argument(
        "--factor", type=float, default=defaults.factor, help=f"slowdown of the drift (default {defaults.factor})"
    )
    add_positive_int(p, "--drift-at", defaults.drift_at, "optimizer steps before the device slows down")
    add_positive_int(p, "--recover-at", defaults.recover_at, "optimizer steps before it recovers")
    add_positive_int(p, "--iterations", defaults.drift_iterations, "iterations of each run")
    add_positive_int(
        p, "--check-interval-steps", defaults.check_interval_steps, "poplar.rebalance.check_interval_steps"
    )
    add_cache_dir(p, "the demo's profile cache (default: the demo's; with --trainer its trainer/ folder)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import drift

    try:  # bad input reads as argparse's own errors for the command
        settings = drift.DriftSettings(
            factor=args.factor,
            drift_at=args.drift_at,
            recover_at=args.recover_at,
            drift_iterations=args.iterations,
            check_interval_steps=args.check_interval_steps,
            cache_dir=args.cache_dir,
            timeout_s=1800.0,
            loop="trainer" if args.trainer else "plain",
        )
    except ValueError as exc:
        print(f"poplar-bench drift: error: {exc}", file=sys.stderr)
        return 2
    warn_if_no_figure("drift")
    return print_paths(
        drift.run_drift(settings, out_dir=args.output_dir, name="drift_trainer" if args.trainer else "drift")
    )
