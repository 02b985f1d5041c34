"""`poplar-bench demo --repetitions N`: the demo N times, each profiled afresh; whether the emulated CPU
instrument is steady enough that one run says something (the spreads against goals). See docs/bench.md."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import read_json

from .report import goal_entry, goals_table, made_line, num_text, summary_provenance, write_json_and_markdown

SHARE_SPREAD_GOAL = 0.02  # poplar's share of the measured ideal: largest - smallest over the runs, at most this
ERROR_SPREAD_GOAL = 0.03  # each policy's prediction error: largest - smallest over the runs, at most (3 points)


def _spread(values: list[float]) -> float | None:
    return max(values) - min(values) if values else None


def summarize_steadiness(reports: list[dict[str, Any]], *, failed: dict[int, str] | None = None) -> dict[str, Any]:
    """Every run's figures and their spreads, with the goals evaluated (reported, never asserted); `failed`: the
    runs (numbered from 1 among all of them) whose demo failed, with why: a row each, and no goal is met."""
    failed = failed or {}
    runs = []
    measured = iter(reports)
    for number in range(1, len(reports) + len(failed) + 1):
        if number in failed:
            runs.append(
                {
                    "run": number,
                    "failed": failed[number],
                    "poplar_share_of_ideal": None,
                    "prediction_error": {},
                    "emulation_overrun_share": None,
                    "profiles_from_cache": None,
                }
            )
            continue
        report = next(measured)
        scenario = report["scenarios"][0]
        entries = {e["policy"]: e for e in scenario["policies"] if e["status"] == "ok"}
        runs.append(
            {
                "run": number,
                "poplar_share_of_ideal": (entries.get("poplar") or {}).get("share_of_ideal"),
                "prediction_error": {p: e.get("prediction_error") for p, e in entries.items()},
                "emulation_overrun_share": scenario.get("emulation_overrun_share"),
                "profiles_from_cache": scenario.get("profiles_from_cache"),
            }
        )
    shares = [r["poplar_share_of_ideal"] for r in runs if r["poplar_share_of_ideal"] is not None]
    policies = sorted({p for r in runs for p in r["prediction_error"]})
    error_spreads = {
        p: _spread([r["prediction_error"][p] for r in runs if r["prediction_error"].get(p) is not None])
        for p in policies
    }
    share_spread = _spread(shares)
    met = share_spread is not None and len(shares) == len(runs) and share_spread <= SHARE_SPREAD_GOAL
    goals = [
        goal_entry(
            "poplar share of the measured ideal: spread over the runs", share_spread, f"<= {SHARE_SPREAD_GOAL}", met
        )
    ]
    for policy, spread in error_spreads.items():
        met = spread is not None and spread <= ERROR_SPREAD_GOAL and not failed
        goals.append(
            goal_entry(f"{policy} prediction error: spread over the runs", spread, f"<= {ERROR_SPREAD_GOAL}", met)
        )
    return {
        "kind": "steadiness",
        "data_source": reports[0]["data_source"] if reports else None,
        **summary_provenance(reports),  # the last run's time and machine, together
        "runs": runs,
        "failed_runs": sorted(failed),
        "poplar_share_spread": share_spread,
        "prediction_error_spread": error_spreads,
        "goals": goals,
    }


def render_steadiness(summary: dict[str, Any]) -> str:
    """The runs and their spreads as markdown."""
    policies = sorted(summary["prediction_error_spread"])
    lines = [
        "# poplar-bench demo, repeated from a cold profile cache",
        "",
        f"- data: **{summary['data_source']}**",
        made_line(summary.get("created_utc"), summary.get("machine")) + f", the last of {len(summary['runs'])} runs",
        "",
        "| run | poplar share of ideal | " + " | ".join(f"{p} prediction error" for p in policies) + " | overrun |",
        "| --- | --- | " + " | ".join("---" for _ in policies) + " | --- |",
    ]
    for run in summary["runs"]:
        if run.get("failed"):
            lines.append(
                f"| {run['run']} | failed: {run['failed'].replace('|', '/')} | "
                + " | ".join("" for _ in policies)
                + " |"
            )
            continue
        errors = " | ".join(num_text(run["prediction_error"].get(p), "{:+.3f}") for p in policies)
        lines.append(
            f"| {run['run']} | {num_text(run['poplar_share_of_ideal'], '{:.3f}')} | {errors} | "
            f"{num_text(run['emulation_overrun_share'], '{:.2%}')} |"
        )
    lines += ["", *goals_table(summary["goals"], "{:.3f}")]
    if summary.get("failed_runs"):
        lines += [
            "",
            f"**{len(summary['failed_runs'])} of {len(summary['runs'])} runs failed** and were not measured (no goal "
            f"is met without them): run {', '.join(map(str, summary['failed_runs']))}.",
        ]
    return "\n".join(lines) + "\n"


def run_steadiness(settings: Any, *, out_dir: Path, repetitions: int, name: str = "demo") -> list[Path]:
    """The demo `repetitions` times, each profiled afresh (``force_profile``); each run's report under
    ``OUT/<name>-steadiness/``, the summary as ``<name>-steadiness.json`` and ``.md`` in `out_dir`."""
    from . import demo
    from .prediction_check import failure_text

    settings = dataclasses.replace(settings, force_profile=True)
    reports, failed = [], {}
    for number in range(1, repetitions + 1):
        demo.progress(f"repetition {number}/{repetitions}, profiled afresh")
        try:
            paths = demo.run_demo(settings, out_dir=out_dir / f"{name}-steadiness", name=f"{name}-{number}")
        except RuntimeError as exc:  # its ranks failed or hung (local_ranks.RankFailure): the other runs still run
            failed[number] = failure_text(exc)
            demo.progress(f"repetition {number}/{repetitions} FAILED: {failed[number]}")
            continue
        reports.append(read_json(paths[0]))
    summary = summarize_steadiness(reports, failed=failed)
    paths = write_json_and_markdown(summary, render_steadiness(summary), out_dir, f"{name}-steadiness")
    for goal in summary["goals"]:
        demo.progress(f"goal {goal['goal']} {goal['target']}: {goal['value']} ({'met' if goal['met'] else 'MISSED'})")
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {repetitions} runs failed (run {', '.join(map(str, failed))}); the summary of every "
            f"run, the failed ones named, is in {paths[1]}"
        )
    return paths
