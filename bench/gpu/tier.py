"""Step 1 of `poplar-bench gpu`: the GPU test tier (tests/gpu) under pytest, its outcome per test.

The tests record what they measured (``record_property``: each stage's largest parameter
difference, the missing-weight mutation's, the tolerance, what the collectives ran on);
pytest writes it into its JUnit XML, which is read back here. In the dry run the tier's
equivalence tests run on CPU ranks (POPLAR_GPU_TIER_ON_CPU=1, see tests/gpu/test_runtime_gpu.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

TIER = Path("tests") / "gpu"
"""The tier, relative to the repository root (the GPU run starts in a copy of the working tree)."""


def run_tier(*, repo: Path, out_dir: Path, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    """pytest on the tier in a child process (its own CUDA and ranks); each test's outcome and properties.

    Writes ``gpu_tests.xml`` (JUnit) and ``gpu_tests.log`` (pytest's output) into `out_dir`.
    Raises RuntimeError when pytest could not run the tier or a test failed (the result is
    still complete: the caller records it).
    """
    if not (repo / TIER).is_dir():
        raise ValueError(f"{repo / TIER}: expected the GPU test tier (run from the repository root)")
    xml_path, log_path = out_dir / "gpu_tests.xml", out_dir / "gpu_tests.log"
    env = dict(os.environ)
    if dry_run:
        env["POPLAR_GPU_TIER_ON_CPU"] = "1"
    command = [
        sys.executable, "-m", "pytest", str(TIER), "-p", "no:cacheprovider", "-rA", "--durations=10",
        "-o", "junit_family=xunit1",  # xunit2 drops record_property's values
        f"--junitxml={xml_path}",
    ]  # fmt: skip
    with log_path.open("w") as log:
        exit_code = run_in_own_group(command, cwd=repo, env=env, log=log, timeout_s=timeout_s)
    tests = read_junit(xml_path) if xml_path.exists() else []
    result = {"command": " ".join(command), "pytest_exit_code": exit_code, "tests": tests}
    failed = [t["name"] for t in tests if t["outcome"] in ("failed", "error")]
    # pytest's 5: nothing collected, which is a broken tier, not a pass.
    if exit_code != 0 or failed or not tests:
        stopped = f"stopped after {timeout_s:g} s; " if exit_code is None else ""
        result["error"] = f"{stopped}pytest exit code {exit_code}; failed: {failed or 'none'} (log: {log_path.name})"
    return result


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


def read_junit(path: Path) -> list[dict[str, Any]]:
    """Every test case of a JUnit XML file: name, outcome, seconds, message, recorded properties."""
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                outcome, message = name, (child.get("message") or "")[:2000]
                break
        properties = {p.get("name"): _number(p.get("value")) for p in case.iter("property")}
        tests.append(
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "time_s": float(case.get("time") or 0.0),
                "message": message,
                "properties": properties,
            }
        )
    return tests


def _number(text: str | None) -> Any:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def tier_markdown(result: dict[str, Any]) -> list[str]:
    """The tier's lines of the run's markdown report."""
    lines = ["| test | outcome | s | recorded |", "| --- | --- | --- | --- |"]
    for test in result.get("tests", []):
        recorded = "; ".join(f"{k} = {_shown(v)}" for k, v in test["properties"].items())
        detail = recorded or test["message"]
        lines.append(f"| {test['name']} | {test['outcome']} | {test['time_s']:.1f} | {detail.replace('|', '/')} |")
    return lines


def _shown(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
