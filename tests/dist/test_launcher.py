"""The example script under the real launchers (deepspeed and torchrun), and
poplar-profile under the deepspeed launcher as the docs give it; CPU/gloo.

Each launch costs 10-25 s (fresh interpreters import deepspeed), so there is one
run per launcher and form.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import assert_launch_finished, free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _launch(launcher: list[str], tmp_path: Path) -> tuple[dict, str]:
    result = tmp_path / "result.json"
    command = launcher + [
        str(REPO / "examples" / "train.py"),
        "--deepspeed_config",
        str(REPO / "examples" / "ds_config.json"),
        "--steps",
        str(STEPS),
        "--result",
        str(result),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    # Rank 0's summary follows the last (collective) step: gloo's exit race may abort a rank after it
    # (pytorch/pytorch#179291, docs/fault-tolerance.md).
    assert_launch_finished(done.returncode, log, [result], f"{' '.join(command)} failed:\n{log[-4000:]}")
    return json.loads(result.read_text()), log


def _check(summary: dict, log: str) -> None:
    assert summary["world_size"] == 2
    assert summary["global_batch_size"] == 12  # the plan's, not DeepSpeed's nominal 4*2*2
    assert (summary["rank0_micro_batch_size"], summary["rank0_gradient_accumulation_steps"]) == (4, 2)
    assert summary["consumed_samples"] == STEPS * 12
    assert summary["rank0_device"] == "cpu (real)"
    assert summary["devices"] == ["cpu (real)", "cpu-slow (emulated: 2x slower, 2.0 GB)"]
    assert "rank 1: cpu-slow (emulated: 2x slower, 2.0 GB), micro-batch 2 x 2" in log
    # The example's loop reads the weighted loss backward returns without torch's warning about a tensor that
    # requires grad turned into a float (one per rank, in every run a user starts).
    assert "Converting a tensor with requires_grad=True" not in log


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_deepspeed_launcher(tmp_path):
    port = free_port()
    _check(*_launch(["deepspeed", "--num_gpus", "2", "--master_port", str(port)], tmp_path))
    # DeepSpeed's CPU shared-memory op names a 69 MB buffer per rank in /dev/shm and never removes it:
    # every job would keep its ranks' buffers in memory until the machine restarts.
    assert sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []


def test_torchrun(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    _check(*_launch(launcher, tmp_path))


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_profiler_as_a_module_under_the_deepspeed_launcher(tmp_path):
    # The form the docs and error messages give: `--module` runs `python -m`, which
    # works wherever poplar_ext is importable (a pyenv shim from `which` does not).
    cluster = {
        "schema_version": 1,
        "nodes": [
            {
                "name": "localhost",
                "devices": [{"device_type": "cpu-fast", "count": 1}, {"device_type": "cpu-slow", "count": 1}],
            }
        ],
        "device_types": {
            "cpu-fast": {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": 8_000_000_000}},
            "cpu-slow": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 8_000_000_000}},
        },
    }
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    # torch_adam: DeepSpeed's own CPU Adam is a C++ op compiled on first use (~70 s).
    (tmp_path / "ds.json").write_text(
        json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}}})
    )
    command = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "poplar_ext.profiler",
        "--deepspeed_config",
        "ds.json",
        "--cluster",
        "cluster.json",
        "--model",
        "toy-gpt",
        "--layers",
        "1",
        "--hidden-size",
        "32",
        "--heads",
        "2",
        "--vocab-size",
        "64",
        "--sequence-length",
        "16",
        "--zero-stages",
        "1",
        "--max-micro-batch-size",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--output-dir",
        "prof",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = sorted(p.name for p in (tmp_path / "prof").glob("*.json"))
    assert [name.split("-", 4)[-1] for name in written] == [
        "cpu-fast-zero1-ckpt.json",
        "cpu-fast-zero1.json",
        "cpu-slow-zero1-ckpt.json",
        "cpu-slow-zero1.json",
    ], written
    profile = json.loads((tmp_path / "prof" / written[3]).read_text())
    assert profile["device_type"] == "cpu-slow" and profile["emulated"]["slowdown"] == 2.0


_SCRIPT_STARTS_ITS_GROUP = """
import os, torch.distributed as dist
dist.init_process_group("gloo")  # the script's own group, before poplar-ext joins it
from poplar_ext.collectives import ensure_process_group
ensure_process_group(dist_backend="gloo")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")  # as deepspeed.initialize does when it builds the engine
print(os.environ["MASTER_PORT"])
"""


def test_shared_memory_names_are_released_where_the_script_started_its_group(tmp_path):
    """DeepSpeed's backend, made for a group the script started, leaves no /dev/shm buffer either."""
    from poplar_bench.local_ranks import run_command_ranks

    outcomes = run_command_ranks(
        [sys.executable, "-c", _SCRIPT_STARTS_ITS_GROUP],
        world_size=2,
        log_dir=tmp_path,
        timeout_s=120,
        env={"LOCAL_SIZE": "2", "PYTHONPATH": str(REPO)},  # LOCAL_SIZE: as the deepspeed launcher sets it
    )
    assert [o.error for o in outcomes] == ["", ""]
    port = (tmp_path / "rank0.out").read_text().split()[-1]  # its last line (DeepSpeed prints before it)
    assert port.isdigit(), port
    assert sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []
