"""`poplar-bench clean-exit`: does a finished job exit 0? Every rank's exit code over many launches, busy CPU.
See docs/bench.md (the cases) and docs/fault-tolerance.md (why a rank can abort at exit)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import code_text

_CASE_ARGS = {
    "torch": ["--kind", "torch"],
    "torch-destroyed": ["--kind", "torch", "--destroy"],
    "poplar-no-handler": ["--kind", "poplar", "--handler", "none"],
    "poplar-destroy-only": ["--kind", "poplar", "--handler", "destroy"],
    "poplar": ["--kind", "poplar"],
}
CASES = tuple(_CASE_ARGS)
"""Every case, in the order the report shows them."""


def launch_once(case: str, *, world_size: int, work_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """One launch of `case` on `world_size` local ranks; each rank's exit code and last stderr line.

    A rank still running after `timeout_s` is killed; its exit code is then None.
    """
    from poplar_bench.local_ranks import run_command_ranks

    command = [sys.executable, "-m", "poplar_bench.clean_exit_rank", *_CASE_ARGS[case]]
    if case.startswith("poplar"):
        command += ["--work-dir", str(work_dir)]
    with tempfile.TemporaryDirectory(prefix="logs-", dir=work_dir) as log_dir:
        outcomes = run_command_ranks(
            command, world_size=world_size, log_dir=log_dir, timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1"}
        )
        ranks = []
        for outcome in outcomes:
            lines = [line for line in outcome.log_tail().splitlines() if line.strip()]
            ranks.append(
                {"rank": outcome.rank, "exit_code": outcome.exit_code, "last_stderr_line": lines[-1] if lines else ""}
            )
    return ranks


def summarise(case: str, launches: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Counts for one case: rank exits by code, launches with a failed rank, what the failures said."""
    codes = collections.Counter(r["exit_code"] for ranks in launches for r in ranks)
    failed = [ranks for ranks in launches if any(r["exit_code"] != 0 for r in ranks)]
    said = collections.Counter(r["last_stderr_line"] for ranks in failed for r in ranks if r["exit_code"] != 0)
    return {
        "case": case,
        "launches": len(launches),
        "rank_exits": sum(codes.values()),
        "exit_codes": {str(code): count for code, count in sorted(codes.items(), key=lambda kv: str(kv[0]))},
        "launches_with_a_failed_rank": len(failed),
        "failed_ranks_said": dict(said.most_common()),
    }


def run_clean_exit(
    *,
    launches: int = 30,
    world_size: int = 3,
    busy_processes: int = 2,
    cases: tuple[str, ...] = CASES,
    timeout_s: float = 300.0,
    progress: Any = None,
) -> dict[str, Any]:
    """Launch every case `launches` times in turn beside `busy_processes` spinning processes."""
    from .report import machine_description, utc_now

    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ValueError(f"cases: expected some of {', '.join(CASES)}, found {', '.join(unknown)}")
    repeated = sorted({case for case in cases if cases.count(case) > 1})
    if repeated:  # each launch would run it twice, its row given twice with both counts
        raise ValueError(
            f"cases: expected each case once (--launches sets how often), found {', '.join(repeated)} more than once"
        )
    results: dict[str, list] = {case: [] for case in cases}
    # Each spins until its parent is gone, so that none outlives an interrupted bench.
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(busy_processes)]
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="poplar-clean-exit-") as work:
            for index in range(launches):
                for case in cases:
                    ranks = launch_once(case, world_size=world_size, work_dir=Path(work), timeout_s=timeout_s)
                    results[case].append(ranks)
                    if progress is not None:
                        progress(f"launch {index + 1}/{launches} {case}: exit codes {[r['exit_code'] for r in ranks]}")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return {
        "benchmark": "clean_exit",
        "made": utc_now(),
        "machine": machine_description(),
        "devices": "real CPU ranks (gloo); nothing emulated",
        "world_size": world_size,
        "busy_processes": busy_processes,
        "duration_s": round(time.perf_counter() - started, 1),
        "cases": [summarise(case, results[case]) for case in cases],
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Does a finished job exit 0?",
        "",
        f"Made {report['made']}, {report['world_size']} local ranks per launch beside {report['busy_processes']} "
        f"spinning processes, {report['devices']}; {report['duration_s']:.0f} s in all. Every script ends with a "
        "plain return; each rank's own exit code is counted (poplar_bench/clean_exit.py)."
        + (f" The {code}." if (code := code_text(report.get("machine"))) else ""),
        "",
        "| case | launches | rank exits | exit codes (code: ranks) | launches with a failed rank | failed ranks said |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in report["cases"]:
        codes = ", ".join(f"{code}: {count}" for code, count in case["exit_codes"].items())
        said = "; ".join(f"{text!r} x{count}" for text, count in case["failed_ranks_said"].items()) or "-"
        lines.append(
            f"| {case['case']} | {case['launches']} | {case['rank_exits']} | {codes} | "
            f"{case['launches_with_a_failed_rank']} | {said} |"
        )
    lines += [
        "",
        "torch: torch and gloo alone, the group left up at exit. torch-destroyed: the same, destroyed by the script. "
        "poplar-no-handler: a training script (ZeRO stages 0-3 in turn, an engine each: "
        "poplar_ext.initialize, two steps, a checkpoint, the parameters gathered) with poplar-ext's exit handler "
        "taken back, as before it existed. "
        "poplar-destroy-only: the same with a handler that only destroys the group (its first version). "
        "poplar: the same script as users run it.",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: str | os.PathLike[str], name: str = "clean_exit") -> list[Path]:
    from .report import write_json_and_markdown

    return write_json_and_markdown(report, render_markdown(report), out_dir, name)


__all__ = ["CASES", "launch_once", "render_markdown", "run_clean_exit", "summarise", "write_report"]
