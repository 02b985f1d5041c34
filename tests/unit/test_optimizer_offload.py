"""Optimizer offload's runtime and profiler parts that need no ranks (issue 16's second lever)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poplar_ext.optimizer_offload import offload_deepspeed_optimizer
from poplar_ext.plan.formats import plan_from_dict
from poplar_ext.profiler.cache import profile_file_name
from poplar_ext.profiler.cli import parse_command, summary
from poplar_ext.runtime.config import nominal_deepspeed_config


def _plan(offload):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": 2,
            "global_batch_size": 8,
            "ranks": [
                {
                    "rank": r,
                    "device_type": "a" if r == 0 else "b",
                    "micro_batch_size": 2,
                    "gradient_accumulation_steps": 2,
                    "optimizer_offload": on,
                }
                for r, on in enumerate(offload)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 8.0, "ideal_samples_per_s": 8.0},
            "profile_fingerprints": {},
        }
    )


def test_only_the_offloading_rank_gets_offload_optimizer():
    user = {"zero_optimization": {"stage": 2, "overlap_comm": True}}
    plan = _plan([False, True])
    plain, offloading = (nominal_deepspeed_config(user, plan, rank) for rank in (0, 1))
    assert "offload_optimizer" not in plain["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in plain
    assert offloading["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert offloading["zero_optimization"]["overlap_comm"] is True
    # A client optimizer steps on the host: DeepSpeed refuses it unless told.
    assert offloading["zero_force_ds_cpu_optimizer"] is False
    assert "offload_optimizer" not in user["zero_optimization"], "the user's config is left as it was"


def test_the_users_offload_options_are_kept():
    config = {
        "zero_optimization": {"offload_optimizer": {"device": "none", "pin_memory": True}},
        "zero_force_ds_cpu_optimizer": True,
    }
    offload_deepspeed_optimizer(config)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["zero_force_ds_cpu_optimizer"] is True, "what the user set stays"
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
    assert offload_deepspeed_optimizer(nvme)["zero_optimization"]["offload_optimizer"]["device"] == "nvme"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n", "devices": [{"device_type": "cpu", "count": 2}]}]})
    )
    return {"ds": str(ds), "cluster": str(cluster)}


def test_the_profile_cli_reads_optimizer_offload(files, capsys):
    from poplar_ext.profiler.cli import main

    args = ["--deepspeed_config", files["ds"], "--cluster", files["cluster"], "--model", "toy-gpt"]
    assert parse_command(args).optimizer_offload == "off"
    assert parse_command([*args, "--optimizer-offload", "smallest"]).optimizer_offload == "smallest"
    assert main([*args, "--optimizer-offload", "sometimes"]) == 2
    assert "--optimizer-offload: invalid choice" in capsys.readouterr().err


def test_profile_model_refuses_an_unknown_offload_mode(tmp_path):
    import torch

    from poplar_ext.profiler import profile_model

    with pytest.raises(ValueError, match="optimizer_offload: expected one of 'off', 'smallest', 'both', found 'yes'"):
        profile_model(
            model_factory=lambda: torch.nn.Linear(2, 1),
            make_batch=lambda b: torch.ones(b, 2),
            ds_config={"optimizer": {"type": "SGD"}},
            cache_dir=tmp_path,
            optimizer_offload="yes",
        )


def test_offloaded_profiles_have_their_own_file_name_and_summary_column():
    import dataclasses

    from poplar_bench.synthetic import synthetic_profile

    plain = synthetic_profile("t4", zero_stage=1, max_micro_batch_size=4, overhead_s=0.01, seconds_per_sample=0.01)
    offloaded = dataclasses.replace(plain, optimizer_offload=True)
    assert profile_file_name(offloaded).endswith("-t4-zero1-offload.json")
    assert profile_file_name(plain).endswith("-t4-zero1.json")
    lines = summary([plain, offloaded]).splitlines()
    assert "optimizer offload" in lines[0]
    assert lines[1].split()[3] == "off" and lines[2].split()[3] == "on"


def test_the_poplar_section_says_what_the_automatic_mode_profiles_offloaded():
    from poplar_ext.plan.errors import FormatError
    from poplar_ext.runtime.config import poplar_config_from_dict

    def read(section):
        return poplar_config_from_dict({"profiles": "p", **section}, base_dir=Path("."), source="ds.json")

    assert read({}).optimizer_offload == "off"
    assert read({"optimizer_offload": "smallest"}).optimizer_offload == "smallest"
    with pytest.raises(
        FormatError, match="ds.json: poplar.optimizer_offload: expected one of 'off', 'smallest', 'both'"
    ):
        read({"optimizer_offload": True})


def test_the_automatic_mode_measures_with_the_sections_offload(monkeypatch, tmp_path):
    import torch

    from poplar_ext.profiler import api
    from poplar_ext.profiler.auto import missing_profiles_measurer

    seen = {}

    def fake_profile_model(**kwargs):
        seen.update(kwargs)
        return []

    # The package's name first: its lazy lookup reads api's, which must still be the real one to restore.
    monkeypatch.setattr("poplar_ext.profiler.profile_model", fake_profile_model)
    monkeypatch.setattr(api, "profile_model", fake_profile_model)
    measure = missing_profiles_measurer(
        model=torch.nn.Linear(2, 1),
        training_data=[torch.ones(2)],
        collate_fn=None,
        optimizer=None,
        ds_config={"optimizer": {"type": "SGD"}},
        profiles_dir=tmp_path,
        micro_batch_size_limit=4,
        optimizer_offload="smallest",
    )
    assert measure([("cpu", 1)], cluster=None) == []
    assert seen["optimizer_offload"] == "smallest" and seen["zero_stages"] == [1]


def test_a_client_optimizer_deepspeed_would_not_offload_is_refused_on_every_rank_before_the_engine(monkeypatch):
    # DeepSpeed raises ZeRORuntimeException on the offloading rank alone, inside its initialize: the other
    # ranks went on and died on a closed connection (gloo) or would wait in a collective (NCCL).
    from types import SimpleNamespace

    import torch

    from poplar_ext.plan.errors import FormatError
    from poplar_ext.zero import initialize as zero_initialize

    def engine_build(*args, **kwargs):
        raise RuntimeError("reached the engine's build")

    job = SimpleNamespace(
        plan=_plan([False, True]),
        ds_config={"zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": True},
        source="ds.json",
        rank=0,
        plan_reason="the plan file plan.json",
    )
    monkeypatch.setattr(zero_initialize, "load_deepspeed_config", lambda *args, **kwargs: ({}, Path("."), "ds.json"))
    monkeypatch.setattr(zero_initialize, "read_poplar_section", lambda *args, **kwargs: None)
    monkeypatch.setattr(zero_initialize, "prepare_job", lambda *args, **kwargs: job)
    monkeypatch.setattr(zero_initialize, "set_up_rank", engine_build)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(FormatError) as refused:
        zero_initialize.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config={})
    assert str(refused.value).startswith(
        "ds.json: zero_force_ds_cpu_optimizer: expected false (or unset) where the plan file plan.json offloads the "
        "optimizer (ranks[1].optimizer_offload) of a client optimizer other than DeepSpeedCPUAdam or "
        "DeepSpeedCPULion"
    ), str(refused.value)
    assert "found True with the client optimizer torch.optim.adam.Adam" in str(refused.value)


def test_what_deepspeed_offloads_passes_the_client_optimizer_check():
    import torch

    from poplar_ext.optimizer_offload import check_client_optimizer_offloads

    class DeepSpeedCPUAdam(torch.optim.Adam):  # DeepSpeed's own host optimizer, by class name
        pass

    params = [torch.nn.Parameter(torch.zeros(1))]
    force = {"zero_force_ds_cpu_optimizer": True}
    offloading, plain = _plan([False, True]), _plan([False, False])
    check_client_optimizer_offloads(force, offloading, DeepSpeedCPUAdam(params), source="ds.json")
    check_client_optimizer_offloads({}, offloading, torch.optim.Adam(params), source="ds.json")  # set false for it
    check_client_optimizer_offloads(force, plain, torch.optim.Adam(params), source="ds.json")
    check_client_optimizer_offloads(force, offloading, None, source="ds.json")  # the config's optimizer section
    check_client_optimizer_offloads(force, offloading, torch.optim.Adam, source="ds.json")  # a factory: DeepSpeed's


def _offloading_job():
    from types import SimpleNamespace

    return SimpleNamespace(
        plan=_plan([False, True]),
        ds_config={"zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": True},
        source="ds.json",
        rank=0,
        plan_reason="the plan file plan.json",
    )


def test_accelerate_maps_adam_and_adamw_faithfully_and_anything_else_is_refused():
    # accelerate (map_pytorch_optim_to_deepspeed) swaps a client optimizer for DeepSpeedCPUAdam where it offloads
    # under zero_force_ds_cpu_optimizer: where the plan offloads some ranks alone, an SGD trained as Adam there.
    import torch

    from poplar_ext.optimizer_offload import check_client_optimizer_offloads
    from poplar_ext.plan.errors import FormatError

    job, params = _offloading_job(), [torch.nn.Parameter(torch.zeros(1))]
    for kind in (torch.optim.Adam, torch.optim.AdamW):
        check_client_optimizer_offloads(job.ds_config, job.plan, kind(params), source="ds.json", accelerate_maps=True)
    with pytest.raises(FormatError) as refused:
        check_client_optimizer_offloads(
            job.ds_config, job.plan, torch.optim.SGD(params, lr=0.1), source="ds.json", accelerate_maps=True
        )
    message = str(refused.value)
    assert message.startswith(
        "ds.json: zero_force_ds_cpu_optimizer: expected false (or unset) where the plan offloads the optimizer "
        "(ranks[1].optimizer_offload) of a client optimizer other than DeepSpeedCPUAdam or "
        "Adam or AdamW (accelerate trains it as DeepSpeedCPUAdam on the offloading ranks alone"
    ), message
    assert "found True with the client optimizer torch.optim.sgd.SGD" in message


@pytest.mark.parametrize(
    ("make", "said"),
    [
        # accelerate 1.15 builds DeepSpeedCPUAdagrad(..., adamw_mode=False): a TypeError on the offloading ranks alone
        (lambda torch, params, _: torch.optim.Adagrad(params), "torch.optim.adagrad.Adagrad; "),
        # DeepSpeedCPUAdam refuses the AMSGrad variant: a RuntimeError on the offloading ranks alone
        (lambda torch, params, _: torch.optim.Adam(params, amsgrad=True), "(amsgrad=True)"),
        (lambda torch, params, _: torch.optim.AdamW(params, maximize=True), "(maximize=True)"),
        # accelerate makes every optimizer but torch's AdamW L2 Adam (adamw_mode False)
        (
            lambda torch, params, _: torch.optim.Adam(params, weight_decay=0.1, decoupled_weight_decay=True),
            "(decoupled_weight_decay=True with weight decay",
        ),
        (lambda torch, params, host: host["DeepSpeedCPUAdam"](params, weight_decay=0.1), "(adamw_mode=True with"),
        (lambda torch, params, host: host["DeepSpeedCPULion"](params), "DeepSpeedCPULion; "),
    ],
    ids=["adagrad", "amsgrad", "maximize", "adam-decoupled", "cpu-adam-adamw-mode", "cpu-lion"],
)
def test_what_accelerate_cannot_swap_for_the_same_rule_is_refused(make, said):
    # Through accelerate, an optimizer DeepSpeed itself would offload is replaced too (map_pytorch_optim_to_deepspeed):
    # Adagrad and amsgrad failed on the offloading ranks alone (the others left waiting), maximize, Adam's decoupled
    # weight decay and DeepSpeedCPUAdam's adamw_mode became L2 Adam there, DeepSpeedCPULion became DeepSpeedCPUAdam.
    import torch

    from poplar_ext.optimizer_offload import check_client_optimizer_offloads
    from poplar_ext.plan.errors import FormatError

    class DeepSpeedCPUAdam(torch.optim.Adam):  # DeepSpeed's host optimizers, by class name (no op build)
        def __init__(self, params, weight_decay=0.0, adamw_mode=True):
            super().__init__(params, weight_decay=weight_decay)
            self.adam_w_mode = adamw_mode

    class DeepSpeedCPULion(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)

    host = {"DeepSpeedCPUAdam": DeepSpeedCPUAdam, "DeepSpeedCPULion": DeepSpeedCPULion}
    job, params = _offloading_job(), [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(FormatError) as refused:
        check_client_optimizer_offloads(
            job.ds_config, job.plan, make(torch, params, host), source="ds.json", accelerate_maps=True
        )
    assert said in str(refused.value), str(refused.value)
    # What accelerate swaps for the same rule passes.
    for faithful in (
        torch.optim.AdamW(params, weight_decay=0.1),
        torch.optim.Adam(params, weight_decay=0.1),
        torch.optim.Adam(params, decoupled_weight_decay=True),  # no weight decay to decouple
        DeepSpeedCPUAdam(params, weight_decay=0.1, adamw_mode=False),
        DeepSpeedCPUAdam(params),
    ):
        check_client_optimizer_offloads(job.ds_config, job.plan, faithful, source="ds.json", accelerate_maps=True)
    # Without accelerate DeepSpeed offloads its own as given.
    check_client_optimizer_offloads(job.ds_config, job.plan, DeepSpeedCPULion(params), source="ds.json")


def test_poplar_trainer_refuses_the_optimizer_accelerate_would_swap_on_offloading_ranks():
    import torch

    from poplar_ext.integrations.transformers import PoplarTrainerMixin
    from poplar_ext.plan.errors import FormatError

    class TrainerLike:
        chosen = torch.optim.SGD

        def create_optimizer(self, model=None):
            return self.chosen([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    class Mixed(PoplarTrainerMixin, TrainerLike):
        pass

    trainer = object.__new__(Mixed)
    trainer.job = _offloading_job()
    with pytest.raises(FormatError, match="torch.optim.sgd.SGD"):
        trainer.create_optimizer()
    trainer.chosen = torch.optim.AdamW
    assert isinstance(trainer.create_optimizer(), torch.optim.AdamW)


def test_poplar_accelerator_refuses_the_optimizer_accelerate_would_swap_on_offloading_ranks():
    import torch

    from poplar_ext.integrations.accelerate import PoplarAccelerator
    from poplar_ext.plan.errors import FormatError

    accelerator = object.__new__(PoplarAccelerator)
    accelerator.job = _offloading_job()
    model = torch.nn.Linear(2, 1)
    with pytest.raises(FormatError, match="zero_force_ds_cpu_optimizer.*torch.optim.sgd.SGD"):
        accelerator._prepare_deepspeed(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("accelerate_maps", [False, True])
def test_a_host_optimizer_on_a_plan_that_offloads_some_gpu_ranks_alone_is_refused(accelerate_maps):
    # DeepSpeedCPUAdam asserts its parameters are on the CPU: on a GPU, the ranks that keep their partitions there
    # would fail at their first step ("CPUAdam param is on cuda:0 and must be 'cpu'") while the others wait.
    import torch

    from poplar_ext.optimizer_offload import check_job_optimizer_offloads

    class DeepSpeedCPUAdam(torch.optim.Adam):  # DeepSpeed's own host optimizer, by class name
        pass

    params = [torch.nn.Parameter(torch.zeros(1))]
    job = _offloading_job()
    job.ds_config = {"zero_optimization": {"stage": 2}}
    job.device = torch.device("cuda", 0)
    with pytest.raises(ValueError) as refused:
        check_job_optimizer_offloads(job, DeepSpeedCPUAdam(params), accelerate_maps=accelerate_maps)
    message = str(refused.value)
    assert message.startswith("the plan file plan.json: expected a client optimizer that steps where each rank"), (
        message
    )
    assert "the ranks that keep it on the GPU (ranks[0])" in message
    check_job_optimizer_offloads(job, torch.optim.AdamW(params), accelerate_maps=accelerate_maps)
    job.device = torch.device("cpu")  # every partition on the host: it steps them all
    check_job_optimizer_offloads(job, DeepSpeedCPUAdam(params), accelerate_maps=accelerate_maps)
    job.device, job.plan = torch.device("cuda", 0), _plan([True, True])  # every rank offloads
    check_job_optimizer_offloads(job, DeepSpeedCPUAdam(params), accelerate_maps=accelerate_maps)


def test_the_force_refusal_of_a_mixed_plan_says_where_deepspeeds_cpu_adam_fits():
    import torch

    from poplar_ext.optimizer_offload import check_client_optimizer_offloads
    from poplar_ext.plan.errors import FormatError

    job, params = _offloading_job(), [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(FormatError) as refused:
        check_client_optimizer_offloads(job.ds_config, job.plan, torch.optim.SGD(params, lr=0.1), source="ds.json")
    assert str(refused.value).endswith(
        "set it false, pass DeepSpeedCPUAdam, or train a plan without optimizer offload (DeepSpeedCPUAdam on GPUs "
        "only where every rank offloads: it steps on the host alone)"
    ), str(refused.value)
