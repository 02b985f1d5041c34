"""The README's test command collects every tier of the suite.

pytest skips directories named ``dist`` unless told otherwise (its default
``norecursedirs``), and tests/dist holds the multi-process tests: this guards the
pyproject setting that keeps them in ``python -m pytest tests``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_test_command_collects_unit_dist_and_gpu_tests():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    files = {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}
    tiers = {Path(f).parts[1] for f in files if f.startswith("tests/")}
    assert tiers == {"unit", "dist", "gpu"}, sorted(files)
    expected = {f"tests/dist/{p.name}" for p in (ROOT / "tests" / "dist").glob("test_*.py")}
    assert expected <= files, sorted(expected - files)
