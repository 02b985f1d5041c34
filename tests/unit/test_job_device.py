"""A rank's device is chosen before its process group starts (issue 32, item 1).

DeepSpeed binds the process group to ``cuda:$LOCAL_RANK`` when it starts it, and its
engine and ZeRO-3 partitioning take LOCAL_RANK as a device index too; ranks sharing a
GPU (the test and bench harness) or given one GPU each through CUDA_VISIBLE_DEVICES must
therefore have a LOCAL_RANK that names a visible device before the group starts. CUDA is
faked here: the order of the calls and the environment they see are what is checked.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

import poplar_ext.collectives as collectives
import poplar_ext.hardware.devices as devices
from poplar_bench import local_ranks


class _FakeCudaAccelerator:
    def device_name(self) -> str:
        return "cuda"


@pytest.fixture
def fake_cuda(monkeypatch):
    """One visible CUDA device; `selected` records set_device's calls."""
    import deepspeed.accelerator

    selected: list[int] = []
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _FakeCudaAccelerator())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.delenv(devices.LAUNCHER_LOCAL_RANK_VARIABLE, raising=False)
    return selected


@pytest.mark.parametrize("launcher_local_rank", ["1", "2", "3"])
def test_a_rank_beyond_the_visible_gpus_gets_a_local_rank_naming_a_visible_one(
    fake_cuda, monkeypatch, launcher_local_rank
):
    monkeypatch.setenv("LOCAL_RANK", launcher_local_rank)
    device = devices.select_job_device()
    assert device == torch.device("cuda", 0)
    assert fake_cuda == [0]
    # What DeepSpeed reads as the device index from here on:
    assert devices.os.environ["LOCAL_RANK"] == "0"
    assert devices.os.environ[devices.LAUNCHER_LOCAL_RANK_VARIABLE] == launcher_local_rank


def test_a_local_rank_that_names_a_visible_gpu_is_left_as_it_is(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devices.select_job_device() == torch.device("cuda", 2)
    assert devices.os.environ["LOCAL_RANK"] == "2"
    assert devices.LAUNCHER_LOCAL_RANK_VARIABLE not in devices.os.environ


def test_selecting_twice_keeps_the_launchers_local_rank(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    devices.select_job_device()
    devices.select_job_device()
    assert devices.os.environ[devices.LAUNCHER_LOCAL_RANK_VARIABLE] == "2"


def test_join_job_starts_the_group_after_the_device_is_chosen(fake_cuda, monkeypatch):
    seen_at_group_start: list[str] = []
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(collectives, "discover_launch_environment", lambda **options: None)
    monkeypatch.setattr(
        collectives,
        "ensure_process_group",
        lambda **options: seen_at_group_start.append(devices.os.environ["LOCAL_RANK"]),
    )
    assert devices.join_job(dist_backend="gloo") == torch.device("cuda", 0)
    assert seen_at_group_start == ["0"], "the group started before LOCAL_RANK named a visible device"
    assert fake_cuda == [0]


def test_the_harness_chooses_the_device_before_its_gloo_group(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(local_ranks, "skip_deepspeed_shm_op", lambda: calls.append("no shm op"))
    monkeypatch.setattr(collectives, "discover_launch_environment", lambda **options: calls.append("discover"))
    monkeypatch.setattr(devices, "select_job_device", lambda: calls.append("device"))
    monkeypatch.setattr(
        collectives, "ensure_process_group", lambda **options: calls.append(f"group {options['dist_backend']}")
    )
    local_ranks._join_process_group(5.0)
    assert calls == ["no shm op", "discover", "device", "group gloo"]


def test_the_process_group_fails_in_minutes_unless_the_user_chose_a_timeout(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert collectives.process_group_options({})["timeout"] == timedelta(seconds=collectives.PROCESS_GROUP_TIMEOUT_S)
    assert collectives.PROCESS_GROUP_TIMEOUT_S <= 15 * 60
    chosen = timedelta(hours=2)
    assert collectives.process_group_options({"timeout": chosen})["timeout"] == chosen
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "45")  # DeepSpeed's own variable, in minutes: DeepSpeed applies it
    assert "timeout" not in collectives.process_group_options({"distributed_port": 29500})


def test_launch_variables_are_discovered_only_where_no_launcher_set_them(monkeypatch):
    from deepspeed.comm import comm as ds_comm

    discovered: list[int] = []
    monkeypatch.setattr(ds_comm, "in_aml", lambda: False)
    monkeypatch.setattr(ds_comm, "in_aws_sm", lambda: False)
    monkeypatch.setattr(ds_comm, "mpi_discovery", lambda distributed_port, verbose: discovered.append(distributed_port))
    launcher = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    collectives.discover_launch_environment(distributed_port=1234)
    assert discovered == []
    monkeypatch.delenv("LOCAL_RANK")
    collectives.discover_launch_environment(distributed_port=1234)
    assert discovered == [1234]
    collectives.discover_launch_environment(auto_mpi_discovery=False)
    assert discovered == [1234]


def test_a_script_started_by_hand_trains_as_one_process(monkeypatch):
    from deepspeed.comm import comm as ds_comm

    discovered: list[int] = []
    monkeypatch.setattr(ds_comm, "in_aml", lambda: False)
    monkeypatch.setattr(ds_comm, "in_aws_sm", lambda: False)
    monkeypatch.setattr(ds_comm, "mpi_discovery", lambda distributed_port, verbose: discovered.append(distributed_port))
    for name in (*collectives._LAUNCH_VARIABLES, *collectives.MPI_RANK_VARIABLES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    collectives.discover_launch_environment(distributed_port=1234)
    assert discovered == [], "no MPI discovery: it fails without mpi4py"
    assert {v: os.environ[v] for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    # Under mpirun (its rank variables set) DeepSpeed's discovery still reads the ranks.
    for name in (*collectives._LAUNCH_VARIABLES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    collectives.discover_launch_environment(distributed_port=1234)
    assert discovered == [1234]


def test_a_stray_launch_variable_without_mpi4py_names_what_to_change(monkeypatch):
    # MASTER_PORT left in the shell, the script started by hand: DeepSpeed's MPI discovery runs and, without
    # mpi4py, failed with a bare "No module named 'mpi4py'" that named neither the variable nor a launcher.
    from deepspeed.comm import comm as ds_comm

    def no_mpi4py(distributed_port, verbose):
        raise ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py")

    monkeypatch.setattr(ds_comm, "in_aml", lambda: False)
    monkeypatch.setattr(ds_comm, "in_aws_sm", lambda: False)
    monkeypatch.setattr(ds_comm, "mpi_discovery", no_mpi4py)
    for name in (*collectives._LAUNCH_VARIABLES, *collectives.MPI_RANK_VARIABLES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"MASTER_PORT.*RANK.*torchrun.*mpi4py") as error:
        collectives.discover_launch_environment(distributed_port=1234)
    assert isinstance(error.value.__cause__, ModuleNotFoundError)
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(ValueError, match=r"PMI_RANK \(mpirun's ranks\).*pip install mpi4py"):
        collectives.discover_launch_environment(distributed_port=1234)


def test_under_open_mpi_deepspeeds_engine_accepts_the_rewritten_local_rank(fake_cuda, monkeypatch):
    # mpirun with one GPU visible to each process (CUDA_VISIBLE_DEVICES per rank): local rank 1 is device 0, and
    # DeepSpeed's engine asserts OMPI_COMM_WORLD_LOCAL_RANK equals LOCAL_RANK ("not sure how to proceed").
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.select_job_device() == torch.device("cuda", 0)
    engine = SimpleNamespace()
    DeepSpeedEngine._configure_with_arguments(engine, SimpleNamespace(), None)  # what the engine's build does
    assert engine.local_rank == 0
    assert devices.os.environ[devices.LAUNCHER_LOCAL_RANK_VARIABLE] == "1"
