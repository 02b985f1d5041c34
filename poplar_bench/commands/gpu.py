"""`poplar-bench gpu`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._options import checkout_root


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..gpu.context import BUDGET_S, STEPS

    p = subparsers.add_parser(
        "gpu",
        help="the CUDA path's evidence in one offline call of at most 7 minutes",
        description="On a machine with a CUDA GPU, in this order, each result written as it is made: provenance "
        "(GPU, driver, CUDA, torch, DeepSpeed); exact training with 3 ranks sharing the GPU at ZeRO 0-3 in fp32 and "
        "bf16 (with the missing-loss-weight mutation); a ~136M-parameter GPT profiled in bf16 at ZeRO 1 and 3 with "
        "the real out-of-memory probe (a line per trial); the policies measured against their predictions with one "
        "emulated slower type; the deepspeed launcher if time is left. Eight files, flat, in --output-dir. A step's "
        "failure is recorded and the others still run; the exit code is 1 when any failed. Run from the repository "
        "root (docs/gpu.md; bench/gpu/run_on_gpu.sh installs the wheels first).",
    )
    p.add_argument("--output-dir", type=Path, required=True, help="folder for the eight result files")
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds the whole run may take; each step gets what is left, at most its own limit (default "
        f"{BUDGET_S:g}: with the wheels' install, within 7 minutes)",
    )
    p.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated steps to run, in their fixed order (default: all of {','.join(STEPS)})",
    )
    p.add_argument("--work-dir", type=Path, default=None, help="rank logs and caches (default: a new temporary folder)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code paths on CPU with CPU stand-ins and tiny sizes, about a minute on a quiet machine "
        "(the test suite runs it); nothing is measured on a GPU",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..gpu.context import STEPS, GpuRunSettings
    from ..gpu.run import run_gpu

    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    checkout = checkout_root()  # its tests/gpu, from any folder; installed as a package, the current folder's
    settings = GpuRunSettings(
        output_dir=args.output_dir,
        dry_run=args.dry_run,
        repo=Path.cwd() if checkout is None else checkout,
        budget_s=args.budget_s,
        steps=tuple(s for s in STEPS if s in chosen) + tuple(s for s in chosen if s not in STEPS),
        work_dir=args.work_dir,
    )
    return run_gpu(settings)
