"""`poplar_ext.initialize` for a `PoplarPipelineModule`: the pipeline engine, each pipeline's data; DeepSpeed sees
this rank's pipeline alone (data-parallel size 1). See docs/pipeline.md."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from poplar_ext.hardware.emulation import (
    PIPELINE_OPTIMIZER_KEY,
    ComputeSlowdown,
    SteadyReference,
    device_label,
    emulation_for_rank,
    pipeline_reference,
)
from poplar_ext.pipeline.engine import PoplarPipelineEngine, warn_unloadable_optimizer_state
from poplar_ext.pipeline.job import PipelineJob
from poplar_ext.pipeline.planning import pipeline_drift_monitor
from poplar_ext.plan.pipeline_formats import PipelinePlan
from poplar_ext.runtime.config import DICT_SOURCE, load_deepspeed_config, unsynchronised_throughput_timer
from poplar_ext.runtime.data import check_holds_global_batch, check_plan_dataset, plan_dataloader
from poplar_ext.runtime.engine_core import undo_initial_zero_step
from poplar_ext.runtime.rebalance import job_rebalancer

logger = logging.getLogger(__name__)


DEEPSPEED_PRINT_OFF = 2**62
"""steps_per_print that DeepSpeed's pipeline engine never reaches."""


def pipeline_deepspeed_config(
    ds_config: dict, plan: PipelinePlan, pipeline_index: int, *, source: str = DICT_SOURCE
) -> dict:
    """The config DeepSpeed gets on a rank of pipeline `pipeline_index`: valid for that pipeline alone."""
    pipeline = plan.pipelines[pipeline_index]
    nominal = copy.deepcopy(ds_config)
    nominal["train_micro_batch_size_per_gpu"] = pipeline.micro_batch_size
    nominal["gradient_accumulation_steps"] = pipeline.num_micro_batches
    nominal["train_batch_size"] = pipeline.samples_per_iteration
    nominal.setdefault("zero_optimization", {})["stage"] = plan.zero_stage
    unsynchronised_throughput_timer(nominal, source=source)
    # DeepSpeed's own "steps: N loss: X" line would show rank 0's pipeline's weighted share of the
    # loss: poplar's line (every poplar.log_interval_steps) shows the global batch's instead.
    nominal["steps_per_print"] = DEEPSPEED_PRINT_OFF
    return nominal


def check_token_mean_samples(training_data: Any, reduction: str) -> None:
    """ValueError unless a token_mean job's samples are ``(inputs, labels)`` with labels a tensor (counted inside
    the schedule, where an error would leave the others waiting)."""
    if reduction != "token_mean" or training_data is None or len(training_data) == 0:
        return
    sample = training_data[0]
    labels = sample[1] if isinstance(sample, (tuple, list)) and len(sample) == 2 else None
    if not isinstance(labels, torch.Tensor):
        found = type(labels).__name__ if labels is not None else f"a sample of type {type(sample).__name__}"
        raise ValueError(
            "training_data: expected (inputs, labels) samples with labels a tensor of token ids with "
            f"poplar.loss_reduction token_mean, found {found}"
        )


def _steady_reference(job: PipelineJob) -> SteadyReference | None:
    """This emulated rank's stage blocks from the layer profiles the plan was made from, or None (learned)."""
    blocks = job.steady_stages.get(job.rank)
    if blocks is None:
        logger.info("rank %d: emulated compute steady at the times learned from its first blocks", job.rank)
        return None
    return pipeline_reference(
        stage_compute_s=blocks["compute_s"],
        recompute_s=blocks["recompute_s"],
        optimizer_step_s=blocks["optimizer_step_s"],
        profile_slowdown=blocks["profile_slowdown"],
        source=f"the layer profiles of {blocks['type']} at ZeRO stage {job.plan.zero_stage}",
    )


def _build_engine(job: PipelineJob, model: Any, **arguments: Any) -> PoplarPipelineEngine:
    """DeepSpeed's pipeline engine as ``deepspeed.initialize`` builds it (its PipelineModule branch)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    nominal = pipeline_deepspeed_config(job.ds_config, job.plan, job.pipeline_index, source=job.source)
    mpu = model.mpu()
    config_class = deepspeed.DeepSpeedConfig(nominal, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    emulation = emulation_for_rank(job.cluster, job.rank)
    slowdown = None
    if emulation is not None:
        slowdown = ComputeSlowdown(
            emulation,
            clock="thread" if get_accelerator().device_name() == "cpu" else "cuda",
            reference=_steady_reference(job),
            # The optimizer step's clipping norm and overflow check are agreed across stages: waits, not compute.
            window_waits=(PIPELINE_OPTIMIZER_KEY,),
        )
    rebalancer = job_rebalancer(
        job, make_monitor=lambda: pipeline_drift_monitor(job.plan, job.cluster, job.poplar_config)
    )
    partition_parameters.shutdown_init_context()
    # DeepSpeed's build leaves this grid in deepspeed.utils.groups.mpu, where an engine given no mpu (a ZeRO
    # job's, built before) reads its data-parallel group at every ZeRO 0 step; this engine steps on its own
    # grid (self.grid, self.mpu; its reduction and clipping are ours), so the global is given back.
    previous_mpu = groups.mpu
    try:
        engine = PoplarPipelineEngine(
            poplar_job=job,
            slowdown=slowdown,
            rebalancer=rebalancer,
            model=model,
            mpu=mpu,
            config=nominal,
            config_class=config_class,
            **arguments,
        )
    finally:
        partition_parameters.restore_init_context()
        groups.mpu = previous_mpu
    undo_initial_zero_step(engine)  # fp16 at ZeRO 0: DeepSpeed's zero-gradient step at its build
    engine._configure_python_gc()
    return engine


def initialize_pipeline(
    *,
    model: Any,
    args: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
    mesh_param: Any = None,
) -> tuple[PoplarPipelineEngine, Any, torch.utils.data.DataLoader | None, Any]:
    """``(engine, optimizer, dataloader, lr_scheduler)`` for a `PoplarPipelineModule` (collective). The config, if
    given, must be the module's. The dataloader (None without `training_data`) yields this pipeline's
    micro-batches; ``engine.train_batch()`` reads it."""
    job: PipelineJob = model.poplar_job
    # What a pipeline job cannot take: the same ValueError on every rank (it is the script's).
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "poplar_ext.initialize: expected no mpu= or mesh_param= with a PoplarPipelineModule (its grid is the "
            "plan's)"
        )
    check_plan_dataset(training_data, "training_data")
    if any(value is not None for value in (config, config_params, getattr(args, "deepspeed_config", None))):
        ds_config, _, source = load_deepspeed_config(config, config_params=config_params, args=args)
        if ds_config != job.ds_config:
            raise ValueError(
                f"poplar_ext.initialize: expected the DeepSpeed config the PoplarPipelineModule was built with (its "
                f"plan was settled then), found another one in {source}; give both the same, or none here"
            )
    check_token_mean_samples(training_data, job.poplar_config.loss_reduction)
    if training_data is not None:  # before DeepSpeed builds the engine
        check_holds_global_batch(len(training_data), job.plan.global_batch_size, "training_data: num_samples")
    # DeepSpeed refuses a config both in args and in config=: it gets the nominal one only.
    ds_args = copy.copy(args)
    if hasattr(ds_args, "deepspeed_config"):
        ds_args.deepspeed_config = None
    engine = _build_engine(
        job,
        model,
        args=ds_args,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=None,  # DeepSpeed would give every pipeline the same samples: poplar-ext's loader instead
        lr_scheduler=lr_scheduler,
        dist_init_required=dist_init_required,
        collate_fn=None,
    )
    warn_unloadable_optimizer_state(engine, rank=job.rank)
    if job.rank == 0:  # as a ZeRO job's engine logs it: a plan file, or searched at start from which profiles
        logger.info("poplar plan from step 0: %s", job.plan_reason)
    if job.rank == 0 and "steps_per_print" in job.ds_config:
        logger.info(
            "steps_per_print: DeepSpeed's own loss line is off for a poplar pipeline job (it would show one "
            "pipeline's weighted share of the loss); the 'poplar step' line every poplar.log_interval_steps "
            "(%d) steps shows the loss of the global batch",
            job.poplar_config.log_interval_steps,
        )
    pipeline, stage = job.pipeline, job.pipeline.stages[job.stage_index]
    logger.info(
        "rank %d: %s, pipeline %d stage %d of %d (layers %d-%d), micro-batch %d x %d; "
        "true global batch %d, ZeRO stage %d",
        job.rank,
        device_label(stage.device_type, job.cluster.emulation_of(stage.device_type)),
        job.pipeline_index,
        job.stage_index,
        len(pipeline.stages),
        stage.first_layer,
        stage.last_layer,
        pipeline.micro_batch_size,
        pipeline.num_micro_batches,
        job.plan.global_batch_size,
        job.plan.zero_stage,
    )
    loader = None
    if training_data is not None:
        sampler = engine.create_batch_sampler(len(training_data))
        loader = plan_dataloader(training_data, sampler, collate_fn=collate_fn, device=job.device)
        engine.use_loader(loader)
    return engine, engine.optimizer, loader, engine.lr_scheduler


__all__ = ["initialize_pipeline", "pipeline_deepspeed_config"]
