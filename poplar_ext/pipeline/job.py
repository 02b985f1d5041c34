"""A pipeline job settled on every rank before any layer is built: config, process group, cluster, plan.
See docs/pipeline.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar_ext.collectives import broadcast_from_rank0, process_group_rank
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.hardware.devices import join_job
from poplar_ext.hardware.emulation import emulation_for_rank
from poplar_ext.pipeline.planning import (
    MeasureMissingLayers,
    check_pipeline_config,
    requested_pipeline_batch,
    resolve_pipeline_plan,
    steady_stage_times,
)
from poplar_ext.plan.pipeline_formats import Pipeline, PipelinePlan
from poplar_ext.profiler.layers import layers_fingerprint, pipeline_layers
from poplar_ext.profiler.measure import training_dtype
from poplar_ext.runtime.config import PoplarConfig, requested_zero_stage
from poplar_ext.runtime.job_start import JobBase, agreed_job_cluster, read_poplar_section, steady_from_rank0
from poplar_ext.runtime.process_settings import apply_cpu_process_settings, on_cpu_accelerator


@dataclass(frozen=True, kw_only=True)
class PipelineJob(JobBase):
    """What a pipeline job runs, the same on every rank (but `rank` and `device`)."""

    plan: PipelinePlan
    """Checked for this job on rank 0, the same on every rank."""
    steady_stages: dict[int, dict] = field(default_factory=dict)
    """Emulated rank -> its stage's blocks from the layer profiles (`steady_stage_times`; rank 0's, sent to all)."""

    @property
    def pipeline_index(self) -> int:
        """Which pipeline of the plan this rank is in."""
        return self.plan.place_of(self.rank)[0]

    @property
    def stage_index(self) -> int:
        """Which stage of its pipeline this rank is."""
        return self.plan.place_of(self.rank)[1]

    @property
    def pipeline(self) -> Pipeline:
        return self.plan.pipelines[self.pipeline_index]

    @property
    def plan_reason(self) -> str:
        """Where the plan came from, for the plan history."""
        if self.poplar_config.plan is None:
            return f"searched at start from the layer profiles in {self.poplar_config.profiles}"
        return f"the plan file {self.poplar_config.plan}"


@ends_job_on_user_error
def prepare_pipeline_job(
    loaded_config: tuple[dict, Path, str],
    *,
    num_layers: int,
    init_options: dict | None = None,
    layers: list[Any] | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    training_data: Any = None,
) -> PipelineJob:
    """Everything before the layers are built (collective; the same ValueError on every rank). `loaded_config`:
    `load_deepspeed_config`'s result. Without a plan file, `layers` (by their fingerprint) pick the layer
    profiles searched from, and with `training_data` missing ones are measured (with `loss_fn`)."""
    ds_config, _, source = loaded_config
    poplar_config = read_poplar_section(loaded_config, otherwise="deepspeed.pipe.PipelineModule")
    check_pipeline_config(ds_config, poplar_config)
    _refuse_another_reduction(loss_fn, poplar_config.loss_reduction, source=source)
    device = join_job(**(init_options or {}))
    # DeepSpeed's PipelineModule talks through DeepSpeed's communication backend, which deepspeed.initialize
    # would set up only later; over a process group that exists, this only wraps it.
    import deepspeed

    deepspeed.init_distributed(**(init_options or {}))
    rank, world_size = process_group_rank()
    _, cluster = agreed_job_cluster(device, ds_config, poplar_config, rank=rank)
    _refuse_fp16_where_unsupported(ds_config, source=str(source), device=device, world_size=world_size)
    emulated = emulation_for_rank(cluster, rank) is not None
    apply_cpu_process_settings(poplar_config, on_cpu=on_cpu_accelerator(), emulated=emulated, rank=rank)
    plan = resolve_pipeline_plan(
        poplar_config,
        cluster,
        world_size=world_size,
        rank=rank,
        num_layers=num_layers,
        zero_stage=requested_zero_stage(poplar_config, ds_config),
        global_batch=requested_pipeline_batch(poplar_config, ds_config),
        broadcast=broadcast_from_rank0,
        layers_fingerprint=None if layers is None else lambda: layers_fingerprint(pipeline_layers(layers)),
        measure_missing=_layer_measurer(poplar_config, ds_config, layers, loss_fn, training_data),
        dtype=training_dtype(ds_config),
    )
    steady_stages = steady_from_rank0(cluster, lambda: steady_stage_times(plan, cluster, poplar_config), rank=rank)
    return PipelineJob(
        ds_config=ds_config,
        source=source,
        poplar_config=poplar_config,
        cluster=cluster,
        plan=plan,
        rank=rank,
        device=device,
        steady_stages=steady_stages,
    )


def _refuse_fp16_where_unsupported(ds_config: dict, *, source: str, device: Any, world_size: int) -> None:
    """fp16 where some rank's DeepSpeed accelerator refuses it (its CPU accelerator without AVX512-FP16 or
    AMX-FP16): the same ValueError on every rank now (collective), where DeepSpeed would raise on those ranks
    alone when the engine is built and leave the others waiting in its first collective."""
    if training_dtype(ds_config) != "float16":
        return
    from deepspeed.accelerator import get_accelerator

    from poplar_ext.collectives import agree_sum

    refusing = agree_sum(int(not get_accelerator().is_fp16_supported()), device)
    if refusing:
        raise ValueError(
            f"{source}: fp16.enabled: expected an accelerator that trains fp16 on every rank, found {refusing} of "
            f"{world_size} ranks whose DeepSpeed accelerator ({get_accelerator().device_name()}) does not (a CPU "
            "needs AVX512-FP16 or AMX-FP16 for it); train in bf16 (bf16.enabled) instead"
        )


def _refuse_another_reduction(loss_fn: Any, reduction: str, *, source: str) -> None:
    """A loss that says which reduction it computes (`CausalLMLoss`) must get that one; token_mean needs a loss_fn
    (the last stage counts the label tokens of the labels it gets)."""
    if reduction == "token_mean" and loss_fn is None:
        raise ValueError(
            f"{source}: poplar.loss_reduction: expected mean or sum without a loss_fn (the last layer's output as the "
            "loss), found token_mean (a micro-batch's label tokens are counted from the labels a loss_fn gets)"
        )
    wanted = getattr(loss_fn, "poplar_loss_reduction", None)
    if wanted is not None and wanted != reduction:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ValueError(
            f"{source}: poplar.loss_reduction: expected {wanted} with loss_fn {name}, found {reduction} (the loss is a "
            f"{wanted}; weighted as a {reduction}, the optimizer would see another loss than the model's)"
        )


def _layer_measurer(
    poplar_config: PoplarConfig, ds_config: dict, layers: list[Any] | None, loss_fn: Any, training_data: Any
) -> MeasureMissingLayers | None:
    """What measures missing layer profiles for a plan searched at start; None where nothing can."""
    if poplar_config.plan is not None or layers is None or training_data is None:
        return None
    from poplar_ext.profiler.auto import missing_layer_profiles_measurer

    batch = requested_pipeline_batch(poplar_config, ds_config)
    assert batch is not None, "check_pipeline_config refuses a search without a global batch"
    return missing_layer_profiles_measurer(
        layers=layers,
        loss_fn=loss_fn,
        training_data=training_data,
        ds_config=ds_config,
        profiles_dir=poplar_config.profiles,
        micro_batch_size_limit=batch.size,
    )
