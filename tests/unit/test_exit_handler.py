"""poplar-ext ends the process group it set up before the interpreter shuts down.

A gloo group alive at interpreter shutdown can abort a finished rank (exit -6); the
exit handler `ensure_process_group` registers destroys it first, and is harmless when
the script destroyed it itself. Each case runs in a fresh one-rank interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PRELUDE = """
import atexit
import torch.distributed as dist
from poplar_ext.collectives import free_port

def report():  # registered before poplar-ext's handler, so it runs after it (atexit is LIFO)
    print("group up at exit:", dist.is_initialized(), flush=True)

atexit.register(report)
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
"""


def _run(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_the_group_ensure_process_group_saw_is_destroyed_before_shutdown():
    done = _run("""
        from poplar_ext.collectives import ensure_process_group
        ensure_process_group()
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group up at exit: False" in done.stdout


@pytest.mark.multiprocess
def test_without_poplar_ext_the_group_is_still_up_at_shutdown():
    # the control: what the handler changes
    done = _run("")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group up at exit: True" in done.stdout


@pytest.mark.multiprocess
def test_a_script_that_destroyed_its_group_itself_exits_cleanly():
    done = _run("""
        from poplar_ext.collectives import ensure_process_group
        ensure_process_group()
        dist.destroy_process_group()
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group up at exit: False" in done.stdout
    assert "Traceback" not in done.stderr


def _leave_with(monkeypatch, *, backend: str, failed: bool) -> list[str]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from poplar_ext.collectives import leave_process_group

    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    if failed:
        monkeypatch.setattr(sys, "last_value", RuntimeError("a rank failed"), raising=False)
    else:
        monkeypatch.delattr(sys, "last_value", raising=False)
    leave_process_group()
    return calls


def test_an_nccl_group_is_aborted_when_the_process_leaves_on_an_exception(monkeypatch):
    # destroy_process_group on a broken NCCL communicator can hang; abort does not wait.
    assert _leave_with(monkeypatch, backend="nccl", failed=True) == ["abort"]


def test_a_normal_exit_and_gloo_still_destroy(monkeypatch):
    assert _leave_with(monkeypatch, backend="nccl", failed=False) == ["destroy"]
    assert _leave_with(monkeypatch, backend="gloo", failed=True) == ["destroy"]


def test_a_group_with_a_backend_per_device_is_aborted_where_it_runs_nccl(monkeypatch):
    # dist.init_process_group() without a backend: torch names it "undefined" and runs NCCL for CUDA tensors.
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _leave_with(monkeypatch, backend="undefined", failed=True) == ["abort"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _leave_with(monkeypatch, backend="undefined", failed=True) == ["destroy"]
