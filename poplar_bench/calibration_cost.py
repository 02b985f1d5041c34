"""`poplar-bench calibration`: what checking cached profiles at start costs and finds: three demo runs on one
profile cache, or ``--check-only`` (`run_check_cost`). See docs/bench.md."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import code_lines, made_line, summary_provenance, utc_now, write_json_and_markdown

RUNS = (("fresh", "off", True), ("cached, unchecked", "off", False), ("cached, checked", "cached", False))
"""(name, the demo's calibration, profile afresh) of each run, in order."""


def summarize(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One entry per run: the check's cost and findings, the prediction error per policy, the load."""
    entries = []
    for name, report in runs:
        scenario = report["scenarios"][0]
        timings = report["timings_s"]
        entries.append(
            {
                "run": name,
                "profiles_from_cache": scenario["profiles_from_cache"],
                "calibration": scenario.get("calibration", {}),
                "calibration_s": max((v for k, v in timings.items() if k.endswith("_calibration_s")), default=None),
                "profile_s": max((v for k, v in timings.items() if k.endswith("_profile_s")), default=None),
                "prediction_error": {
                    e["policy"]: e.get("prediction_error") for e in scenario["policies"] if e["status"] == "ok"
                },
                "load_average": report.get("machine", {}).get("load_average"),
            }
        )
    return {
        "kind": "calibration",
        **summary_provenance([report for _, report in runs]),
        "devices": "emulated CPU ranks (gloo), the demo's default cluster (slowdowns 3, 6, 12)",
        "runs": entries,
    }


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.1f}%"


def render_markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# Cached profiles checked at start: cost and findings",
        "",
        made_line(summary.get("created_utc"), summary.get("machine")) + " (the last run's report)",
        "",
        f"Devices: {summary['devices']}. Three demo runs on one profile cache (poplar_bench/calibration_cost.py); the "
        "check times a few micro-steps per device type at poplar's plan's sizes as training runs them. Prediction "
        "error = (predicted - measured) / measured iteration time (median over the run's repetitions).",
        "",
        "| run | profiles | check (s, slowest rank) | found (measured / profiled, outcome) | uniform | proportional "
        "| poplar | load avg (1 min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in summary["runs"]:
        found = "; ".join(
            f"{t} {c['measured_over_profiled']:.2f} {c['outcome']}" for t, c in sorted(run["calibration"].items())
        )
        errors = run["prediction_error"]
        load = run["load_average"]
        check_s = "" if run["calibration_s"] is None else f"{run['calibration_s']:.1f}"
        lines.append(
            f"| {run['run']} | {'cached' if run['profiles_from_cache'] else 'measured'} | "
            f"{check_s} | {found or 'not checked'} | "
            f"{_percent(errors.get('uniform'))} | {_percent(errors.get('proportional'))} | "
            f"{_percent(errors.get('poplar'))} | {'' if not load else f'{load[0]:.1f}'} |"
        )
    cpus = (summary.get("machine") or {}).get("usable_cpus") or "unknown"
    lines += [
        "",
        f"The machine has {cpus} usable CPUs; its load (the last column, the ranks' own included) shows in the errors.",
        "",
    ]
    return "\n".join(lines)


def run_calibration_check(*, out_dir: Path, rounds: int = 2, cache_dir: Path | None = None) -> list[Path]:
    """The three runs, then calibration.{json,md} in `out_dir` (each run's demo report under ``calibration/``)."""
    from poplar_ext.plan.formats import read_json

    from . import demo
    from .demo_config import DemoSettings

    with tempfile.TemporaryDirectory(prefix="poplar-calibration-") as tmp:
        base = DemoSettings(rounds=rounds, iterations=1, cache_dir=cache_dir or Path(tmp))
        reports = []
        for name, calibration, fresh in RUNS:
            demo.progress(f"calibration bench: {name}")
            settings = dataclasses.replace(base, calibration=calibration, force_profile=fresh)
            paths = demo.run_demo(settings, out_dir=out_dir / "calibration", name=name.replace(", ", "-"))
            reports.append((name, read_json(paths[0])))
    summary = summarize(reports)
    return write_json_and_markdown(summary, render_markdown(summary), out_dir, "calibration")


CHECK_REPEATS = 3  # how many times `run_check_cost` runs the check in one forked group


def check_cost_rank(settings: Any, work: Path, repeats: int = CHECK_REPEATS) -> dict[str, Any]:
    """One forked rank: the demo's profiles (measured once, then from the cache), then the demo's start-up
    check `repeats` times: each one's wall seconds and what the last found."""
    import torch.distributed as dist

    from .demo_worker import agreed_cluster, calibrate_profiles, profile_devices

    cluster_path = work / "cluster.json"
    cluster = agreed_cluster(settings, cluster_path)
    profiles, cache_hit = profile_devices(settings, cluster_path)
    seconds, checks = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        _, checks = calibrate_profiles(settings, cluster_path, cluster, profiles)
        seconds.append(time.perf_counter() - start)
    return {
        "device_type": cluster.rank_device_types[dist.get_rank()],
        "profiles_from_cache": cache_hit,
        "check_s": seconds,
        "checks": {t: c.to_dict() for t, c in sorted(checks.items())},
    }


def summarize_check_cost(
    rank_results: list[dict[str, Any]],
    *,
    devices: str,
    load_average: dict[str, list[float] | None],
    machine: dict[str, Any] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """Per repeat the slowest rank's check, their median, and what the check found (pure)."""
    per_repeat = [max(values) for values in zip(*(r["check_s"] for r in rank_results))]
    return {
        "kind": "calibration-check-cost",
        "created_utc": utc_now(),
        "machine": machine or {},
        "note": note,
        "devices": devices,
        "check_s": per_repeat,
        "median_check_s": statistics.median(per_repeat),
        "profiles_from_cache": all(r["profiles_from_cache"] for r in rank_results),
        "checks": rank_results[0]["checks"],
        "load_average": load_average,
    }


def render_check_cost(summary: dict[str, Any]) -> str:
    checks = summary["checks"]
    found = "; ".join(
        f"{t} at {', '.join(map(str, c['sizes']))}: {c['measured_over_profiled']:.2f} {c['outcome']}"
        for t, c in checks.items()
    )
    load = summary["load_average"]
    machine = summary.get("machine") or {}
    lines = [
        "# The start-up check of cached profiles: its cost",
        "",
        f"- made {summary.get('created_utc')} on {machine.get('cpu')} ({machine.get('usable_cpus')} usable CPUs), "
        f"python {machine.get('python')}{'; ' + summary['note'] if summary.get('note') else ''}",
        *code_lines(machine),
        "",
        f"Devices: {summary['devices']}. The demo's check (poplar_bench/demo_worker.py `calibrate_profiles`: rank 0 "
        "searches the policies, every rank times micro-steps at the sizes checked, each type's measured / "
        "profiled decided) run in one forked group after the profiles; wall time of the slowest rank "
        "(poplar_bench/calibration_cost.py `run_check_cost`).",
        "",
        f"- check, per repeat: {', '.join(f'{s:.2f} s' for s in summary['check_s'])}; median "
        f"**{summary['median_check_s']:.2f} s**",
        f"- profiles {'from the cache' if summary['profiles_from_cache'] else 'measured in this run'}; "
        f"sizes timed and findings: {found or 'none'}",
        f"- load average (1, 5, 15 min) before: {load.get('before')}, after: {load.get('after')} "
        f"({machine.get('usable_cpus') or 'unknown'} usable CPUs; the ranks' own load included)",
        "",
    ]
    return "\n".join(lines)


def run_check_cost(
    *,
    out_dir: Path,
    repeats: int = CHECK_REPEATS,
    cache_dir: Path | None = None,
    name: str = "calibration_check",
    note: str = "",
) -> list[Path]:
    """The demo's ranks forked once: profiles, then the check `repeats` times; NAME.{json,md} in `out_dir`
    (`note`: what the report should say of the code or setting measured)."""
    from . import demo
    from .demo_config import DemoSettings
    from .report import machine_description

    demo.preimport()
    before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="poplar-calibration-check-") as tmp:
        settings = DemoSettings(cache_dir=cache_dir or Path(tmp) / "cache", calibration="cached")
        results = demo.run_ranks(settings, Path(tmp), target=functools.partial(check_cost_rank, repeats=repeats))
    summary = summarize_check_cost(
        results,
        devices="emulated CPU ranks (gloo), the demo's default cluster (slowdowns 3, 6, 12) and toy GPT at ZeRO-1",
        load_average={"before": before, "after": list(os.getloadavg())},
        machine=machine_description(),
        note=note,
    )
    return write_json_and_markdown(summary, render_check_cost(summary), out_dir, name)
