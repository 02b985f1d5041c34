"""The README's test command collects every tier of the suite, and CI runs the README's two commands.

pytest skips directories named ``dist`` unless told otherwise (its default
``norecursedirs``), and tests/dist holds the multi-process tests: this guards the
pyproject setting that keeps them in ``python -m pytest tests``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _collected_by_the_test_command() -> set[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}


def _tiers(files: set[str]) -> set[str]:
    return {Path(f).parts[1] for f in files if f.startswith("tests/")}


@pytest.mark.multiprocess  # run on fewer paths, it collects the suite in a fresh interpreter
def test_the_test_command_collects_unit_dist_and_gpu_tests(collected_test_files):
    # Run as the README's command or with `-m` (which deselects after collecting), this session's
    # own collection is the answer (a collection error leaves its file out); run on
    # fewer paths, collect the whole suite apart (about 12 s).
    expected = {f"tests/dist/{p.name}" for p in (ROOT / "tests" / "dist").glob("test_*.py")}
    files = set(collected_test_files)
    if _tiers(files) != {"unit", "dist", "gpu"} or not expected <= files:
        files = _collected_by_the_test_command()
    assert _tiers(files) == {"unit", "dist", "gpu"}, sorted(files)
    assert expected <= files, sorted(expected - files)


def test_ci_runs_the_readmes_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```", 2)[1].strip().splitlines()  # the first screen's two commands
    install, test = block[0].split(" && ")[0], block[1]
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and line[0] not in "#"]
    assert ci_commands[-2:] == [install, test], (ci_commands, block)
