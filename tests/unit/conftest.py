"""Fixtures every unit test gets."""

from __future__ import annotations

import os
from unittest import mock

import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    """os.environ as the test found it, after it: what a test's libraries set there stays with that test.
    transformers' TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED=true, which sends a plain
    Trainer built later in the same process through DeepSpeed (tests/dist/test_trl.py's reference run: its MPI
    discovery, without mpi4py)."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    """The test runs in its own folder: what it writes to relative paths (a Trainer's ``output_dir``,
    which the Trainer creates) stays out of the repository."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
