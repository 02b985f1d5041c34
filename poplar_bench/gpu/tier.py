"""The steps of `poplar-bench gpu` that are tests of tests/gpu, run by pytest in a child process whose output goes
into ``gpu_run.log`` (docs/gpu.md): ``exact``, the equivalence tests, written to ``exact.jsonl`` per (dtype, stage)
as soon as known, so a time-out keeps what finished; ``launcher``, the launcher test (skipped in the dry run, and
then reported as skipped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import StepContext

TIER_MODULE = Path("tests") / "gpu" / "test_runtime_gpu.py"
"""The checks, relative to the repository root (the GPU run starts in a copy of the working tree)."""


def run_exactness(context: StepContext) -> dict[str, Any]:
    """The equivalence tests; their lines, read back from ``exact.jsonl``, and pytest's exit code."""
    lines_path = context.out / "exact.jsonl"
    lines_path.unlink(missing_ok=True)
    exit_code = _pytest(
        context, selection="fp32_equals or bf16_equals", extra_env={"POPLAR_GPU_EXACT_LINES": str(lines_path)}
    )
    lines = [json.loads(line) for line in lines_path.read_text().splitlines()] if lines_path.exists() else []
    result: dict[str, Any] = {"pytest_exit_code": exit_code, "lines": lines}
    wrong = [
        f"{line['check']} at stage {line['zero_stage']}"
        for line in lines
        if line["within_tolerance"] == ("mutation" in line["check"])
    ]
    if exit_code != 0 or wrong or not lines:
        stopped = f"stopped after {context.timeout_s:.0f} s; " if exit_code is None else ""
        result["error"] = (
            f"{stopped}pytest exit code {exit_code}; {len(lines)} lines; "
            f"outside what they must show: {', '.join(wrong) or 'none'} (pytest's output: gpu_run.log)"
        )
    return result


def run_launcher(context: StepContext) -> dict[str, Any]:
    """The deepspeed launcher with bf16 and the cluster read from the hardware (skipped by pytest in the dry run)."""
    report = context.work_dir / "launcher.xml"
    exit_code = _pytest(context, selection="launcher", extra_env={}, more=[f"--junitxml={report}"])
    result: dict[str, Any] = {"pytest_exit_code": exit_code}
    if exit_code != 0:
        stopped = f"stopped after {context.timeout_s:.0f} s; " if exit_code is None else ""
        result["error"] = f"{stopped}pytest exit code {exit_code} (pytest's output: gpu_run.log)"
    elif reason := _skip_reason(report):  # pytest exits 0 when it skipped every test: not a launcher that ran
        result.update(skipped=True, reason=reason)
    return result


def _skip_reason(junit_xml: Path) -> str | None:
    """pytest's reason where it skipped every test of its JUnit report `junit_xml`, else None."""
    import xml.etree.ElementTree as ElementTree

    cases = list(ElementTree.parse(junit_xml).iter("testcase")) if junit_xml.is_file() else []
    skips = [case.find("skipped") for case in cases]
    if not cases or any(skip is None for skip in skips):
        return None
    return skips[0].get("message") or "skipped by pytest"


def _pytest(context: StepContext, *, selection: str, extra_env: dict[str, str], more: list[str] = ()) -> int | None:
    repo = context.settings.repo
    if not (repo / TIER_MODULE).is_file():
        raise ValueError(f"{repo / TIER_MODULE}: expected the GPU checks (run from the repository root)")
    context.work_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **extra_env}
    if context.settings.dry_run:
        env["POPLAR_GPU_TIER_ON_CPU"] = "1"
    command = [
        sys.executable, "-m", "pytest", str(TIER_MODULE), "-k", selection, "-p", "no:cacheprovider", "-q", "-rA",
        f"--basetemp={context.work_dir / 'pytest'}", *more,
    ]  # fmt: skip
    context.log.say(" ".join(command))
    with context.log.path.open("a") as log:
        return run_in_own_group(command, cwd=repo, env=env, log=log, timeout_s=context.timeout_s)


def run_in_own_group(command: list[str], *, cwd: Path, env: dict[str, str], log: Any, timeout_s: float) -> int | None:
    """The command's exit code, or None when it ran past `timeout_s` and was killed with every rank it forked
    (its own process group: ranks left behind would hold the GPU for the next step)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def exactness_markdown(result: dict[str, Any]) -> list[str]:
    """The exactness step's lines of the run's markdown report."""
    lines = ["| check | ZeRO stage | largest difference | tolerance | within | device | s |", "| --- " * 7 + "|"]
    for line in result.get("lines", []):
        lines.append(
            f"| {line['check']} | {line['zero_stage']} | {line['max_difference']:.3g} | {line['tolerance']:g} | "
            f"{line['within_tolerance']} | {line['device']} | {line['seconds']:.1f} |"
        )
    if result.get("lines"):
        lines += ["", f"Collectives: {result['lines'][0]['collectives']}."]
    return lines
