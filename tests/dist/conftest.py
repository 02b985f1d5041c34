"""Shared setup of the multi-process tests: every test here is marked ``dist`` (and, by
tests/conftest.py, ``multiprocess``).

The ranks are forked by ``harness.run_ranks`` (this directory is on ``sys.path``
in its tests, so ``from harness import run_ranks`` works).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)
