"""`poplar-bench demo`: the parent forks the ranks (`demo_worker`) and builds the report (`assemble_report`, pure).
See docs/bench.md (the demo, how it runs)."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import POLICIES, cluster_from_dict, read_json

from .demo_config import DemoSettings
from .report import (
    REPORT_SCHEMA,
    curve,
    demo_goals,
    derive_comparisons,
    emulation_dict,
    goal_value_text,
    infeasible_entry,
    machine_description,
    progress,
    repetitions,
    utc_now,
    write_report,
)


def preimport() -> float:
    """Import what every rank needs before forking, so that each rank starts fast; the seconds it took."""
    start = time.perf_counter()
    from poplar_bench.local_ranks import preimport_for_fork

    preimport_for_fork()
    from . import demo_worker  # noqa: F401

    return time.perf_counter() - start


def run_ranks(
    settings: DemoSettings,
    work_dir: Path,
    *,
    target: Callable[[Any, Path], dict[str, Any]] | None = None,
    pg_timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Fork the ranks, each running ``target(settings, work_dir)`` (`demo_worker.run_rank`); their results in rank
    order. A failed rank stops the others a few seconds later, a hung one is killed at `settings.timeout_s`;
    either way `local_ranks.RankFailure` (a RuntimeError) names every failed rank."""
    from poplar_bench.local_ranks import run_ranks as run_local_ranks

    from .demo_worker import PG_TIMEOUT_S, demo_rank, run_rank

    return run_local_ranks(
        demo_rank,
        world_size=settings.world_size,
        log_dir=work_dir,
        args=(target or run_rank, settings, work_dir),
        timeout_s=settings.timeout_s,
        pg_timeout_s=PG_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s,
        capture_output=False,  # the ranks' progress is the demo's console
        stop_after_failure_s=5.0,
    )


def run_demo(settings: DemoSettings, *, out_dir: Path, name: str = "demo") -> list[Path]:
    """Run the whole demo and write its report; returns the report's paths."""
    started = time.perf_counter()
    progress(f"importing torch and deepspeed; {settings.world_size} ranks will be forked")
    import_s = preimport()
    progress(f"imports took {import_s:.1f} s; cache: {settings.cache_root()}")
    with tempfile.TemporaryDirectory(prefix="poplar-demo-") as tmp:
        rank_results = run_ranks(settings, Path(tmp))
        plans = read_json(Path(tmp) / "plans.json")
    timings = {"import_s": import_s, "total_s": time.perf_counter() - started}
    report = assemble_report(settings, rank_results, plans, timings=timings)
    paths = write_report(report, out_dir, name)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    for line in console_summary(report):
        progress(line)
    return paths


def console_summary(report: dict[str, Any]) -> list[str]:
    """The run's result as the console shows it: what ran (devices emulated), each policy's allocation and
    throughput, the goals."""
    scenario = report["scenarios"][0]
    lines = [
        f"{scenario['name']}, global batch {scenario['global_batch_size']}: {report['data_source']}; "
        "samples/s: the global batch over the iteration time, measured (wall time) and predicted (cost model)"
    ]
    for entry in scenario["policies"]:
        if entry["status"] != "ok":
            lines.append(f"{entry['policy']}: {entry['message']}")
            continue
        allocation = ", ".join(
            f"{r['device_type']} {r['micro_batch_size']}x{r['gradient_accumulation_steps']}" for r in entry["ranks"]
        )
        lines.append(
            f"{entry['policy']:>12}: {entry['measured']['samples_per_s']:.1f} samples/s measured, "
            f"{entry['predicted']['samples_per_s']:.1f} predicted"
            + (f", {entry['speedup_over_uniform']:.2f}x uniform" if entry.get("speedup_over_uniform") else "")
            + (f", {entry['share_of_ideal']:.2f} of ideal" if entry.get("share_of_ideal") else "")
            + f" (ZeRO {entry['zero_stage']}, micro-batch x accumulation: {allocation})"
        )
    for goal in scenario["goals"]:
        value = goal_value_text(goal)
        lines.append(f"goal {goal['goal']} {goal['target']}: {value} ({'met' if goal['met'] else 'MISSED'})")
    lines.append(goals_summary(scenario["goals"]))
    return lines


def goals_summary(goals: list[dict[str, Any]]) -> str:
    """One line: how many goals were met, which were missed, and that the exit status does not say it."""
    missed = [f"{g['goal']} {g['target']}" for g in goals if not g["met"]]
    line = f"{len(goals) - len(missed)} of {len(goals)} goals met"
    if missed:
        line += f" (missed: {'; '.join(missed)}); a goal is a measurement, reported here, not in the exit status"
    return line


# --- Pure: rank result files -> report ---
def measured_iteration_times_s(rank_results: list[dict[str, Any]], policy: str) -> list[float]:
    """Per measured iteration, the slowest rank's time from the common start to the end of its step."""
    per_rank = [r["policies"][policy]["iteration_time_s"] for r in rank_results]
    lengths = {len(times) for times in per_rank}
    assert len(lengths) == 1, f"ranks measured different numbers of iterations for {policy}: {lengths}"
    return [max(values) for values in zip(*per_rank)]


def measured_ideal_samples_per_s(rank_results: list[dict[str, Any]]) -> float:
    """Sum over ranks of each rank's best standalone throughput (micro-steps only)."""
    return sum(
        max(p["micro_batch_size"] / statistics.median(p["micro_step_time_s"]) for p in result["standalone"])
        for result in rank_results
    )


def _standalone_curve(result: dict[str, Any]) -> list[dict[str, float]]:
    points = sorted(result["standalone"], key=lambda p: p["micro_batch_size"])
    return curve((p["micro_batch_size"], statistics.median(p["micro_step_time_s"])) for p in points)


def _median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


_MEASURED_PARTS = {
    "busy_s": "busy_s",
    "first_micro_step_s": "first_micro_step_s",
    "later_micro_step_s": "later_micro_step_s",
    "boundary_reduction_and_wait_s": "boundary_wait_s",
    "step_s": "step_s",
    "iteration_time_s": "iteration_time_s",
}
"""A decomposition's measured part -> the `PolicyRun.MEASURES` key it is the median of."""


def rank_decomposition(
    info: dict[str, Any], rank_plan: dict[str, Any], measures: dict[str, list[Any]]
) -> dict[str, Any]:
    """One rank's iteration in parts, predicted and measured (medians over repetitions, seconds).

    Predicted: compute (the profile's micro-steps), communication on micro-steps (stages 2-3), the boundary's
    collectives and optimizer step (from the network file and the profile; without one, both are the profile's
    measured boundary). Measured: busy (micro-steps, with any per-micro-step communication), the first
    micro-step after an optimizer step against the others, the boundary reduction with the wait for the
    slowest rank, and the boundary ``engine.step``."""
    rank = rank_plan["rank"]
    boundary = info.get("predicted_boundary") or {}
    compute = info.get("predicted_compute_s")
    return {
        "predicted": {
            "compute_s": None if compute is None else compute[rank],
            "micro_step_communication_s": None if compute is None else info["predicted_busy_s"][rank] - compute[rank],
            "boundary_communication_s": boundary.get("communication_s"),
            "optimizer_step_s": boundary.get("optimizer_step_s"),
            "iteration_time_s": info["predicted"]["iteration_time_s"],
        },
        "measured": {part: _median_of(measures[key]) for part, key in _MEASURED_PARTS.items()},
    }


def assemble_report(
    settings: DemoSettings,
    rank_results: list[dict[str, Any]],
    plans: dict[str, Any],
    *,
    timings: dict[str, float],
) -> dict[str, Any]:
    """Build the demo report from the ranks' result files and the search's plans.

    `plans` (rank 0's, `poplar_bench.demo_worker.make_plans`) maps each policy to ``{status, message, plan (plan JSON
    or None), predicted_busy_s (per rank), predicted {iteration_time_s, samples_per_s}}``, plus ``cluster``
    (the cluster JSON the ranks agreed on), ``profiles`` (device type -> curve at the demo's stage and
    profile provenance) and ``ideal_predicted``."""
    cluster = cluster_from_dict(plans["cluster"])
    scenario = {
        "name": f"{cluster.world_size} CPU ranks emulating " + ", ".join(cluster.type_counts()),
        "cluster": {"world_size": cluster.world_size, "type_counts": cluster.type_counts(), "file": None},
        "model": plans["model"],
        "device_types": _device_types(cluster, plans["profiles"]),
        "global_batch_size": settings.global_batch_size,
        "ideal_samples_per_s": {
            "predicted": plans.get("ideal_predicted"),
            "measured": measured_ideal_samples_per_s(rank_results),
        },
        **_curves(rank_results, plans["profiles"]),
        "profiles_from_cache": all(r.get("profile_cache_hit") for r in rank_results),
        # Each type's profile against micro-steps timed at start ({}: not checked).
        "calibration": plans.get("calibration", {}),
        "network": plans.get("network"),
        "policies": [_policy_entry(policy, plans["policies"][policy], rank_results) for policy in POLICIES],
    }
    overruns = [r["emulation_overrun"] for p in scenario["policies"] for r in p["ranks"] if r.get("emulation_overrun")]
    scenario["emulation_overrun_share"] = max((o["overrun_share"] for o in overruns), default=None)
    derive_comparisons(scenario)
    scenario["goals"] = demo_goals(scenario)
    return {
        "schema": REPORT_SCHEMA,
        "kind": "demo",
        "title": "poplar-bench demo: allocation policies on an emulated heterogeneous CPU cluster",
        "created_utc": utc_now(),
        "machine": machine_description(),
        "data_source": (
            "measured on CPU ranks with EMULATED device types (compute slowdown, memory capacity), real DeepSpeed"
        ),
        "notes": _notes(settings),
        "timings_s": {
            **timings,
            **{f"rank{r['rank']}_{k}": v for r in rank_results for k, v in r["timings_s"].items()},
        },
        "settings": {**dataclasses.asdict(settings), "cache_dir": str(settings.cache_root())},
        "scenarios": [scenario],
    }


def _policy_entry(policy: str, info: dict[str, Any], rank_results: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's row: its plan, predicted against measured (iterations and each rank)."""
    if info["status"] != "ok":
        return infeasible_entry(policy, info["status"], info["message"])
    plan = info["plan"]
    iteration = measured_iteration_times_s(rank_results, policy)
    return {
        "policy": policy,
        "status": "ok",
        "message": info["message"],
        "zero_stage": plan["zero_stage"],
        "global_batch_size": plan["global_batch_size"],
        "ranks": [
            _rank_entry(info, rank_plan, result["policies"][policy], (result.get("emulation") or {}).get(policy))
            for rank_plan, result in zip(plan["ranks"], rank_results)
        ],
        "predicted": info["predicted"],
        "measured": {
            "iteration_time_s": repetitions(iteration),
            "samples_per_s": plan["global_batch_size"] / statistics.median(iteration),
        },
    }


def _rank_entry(
    info: dict[str, Any], rank_plan: dict[str, Any], measures: dict[str, Any], emulation: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One rank under one policy: its allocation, predicted and measured busy time, where its time went, and
    how far its emulated compute ran past its steady time (`ComputeSlowdown.overrun_report`; None: real)."""
    entry = {
        **{k: rank_plan[k] for k in ("rank", "device_type", "micro_batch_size", "gradient_accumulation_steps")},
        "predicted_busy_s": info["predicted_busy_s"][rank_plan["rank"]],
        "measured_busy_s": repetitions(measures["busy_s"]),
        "measured_boundary_wait_s": repetitions(measures["boundary_wait_s"]),
        "emulation_overrun": emulation,
    }
    # Where the time goes, predicted against measured (older rank results lack it).
    if "step_s" in measures:
        entry["decomposition"] = rank_decomposition(info, rank_plan, measures)
    return entry


def _device_types(cluster: Any, profiles: dict[str, Any]) -> dict[str, Any]:
    """Each device type: real or emulated (and how), its profile's largest micro-batch and provenance."""
    return {
        name: {
            "source": "emulated" if cluster.emulation_of(name) else "real",
            "emulation": emulation_dict(cluster.emulation_of(name)),
            "max_micro_batch_size": profiles.get(name, {}).get("max_micro_batch_size"),
            "profile": profiles.get(name, {}).get("provenance"),
        }
        for name in cluster.type_counts()
    }


def _curves(rank_results: list[dict[str, Any]], profiles: dict[str, Any]) -> dict[str, Any]:
    """The scenario's curves: measured alone in this run (the figure's), every repetition behind them,
    and the profiled ones (possibly from the cache) for comparison."""
    return {
        "curves": {result["device_type"]: _standalone_curve(result) for result in rank_results},
        "curves_kind": "measured alone in this run",
        # Every repetition of the standalone measurements behind the measured ideal.
        "standalone": {
            result["device_type"]: [
                {"micro_batch_size": p["micro_batch_size"], "micro_step_time_s": repetitions(p["micro_step_time_s"])}
                for p in result["standalone"]
            ]
            for result in rank_results
        },
        "profiled_curves": {name: info["curve"] for name, info in profiles.items()},
    }


def _notes(settings: DemoSettings) -> list[str]:
    """How the demo measures, for the report's readers."""
    stage_note = (
        "" if settings.zero_stage < 2 else " (busy time holds each micro-step communication and the waits in it)"
    )
    return [
        "Devices are emulated (poplar_ext.hardware.emulation): each rank is a CPU process (1 thread) whose compute "
        "is steady: a micro-step lasts the time its type's profile gives that micro-batch, the optimizer step the "
        "median of its first 3 (the rank computes, then sleeps what is left); where the real work ran longer, the "
        "overrun is reported per rank. A type's memory capacity is a declared limit above the ranks' measured "
        "baseline.",
        f"ZeRO stage {settings.zero_stage}{stage_note}; {settings.rounds} rounds, policies "
        f"interleaved per round; in each round each policy ran {settings.warmup_iterations} unmeasured warm-up + "
        f"{settings.iterations} measured iterations (warm-up after every switch of engine); figures are medians, "
        "every repetition is in the JSON.",
        "Iteration time: from a barrier to the end of the optimizer step on the slowest rank. Busy time: from that "
        "barrier until the rank reaches the boundary gradient reduction (its own micro-steps, without waiting).",
        "The engine ends each emulated micro-step (and its sleep) before the gradient reduction, as a slow device "
        "finishes computing before it communicates.",
        "Ideal: sum over ranks of each rank's best standalone throughput (micro-steps only, no communication, so "
        "no waiting; all ranks at once, as in training), measured in this run at the largest micro-batch and at "
        "the one of highest throughput on the profile's fitted curve (the times the plans and the steady "
        "emulation use).",
        "Predictions come from the profiles (each micro-step timed by thread CPU time x slowdown, the median of "
        "repeats) and from the network file the profiler measured (collective times on these ranks, fitted to a "
        "ring model; none: the boundary as profiled); measurements are wall time. Compute runs at the profiles' "
        "times by construction, so the prediction error measures the rest: communication, the boundary, waiting "
        "and the runtime's overhead.",
        "Other processes on this machine were not controlled; its load shows in the repetitions.",
    ]
