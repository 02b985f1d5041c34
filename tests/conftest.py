"""The suite's two workers (pytest-xdist, the README's `-n 2`), the tests that must run alone, the fast tier.

A test marked ``exclusive`` asserts on wall-clock times or timeouts a starved process misses:
under xdist it runs while no other test runs. Every other test shares the machine. Without
xdist nothing is locked. The fast tier (``-m "not multiprocess"``) fails a test that starts a
process without the ``multiprocess`` mark. See DEVELOPING.md ("Tests").
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing.process
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import _posixsubprocess
except ImportError:  # not POSIX
    _posixsubprocess = None

LOCK_DIR_VARIABLE = "POPLAR_TEST_LOCK_DIR"
"""Where the controller puts the lock files its workers share (they inherit its environment)."""
_LOCK_DIR = pytest.StashKey[str]()
"""The lock folder this process made and removes (the controller's; workers only inherit it)."""
_COLLECTED_FILES = pytest.StashKey[frozenset]()
_FAST_TIER = pytest.StashKey[bool]()
MULTIPROCESS = "multiprocess"
"""The mark of a test that starts processes (ranks, launchers, a fresh interpreter): outside the fast tier."""


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # xdist's loadfile would queue files by number of tests, most first: the heavy one-test
        # files (launchers, the elastic restart) ran last, and one worker ended ~40 s after the
        # other. `_multi_process_files_first` orders them.
        config.option.loadscopereorder = False
    config.stash[_FAST_TIER] = deselects_multiprocess(config.option.markexpr)
    if config.stash[_FAST_TIER]:
        platform.platform()  # asks `uname -p` once per process (cached): not a test's process
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
    for item in items:
        if any(folder in item.path.parents for folder in _WHOLLY_MULTIPROCESS):
            item.add_marker(MULTIPROCESS)
    _multi_process_files_first(items)


MULTI_PROCESS_FOLDER = Path(__file__).parent / "dist"
_WHOLLY_MULTIPROCESS = (MULTI_PROCESS_FOLDER, Path(__file__).parent / "gpu")
"""Folders whose every test starts ranks (tests/gpu: on CUDA): marked ``multiprocess`` here, before `-m` deselects."""


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
    with contextlib.ExitStack() as stack:
        if item.config.stash.get(_FAST_TIER, False) and item.get_closest_marker(MULTIPROCESS) is None:
            stack.enter_context(refusing_new_processes(item.nodeid))
        lock_dir = os.environ.get(LOCK_DIR_VARIABLE)
        if lock_dir is not None and hasattr(item.config, "workerinput"):
            exclusive = item.get_closest_marker("exclusive") is not None
            stack.enter_context(machine_share(Path(lock_dir), exclusive=exclusive))
        yield


def deselects_multiprocess(mark_expression: str | None) -> bool:
    """Whether `-m mark_expression` leaves out a test marked only ``multiprocess``: the fast tier."""
    if not mark_expression:
        return False
    from _pytest.mark.expression import Expression  # pytest's own evaluation of `-m`

    try:
        return not Expression.compile(mark_expression).evaluate(lambda name, **kwargs: name == MULTIPROCESS)
    except Exception:  # SyntaxError (pytest 9) or ParseError: pytest names the bad expression when it deselects
        return False


@contextlib.contextmanager
def refusing_new_processes(nodeid: str) -> Iterator[None]:
    """A test of the fast tier fails where it would start a process: its mark is missing, and the
    tier would grow slow unseen. A failure, not an exception the test could catch."""

    def refuse(*args, **kwargs):
        pytest.fail(f"{nodeid} starts a process: mark it `{MULTIPROCESS}`, which the fast tier leaves out")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        if _posixsubprocess is not None:  # multiprocessing's helpers (resource tracker, forkserver) start through it
            patch.setattr(_posixsubprocess, "fork_exec", refuse)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(os, name, refuse)
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
