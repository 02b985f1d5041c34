"""What every engine's job settles first: the ``poplar`` section, the cluster, rank 0's steady compute.
See docs/training.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from poplar_ext.collectives import broadcast_from_rank0, decided_by_rank0
from poplar_ext.hardware.discovery import DeviceFacts, agreed_cluster, check_device_support, gather_device_facts
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, Plan
from poplar_ext.plan.pipeline_formats import PipelinePlan, load_any_plan
from poplar_ext.profiler.measure import training_dtype
from poplar_ext.runtime.config import SECTION, GlobalBatchRequest, PoplarConfig, poplar_config_from_dict

Steady = TypeVar("Steady")


@dataclass(frozen=True, kw_only=True)
class JobBase:
    """What every engine's job holds, the same on every rank (but `rank` and `device`); each engine's job
    adds its plan (`poplar_ext.zero.initialize.Job`, `poplar_ext.pipeline.job.PipelineJob`)."""

    ds_config: dict
    """The user's DeepSpeed config."""
    source: str
    """Its file (or how a dict is named in messages)."""
    poplar_config: PoplarConfig
    cluster: Cluster
    """Checked against every rank's hardware (or read from it)."""
    rank: int
    device: Any
    """This rank's ``torch.device``."""


def read_poplar_section(
    loaded_config: tuple[dict, Path, str],
    *,
    needs: str = "{} for the automatic mode, or with 'plan' or 'profiles'",
    otherwise: str,
) -> PoplarConfig:
    """The ``poplar`` section of `loaded_config` (`load_deepspeed_config`'s result), checked; a ValueError
    saying what it `needs` and what to use `otherwise` where the config has none."""
    ds_config, base_dir, source = loaded_config
    if SECTION not in ds_config:
        raise ValueError(
            f"DeepSpeed config: expected a top-level '{SECTION}' section ({needs}), found none in {source}; "
            f"use {otherwise} for a run without one"
        )
    return poplar_config_from_dict(ds_config[SECTION], base_dir=base_dir, source=source)


def agreed_job_cluster(
    device: Any, ds_config: dict, poplar_config: PoplarConfig, *, rank: int
) -> tuple[list[DeviceFacts], Cluster]:
    """Every rank's device facts and the cluster agreed from them (collective). The hardware is the truth: every rank's
    device must run the job (kernels, bf16); the cluster file (rank 0's) is checked against it."""
    source = str(poplar_config.source)
    facts = gather_device_facts(device)
    check_device_support(facts, bf16=training_dtype(ds_config) == "bfloat16", source=source)
    return facts, agreed_cluster(poplar_config.cluster, facts, rank=rank, name=f"{SECTION}.cluster")


def read_plan_file(poplar_config: PoplarConfig, *, pipeline: bool) -> Plan | PipelinePlan:
    """``poplar.plan`` read (rank 0's part); a ValueError naming the file where it is not the engine's kind
    (a `PipelinePlan` where `pipeline`, else a ZeRO `Plan`), where the section's ``poplar.policy`` is
    another than the plan's, where its ``poplar.profiles`` is no directory, or where its global batch is
    above the config's bound."""
    plan_path, profiles = poplar_config.plan, poplar_config.profiles
    if profiles is not None and not profiles.is_dir():
        # Beside a plan nothing is measured into it: a misspelt folder would read as "no profiles".
        raise FormatError(
            poplar_config.source,
            f"{SECTION}.profiles",
            f"a directory of profiles beside {SECTION}.plan (the plan is checked and re-balanced against them)",
            f"the file {profiles}" if profiles.exists() else f"nothing at {profiles}",
        )
    try:
        plan = load_any_plan(plan_path)
    except FormatError as exc:
        raise ValueError(f"{SECTION}.plan: {exc}") from exc
    if pipeline and not isinstance(plan, PipelinePlan):
        raise ValueError(
            f"{SECTION}.plan: {plan_path} is a ZeRO plan (every rank trains the whole model); a "
            "PoplarPipelineModule needs a pipeline plan ('parallelism': 'pipeline')"
        )
    if not pipeline and not isinstance(plan, Plan):
        raise ValueError(
            f"{SECTION}.plan: {plan_path} is a pipeline plan ('parallelism': 'pipeline'); it trains a "
            "poplar_ext.pipeline.PoplarPipelineModule, not this model: build the model as one, or give a "
            "ZeRO plan (poplar-search)"
        )
    if poplar_config.policy_given and poplar_config.policy != plan.policy:
        # The plan's allocation is trained as it is: the config would say two things.
        raise FormatError(
            poplar_config.source,
            f"{SECTION}.policy",
            f"{plan.policy!r} (the policy {SECTION}.plan {plan_path} was made by: a policy only chooses a plan "
            f"searched at start) or no {SECTION}.policy",
            f"{poplar_config.policy!r} beside {SECTION}.plan",
        )
    # The plan's batch is the job's, held to the bound as a batch the config sets (PoplarConfig.max_global_batch_size).
    above = poplar_config.batch_above_bound(
        GlobalBatchRequest(size=plan.global_batch_size, origin=f"{SECTION}.plan {plan_path}")
    )
    if above is not None:
        raise above
    return plan


def job_plan_problems(
    plan: Plan | PipelinePlan,
    cluster: Cluster,
    *,
    world_size: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest | None,
) -> dict[str, list[str]]:
    """What the job alone knows makes `plan` unrunnable, as sentences under what they concern, for each engine to
    say in its order: ``counts`` (the job's and the cluster's number of ranks), ``stage`` (the config's ZeRO stage),
    ``batch`` (the config's global batch; one without a number, ``"auto"`` or none, compares nothing)."""
    problems: dict[str, list[str]] = {"counts": [], "stage": [], "batch": []}
    if plan.world_size != world_size:
        problems["counts"].append(f"The plan names {plan.world_size} ranks but the job has {world_size} (WORLD_SIZE).")
    if cluster.world_size != world_size:
        problems["counts"].append(
            f"The cluster description names {cluster.world_size} ranks but the job has {world_size} (WORLD_SIZE)."
        )
    if zero_stage is not None and zero_stage != plan.zero_stage:
        problems["stage"].append(
            f"The plan is for ZeRO stage {plan.zero_stage} but the config asks for stage {zero_stage} "
            f"(zero_optimization.stage or {SECTION}.zero_stage)."
        )
    size = None if global_batch is None else global_batch.size
    if isinstance(size, int) and size != plan.global_batch_size:
        batch = plan.global_batch_size
        problem = (
            f"The plan's global batch is {batch} but the config asks for {size} "
            f"({global_batch.origin}). Make that {batch}, or use a plan for {size}."
        )
        if global_batch.origin.startswith("TrainingArguments"):
            # The Trainer's product over the ranks: a plan's batch need not be a multiple of them (3 x 2 and 1 x 3
            # make 9 on 2 ranks), and a DeepSpeed config's train_batch_size, beside its "auto" micro-batch and
            # accumulation count, sets it alone.
            problem += f" Or set train_batch_size {batch} in the DeepSpeed config"
            if batch % world_size:
                problem += f" ({batch} is no multiple of the {world_size} ranks, so those arguments cannot make it)"
            problem += "."
        problems["batch"].append(problem)
    return problems


def steady_from_rank0(cluster: Cluster, compute: Callable[[], dict[Any, Steady]], *, rank: int) -> dict[Any, Steady]:
    """Rank 0's `compute` of the emulated types' steady blocks, sent to every rank; {} (and no collective,
    the same on every rank) where no device type is emulated."""
    if all(cluster.emulation_of(t) is None for t in cluster.type_counts()):
        return {}
    return decided_by_rank0(compute, rank=rank, broadcast=broadcast_from_rank0)
