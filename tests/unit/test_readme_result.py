"""The README's result table is the committed demo run's (bench/results/demo.json), not a memory of one."""

from __future__ import annotations

import json
from pathlib import Path

from poplar_bench.report import readme_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_shows_the_committed_demo_run():
    report = json.loads((ROOT / "bench" / "results" / "demo.json").read_text())
    assert readme_table(report) in (ROOT / "README.md").read_text()
