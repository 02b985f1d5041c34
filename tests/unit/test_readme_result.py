"""The README's result table is the committed demo run's (bench/results/demo.json), not a memory of one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from poplar_bench.report import readme_table

ROOT = Path(__file__).resolve().parents[2]
DEMO = Path("bench") / "results" / "demo.json"


def _demo_reports() -> list[dict]:
    """The working tree's demo report and, in a git checkout, the committed one: `poplar-bench demo` (the
    README's first command) writes a new run over the working tree's, which the README need not show."""
    reports = [json.loads((ROOT / DEMO).read_text())]
    try:
        committed = subprocess.run(
            ["git", "show", f"HEAD:{DEMO.as_posix()}"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):  # no git: the working tree's alone
        return reports
    if committed.returncode == 0:
        reports.append(json.loads(committed.stdout))
    return reports


@pytest.mark.multiprocess
def test_the_readme_shows_the_committed_demo_run():
    readme = (ROOT / "README.md").read_text()
    tables = [readme_table(report) for report in _demo_reports()]
    assert any(table in readme for table in tables), tables[-1]
