"""`poplar-bench demo`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from poplar_ext.plan.formats import ZERO_STAGES

from ._options import (
    add_cache_dir,
    add_output_dir,
    add_positive_int,
    default_output_dir,
    file_stem,
    print_paths,
    warn_if_no_figure,
)

EIGHT_RANKS_NAME = "demo_eight_ranks"
"""``--eight-ranks``' default report stem: bench/results/demo_eight_ranks.md, beside the 3-rank demo.md."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..demo_config import CALIBRATION_MODES, DemoSettings

    defaults = DemoSettings()
    p = subparsers.add_parser(
        "demo",
        help="train on an emulated 3-rank heterogeneous CPU cluster with each policy and compare",
        description=(
            "Three CPU ranks emulate three device types (cpu-fast, 3x slower than a CPU core; cpu-medium, 6x; "
            "cpu-slow, 12x, with the least memory). With the project's toy GPT and real DeepSpeed ZeRO, it "
            "profiles each type (reusing cached profiles), searches a plan per policy (uniform, proportional, "
            "poplar), trains each for a fixed number of iterations in one launch, and reports measured against "
            "predicted iteration time, speedup over uniform and share of the measured ideal, with its goals met or "
            "MISSED (reported, not in the exit status). Writes NAME.json, NAME.md and NAME.png (the figure needs "
            "matplotlib: pip install 'poplar-ext[bench]'), replacing those in the output directory, and prints "
            "their paths. On a 2-core VM: a few minutes the first time (profiling), less when the profiles come "
            "from the cache."
        ),
    )
    add_output_dir(p)
    p.add_argument(
        "--name",
        type=file_stem,
        default=None,
        help=f"report file stem (default: demo); {EIGHT_RANKS_NAME} with --eight-ranks, so that it does not "
        "replace the 3-rank report",
    )
    add_positive_int(p, "--iterations", defaults.iterations, "measured iterations per policy and round")
    add_positive_int(p, "--rounds", defaults.rounds, "rounds; each round runs every policy in turn")
    add_positive_int(p, "--global-batch-size", defaults.global_batch_size, "samples per iteration")
    add_cache_dir(
        p,
        "where the emulated cluster and the cached profiles are kept; a second run reuses them "
        "(default: $XDG_CACHE_HOME/poplar-ext/demo, ~/.cache/poplar-ext/demo when unset)",
    )
    p.add_argument("--force-profile", action="store_true", help="measure again even when cached profiles exist")
    p.add_argument(
        "--eight-ranks",
        action="store_true",
        help="8 ranks on 2 emulated nodes (ranks 0-3 and 4-7) instead of the default 3 on one: 2 cpu8-fast "
        "(6x slower than a core), 3 cpu8-medium (12x), 3 cpu8-slow (24x); together 0.71 of a core, so more "
        "ranks than cores run with their compute mostly waiting",
    )
    add_positive_int(
        p,
        "--repetitions",
        1,
        "run the demo this many times, each profiled afresh, and write NAME-steadiness.json and .md: "
        "every run's poplar share of the ideal and prediction errors, and how far apart they land",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=ZERO_STAGES,
        default=defaults.zero_stage,
        help=f"ZeRO stage of every policy's run (default {defaults.zero_stage})",
    )
    p.add_argument(
        "--slowdowns",
        type=_slowdowns,
        default=None,
        metavar="A,B,...",
        help="one rank per value, each an emulated device type that much slower than a CPU core, e.g. 3,4.5,9 "
        "(default: 3,6,12 as cpu-fast, cpu-medium, cpu-slow); 2 to 4 ranks on a 2-core machine, where the sum of "
        "1/slowdown must stay within the cores",
    )
    p.add_argument(
        "--calibration",
        choices=CALIBRATION_MODES,
        default=defaults.calibration,
        help="check profiles against micro-steps timed at start, as training runs them: cached (profiles "
        "from the cache only), always (fresh ones too), off (default: emulated compute is steady at its "
        "profile's times, so there is nothing to check)",
    )
    p.add_argument(
        "--calibration-action",
        choices=("rescale", "remeasure"),
        default=defaults.calibration_action,
        help="what a profile off by more than 10%% gets (default rescale: its micro-step times scaled)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import demo
    from ..demo_config import DemoSettings, default_devices, devices_from_slowdowns, eight_rank_devices

    try:  # bad input reads as argparse's own errors for the command
        if args.eight_ranks and args.slowdowns is not None:
            raise ValueError("expected --eight-ranks or --slowdowns, found both")
        devices = default_devices() if args.slowdowns is None else devices_from_slowdowns(args.slowdowns)
        settings = DemoSettings(
            devices=eight_rank_devices() if args.eight_ranks else devices,
            nodes=2 if args.eight_ranks else 1,
            zero_stage=args.zero_stage,
            iterations=args.iterations,
            rounds=args.rounds,
            global_batch_size=args.global_batch_size,
            cache_dir=args.cache_dir,
            force_profile=args.force_profile,
            calibration=args.calibration,
            calibration_action=args.calibration_action,
        )
    except ValueError as exc:
        print(f"poplar-bench demo: error: {exc}", file=sys.stderr)
        return 2
    if args.name is None:
        args.name = EIGHT_RANKS_NAME if args.eight_ranks else "demo"
    warn_if_no_figure("demo")
    try:
        if args.repetitions == 1:
            paths = demo.run_demo(settings, out_dir=args.output_dir, name=args.name)
            demo.progress(written_line(paths, args.output_dir))
            return print_paths(paths)
        from ..steadiness import run_steadiness

        return print_paths(
            run_steadiness(settings, out_dir=args.output_dir, repetitions=args.repetitions, name=args.name)
        )
    except RuntimeError as exc:  # a rank failed: its traceback is in the message
        print(f"poplar-bench demo: {exc}", file=sys.stderr)
        return 1


def _slowdowns(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 1, found {text!r}") from None
    if len(values) < 2 or any(not v >= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected at least 2 comma-separated numbers >= 1, found {text!r}")
    return values


def written_line(paths: list[Path], output_dir: Path) -> str:
    """Where the report went; in the checkout's bench/results it replaced the committed report."""
    line = f"report written into {output_dir}: {', '.join(path.name for path in paths)}"
    checkout_results = default_output_dir()  # the current directory outside a checkout
    if checkout_results != Path.cwd() and Path(output_dir).resolve() == checkout_results.resolve():
        line += " (this checkout's bench/results, replacing the committed report; --output-dir DIR writes elsewhere)"
    return line
