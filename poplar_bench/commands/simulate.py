"""`poplar-bench simulate`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from poplar_ext.search.cli import parse_positive_int as _positive_int
from poplar_ext.search.cli import parse_zero_stage as _stage

from ._options import add_output_dir, default_output_dir, file_stem, print_paths, warn_if_no_figure

_CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout (in an editable install): report paths inside it are written relative to it."""


def register(subparsers: argparse._SubParsersAction) -> None:
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
    add_output_dir(p)
    p.add_argument("--name", type=file_stem, default="simulation", help="report file stem (default: simulation)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poplar_ext.plan.formats import load_cluster, load_profiles

    from .. import gpu_model, simulate
    from ..cluster_files import CLUSTER_DIR
    from ..report import write_report

    warn_if_no_figure("simulate")
    cluster_paths = args.cluster or sorted(CLUSTER_DIR.glob("*.json"), key=_cluster_sort_key)
    samples_per_rank = args.samples_per_rank or simulate.DEFAULT_SAMPLES_PER_RANK
    if args.profiles is not None:
        if args.model:
            raise ValueError("--model: only for modelled profiles, found it together with --profiles")
        profiles = tuple(load_profiles(args.profiles))
        _refuse_mixed_models(profiles, args)
        clusters = [(path, load_cluster(path)) for path in cluster_paths]
        _refuse_unprofiled_types(clusters, profiles, args)
        cases = [
            simulate.SimulationCase(
                name=Path(path).stem,
                cluster=cluster,
                profiles=profiles,
                global_batch_size=args.global_batch_size or samples_per_rank * cluster.world_size,
                zero_stage=args.zero_stage,
                cluster_file=_shown_path(path),
            )
            for path, cluster in clusters
        ]
        checkpointing_cases = None
    else:
        shapes = [gpu_model.model_shape(name) for name in (args.model or [s.name for s in gpu_model.MODEL_SHAPES])]

        def shipped(paths: list[Path], **levers: tuple[bool, ...]) -> list[simulate.SimulationCase]:
            cases = simulate.shipped_cases(
                paths, shapes, samples_per_rank=samples_per_rank, zero_stage=args.zero_stage, **levers
            )
            return [
                dataclasses.replace(
                    c,
                    global_batch_size=args.global_batch_size or c.global_batch_size,
                    cluster_file=_shown_path(c.cluster_file),
                )
                for c in cases
            ]

        cases = shipped(cluster_paths)
        # The small-memory pair, each type modelled without and with activation checkpointing,
        # and without and with its optimizer offloaded (stages 1-2).
        paths = [p for p in cluster_paths if simulate.CHECKPOINTING_CLUSTERS in Path(p).name]
        checkpointing_cases = shipped(paths, checkpointing=(False, True), offload=(False, True)) or None
    for index, case in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {case.name}: {case.cluster.world_size} ranks", file=sys.stderr, flush=True)
    parallelism = None
    if args.profiles is None and args.pipelines:
        from ..simulate_pipelines import parallelism_comparison

        print("ZeRO or pipelines, network slow and fast ...", file=sys.stderr, flush=True)
        parallelism = parallelism_comparison(
            cluster_paths, shapes, samples_per_rank=samples_per_rank, global_batch_size=args.global_batch_size
        )
    report = simulate.simulation_report(cases, checkpointing_cases=checkpointing_cases, parallelism=parallelism)
    for scenario in report["scenarios"]:  # written all the same: the report shows why, row by row
        if all(entry["status"] != "ok" for entry in scenario["policies"]):
            reason = scenario["policies"][0]["message"]
            print(f"poplar-bench simulate: {scenario['name']}: no policy has a plan: {reason}", file=sys.stderr)
    return print_paths(write_report(report, args.output_dir or default_output_dir(), args.name))


def _refuse_mixed_models(profiles: tuple, args: argparse.Namespace) -> None:
    """Profiles of several models in `--profiles`, refused before any search with what simulate can do about it:
    the search's own message names poplar-search's --model, which simulate has only for modelled profiles."""
    from poplar_ext.plan.formats import files_text, mixed_models

    mixed = mixed_models(profiles)
    if mixed is not None:
        raise ValueError(
            f"profiles: expected profiles of one model, found {mixed[0]} models: {mixed[1]} (poplar-search: --model "
            f"NAME picks one){files_text(profiles)}; poplar-bench simulate cannot pick one (its --model is for "
            f"modelled profiles only): give --profiles a folder holding one model's profiles, not {args.profiles}"
        )


def _refuse_unprofiled_types(clusters: list, profiles: tuple, args: argparse.Namespace) -> None:
    """A cluster with a device type that `--profiles` does not cover, named with its file before any search."""
    profiled = sorted({profile.device_type for profile in profiles})
    for path, cluster in clusters:
        missing = [name for name in cluster.type_counts() if name not in profiled]
        if missing:
            given = "" if args.cluster else " (a shipped cluster: without --cluster every shipped one is simulated)"
            raise ValueError(
                f"{_shown_path(path)}{given}: device type {missing[0]!r} has no profile in {args.profiles} "
                f"(its profiles cover {', '.join(profiled)}); give --cluster FILE for a cluster of those types"
            )


def _cluster_sort_key(path: Path) -> tuple[str, int]:
    stem, _, size = path.stem.rpartition("-x")
    return (stem, int(size) if size.isdigit() else 0)


def _shown_path(path: str | Path | None) -> str | None:
    """Paths inside the checkout are written relative to it, so reports do not name a home directory."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    return str(resolved.relative_to(_CHECKOUT)) if resolved.is_relative_to(_CHECKOUT) else str(path)
