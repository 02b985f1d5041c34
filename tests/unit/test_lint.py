"""The code keeps its written rules: ruff's lint and format, and the import layers (import-linter).

The rules live in pyproject.toml ([tool.ruff], [tool.importlinter]); these tests run the
same tools CI would, so a change that breaks a rule fails the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts a process

ROOT = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing_to_lint():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]')")
    done = _run(sys.executable, "-m", "ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_finds_nothing_to_format():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]')")
    done = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_import_layers_hold():
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[dev]')")
    done = _run(sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
