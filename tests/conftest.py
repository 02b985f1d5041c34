"""The suite's two workers (pytest-xdist, the README's `-n 2`) and the tests that must run alone.

A test marked ``exclusive`` asserts on wall-clock times or timeouts a starved process misses:
under xdist it runs while no other test runs. Every other test shares the machine. Without
xdist nothing is locked. See DEVELOPING.md ("Tests").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCK_DIR_VARIABLE = "POPLAR_TEST_LOCK_DIR"
"""Where the controller puts the lock files its workers share (they inherit its environment)."""
_LOCK_DIR = pytest.StashKey[str]()
"""The lock folder this process made and removes (the controller's; workers only inherit it)."""
_COLLECTED_FILES = pytest.StashKey[frozenset]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # xdist's loadfile would queue files by number of tests, most first: the heavy one-test
        # files (launchers, the elastic restart) ran last, and one worker ended ~40 s after the
        # other. `_multi_process_files_first` orders them.
        config.option.loadscopereorder = False
    is_worker = hasattr(config, "workerinput")
    if not is_worker and config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        lock_dir = tempfile.mkdtemp(prefix="poplar-tests-")
        config.stash[_LOCK_DIR] = lock_dir
        os.environ[LOCK_DIR_VARIABLE] = lock_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    lock_dir = config.stash.get(_LOCK_DIR, None)
    if lock_dir is not None:
        os.environ.pop(LOCK_DIR_VARIABLE, None)
        shutil.rmtree(lock_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Before `-m`/`-k` deselect any: the files this session's collection reached.
    config.stash[_COLLECTED_FILES] = frozenset(item.nodeid.split("::")[0] for item in items)
    _multi_process_files_first(items)


MULTI_PROCESS_FOLDER = Path(__file__).parent / "dist"


def _multi_process_files_first(items: list[pytest.Item]) -> None:
    """The long files (tests/dist: ranks, launchers) first, the many short ones after: whichever
    worker ends its last long file first takes more short ones, so both end within seconds."""
    items.sort(key=lambda item: MULTI_PROCESS_FOLDER not in item.path.parents)  # stable: files stay whole


@pytest.fixture
def collected_test_files(request: pytest.FixtureRequest) -> frozenset:
    """The test files this session collected, also those `-m` or `-k` then deselected."""
    return request.config.stash[_COLLECTED_FILES]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # The whole protocol, so that a module fixture set up or torn down by this test is inside the lock.
    lock_dir = os.environ.get(LOCK_DIR_VARIABLE)
    if lock_dir is None or not hasattr(item.config, "workerinput"):
        yield
        return
    with machine_share(Path(lock_dir), exclusive=item.get_closest_marker("exclusive") is not None):
        yield


@contextlib.contextmanager
def machine_share(lock_dir: Path, *, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock over processes: many shared holders or one exclusive one.

    The exclusive side holds the turnstile while it waits and runs, so that shared holders
    queue behind it instead of keeping the machine busy forever (flock alone favours none)."""
    with open(lock_dir / "turnstile", "a") as turnstile, open(lock_dir / "machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
