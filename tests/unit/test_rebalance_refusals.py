"""What re-balancing and the Trainer refuse before any collective, with the field named."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.runtime.rebalance import unmeasurable_reason
from poplar_ext.zero.initialize import zero_rebalancer as job_rebalancer

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir


def _job(device_kind="cpu", zero_stage=0, **section):
    config = poplar_config_from_dict({"plan": "p.json", "profiles": "profiles", **section}, base_dir=Path("."))
    return SimpleNamespace(
        poplar_config=config,
        source="ds.json",
        rank=0,
        device=SimpleNamespace(type=device_kind),
        plan=SimpleNamespace(zero_stage=zero_stage),
    )


def test_drop_last_with_rebalancing_asked_for_is_refused():
    with pytest.raises(ValueError, match="ds.json: poplar.rebalance.enabled: expected false .* with poplar.drop_last"):
        job_rebalancer(_job(drop_last=True, rebalance={"enabled": True}))


def test_drop_last_turns_automatic_rebalancing_off():
    assert job_rebalancer(_job(drop_last=True)) is None


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_rebalancing_asked_for_on_cuda_at_zero_2_3_is_refused_before_training(zero_stage):
    # Its compute windows would hold collectives in which a fast GPU waits for a slow one.
    with pytest.raises(
        ValueError,
        match=rf"ds.json: poplar.rebalance.enabled: expected false .* on cuda at ZeRO stage "
        rf"{zero_stage}, found true: .*a fast GPU waits for a slow one",
    ):
        job_rebalancer(_job("cuda", zero_stage, drop_last=False, rebalance={"enabled": True}))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_automatic_rebalancing_on_cuda_at_zero_2_3_is_off_with_the_reason_logged(zero_stage, caplog):
    caplog.set_level(logging.INFO, logger="poplar_ext.runtime.rebalance")
    assert job_rebalancer(_job("cuda", zero_stage, drop_last=False)) is None
    assert "poplar rebalance (auto): off for this job: its compute cannot be measured on CUDA" in caplog.text


def test_rebalancing_is_measurable_on_cpu_at_every_stage_and_on_cuda_at_zero_0_1():
    measurable = [
        (kind, stage) for kind in ("cpu", "cuda") for stage in range(4) if unmeasurable_reason(kind, stage) is None
    ]
    assert measurable == [("cpu", 0), ("cpu", 1), ("cpu", 2), ("cpu", 3), ("cuda", 0), ("cuda", 1)]


def test_accelerate_s_own_accumulation_count_is_refused_by_the_trainer():
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    args = TrainingArguments(
        output_dir="unused",
        use_cpu=True,
        deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}},
        accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}},
    )
    with pytest.raises(ValueError, match="gradient_accumulation_kwargs: expected no 'num_steps'"):
        PoplarTrainer(model=None, args=args)


def test_automatic_rebalancing_off_for_a_plan_file_alone_says_so_in_plain_words(caplog):
    # A new user's run with a plan file: the note read like an error ("expected poplar.profiles too ... found none").
    caplog.set_level(logging.INFO, logger="poplar_ext.runtime.rebalance")
    config = poplar_config_from_dict({"plan": "p.json"}, base_dir=Path("."))
    job = SimpleNamespace(
        poplar_config=config,
        source="ds.json",
        rank=0,
        device=SimpleNamespace(type="cpu"),
        plan=SimpleNamespace(zero_stage=1),
        cluster=None,
        profile_directory=None,
    )
    assert job_rebalancer(job) is None
    assert "off for this job, as it is by default where it cannot run" in caplog.text
    assert "no poplar.profiles is named" in caplog.text and "nothing is wrong" in caplog.text
    assert "expected" not in caplog.text and "found none" not in caplog.text


def test_rebalancing_asked_for_without_profiles_is_still_an_error_naming_the_field():
    config = poplar_config_from_dict({"plan": "p.json", "rebalance": {"enabled": True}}, base_dir=Path("."))
    job = SimpleNamespace(
        poplar_config=config,
        source="ds.json",
        rank=0,
        device=SimpleNamespace(type="cpu"),
        plan=SimpleNamespace(zero_stage=1),
        cluster=None,
        profile_directory=None,
    )
    with pytest.raises(ValueError, match=r"poplar.rebalance.enabled: expected poplar.profiles too"):
        job_rebalancer(job)


@pytest.mark.parametrize("option", ["dispatch_batches", "split_batches"])
def test_accelerates_batch_dispatching_and_splitting_are_refused_by_the_trainer(option):
    # Each rank's micro-batches are the plan's, of uneven sizes: accelerate's rank-0 dispatcher refuses batches of
    # different sizes at the first step (the other ranks then wait), and splitting one batch evenly is not the plan.
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    args = TrainingArguments(
        output_dir="unused",
        use_cpu=True,
        deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}},
        accelerator_config={option: True},
    )
    with pytest.raises(
        ValueError, match=rf"^TrainingArguments.accelerator_config: {option}: expected False .* found True"
    ):
        PoplarTrainer(model=None, args=args)


def test_node_local_checkpoints_without_save_on_each_node_are_refused_by_the_trainer():
    # DeepSpeed writes each node's part into its own storage, the Trainer its trainer_state.json on the first node
    # alone: a resume would fail on every other node's ranks.
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    config = {"zero_optimization": {"stage": 0}, "checkpoint": {"use_node_local_storage": True}, "poplar": {}}
    args = TrainingArguments(output_dir="unused", use_cpu=True, deepspeed=config)
    with pytest.raises(
        ValueError, match=r"^TrainingArguments.save_on_each_node: expected True with the DeepSpeed config's checkpoint"
    ):
        PoplarTrainer(model=None, args=args)


def test_poplar_ext_initialize_refuses_rebalancing_before_deepspeed_builds_the_engine(monkeypatch):
    # poplar.rebalance.enabled true that cannot run was refused after deepspeed.initialize: the engine's build
    # (and its logs) came first, for an error in the config.
    import deepspeed
    import torch

    from poplar_ext.zero import initialize as zero_initialize

    def refused(job):
        raise ValueError("ds.json: poplar.rebalance.enabled: refused")

    def built(*args, **kwargs):
        raise AssertionError("DeepSpeed built the engine before the refusal")

    job = SimpleNamespace(plan=SimpleNamespace(ranks=[]), ds_config={}, source="ds.json", rank=0)
    monkeypatch.setattr(zero_initialize, "load_deepspeed_config", lambda *args, **kwargs: ({}, Path("."), "ds.json"))
    monkeypatch.setattr(zero_initialize, "read_poplar_section", lambda *args, **kwargs: None)
    monkeypatch.setattr(zero_initialize, "prepare_job", lambda *args, **kwargs: job)
    monkeypatch.setattr(zero_initialize, "nominal_deepspeed_config", lambda *args, **kwargs: {})
    monkeypatch.setattr(zero_initialize, "set_up_rank", lambda *args, **kwargs: ((), None))
    monkeypatch.setattr(zero_initialize, "zero_rebalancer", refused)
    monkeypatch.setattr(deepspeed, "initialize", built)
    with pytest.raises(ValueError, match="poplar.rebalance.enabled: refused"):
        zero_initialize.initialize(model=torch.nn.Linear(2, 1), config={})
