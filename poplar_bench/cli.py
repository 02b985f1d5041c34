"""`poplar-bench`: the benchmark harness's command line.

Thin: each subcommand parses its options and calls a pure function of its module,
importing it only when that subcommand runs (``simulate`` never imports torch).

Exit codes: 0 success, 1 the benchmark failed, 2 bad input (which option or file).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import ZERO_STAGES
from poplar_ext.search.cli import parse_positive_int as _positive_int
from poplar_ext.search.cli import parse_zero_stage as _stage

_BENCH_DIR = Path(__file__).resolve().parent


def default_output_dir() -> Path:
    """``bench/results`` of the checkout when running from one (an editable install),
    otherwise the current directory."""
    results = _BENCH_DIR.parent / "bench" / "results"
    if (_BENCH_DIR.parent / "pyproject.toml").is_file() and results.is_dir():
        return results
    return Path.cwd()


_OUTPUT_HELP = (
    "directory for the report files (default: bench/results of the poplar-ext checkout when "
    "poplar-ext is installed from a checkout, as with `pip install -e .`, from whatever directory "
    "you run it; otherwise the current directory)"
)


# ----------------------------------------------------------------------------------
# simulate
# ----------------------------------------------------------------------------------
def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="compare the policies by prediction on clusters of any size",
        description=(
            "Compare uniform, proportional and poplar by the search's prediction. With no options: "
            "every shipped cluster in poplar_bench/clusters/ (pairs of GPU types, 8 to 4096 GPUs) with every "
            "model preset, using profiles MODELLED from datasheet specs (poplar_bench/gpu_model.py), plus, on the "
            "V100-16GB + T4-16GB clusters, poplar with activation checkpointing, and apart with optimizer offload, "
            "chosen per device type against poplar without either, and the best ZeRO plan against the best pipeline "
            "plan with the network slow (10 Gb/s per GPU) and fast (100 Gb/s). With --profiles: your profiles "
            "(measured or not) for the given clusters."
        ),
    )
    p.add_argument(
        "--cluster", action="append", type=Path, help="cluster description JSON (repeatable; default: the shipped ones)"
    )
    p.add_argument("--profiles", type=Path, help="directory of profile JSON files (default: modelled profiles)")
    p.add_argument(
        "--model", action="append", help="model preset for modelled profiles (repeatable; default: all presets)"
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument(
        "--samples-per-rank", type=_positive_int, default=None, help="global batch = this * world size (default 16)"
    )
    batch.add_argument(
        "--global-batch-size", type=_positive_int, default=None, help="the same global batch for every cluster"
    )
    p.add_argument("--zero-stage", type=_stage, default="auto", help="auto (default) or 0-3")
    p.add_argument(
        "--no-pipelines",
        dest="pipelines",
        action="store_false",
        help="leave out the comparison of the best ZeRO plan with the best pipeline plan (modelled profiles only; "
        "the network slow and fast)",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument("--name", default="simulation", help="report file stem (default: simulation)")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from poplar_ext.plan.formats import load_cluster, load_profiles

    from . import gpu_model, simulate
    from .cluster_files import CLUSTER_DIR
    from .report import write_report

    _warn_if_no_figure("simulate")
    cluster_paths = args.cluster or sorted(CLUSTER_DIR.glob("*.json"), key=_cluster_sort_key)
    samples_per_rank = args.samples_per_rank or simulate.DEFAULT_SAMPLES_PER_RANK
    if args.profiles is not None:
        if args.model:
            raise ValueError("--model: only for modelled profiles, found it together with --profiles")
        profiles = tuple(load_profiles(args.profiles))
        cases = []
        for path in cluster_paths:
            cluster = load_cluster(path)
            cases.append(
                simulate.SimulationCase(
                    name=Path(path).stem,
                    cluster=cluster,
                    profiles=profiles,
                    global_batch_size=args.global_batch_size or samples_per_rank * cluster.world_size,
                    zero_stage=args.zero_stage,
                    cluster_file=_shown_path(path),
                )
            )
    else:
        shapes = [gpu_model.model_shape(name) for name in (args.model or [s.name for s in gpu_model.MODEL_SHAPES])]
        cases = simulate.shipped_cases(
            cluster_paths, shapes, samples_per_rank=samples_per_rank, zero_stage=args.zero_stage
        )
        cases = [
            dataclasses.replace(
                c,
                global_batch_size=args.global_batch_size or c.global_batch_size,
                cluster_file=_shown_path(c.cluster_file),
            )
            for c in cases
        ]
    checkpointing_cases = None
    if args.profiles is None:
        # The small-memory pair, each type modelled without and with activation checkpointing,
        # and without and with its optimizer offloaded (stages 1-2).
        paths = [p for p in cluster_paths if simulate.CHECKPOINTING_CLUSTERS in Path(p).name]
        checkpointing_cases = simulate.shipped_cases(
            paths,
            shapes,
            samples_per_rank=samples_per_rank,
            zero_stage=args.zero_stage,
            checkpointing=(False, True),
            offload=(False, True),
        )
        checkpointing_cases = [
            dataclasses.replace(
                c,
                global_batch_size=args.global_batch_size or c.global_batch_size,
                cluster_file=_shown_path(c.cluster_file),
            )
            for c in checkpointing_cases
        ] or None
    for index, case in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {case.name}: {case.cluster.world_size} ranks", file=sys.stderr, flush=True)
    parallelism = None
    if args.profiles is None and args.pipelines:
        from .simulate_pipelines import parallelism_comparison

        print("ZeRO or pipelines, network slow and fast ...", file=sys.stderr, flush=True)
        parallelism = parallelism_comparison(cluster_paths, shapes, samples_per_rank=samples_per_rank)
    report = simulate.simulation_report(cases, checkpointing_cases=checkpointing_cases, parallelism=parallelism)
    out_dir = args.output_dir or default_output_dir()
    for path in write_report(report, out_dir, args.name):
        print(path)
    return 0


def _cluster_sort_key(path: Path) -> tuple[str, int]:
    stem, _, size = path.stem.rpartition("-x")
    return (stem, int(size) if size.isdigit() else 0)


def _shown_path(path: str | Path | None) -> str | None:
    """Paths inside the checkout are written relative to it, so reports do not name a home directory."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(_BENCH_DIR.parent))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------
def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    from .demo_config import CALIBRATION_MODES, DemoSettings

    defaults = DemoSettings()
    p = subparsers.add_parser(
        "demo",
        help="train on an emulated 3-rank heterogeneous CPU cluster with each policy and compare",
        description=(
            "Three CPU ranks emulate three device types (cpu-fast; cpu-medium, 2x slower; cpu-slow, 4x slower "
            "with the least memory). With the project's toy GPT and real DeepSpeed ZeRO, it profiles each type "
            "(reusing cached profiles), searches a plan per policy (uniform, proportional, poplar), trains "
            "each for a fixed number of iterations in one launch, and reports measured against predicted "
            "iteration time, speedup over uniform and share of the measured ideal. Writes NAME.json, "
            "NAME.md and NAME.png (the figure needs matplotlib: pip install 'poplar-ext[bench]'). On a 2-core "
            "VM: about 3 minutes the first time (profiling), 1.5-2.5 minutes when the profiles come from the cache."
        ),
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument("--name", default="demo", help="report file stem (default: demo)")
    p.add_argument(
        "--iterations",
        type=_positive_int,
        default=defaults.iterations,
        help=f"measured iterations per policy and round (default {defaults.iterations})",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=defaults.rounds,
        help=f"rounds; each round runs every policy in turn (default {defaults.rounds})",
    )
    p.add_argument(
        "--global-batch-size",
        type=_positive_int,
        default=defaults.global_batch_size,
        help=f"samples per iteration (default {defaults.global_batch_size})",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the emulated cluster and the cached profiles are kept; a second run reuses them "
        "(default: $XDG_CACHE_HOME/poplar-ext/demo, ~/.cache/poplar-ext/demo when unset)",
    )
    p.add_argument("--force-profile", action="store_true", help="measure again even when cached profiles exist")
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
        help="check profiles against micro-steps timed at start, as training runs them: cached (default: "
        "profiles from the cache only), always (fresh ones too), off",
    )
    p.add_argument(
        "--calibration-action",
        choices=("rescale", "remeasure"),
        default=defaults.calibration_action,
        help="what a profile off by more than 10%% gets (default rescale: its micro-step times scaled)",
    )
    p.set_defaults(run=_run_demo)


def _slowdowns(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 1, found {text!r}") from None
    if len(values) < 2 or any(not v >= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected at least 2 comma-separated numbers >= 1, found {text!r}")
    return values


def _warn_if_no_figure(command: str) -> None:
    """Say at the start, not after minutes of work, that the figure will be missing."""
    from .report import FIGURE_NEEDS, figure_available

    if not figure_available():
        print(
            f"poplar-bench {command}: the PNG figure needs {FIGURE_NEEDS}, which is not installed; "
            "the JSON and markdown reports are written without it",
            file=sys.stderr,
            flush=True,
        )


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo
    from .demo_config import DemoSettings, default_devices, devices_from_slowdowns

    try:
        settings = DemoSettings(
            devices=default_devices() if args.slowdowns is None else devices_from_slowdowns(args.slowdowns),
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
    _warn_if_no_figure("demo")
    try:
        paths = demo.run_demo(settings, out_dir=args.output_dir or default_output_dir(), name=args.name)
    except RuntimeError as exc:  # a rank failed: its traceback is in the message
        print(f"poplar-bench demo: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


# ----------------------------------------------------------------------------------
# search-speed and overhead: modules owned by the search and runtime engineers
# ----------------------------------------------------------------------------------
def add_predictions_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predictions",
        help="prediction error of the CPU demo on cases drawn from a seed (stages 0-3, 2-4 ranks)",
        description="Run the demo once per case, each profiled afresh, and summarise, per case and policy, the median "
        "over the measured repetitions of |predicted - measured| / measured iteration time "
        "(poplar_bench/prediction_check.py). The cases are drawn from --seed (ZeRO stage 0-3, 2-4 ranks, slowdowns "
        "whose sum of 1/slowdown spans the emulation's validity range, a global batch), or with --fixed the "
        "fixed cases of issue 15 (stages 0-3 on the default 3 ranks, stage 1 on 2, stage 2 on 4). Writes "
        "prediction_check.json and .md, and each case's demo report under prediction_check/. "
        "About 2-3 minutes per case on a 2-core VM.",
    )
    p.add_argument("--seed", type=int, default=27, help="what the cases are drawn from (default 27)")
    p.add_argument("--cases", type=_positive_int, default=6, help="cases to draw (default 6)")
    p.add_argument("--fixed", action="store_true", help="run the fixed cases instead of drawing them")
    p.add_argument(
        "--calibration",
        choices=("always", "off"),
        default="always",
        help="always (default): each fresh profile is checked against micro-steps timed as training runs them "
        "and rescaled beyond 10%%; off: predictions from the profiles as measured",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=3,
        help="rounds per case, each one measured iteration per policy: the repetitions (default 3)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="the demo's profile cache (default: the demo's)")
    p.add_argument(
        "--reuse-profiles",
        action="store_true",
        help="take cached profiles where they exist (default: every case profiles afresh, so that the error "
        "measures the cost model, not a profile taken on another day)",
    )
    p.set_defaults(run=_run_predictions)


def _run_predictions(args: argparse.Namespace) -> int:
    from . import prediction_check

    _warn_if_no_figure("demo")
    fixed = args.fixed
    paths = prediction_check.run_prediction_check(
        prediction_check.DEFAULT_CASES if fixed else prediction_check.draw_cases(args.seed, args.cases),
        out_dir=args.output_dir or default_output_dir(),
        rounds=args.rounds,
        cache_dir=args.cache_dir,
        force_profile=not args.reuse_profiles,
        seed=None if fixed else args.seed,
        calibration=args.calibration,
    )
    for path in paths:
        print(path)
    return 0


def add_drift_parser(subparsers: argparse._SubParsersAction) -> None:
    from .drift import DriftSettings

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
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument(
        "--trainer",
        action="store_true",
        help="train through PoplarTrainer (the Hugging Face Trainer) on a GPT-2 of the demo model's shape, in its "
        "automatic mode; writes drift_trainer.json, .md and .png (poplar_bench/drift_trainer.py; needs the hf extra)",
    )
    p.add_argument(
        "--factor", type=float, default=defaults.factor, help=f"slowdown of the drift (default {defaults.factor})"
    )
    p.add_argument(
        "--drift-at",
        type=_positive_int,
        default=defaults.drift_at,
        help=f"optimizer steps before the device slows down (default {defaults.drift_at})",
    )
    p.add_argument(
        "--recover-at",
        type=_positive_int,
        default=defaults.recover_at,
        help=f"optimizer steps before it recovers (default {defaults.recover_at})",
    )
    p.add_argument(
        "--iterations",
        type=_positive_int,
        default=defaults.drift_iterations,
        help=f"iterations of each run (default {defaults.drift_iterations})",
    )
    p.add_argument(
        "--check-interval-steps",
        type=_positive_int,
        default=defaults.check_interval_steps,
        help=f"poplar.rebalance.check_interval_steps (default {defaults.check_interval_steps})",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the demo's profile cache (default: the demo's; with --trainer its trainer/ folder)",
    )
    p.set_defaults(run=_run_drift)


def _run_drift(args: argparse.Namespace) -> int:
    from . import drift

    try:
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
    name = "drift_trainer" if args.trainer else "drift"
    _warn_if_no_figure("drift")
    for path in drift.run_drift(settings, out_dir=args.output_dir or default_output_dir(), name=name):
        print(path)
    return 0


def add_checkpointing_parser(subparsers: argparse._SubParsersAction) -> None:
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
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument("--rounds", type=_positive_int, default=3, help="alternating training rounds per plan (default 3)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="profile cache root, one folder per case (default: beside the demo's cache)",
    )
    p.set_defaults(run=_run_checkpointing)


def _run_checkpointing(args: argparse.Namespace) -> int:
    from . import checkpointing

    for path in checkpointing.run_checkpointing(
        out_dir=args.output_dir or default_output_dir(), cache_dir=args.cache_dir, rounds=args.rounds
    ):
        print(path)
    return 0


def add_pipeline_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pipeline",
        help="the best ZeRO plan against the best pipeline plan on 2 emulated CPU nodes, slow and fast link",
        description="4 forked CPU ranks as 2 emulated nodes of 2 (one of them an emulated type 2x slower), the toy "
        "pipeline MLP: profiled (whole model, network with the link in place), then a ZeRO job and a pipeline job "
        "whose plans are searched at start, each trained and timed against its prediction; with the link between "
        "the nodes capped (poplar_bench/link_emulation.py) and uncapped. Writes pipeline.json, pipeline.md and "
        "pipeline.png (poplar_bench/pipeline_compare.py). Several minutes on a 2-core VM.",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.add_argument("--work-dir", type=Path, default=None, help="profiles and rank logs (default: a temporary folder)")
    p.set_defaults(run=_run_pipeline)


def _run_pipeline(args: argparse.Namespace) -> int:
    from . import pipeline_compare

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    for path in pipeline_compare.run_pipeline_bench(
        out_dir=args.output_dir or default_output_dir(), work_dir=args.work_dir, progress=progress
    ):
        print(path)
    return 0


def add_search_speed_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "search-speed",
        help="search time against cluster size and number of device types",
        description="Time search_plan for 8 to 4096 ranks and 1 to 6 device types (median of repeats); "
        "writes search_speed.json and search_speed.md (poplar_bench/search_speed.py).",
    )
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed repeats per cell (default 5)")
    p.add_argument(
        "--lever-problems",
        type=_positive_int,
        default=None,
        help="seeded problems (seeds 0..N-1) of the memory-lever cells, 8 types x 4 variants x 4096 ranks "
        "(default: seed 0 only)",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.set_defaults(run=_run_search_speed)


def _run_search_speed(args: argparse.Namespace) -> int:
    from . import search_speed

    more = {} if args.lever_problems is None else {"lever_seeds": tuple(range(args.lever_problems))}
    result = search_speed.run_search_speed(repeats=args.repeats, **more)
    for path in search_speed.write_report(result, args.output_dir or default_output_dir()) or []:
        print(path)
    return 0


def add_overhead_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "overhead",
        help="poplar_ext against raw DeepSpeed at the same uniform allocation",
        description="Per-iteration overhead of poplar_ext.initialize against deepspeed.initialize "
        "(poplar_bench/runtime_overhead.py); writes runtime_overhead.json and .md.",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.set_defaults(run=_run_overhead)


def _run_overhead(args: argparse.Namespace) -> int:
    from . import runtime_overhead

    result = runtime_overhead.run_overhead()
    for path in runtime_overhead.write_report(result, args.output_dir or default_output_dir()) or []:
        print(path)
    return 0


def add_clean_exit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "clean-exit",
        help="every rank's exit code over many launches of a script that ends with a plain return",
        description="Launch a script that ends with a plain return many times under a busy CPU and count every "
        "rank's exit code: torch and gloo alone (group left up, or destroyed by the script), and "
        "poplar_ext.initialize without and with poplar-ext's exit handler (poplar_bench/clean_exit.py). "
        "Writes clean_exit.json and .md.",
    )
    p.add_argument("--launches", type=_positive_int, default=30, help="launches per case (default 30)")
    p.add_argument("--ranks", type=_positive_int, default=3, help="ranks per launch (default 3)")
    p.add_argument("--busy-processes", type=int, default=2, help="spinning processes beside the ranks (default 2)")
    p.add_argument("--case", action="append", dest="cases", help="a case to run (repeatable; default: all)")
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.set_defaults(run=_run_clean_exit)


def _run_clean_exit(args: argparse.Namespace) -> int:
    from . import clean_exit

    if args.busy_processes < 0:
        raise ValueError(f"--busy-processes: expected 0 or more, found {args.busy_processes}")
    report = clean_exit.run_clean_exit(
        launches=args.launches,
        world_size=args.ranks,
        busy_processes=args.busy_processes,
        cases=tuple(args.cases or clean_exit.CASES),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    for path in clean_exit.write_report(report, args.output_dir or default_output_dir()):
        print(path)
    return 0


def add_gpu_parser(subparsers: argparse._SubParsersAction) -> None:
    from .gpu.run import BUDGET_S, STEPS

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
    p.set_defaults(run=_run_gpu)


def _run_gpu(args: argparse.Namespace) -> int:
    from .gpu.run import STEPS, GpuRunSettings, run_gpu

    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    settings = GpuRunSettings(
        output_dir=args.output_dir,
        dry_run=args.dry_run,
        repo=Path.cwd(),
        budget_s=args.budget_s,
        steps=tuple(s for s in STEPS if s in chosen) + tuple(s for s in chosen if s not in STEPS),
        work_dir=args.work_dir,
    )
    return run_gpu(settings)


def add_calibration_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibration",
        help="what checking cached profiles at start costs and finds (three demo runs)",
        description="Three runs of the demo on one profile cache: profiled afresh, cached and unchecked, cached and "
        "checked at start (poplar_bench.calibration_cost); reports the check's time, what it found per device type and "
        "each run's prediction error. Writes calibration.json and .md, and each run's demo report under "
        "calibration/. About 2 minutes per run on a 2-core VM.",
    )
    p.add_argument("--rounds", type=_positive_int, default=2, help="rounds per run (default 2)")
    p.add_argument("--cache-dir", type=Path, default=None, help="the profile cache (default: a fresh temporary one)")
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only the check's cost: the demo's ranks profile once, then run the start-up check --repeats times "
        "(calibration_check.json and .md; about a minute)",
    )
    p.add_argument("--repeats", type=_positive_int, default=3, help="checks timed with --check-only (default 3)")
    p.add_argument("--output-dir", type=Path, default=None, help=_OUTPUT_HELP)
    p.set_defaults(run=_run_calibration)


def _run_calibration(args: argparse.Namespace) -> int:
    from . import calibration_cost

    out_dir = args.output_dir or default_output_dir()
    if args.check_only:
        paths = calibration_cost.run_check_cost(out_dir=out_dir, repeats=args.repeats, cache_dir=args.cache_dir)
    else:
        paths = calibration_cost.run_calibration_check(out_dir=out_dir, rounds=args.rounds, cache_dir=args.cache_dir)
    for path in paths:
        print(path)
    return 0


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_demo_parser,
    add_predictions_parser,
    add_calibration_parser,
    add_drift_parser,
    add_checkpointing_parser,
    add_pipeline_parser,
    add_simulate_parser,
    add_search_speed_parser,
    add_overhead_parser,
    add_clean_exit_parser,
    add_gpu_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poplar-bench",
        description="poplar-ext benchmarks: the emulated-cluster demo, prediction error across stages and rank counts, "
        "cached profiles checked at start, "
        "re-balancing under drift, activation checkpointing per device type, ZeRO against pipelines, "
        "large-cluster simulation, search speed, runtime overhead, clean exit, the CUDA path on a GPU.",
    )
    subparsers = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{demo,predictions,calibration,drift,checkpointing,pipeline,simulate,search-speed,overhead,clean-exit,gpu}",
    )
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``poplar-bench`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FormatError) as exc:
        print(f"poplar-bench {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
