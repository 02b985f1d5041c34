"""`poplar-bench calibration`: what checking cached profiles at start costs and what it finds.

Three runs of the demo on one profile cache: the first profiles afresh; the second reuses the
cache as it is (``--calibration off``, as before issue 27); the third reuses it checked
(``cached``: a few micro-steps per device type timed at start as training runs them, a curve
off by more than 10% rescaled). Reported: the check's wall time per rank, what it found per
device type, and each run's prediction error per policy. Every device is an emulated CPU rank.

`summarize` and `render_markdown` are pure (they read demo reports), so that tests check them
without running anything.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from poplar_search.formats import write_json_atomic

RUNS = (("fresh", "off", True), ("cached, unchecked", "off", False), ("cached, checked", "cached", False))
"""(name, the demo's calibration, profile afresh) of each run, in order."""


def summarize(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One entry per run: the check's cost and findings, the prediction error per policy, the load."""
    entries = []
    for name, report in runs:
        scenario = report["scenarios"][0]
        timings = report["timings_s"]
        check_s = [v for k, v in timings.items() if k.endswith("_calibration_s")]
        entries.append(
            {
                "run": name,
                "profiles_from_cache": scenario["profiles_from_cache"],
                "calibration": scenario.get("calibration", {}),
                "calibration_s": max(check_s) if check_s else None,
                "profile_s": max((v for k, v in timings.items() if k.endswith("_profile_s")), default=None),
                "prediction_error": {
                    e["policy"]: e.get("prediction_error") for e in scenario["policies"] if e["status"] == "ok"
                },
                "load_average": report.get("machine", {}).get("load_average"),
            }
        )
    return {
        "kind": "calibration",
        "devices": "emulated CPU ranks (gloo), the demo's default cluster (slowdowns 3, 6, 12)",
        "runs": entries,
    }


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.1f}%"


def render_markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# Cached profiles checked at start: cost and findings",
        "",
        f"Devices: {summary['devices']}. Three demo runs on one profile cache (bench/calibration_cost.py); the "
        "check times a few micro-steps per device type at the plans' sizes as training runs them. Prediction "
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
    lines += ["", "The machine (2 cores) was shared with other sessions; its load shows in the errors.", ""]
    return "\n".join(lines)


def run_calibration_check(*, out_dir: Path, rounds: int = 2, cache_dir: Path | None = None) -> list[Path]:
    """The three runs, then calibration.{json,md} in `out_dir` (each run's demo report under ``calibration/``)."""
    import dataclasses

    from poplar_search.formats import read_json

    from . import demo
    from .demo_config import DemoSettings

    with tempfile.TemporaryDirectory(prefix="poplar-calibration-") as tmp:
        base = DemoSettings(rounds=rounds, iterations=1, cache_dir=cache_dir or Path(tmp))
        reports = []
        for name, calibration, fresh in RUNS:
            demo.progress(f"calibration bench: {name}")
            settings = dataclasses.replace(base, calibration=calibration, force_profile=fresh)
            paths = demo.run_demo(settings, out_dir=out_dir / "calibration", name=name.replace(", ", "-"))
            reports.append((name, read_json(next(p for p in paths if p.suffix == ".json"))))
    summary = summarize(reports)
    json_path, md_path = out_dir / "calibration.json", out_dir / "calibration.md"
    write_json_atomic(summary, json_path)
    md_path.write_text(render_markdown(summary))
    return [json_path, md_path]
