"""The suite's worker machinery (tests/conftest.py): an ``exclusive`` test runs alone; the files' order;
the fast tier refuses an unmarked test's processes."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import multiprocessing
import multiprocessing.resource_tracker
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _suite_conftest():
    spec = importlib.util.spec_from_file_location("suite_conftest", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _held(path: Path) -> bool:
    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_exclusive_holder_waits_for_the_shared_one_and_shared_ones_queue_behind_it(tmp_path):
    machine_share = _suite_conftest().machine_share
    order: list[str] = []
    release = {name: threading.Event() for name in ("first", "exclusive", "second")}

    def hold(name: str, exclusive: bool) -> None:
        with machine_share(tmp_path, exclusive=exclusive):
            order.append(name)
            release[name].wait(30)

    first = threading.Thread(target=hold, args=("first", False))
    first.start()
    _wait_until(lambda: order == ["first"])
    exclusive = threading.Thread(target=hold, args=("exclusive", True))
    exclusive.start()
    _wait_until(lambda: _held(tmp_path / "turnstile"))  # it waits for the machine, holding the turnstile
    second = threading.Thread(target=hold, args=("second", False))
    second.start()
    time.sleep(0.2)
    assert order == ["first"], "neither runs beside a shared holder's test"
    release["first"].set()
    _wait_until(lambda: len(order) == 2)
    time.sleep(0.2)
    assert order == ["first", "exclusive"], "the exclusive test runs alone"
    release["exclusive"].set()
    _wait_until(lambda: len(order) == 3)
    release["second"].set()
    for thread in (first, exclusive, second):
        thread.join(30)
    assert order == ["first", "exclusive", "second"]


_TESTS = """
import json, os, time
from pathlib import Path
import pytest

def _record(name):
    start = time.monotonic()
    time.sleep(0.3)
    worker = os.environ["PYTEST_XDIST_WORKER"]
    Path(os.environ["RECORDS"], name).write_text(json.dumps([start, time.monotonic(), worker]))

@pytest.mark.exclusive
def test_alone():  # first: the other worker starts a shared test at the same time
    _record("alone")

@pytest.mark.parametrize("n", range(6))
def test_shared(n):
    _record(f"shared{n}")
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_under_two_workers_the_exclusive_test_overlaps_no_other(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    exclusive: runs alone\n")
    (suite / "test_timed.py").write_text(_TESTS)
    records = tmp_path / "records"
    records.mkdir()
    # The run's own temporary folder: another pytest session on the machine makes its lock folder in the shared one.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(suite)],
        cwd=suite,
        env={**os.environ, "RECORDS": str(records), "TMPDIR": str(private_tmp)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spans = {p.name: json.loads(p.read_text()) for p in records.iterdir()}
    assert len(spans) == 7
    assert {worker for _, _, worker in spans.values()} == {"gw0", "gw1"}, "both workers ran tests"
    alone_start, alone_end, _ = spans.pop("alone")
    assert all(end <= alone_start or start >= alone_end for start, end, _ in spans.values()), spans
    assert not list(private_tmp.glob("poplar-tests-*")), "its lock files removed"


def test_the_multi_process_files_are_queued_first_in_collection_order():
    """xdist's loadfile takes files in the order collected once its reorder (most tests first) is off."""
    conftest = _suite_conftest()
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True, markexpr=""), workerinput={}, stash={})
    conftest.pytest_configure(config)
    assert config.option.loadscopereorder is False

    tests = CONFTEST.parent
    names = ["unit/test_a.py::x", "unit/test_a.py::y", "dist/test_b.py::x", "dist/test_b.py::y"]
    names += ["gpu/test_c.py::x", "dist/test_d.py::x", "unit/test_e.py::x"]
    items = [SimpleNamespace(path=tests / name.split("::")[0], nodeid=name) for name in names]
    conftest._multi_process_files_first(items)
    assert [item.nodeid for item in items] == [
        "dist/test_b.py::x",
        "dist/test_b.py::y",
        "dist/test_d.py::x",
        "unit/test_a.py::x",
        "unit/test_a.py::y",
        "gpu/test_c.py::x",
        "unit/test_e.py::x",
    ]


@pytest.mark.parametrize(
    ("mark_expression", "fast_tier"),
    [
        ("not multiprocess", True),
        ("not multiprocess and not gpu", True),
        ("gpu or not multiprocess", True),
        ("not dist", False),
        ("multiprocess", False),
        ("", False),
        (None, False),
        ("not (", False),  # pytest itself reports the bad expression
    ],
)
def test_the_fast_tier_is_any_selection_that_leaves_multiprocess_tests_out(mark_expression, fast_tier):
    assert _suite_conftest().deselects_multiprocess(mark_expression) is fast_tier


def _protocol_of(conftest, *, fast_tier: bool, marks: tuple[str, ...]):
    item = SimpleNamespace(
        nodeid="tests/unit/test_x.py::test_y",
        config=SimpleNamespace(stash={conftest._FAST_TIER: fast_tier}),
        get_closest_marker=lambda name: name if name in marks else None,
    )
    return conftest.pytest_runtest_protocol(item, None)


def test_in_the_fast_tier_an_unmarked_test_fails_where_it_starts_a_process(monkeypatch):
    conftest = _suite_conftest()
    monkeypatch.delenv(conftest.LOCK_DIR_VARIABLE, raising=False)
    popen_init, fork = subprocess.Popen.__init__, os.fork
    protocol = _protocol_of(conftest, fast_tier=True, marks=())
    next(protocol)  # inside: the test's setup, call and teardown
    starts = {
        "subprocess": lambda: subprocess.run([sys.executable, "-c", "pass"]),
        "fork": lambda: os.fork() or os._exit(0),  # a child, were one started, leaves at once
        "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        "system": lambda: os.system("true"),
        "resource tracker": multiprocessing.resource_tracker.ResourceTracker().ensure_running,
    }
    try:
        for start in starts.values():
            with pytest.raises(pytest.fail.Exception, match="test_x.py::test_y starts a process: mark it `multipr"):
                start()
        with pytest.raises(StopIteration):
            next(protocol)
    finally:
        protocol.close()  # the patches undone even where an assertion failed
    assert (subprocess.Popen.__init__, os.fork) == (popen_init, fork), "restored after the test"


@pytest.mark.parametrize(("fast_tier", "marks"), [(True, ("multiprocess",)), (False, ())])
def test_a_marked_test_or_the_whole_suite_starts_processes_unhindered(fast_tier, marks, monkeypatch):
    conftest = _suite_conftest()
    monkeypatch.delenv(conftest.LOCK_DIR_VARIABLE, raising=False)
    popen_init, fork = subprocess.Popen.__init__, os.fork
    protocol = _protocol_of(conftest, fast_tier=fast_tier, marks=marks)
    next(protocol)
    try:
        assert (subprocess.Popen.__init__, os.fork) == (popen_init, fork)
        with pytest.raises(StopIteration):
            next(protocol)
    finally:
        protocol.close()
