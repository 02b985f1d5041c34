"""Prediction error beyond the tuned case: the CPU demo on cases drawn from a seed (`draw_cases`), or the
fixed ones (`DEFAULT_CASES`). See docs/bench.md (poplar-bench predictions)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from .demo_config import default_devices, usable_cores
from .report import made_line, summary_provenance

MAX_MEDIAN_ABS_ERROR = 0.05
"""The goal on CPU: median |prediction error| of every case and policy (emulated compute steady: issue 35)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictionCase:
    name: str
    """Report file stem under ``prediction_check/``."""
    zero_stage: int
    slowdowns: tuple[float, ...] | None = None
    """One rank per value (`poplar_bench.demo_config.devices_from_slowdowns`); None: the demo's default 3 ranks."""
    global_batch_size: int | None = None
    """Samples per iteration; None: the demo's default."""

    @property
    def core_demand(self) -> float | None:
        """Sum over ranks of 1/slowdown: the cores the emulated ranks keep busy (None: the default cluster)."""
        return None if self.slowdowns is None else sum(1.0 / s for s in self.slowdowns)


GLOBAL_BATCH_SIZES = (96, 144, 192, 288)  # the global batches `draw_cases` picks from
MIN_SLOWDOWN, MAX_SLOWDOWN = 1.5, 16.0  # a rank's slowdown in `draw_cases` (uniform in log scale, to a tenth)
MIN_CORE_DEMAND = 0.25  # the least sum of 1/slowdown `draw_cases` draws


def max_core_demand(cores: int) -> float:
    """The most sum of 1/slowdown `draw_cases` draws on `cores` cores: half of them, inside the
    emulation's validity range (docs/limits.md) with room for the rest of a shared machine."""
    return 0.5 * cores


def _slowdowns(rng: random.Random, ranks: int, cores: int) -> tuple[float, ...]:
    """Slowdowns for `ranks` ranks whose sum of 1/slowdown lies in [MIN_CORE_DEMAND, max_core_demand]."""
    low, high = math.log(MIN_SLOWDOWN), math.log(MAX_SLOWDOWN)
    while True:  # accepts about half the draws
        slowdowns = tuple(round(math.exp(rng.uniform(low, high)), 1) for _ in range(ranks))
        if MIN_CORE_DEMAND <= sum(1.0 / s for s in slowdowns) <= max_core_demand(cores):
            return slowdowns


def draw_cases(seed: int, count: int, *, cores: int | None = None) -> tuple[PredictionCase, ...]:
    """`count` cases drawn from `seed` alone (the same cases for the same seed and core count; `cores`: default the
    cores this process may use, `demo_config.usable_cores`)."""
    if count < 1:
        raise ValueError(f"count: expected at least 1 case, found {count}")
    cores = cores or usable_cores()
    rng = random.Random(seed)
    cases = []
    for number in range(1, count + 1):
        stage, ranks = rng.randint(0, 3), rng.randint(2, 4)
        cases.append(
            PredictionCase(
                name=f"seed{seed}-case{number}-stage{stage}-{ranks}ranks",
                zero_stage=stage,
                slowdowns=_slowdowns(rng, ranks, cores),
                global_batch_size=rng.choice(GLOBAL_BATCH_SIZES),
            )
        )
    return tuple(cases)


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


def summarize(
    cases: list[tuple[PredictionCase, dict[str, Any]]],
    *,
    seed: int | None = None,
    calibration: str = "off",
    failed: list[tuple[PredictionCase, str]] | tuple = (),
) -> dict[str, Any]:
    """One row per case and policy from the cases' demo reports, and whether the goal holds (`seed`: None for the
    fixed cases; `calibration`: the demo's, said in the report; `failed`: the cases whose demo failed, each with
    why, a row each: the goal is not met without them)."""
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
    for case, error in failed:
        rows.append(
            {
                "case": case.name,
                "zero_stage": case.zero_stage,
                "ranks": len(case.slowdowns) if case.slowdowns else len(default_devices()),
                "slowdowns": list(case.slowdowns) if case.slowdowns else None,
                "policy": None,
                "status": "failed",
                "error": error,
            }
        )
    measured = [r for r in rows if "median_abs_error" in r]
    worst = max(measured, key=lambda r: r["median_abs_error"], default=None)
    return {
        "kind": "prediction_check",
        **summary_provenance([report for _, report in cases]),
        "seed": seed,
        "cases": [
            {
                **dataclasses.asdict(case),
                "slowdowns": None if case.slowdowns is None else list(case.slowdowns),
                "core_demand": None if case.core_demand is None else round(case.core_demand, 3),
            }
            for case in [case for case, _ in cases] + [case for case, _ in failed]
        ],
        "failed_cases": [{"case": case.name, "error": error} for case, error in failed],
        "calibration": calibration,
        "load_average": [report.get("machine", {}).get("load_average") for _, report in cases],
        "usable_cpus": next((report.get("machine", {}).get("usable_cpus") for _, report in cases), None),
        "goal": {"median_abs_error_at_most": MAX_MEDIAN_ABS_ERROR},
        "devices": "emulated CPU ranks (gloo); communication priced from the network the profiler measured",
        "profiles": "measured afresh in each case's run"
        if all(report.get("scenarios", [{}])[0].get("profiles_from_cache") is False for _, report in cases)
        else "some cases reused cached profiles (see each case's report)",
        "rows": rows,
        "worst_median_abs_error": None if worst is None else worst["median_abs_error"],
        "worst": None if worst is None else {k: worst[k] for k in ("case", "policy", "median_abs_error")},
        "goal_met": bool(measured)
        and not failed
        and all(r["median_abs_error"] <= MAX_MEDIAN_ABS_ERROR for r in measured),
    }


def _cases_lines(summary: dict[str, Any]) -> list[str]:
    """The cases, as drawn (seed) or fixed, with the cores their ranks keep busy."""
    seed = summary.get("seed")
    lines = [
        f"Cases drawn from seed {seed} (`poplar-bench predictions --seed {seed}`)."
        if seed is not None
        else "The fixed cases (`poplar-bench predictions --fixed`).",
        "",
        "| case | stage | slowdowns | sum of 1/slowdown | global batch |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in summary.get("cases", []):
        slowdowns = (
            "default (3, 6, 12)" if case["slowdowns"] is None else ", ".join(f"{v:g}" for v in case["slowdowns"])
        )
        demand = "0.58" if case["core_demand"] is None else f"{case['core_demand']:.2f}"
        batch = case["global_batch_size"] or "default (192)"
        lines.append(f"| {case['name']} | {case['zero_stage']} | {slowdowns} | {demand} | {batch} |")
    loads = [load for load in summary.get("load_average", []) if load]
    if loads:
        lines += [
            "",
            f"Load average (1 min) at the end of each case: {', '.join(f'{load[0]:.1f}' for load in loads)} "
            f"({summary.get('usable_cpus') or 'unknown'} usable CPUs; the ranks' own load included).",
        ]
    return [*lines, ""]


def render_markdown(summary: dict[str, Any], *, title: str = "Prediction error beyond the tuned case") -> str:
    lines = [
        f"# {title}",
        "",
        made_line(summary.get("created_utc"), summary.get("machine")) + " (the last case's report)",
        "",
        f"Devices: {summary['devices']}; profiles: {summary.get('profiles', 'n/a')}; calibration at start: "
        f"{summary.get('calibration', 'off')}. Error = (predicted - measured) / measured iteration time, per "
        "measured repetition; the goal is a median |error| of at most "
        f"{100 * summary['goal']['median_abs_error_at_most']:.0f}% for every case and policy.",
        "",
        *_cases_lines(summary),
        "| case | stage | ranks | policy | repetitions | median abs. error | median error | share of ideal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        if row["status"] == "failed":
            lines.append(
                f"| {row['case']} | {row['zero_stage']} | {row['ranks']} | every policy | failed: "
                f"{row['error'].replace('|', '/')} | | | |"
            )
            continue
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
    worst = summary.get("worst")
    shown = "n/a" if worst is None else f"{100 * worst['median_abs_error']:.1f}% ({worst['case']}, {worst['policy']})"
    lines += ["", f"Worst median |error|: {shown}; goal {'met' if summary['goal_met'] else 'NOT met'}."]
    failed = summary.get("failed_cases") or []
    if failed:
        lines += [
            "",
            f"**{len(failed)} of {len(summary['cases'])} cases failed** and were not measured (the goal is not met "
            f"without them): {', '.join(f['case'] for f in failed)}.",
        ]
    return "\n".join(lines) + "\n"


def failure_text(exc: BaseException) -> str:
    """Why a case's demo failed, in one line: each failed rank's exit code and last line (a `RankFailure`, whose
    full tracebacks the ranks printed), else the error's last line."""
    outcomes = [o for o in getattr(exc, "outcomes", []) if not o.ok]
    if outcomes:
        return "; ".join(f"rank {o.rank} (exit code {o.exit_code}): {_last_line(o.error)}" for o in outcomes)
    return _last_line(str(exc))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


class CasesFailed(RuntimeError):
    """Some cases' demos failed; the summary of every case, the failed ones named, was written all the same."""


def run_prediction_check(
    cases: tuple[PredictionCase, ...] = DEFAULT_CASES,
    *,
    out_dir: Path,
    rounds: int = 5,
    iterations: int = 1,
    cache_dir: Path | None = None,
    force_profile: bool = True,
    seed: int | None = None,
    calibration: str = "off",
) -> list[Path]:
    """Run the demo for each case and write prediction_check.{json,md} into `out_dir` (`seed`: what the cases were
    drawn from). Every case profiles afresh by default: a cached profile would measure its staleness, not the model.
    A case whose demo fails is named in the summary and the next case runs; the summary written, `CasesFailed`
    says which failed."""
    from poplar_ext.plan.formats import read_json

    from . import demo
    from .demo_config import DemoSettings, default_devices, devices_from_slowdowns
    from .report import write_json_and_markdown

    reports, failed = [], []
    for number, case in enumerate(cases, start=1):
        started = time.perf_counter()
        demo.progress(f"case {number}/{len(cases)}: {case.name}")
        batch = {} if case.global_batch_size is None else {"global_batch_size": case.global_batch_size}
        settings = DemoSettings(
            devices=default_devices() if case.slowdowns is None else devices_from_slowdowns(list(case.slowdowns)),
            zero_stage=case.zero_stage,
            rounds=rounds,
            iterations=iterations,
            cache_dir=cache_dir,
            force_profile=force_profile,
            calibration=calibration,
            **batch,
        )
        try:
            paths = demo.run_demo(settings, out_dir=out_dir / "prediction_check", name=case.name)
        except RuntimeError as exc:  # its ranks failed or hung (local_ranks.RankFailure): the other cases still run
            failed.append((case, failure_text(exc)))
            demo.progress(f"case {case.name} FAILED after {time.perf_counter() - started:.0f} s: {failed[-1][1]}")
            continue
        reports.append((case, read_json(paths[0])))
        demo.progress(f"case {case.name} done in {time.perf_counter() - started:.0f} s")
    summary = summarize(reports, seed=seed, calibration=calibration, failed=failed)
    paths = write_json_and_markdown(summary, render_markdown(summary), out_dir, "prediction_check")
    if failed:
        raise CasesFailed(
            f"{len(failed)} of {len(cases)} cases failed ({', '.join(case.name for case, _ in failed)}); the summary "
            f"of every case, the failed ones named, is in {paths[1]}"
        )
    return paths
