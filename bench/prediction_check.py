"""Prediction error beyond the tuned case: the CPU demo at every ZeRO stage and with 2 to 4 ranks.

Runs `bench.demo` once per case (its own report under ``prediction_check/``), then
summarises each case and policy by the median over the measured repetitions of
|predicted - measured| / measured iteration time: the figure issue 15's goal bounds
(<= 10% on CPU). Every device is an emulated CPU rank; the network is the gloo group
measured by the profiler.

`summarize` and `render_markdown` are pure (they read demo reports), so that tests
check them without running anything.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poplar_search.formats import write_json_atomic

MAX_MEDIAN_ABS_ERROR = 0.10
"""The goal on CPU: median |prediction error| of every case and policy."""


@dataclass(frozen=True, kw_only=True)
class PredictionCase:
    name: str
    """Report file stem under ``prediction_check/``."""
    zero_stage: int
    slowdowns: tuple[float, ...] | None = None
    """One rank per value (`bench.demo_config.devices_from_slowdowns`); None: the demo's default 3 ranks."""


DEFAULT_CASES = (
    PredictionCase(name="stage0-default", zero_stage=0),
    PredictionCase(name="stage1-default", zero_stage=1),
    PredictionCase(name="stage2-default", zero_stage=2),
    PredictionCase(name="stage3-default", zero_stage=3),
    PredictionCase(name="stage1-2ranks", zero_stage=1, slowdowns=(2.5, 5.0)),
    PredictionCase(name="stage2-4ranks", zero_stage=2, slowdowns=(3.0, 4.0, 6.0, 12.0)),
)


def repetition_errors(entry: dict[str, Any]) -> list[float]:
    """(predicted - measured) / measured for each measured repetition of one policy's run."""
    predicted_s = entry["predicted"]["iteration_time_s"]
    return [
        (predicted_s - measured_s) / measured_s for measured_s in entry["measured"]["iteration_time_s"]["repetitions"]
    ]


def summarize(cases: list[tuple[PredictionCase, dict[str, Any]]]) -> dict[str, Any]:
    """One row per case and policy from the cases' demo reports, and whether the goal holds."""
    rows = []
    for case, report in cases:
        scenario = report["scenarios"][0]
        for entry in scenario["policies"]:
            row: dict[str, Any] = {
                "case": case.name,
                "zero_stage": case.zero_stage,
                "ranks": len(scenario["device_types"]) if "device_types" in scenario else None,
                "slowdowns": list(case.slowdowns) if case.slowdowns else None,
                "policy": entry["policy"],
                "status": entry["status"],
            }
            if entry["status"] == "ok" and entry.get("measured") and entry.get("predicted"):
                errors = repetition_errors(entry)
                row |= {
                    "repetitions": len(errors),
                    "errors": errors,
                    "median_abs_error": statistics.median(abs(e) for e in errors),
                    "median_error": statistics.median(errors),
                    "share_of_ideal": entry.get("share_of_ideal"),
                }
            rows.append(row)
    measured = [r for r in rows if "median_abs_error" in r]
    return {
        "kind": "prediction_check",
        "goal": {"median_abs_error_at_most": MAX_MEDIAN_ABS_ERROR},
        "devices": "emulated CPU ranks (gloo); communication priced from the network the profiler measured",
        "profiles": "measured afresh in each case's run"
        if all(report.get("scenarios", [{}])[0].get("profiles_from_cache") is False for _, report in cases)
        else "some cases reused cached profiles (see each case's report)",
        "rows": rows,
        "worst_median_abs_error": max((r["median_abs_error"] for r in measured), default=None),
        "goal_met": bool(measured) and all(r["median_abs_error"] <= MAX_MEDIAN_ABS_ERROR for r in measured),
    }


def render_markdown(summary: dict[str, Any], *, title: str = "Prediction error beyond the tuned case") -> str:
    lines = [
        f"# {title}",
        "",
        (
            f"Devices: {summary['devices']}; profiles: {summary.get('profiles', 'n/a')}. "
            "Error = (predicted - measured) / measured iteration time, per "
            "measured repetition; the goal is a median |error| of at most "
            f"{100 * summary['goal']['median_abs_error_at_most']:.0f}% for every case and policy."
        ),
        "",
        "| case | stage | ranks | policy | repetitions | median abs. error | median error | share of ideal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        if "median_abs_error" not in row:
            lines.append(
                f"| {row['case']} | {row['zero_stage']} | {row['ranks']} | {row['policy']} | {row['status']} | | | |"
            )
            continue
        share = row.get("share_of_ideal")
        lines.append(
            f"| {row['case']} | {row['zero_stage']} | {row['ranks']} | {row['policy']} | {row['repetitions']} | "
            f"{100 * row['median_abs_error']:.1f}% | {100 * row['median_error']:+.1f}% | "
            f"{'' if share is None else f'{share:.3f}'} |"
        )
    worst = summary["worst_median_abs_error"]
    lines += [
        "",
        (
            f"Worst median |error|: {'n/a' if worst is None else f'{100 * worst:.1f}%'}; "
            f"goal {'met' if summary['goal_met'] else 'NOT met'}."
        ),
    ]
    return "\n".join(lines) + "\n"


def run_prediction_check(
    cases: tuple[PredictionCase, ...] = DEFAULT_CASES,
    *,
    out_dir: Path,
    rounds: int = 5,
    iterations: int = 1,
    cache_dir: Path | None = None,
    force_profile: bool = True,
) -> list[Path]:
    """Run the demo for each case and write prediction_check.{json,md} into `out_dir`.

    By default every case profiles afresh: a profile cached from another day or
    machine would measure the profile's staleness, not the cost model.
    """
    from poplar_search.formats import read_json

    from . import demo
    from .demo_config import DemoSettings, default_devices, devices_from_slowdowns

    reports = []
    for number, case in enumerate(cases, start=1):
        started = time.perf_counter()
        demo.progress(f"case {number}/{len(cases)}: {case.name}")
        settings = DemoSettings(
            devices=default_devices() if case.slowdowns is None else devices_from_slowdowns(list(case.slowdowns)),
            zero_stage=case.zero_stage,
            rounds=rounds,
            iterations=iterations,
            cache_dir=cache_dir,
            force_profile=force_profile,
        )
        paths = demo.run_demo(settings, out_dir=out_dir / "prediction_check", name=case.name)
        report = read_json(next(p for p in paths if p.suffix == ".json"))
        reports.append((case, report))
        demo.progress(f"case {case.name} done in {time.perf_counter() - started:.0f} s")
    summary = summarize(reports)
    json_path, md_path = out_dir / "prediction_check.json", out_dir / "prediction_check.md"
    write_json_atomic(summary, json_path)
    md_path.write_text(render_markdown(summary))
    return [json_path, md_path]
