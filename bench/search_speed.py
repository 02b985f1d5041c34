"""How long `search.search_plan` takes, against cluster size and number of device types.

Each cell times one full search (`zero_stage="auto"`: all four stages, policy
``poplar``) on a seeded synthetic problem (`search.synthetic`: random profiles, ranks
split evenly over the types), once with a fixed global batch (32 samples per rank,
plus 7 so that it is not a round number) and once with the global batch chosen
automatically. Wall time by `time.perf_counter`, median of the repetitions after one
warm-up call. Goals: 4096 ranks x 6 device types under 1 s; 64 ranks under 50 ms
(every number of types), both for the slower of the two modes.

    python -m bench.search_speed            # writes bench/results/search_speed.{json,md}
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import machine_description, utc_now, write_json_and_markdown
from search import search_plan
from search.synthetic import random_profiles, simple_cluster

RANK_COUNTS = (8, 16, 64, 256, 1024, 4096)
TYPE_COUNTS = (1, 2, 3, 4, 5, 6)
GOALS = (
    {"goal": "4096 ranks x 6 device types", "ranks": (4096,), "types": (6,), "target_s": 1.0},
    {"goal": "64 ranks (1 to 6 device types)", "ranks": (64,), "types": TYPE_COUNTS, "target_s": 0.05},
)


def _problem(num_ranks: int, num_types: int, seed: int):
    rng = np.random.default_rng(seed)
    names = [f"gpu{i}" for i in range(num_types)]
    profiles = random_profiles(rng, names)
    counts = {name: num_ranks // num_types + (1 if i < num_ranks % num_types else 0) for i, name in enumerate(names)}
    return profiles, simple_cluster({n: c for n, c in counts.items() if c > 0})


def time_search(num_ranks: int, num_types: int, *, global_batch_size: int | None, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Median wall time of `search_plan` on one synthetic problem (plus every repetition)."""
    profiles, cluster = _problem(num_ranks, num_types, seed)
    result = search_plan(profiles, cluster, global_batch_size=global_batch_size)  # warm-up
    assert result.ok, result.message
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        search_plan(profiles, cluster, global_batch_size=global_batch_size)
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times),
        "repetitions_s": times,
        "global_batch_size": result.plan.global_batch_size,
        "zero_stage": result.zero_stage,
    }


def run_search_speed(
    *, rank_counts: tuple[int, ...] = RANK_COUNTS, type_counts: tuple[int, ...] = TYPE_COUNTS, repeats: int = 5
) -> dict[str, Any]:
    """Time every (ranks, types) cell in both batch modes; returns the report as plain data."""
    cells = []
    for num_ranks in rank_counts:
        for num_types in type_counts:
            fixed = time_search(num_ranks, num_types, global_batch_size=32 * num_ranks + 7, repeats=repeats)
            auto = time_search(num_ranks, num_types, global_batch_size=None, repeats=repeats)
            cells.append({"ranks": num_ranks, "device_types": num_types, "fixed_batch": fixed, "auto_batch": auto})
    goals = []
    for goal in GOALS:
        chosen = [c for c in cells if c["ranks"] in goal["ranks"] and c["device_types"] in goal["types"]]
        if not chosen:
            continue
        worst = max(max(c["fixed_batch"]["median_s"], c["auto_batch"]["median_s"]) for c in chosen)
        goals.append({"goal": f"{goal['goal']} under {goal['target_s']} s", "value_s": worst,
                      "target_s": goal["target_s"], "met": worst < goal["target_s"]})
    return {
        "kind": "search-speed",
        "created_utc": utc_now(),
        "machine": machine_description(),
        # The development machine is shared: the load says how busy it was.
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "method": (
            "search_plan(zero_stage='auto', policy='poplar') on seeded synthetic profiles (search.synthetic); "
            f"median of {repeats} perf_counter timings after one warm-up; fixed batch = 32 * ranks + 7"
        ),
        "cells": cells,
        "goals": goals,
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table with the goals."""
    machine = report["machine"]
    libraries = machine["libraries"]
    lines = [
        "# Search speed",
        "",
        f"- made {report['created_utc']} on {machine.get('cpu')} ({machine.get('usable_cpus')} usable CPUs), "
        f"python {machine.get('python')}, numpy {libraries.get('numpy')}, scipy {libraries.get('scipy')}",
        f"- {report['method']}",
        f"- load average (1, 5, 15 min) when the run ended: {report.get('load_average_1_5_15_min')}",
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
    lines += ["", "| goal | slowest median | met |", "| --- | ---: | --- |"]
    for goal in report["goals"]:
        lines.append(f"| {goal['goal']} | {1000 * goal['value_s']:.1f} ms | {'met' if goal['met'] else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``search_speed.json`` and ``search_speed.md`` into `out_dir`; returns the paths."""
    return write_json_and_markdown(report, render_markdown(report), out_dir, "search_speed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.search_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    report = run_search_speed(repeats=args.repeats)
    for path in write_report(report, args.output_dir):
        print(path)
    for goal in report["goals"]:
        print(f"{goal['goal']}: {1000 * goal['value_s']:.1f} ms, {'met' if goal['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
