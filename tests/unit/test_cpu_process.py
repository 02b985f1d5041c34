"""Process-wide CPU settings (poplar_ext/hardware/cpu_process.py): applied only when asked, undone where scoped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from poplar_ext.hardware.cpu_process import cpu_threads, limit_cpu_threads


def test_limit_cpu_threads_returns_the_previous_count():
    before = torch.get_num_threads()
    try:
        assert limit_cpu_threads(1) == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_limit_cpu_threads_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="threads: expected an integer >= 1, found"):
        limit_cpu_threads(bad)


def test_cpu_threads_gives_the_count_back_also_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.multiprocess
def test_skipping_deepspeeds_shm_op_means_no_build():
    # In a fresh interpreter: the op is marked incompatible, so DeepSpeed's builder returns None at once.
    code = (
        "import time\n"
        "from poplar_ext.hardware.cpu_process import skip_deepspeed_shm_op\n"
        "skip_deepspeed_shm_op()\n"
        "import deepspeed.ops\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "start = time.perf_counter(); op = build_shm_op()\n"
        "assert deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] is False\n"
        "print(op is None, time.perf_counter() - start < 1.0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True True"
