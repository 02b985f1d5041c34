"""How far the pipeline search's heuristic falls from the exact optimum, on small random cases.

``python -m poplar_bench.pipeline_search_gap`` writes pipeline_search_gap.{json,md} (docs/bench.md) to --output-dir:
by default bench/results of an editable checkout, otherwise the current directory.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import numpy as np

from poplar_bench.synthetic import random_layer_profiles, simple_cluster
from poplar_ext.search.network import modelled_network
from poplar_ext.search.pipeline_layouts import all_layouts, candidate_layouts, rank_nodes
from poplar_ext.search.pipeline_search import exact_count, search_pipeline_plan

from .commands._options import add_output_dir, default_output_dir
from .report import code_lines, machine_description, utc_now, write_json_and_markdown

DEFAULT_CASES = 300
MAX_EXACT_SPLITS = 4000  # cases whose exact search would price more split combinations are drawn again
EQUAL = 1e-9


def random_case(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    names = ["a", "b", "c"][: int(rng.integers(1, 4))]
    world_size = int(rng.integers(max(2, len(names)), 6))
    counts = dict.fromkeys(names, 1)
    for _ in range(world_size - len(names)):
        counts[names[int(rng.integers(len(names)))]] += 1
    cluster = simple_cluster(counts, ranks_per_node=int(rng.integers(1, 5)))
    num_layers = int(rng.integers(2, 7))
    network = None
    if rng.random() >= 0.25:
        network = modelled_network(
            bus_bandwidth_bytes_per_s=float(10 ** rng.uniform(8, 10.5)),
            latency_s=float(rng.uniform(0, 1e-3)),
            note="random, for the gap measurement",
        )
    return {
        "seed": seed,
        "profiles": random_layer_profiles(rng, names, num_layers=num_layers),
        "cluster": cluster,
        "network": network,
        "global_batch_size": int(rng.integers(world_size, 4 * world_size + 1)),
    }


def _layout_key(layout: Any, labels: list[tuple[str, int]]) -> tuple:
    return tuple(sorted(tuple(labels[r] for r in pipeline) for pipeline in layout))


HEURISTICS = {
    "all": "every layout (clusters of up to 6 ranks whose exact search is too large)",
    "candidates": "the candidate layouts (clusters of more than 6 ranks)",
}


def _compare(exact: Any, heuristic: Any, offered: set, labels: list) -> dict[str, Any]:
    if not exact.ok:
        return {"outcome": "neither finds a plan" if not heuristic.ok else "heuristic only (a bug)", "gap": None}
    if not heuristic.ok:
        return {"outcome": "heuristic finds no plan", "gap": None}
    gap = heuristic.plan.predicted.iteration_time_s / exact.plan.predicted.iteration_time_s - 1
    if gap <= EQUAL:
        outcome = "equal"
    elif _layout_key(tuple(p.ranks for p in exact.plan.pipelines), labels) in offered:
        outcome = "optimum's layout tried, split or sized otherwise"
    else:
        outcome = "optimum's layout not among the candidates"
    return {"outcome": outcome, "gap": gap, "iteration_time_s": heuristic.plan.predicted.iteration_time_s}


def measure_case(case: dict[str, Any]) -> dict[str, Any] | None:
    """The exact search and both heuristics on one case; None when its exact search is too large to run here."""
    cluster, profiles = case["cluster"], case["profiles"]
    num_layers = profiles[0].num_layers
    every = all_layouts(cluster, num_layers)
    if exact_count(every, num_layers) > MAX_EXACT_SPLITS:
        return None
    kwargs = dict(global_batch_size=case["global_batch_size"], network=case["network"])
    started = time.perf_counter()
    exact = search_pipeline_plan(profiles, cluster, method="exact", **kwargs)
    exact_s = time.perf_counter() - started
    labels = list(zip(cluster.rank_device_types, rank_nodes(cluster)))
    offered = {
        "all": {_layout_key(layout, labels) for layout in every},
        "candidates": {_layout_key(layout, labels) for layout in candidate_layouts(cluster, num_layers)},
    }
    return {
        "seed": case["seed"],
        "world_size": cluster.world_size,
        "device_types": len(cluster.type_counts()),
        "num_layers": num_layers,
        "network": case["network"] is not None,
        "global_batch_size": case["global_batch_size"],
        "exact_s": exact_s,
        "exact_iteration_time_s": exact.plan.predicted.iteration_time_s if exact.ok else None,
        **{
            name: _compare(
                exact,
                search_pipeline_plan(profiles, cluster, method="heuristic", layouts=name, **kwargs),
                offered[name],
                labels,
            )
            for name in HEURISTICS
        },
    }


_STATISTICS = {"median": np.median, "p90": lambda gaps: np.quantile(gaps, 0.9), "max": np.max, "mean": np.mean}


def _quantiles(gaps: list[float]) -> dict[str, float | None]:
    return {name: float(statistic(np.array(gaps))) if gaps else None for name, statistic in _STATISTICS.items()}


def _summary(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    compared = [r for r in rows if r[name]["gap"] is not None]
    outcomes = dict(collections.Counter(r[name]["outcome"] for r in rows))
    groups = {
        f"{w} ranks": [r for r in compared if r["world_size"] == w] for w in sorted({r["world_size"] for r in rows})
    }
    groups["with a network"] = [r for r in compared if r["network"]]
    groups["without a network"] = [r for r in compared if not r["network"]]
    return {
        "outcomes": outcomes,
        "gap_all": _quantiles([r[name]["gap"] for r in compared]),
        "gap_when_not_equal": _quantiles([r[name]["gap"] for r in compared if r[name]["gap"] > EQUAL]),
        "gap_by_group": {
            group: {"cases": len(members), **_quantiles([r[name]["gap"] for r in members])}
            for group, members in groups.items()
        },
    }


def gap_report(num_cases: int = DEFAULT_CASES, first_seed: int = 0) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    seed = first_seed
    while len(rows) < num_cases:
        row = measure_case(random_case(seed))
        seed += 1
        if row is not None:
            rows.append(row)
    return {
        "kind": "pipeline_search_gap",
        "created_utc": utc_now(),
        "machine": machine_description(),
        "data_source": "predicted from synthetic (modelled) layer profiles; no device ran",
        "cases": len(rows),
        "seeds": [first_seed, seed - 1],
        "heuristics": {name: {"layouts": text, **_summary(rows, name)} for name, text in HEURISTICS.items()},
        "rows": rows,
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _render_heuristic(name: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Heuristic on {summary['layouts']}",
        "",
        "| outcome | cases |",
        "| --- | --- |",
        *(f"| {outcome} | {count} |" for outcome, count in sorted(summary["outcomes"].items(), key=lambda kv: -kv[1])),
        "",
        "| cases | gap median | gap p90 | gap max | gap mean |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, stats in (("all compared", summary["gap_all"]), ("not equal", summary["gap_when_not_equal"])):
        lines.append(
            f"| {label} | {_pct(stats['median'])} | {_pct(stats['p90'])} | {_pct(stats['max'])} | "
            f"{_pct(stats['mean'])} |"
        )
    lines += ["", "| group | cases | gap median | gap p90 | gap max |", "| --- | --- | --- | --- | --- |"]
    for group, stats in summary["gap_by_group"].items():
        lines.append(
            f"| {group} | {stats['cases']} | {_pct(stats['median'])} | {_pct(stats['p90'])} | {_pct(stats['max'])} |"
        )
    worst = sorted((r for r in rows if r[name]["gap"] is not None), key=lambda r: -r[name]["gap"])[:6]
    lines += [
        "",
        "Largest gaps:",
        "",
        "| seed | ranks | types | layers | network | global batch | gap | cause |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['seed']} | {r['world_size']} | {r['device_types']} | {r['num_layers']} | "
            f"{'yes' if r['network'] else 'no'} | {r['global_batch_size']} | {_pct(r[name]['gap'])} | "
            f"{r[name]['outcome']} |"
            for r in worst
        ),
        "",
    ]
    return lines


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Pipeline search: the heuristic's gap to the exact optimum",
        "",
        f"- data: **{report['data_source']}**",
        f"- made {report['created_utc']}; {report['cases']} seeded cases (seeds {report['seeds'][0]}-"
        f"{report['seeds'][1]}; cases whose exact search prices more than {MAX_EXACT_SPLITS} split combinations "
        "skipped); `python -m poplar_bench.pipeline_search_gap`",
        *code_lines(report.get("machine")),
        "- gap = the heuristic's predicted iteration time / the exact optimum's - 1, both by the same cost model "
        "(`poplar_ext/search/pipeline_cost.py`); the exact search is tested against brute force in "
        "tests/unit/test_pipeline_search.py",
        "- the heuristic runs twice on every case: on every layout (what clusters of up to 6 ranks get when the "
        "exact search is too large: the gap is the balanced split's and the sizes' alone), and on the candidate "
        "layouts only (what clusters of more than 6 ranks get: the gap adds the layouts left out)",
        "",
    ]
    for name, summary in report["heuristics"].items():
        lines += _render_heuristic(name, summary, report["rows"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES, help=f"seeded cases (default {DEFAULT_CASES})")
    add_output_dir(parser)
    args = parser.parse_args(argv)
    report = gap_report(args.cases)
    output_dir = args.output_dir or default_output_dir()
    for path in write_json_and_markdown(report, render(report), output_dir, "pipeline_search_gap"):
        print(path)


if __name__ == "__main__":
    main()
