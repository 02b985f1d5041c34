"""``poplar-bench search-speed``: how long `search_plan` takes against cluster size, device types and global batch
(docs/bench.md: the cells, large batches, memory levers, goals)."""

from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from poplar_bench.synthetic import random_lever_profiles, random_profiles, simple_cluster
from poplar_ext.plan.formats import ZERO_STAGES, load_cluster, load_profiles
from poplar_ext.search import search_plan

from .report import code_lines, machine_description, progress, utc_now, write_json_and_markdown

RANK_COUNTS = (8, 16, 64, 256, 1024, 4096)
TYPE_COUNTS = (1, 2, 3, 4, 5, 6)
GOALS = (
    {"goal": "4096 ranks x 6 device types", "ranks": (4096,), "types": (6,), "target_s": 1.0},
    {"goal": "64 ranks (1 to 6 device types)", "ranks": (64,), "types": TYPE_COUNTS, "target_s": 0.05},
)
LARGE_BATCHES = (2**22, 10**9, 2**31)
"""Global batches of the large-batch cells: 2^31 is the search's limit (poplar_ext.plan.formats)."""
LARGE_BATCH_GOAL = {
    "goal": "any global batch up to 2^31, every stage, 4096 ranks x 6 types and the shipped example",
    "target_s": 1.0,
}
LEVER_STAGES = (0, 1, 2)  # the stages at which the policy chooses memory levers per device type (stage 3: all or none)
LEVER_GOAL = {
    "goal": "memory levers: {types} device types x 4 lever variants x {ranks} ranks, stages 0-2, fixed and "
    "automatic batch",
    "target_s": 1.0,
}
SYNTHETIC_LARGE = "synthetic 4096 ranks x 6 types"
SHIPPED_EXAMPLE = "shipped example"
EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "poplar_ext" / "search" / "example_profiles"
"""The shipped example profiles and cluster (a checkout's; absent from an installed package)."""


def _problem(num_ranks: int, num_types: int, seed: int, *, levers: bool = False):
    """Seeded profiles (with ``levers``, all four memory-lever variants per type at stages 0-2) and a cluster of
    `num_ranks` split evenly over `num_types` types."""
    rng = np.random.default_rng(seed)
    names = [f"gpu{i}" for i in range(num_types)]
    profiles = random_lever_profiles(rng, names, zero_stages=LEVER_STAGES) if levers else random_profiles(rng, names)
    counts = {name: num_ranks // num_types + (1 if i < num_ranks % num_types else 0) for i, name in enumerate(names)}
    return profiles, simple_cluster({n: c for n, c in counts.items() if c > 0})


def _timed_search(repeats: int, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """One warm-up `search_plan` (which must find a plan), then the wall time of `repeats` more: their median
    and each."""
    result = search_plan(*args, **kwargs)
    assert result.ok, result.message
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        search_plan(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return result, {"median_s": statistics.median(times), "repetitions_s": times}


def time_search(
    num_ranks: int, num_types: int, *, global_batch_size: int | None, repeats: int, seed: int = 0
) -> dict[str, Any]:
    """Median wall time of `search_plan` on one synthetic problem (plus every repetition)."""
    result, timed = _timed_search(repeats, *_problem(num_ranks, num_types, seed), global_batch_size=global_batch_size)
    return {**timed, "global_batch_size": result.plan.global_batch_size, "zero_stage": result.zero_stage}


def time_large_batch(profiles, cluster, *, global_batch_size: int, zero_stage: int, repeats: int) -> dict[str, Any]:
    """Median wall time of `search_plan` at one stage and a fixed global batch, and its peak allocations."""
    result, timed = _timed_search(
        repeats, profiles, cluster, global_batch_size=global_batch_size, zero_stage=zero_stage
    )
    # Apart from the timed runs: tracing every allocation slows them down.
    tracemalloc.start()
    try:
        search_plan(profiles, cluster, global_batch_size=global_batch_size, zero_stage=zero_stage)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {
        **timed,
        "peak_memory_bytes": peak_bytes,
        "plan_global_batch_size": result.plan.global_batch_size,
        "predicted_iteration_time_s": result.plan.predicted.iteration_time_s,
    }


def time_lever_search(
    num_ranks: int, num_types: int, *, zero_stage: int, global_batch_size: int | None, repeats: int, seed: int = 0
) -> dict[str, Any]:
    """Median wall time of `search_plan` at one stage on a problem whose every type has four lever variants."""
    problem = _problem(num_ranks, num_types, seed, levers=True)
    result, timed = _timed_search(repeats, *problem, global_batch_size=global_batch_size, zero_stage=zero_stage)
    levers = {r.device_type: r.levers for r in result.plan.ranks}
    return {
        "ranks": num_ranks,
        "device_types": num_types,
        "settings": 4**num_types,
        "zero_stage": zero_stage,
        "global_batch_size": global_batch_size,
        "seed": seed,
        **timed,
        "plan_global_batch_size": result.plan.global_batch_size,
        "types_with_checkpointing": sum(on for on, _ in levers.values()),
        "types_with_offload": sum(on for _, on in levers.values()),
    }


def _large_problems(example_dir: Path | None) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """The large-batch problems, and the sources their profiles declare (``measured_with.source``)."""
    problems = [(SYNTHETIC_LARGE, *_problem(4096, 6, seed=0))]
    if example_dir is not None and (example_dir / "cluster.json").is_file():
        problems.append((SHIPPED_EXAMPLE, load_profiles(example_dir), load_cluster(example_dir / "cluster.json")))
    sources = sorted({str(p.measured_with.get("source", "unknown")) for _, profiles, _ in problems for p in profiles})
    return problems, sources


def _goal(goal: str, target_s: float, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """A goal met when the slowest cell's median is under `target_s`."""
    worst = max(c["median_s"] for c in cells)
    return {"goal": f"{goal} under {target_s} s", "value_s": worst, "target_s": target_s, "met": worst < target_s}


def run_search_speed(
    *,
    rank_counts: tuple[int, ...] = RANK_COUNTS,
    type_counts: tuple[int, ...] = TYPE_COUNTS,
    repeats: int = 5,
    large_batches: tuple[int, ...] = LARGE_BATCHES,
    large_repeats: int | None = None,
    example_dir: Path | None = EXAMPLE_DIR,
    lever_ranks: int | None = 4096,
    lever_types: int = 8,
    lever_repeats: int | None = None,
    lever_seeds: tuple[int, ...] = (0,),
) -> dict[str, Any]:
    """Time every (ranks, types) cell in both batch modes, every large-batch and lever cell; the report as plain data
    (an `example_dir` without ``cluster.json`` leaves the shipped example out, `lever_ranks` None the lever cells)."""
    large_repeats = repeats if large_repeats is None else large_repeats
    lever_repeats = repeats if lever_repeats is None else lever_repeats
    cells = []
    for num_ranks in rank_counts:
        for num_types in type_counts:
            progress(f"{num_ranks} ranks x {num_types} device types ({repeats} repeats)", bench="search-speed")
            fixed = time_search(num_ranks, num_types, global_batch_size=32 * num_ranks + 7, repeats=repeats)
            auto = time_search(num_ranks, num_types, global_batch_size=None, repeats=repeats)
            cells.append({"ranks": num_ranks, "device_types": num_types, "fixed_batch": fixed, "auto_batch": auto})
    goals = []
    for goal in GOALS:
        chosen = [c for c in cells if c["ranks"] in goal["ranks"] and c["device_types"] in goal["types"]]
        if chosen:
            modes = [c[mode] for c in chosen for mode in ("fixed_batch", "auto_batch")]
            goals.append(_goal(goal["goal"], goal["target_s"], modes))
    problems, sources = _large_problems(example_dir)
    if problems and large_batches:
        progress(f"large batches: {len(problems)} problems x {len(large_batches)} batches", bench="search-speed")
    large_cells = [
        {
            "problem": name,
            "ranks": cluster.world_size,
            "device_types": len(cluster.type_counts()),
            "zero_stage": stage,
            "global_batch_size": batch,
            **time_large_batch(profiles, cluster, global_batch_size=batch, zero_stage=stage, repeats=large_repeats),
        }
        for name, profiles, cluster in problems
        for batch in large_batches
        for stage in ZERO_STAGES
    ]
    if large_cells:
        goals.append(_goal(LARGE_BATCH_GOAL["goal"], LARGE_BATCH_GOAL["target_s"], large_cells))
    if lever_ranks is not None and lever_seeds:
        progress(
            f"memory levers: {lever_types} types x {lever_ranks} ranks, seeds {list(lever_seeds)}", bench="search-speed"
        )
    lever_cells = [
        time_lever_search(
            lever_ranks, lever_types, zero_stage=stage, global_batch_size=batch, repeats=lever_repeats, seed=seed
        )
        for seed in (lever_seeds if lever_ranks is not None else ())
        for stage in LEVER_STAGES
        for batch in (32 * lever_ranks + 7, None)
    ]
    if lever_cells:
        goal = LEVER_GOAL["goal"].format(types=lever_types, ranks=lever_ranks)
        goals.append(_goal(goal, LEVER_GOAL["target_s"], lever_cells))
    return {
        "kind": "search-speed",
        "created_utc": utc_now(),
        "machine": machine_description(),
        # The development machine is shared: the load says how busy it was.
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "method": (
            "search_plan(zero_stage='auto', policy='poplar') on seeded synthetic profiles (poplar_bench.synthetic); "
            f"median of {repeats} perf_counter timings after one warm-up; fixed batch = 32 * ranks + 7"
        ),
        "large_batch_method": (
            "search_plan(zero_stage=<one stage>, policy='poplar', global_batch_size=<fixed>); "
            f"median of {large_repeats} perf_counter timings after one warm-up; peak = tracemalloc peak of one "
            "more run (Python and numpy allocations)"
        ),
        "profiles_note": (
            "No profile here is a measurement: the synthetic problems use seeded random profiles "
            "(poplar_bench.synthetic, measured_with.synthetic = true), and the shipped example's profiles are "
            "modelled from datasheet specs (poplar_bench/gpu_model.py). Sources the profiles declare: "
            f"{', '.join(sources)}."
        ),
        "lever_method": (
            "search_plan(zero_stage=<0, 1 or 2>, policy='poplar') on seeded synthetic profiles with all four "
            "memory-lever variants per type (poplar_bench.synthetic.random_lever_profiles), problems seeded "
            f"{', '.join(map(str, lever_seeds))}; fixed batch = 32 * ranks + 7, automatic batch without a maximum; "
            f"median of {lever_repeats} perf_counter timings after one warm-up"
        ),
        "cells": cells,
        "large_batch_cells": large_cells,
        "lever_cells": lever_cells,
        "goals": goals,
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table with the goals."""
    machine = report["machine"]
    libraries = machine["libraries"]
    lines = [
        "# Search speed",
        "",
        (
            f"- made {report['created_utc']} on {machine.get('cpu')} ({machine.get('usable_cpus')} usable CPUs), "
            f"python {machine.get('python')}, numpy {libraries.get('numpy')}, scipy {libraries.get('scipy')}"
        ),
        *code_lines(machine),
        f"- {report['method']}",
        f"- load average (1, 5, 15 min) when the run ended: {report.get('load_average_1_5_15_min')}",
        *_load_note(report),
        f"- {report.get('profiles_note', '')}",
        "",
        "| ranks | device types | fixed batch: median ms | auto batch: median ms | auto: chosen batch, stage |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for cell in report["cells"]:
        fixed, auto = cell["fixed_batch"], cell["auto_batch"]
        lines.append(
            f"| {cell['ranks']} | {cell['device_types']} | {1000 * fixed['median_s']:.1f} | "
            f"{1000 * auto['median_s']:.1f} | {auto['global_batch_size']}, {auto['zero_stage']} |"
        )
    large = report.get("large_batch_cells", [])
    if large:
        lines += [
            "",
            "## Large global batches",
            "",
            f"- {report['large_batch_method']}",
            "",
            "| problem | ZeRO stage | global batch | median ms | repetitions ms | peak MiB | predicted iteration s |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        lines += [
            f"| {cell['problem']} | {cell['zero_stage']} | {cell['global_batch_size']} | {1000 * cell['median_s']:.1f} "
            f"| {_ms(cell)} | {cell['peak_memory_bytes'] / 2**20:.1f} | {cell['predicted_iteration_time_s']:.6g} |"
            for cell in large
        ]
    levers = report.get("lever_cells", [])
    if levers:
        lines += [
            "",
            "## Memory levers",
            "",
            f"- {report['lever_method']}",
            "",
            "| ranks | device types | settings | ZeRO stage | global batch | seed | median ms | repetitions ms | "
            "plan's batch | types checkpointed, offloaded |",
            "| ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | --- |",
        ]
        lines += [
            f"| {cell['ranks']} | {cell['device_types']} | {cell['settings']} | {cell['zero_stage']} | "
            f"{'automatic' if cell['global_batch_size'] is None else cell['global_batch_size']} | "
            f"{cell.get('seed', 0)} | {1000 * cell['median_s']:.1f} | {_ms(cell)} | "
            f"{cell['plan_global_batch_size']} | {cell['types_with_checkpointing']}, {cell['types_with_offload']} |"
            for cell in levers
        ]
        lines += _lever_summary(levers)
    lines += ["", "| goal | slowest median | met |", "| --- | ---: | --- |"] + [
        f"| {goal['goal']} | {1000 * goal['value_s']:.1f} ms | {'met' if goal['met'] else 'NOT met'} |"
        for goal in report["goals"]
    ]
    return "\n".join(lines) + "\n"


def _ms(cell: dict[str, Any]) -> str:
    return ", ".join(f"{1000 * t:.1f}" for t in cell["repetitions_s"])


def _lever_summary(levers: list[dict[str, Any]]) -> list[str]:
    """Per stage and batch mode, the slowest median over the seeded problems."""
    lines = ["", "| ZeRO stage | global batch | problems | slowest median ms |", "| ---: | --- | ---: | ---: |"]
    for stage in sorted({c["zero_stage"] for c in levers}):
        for automatic in (False, True):
            cells = [c for c in levers if c["zero_stage"] == stage and (c["global_batch_size"] is None) == automatic]
            if cells:
                worst = max(c["median_s"] for c in cells)
                mode = "automatic" if automatic else "fixed"
                lines.append(f"| {stage} | {mode} | {len(cells)} | {1000 * worst:.1f} |")
    return lines


def _load_note(report: dict[str, Any]) -> list[str]:
    """A line saying the machine was loaded when the 15-minute load exceeded its usable CPUs."""
    load, cpus = report.get("load_average_1_5_15_min"), report["machine"].get("usable_cpus")
    if not load or not cpus or load[-1] <= cpus:
        return []
    return [
        f"- **the machine was loaded** (shared with other work: 15-minute load {load[-1]:.1f} on {cpus} CPUs): "
        "these timings are slower than on a quiet machine"
    ]


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``search_speed.json`` and ``search_speed.md`` into `out_dir`; returns the paths."""
    return write_json_and_markdown(report, render_markdown(report), out_dir, "search_speed")
