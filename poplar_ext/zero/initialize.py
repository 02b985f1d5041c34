"""DeepSpeed's initialize on ZeRO with a plan's per-rank batches (any model but a pipeline module; docs/training.md)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from poplar_ext.activation_checkpointing import CheckpointingToggle, apply_plan_checkpointing
from poplar_ext.collectives import broadcast_from_rank0, process_group_rank
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.hardware.devices import join_job
from poplar_ext.hardware.discovery import memory_capacity_bytes
from poplar_ext.hardware.emulation import (
    ComputeSlowdown,
    check_emulation_range,
    device_label,
    emulation_for_rank,
    steady_reference,
)
from poplar_ext.optimizer_offload import check_job_optimizer_offloads
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, Emulation, Plan, profile_from_dict
from poplar_ext.profiler.measure import training_dtype
from poplar_ext.runtime.config import (
    DICT_SOURCE,
    GlobalBatchRequest,
    PoplarConfig,
    clipping_in_effect,
    load_deepspeed_config,
    nominal_deepspeed_config,
    refuse_unclipped_autocast_scaler,
    refuse_unweighted_modes,
    requested_global_batch_size,
    requested_zero_stage,
    throughput_timer_synchronized,
)
from poplar_ext.runtime.data import (
    IterationLoader,
    PlanBatchSampler,
    check_holds_global_batch,
    check_plan_dataset,
)
from poplar_ext.runtime.engine_core import undo_initial_zero_step
from poplar_ext.runtime.job_start import JobBase, agreed_job_cluster, read_poplar_section, steady_from_rank0
from poplar_ext.runtime.process_settings import apply_cpu_process_settings, on_cpu_accelerator
from poplar_ext.runtime.rebalance import DriftMonitor, Rebalancer, job_rebalancer
from poplar_ext.search.model_states import optimizer_state_bytes
from poplar_ext.zero.engine import PoplarEngine
from poplar_ext.zero.planning import (
    ProfileDirectory,
    check_stage_memory,
    load_rebalance_inputs,
    resolve_plan,
    steady_compute_profiles,
)

logger = logging.getLogger(__name__)


def _refuse_other_parallelism(*, mpu: Any, mesh_param: Any, model: Any, ds_config: dict, source: str) -> None:
    """Data parallelism only: the loss weight and the sampler take every rank for a data-parallel rank."""
    unsupported = []
    if mpu is not None:
        unsupported.append("mpu= (a model-parallel unit: tensor or pipeline parallelism)")
    if mesh_param is not None:
        unsupported.append("mesh_param= (a device mesh with model or sequence parallelism)")
    if (ds_config.get("sequence_parallel_size") or 1) != 1:
        unsupported.append(f"sequence_parallel_size {ds_config['sequence_parallel_size']!r} in {source}")
    tensor_parallel = ds_config.get("tensor_parallel")
    if isinstance(tensor_parallel, dict) and (tensor_parallel.get("autotp_size") or 1) != 1:
        unsupported.append(f"tensor_parallel.autotp_size {tensor_parallel['autotp_size']!r} in {source}")
    if isinstance(model, torch.nn.Module):
        from deepspeed.moe.layer import MoE
        from deepspeed.pipe import PipelineModule

        if isinstance(model, PipelineModule):
            unsupported.append(
                "a PipelineModule (pipeline parallelism: build it as poplar_ext.pipeline.PoplarPipelineModule, "
                "with a pipeline plan)"
            )
        if any(isinstance(module, MoE) for module in model.modules()):
            unsupported.append("MoE layers (expert-parallel groups)")
    if unsupported:
        raise ValueError(
            "poplar_ext.initialize: expected data parallelism only, found " + "; ".join(unsupported) + ". "
            "poplar-ext weights each rank's loss and splits the data as if every rank were a data-parallel rank, "
            "so with other parallelism its gradients would be wrong; use deepspeed.initialize for this job"
        )


def _refuse_wrong_sparse_gradients(*, model: Any, ds_config: dict, source: str) -> None:
    """FormatError for the DeepSpeed 0.19.8 settings that train an embedding's sparse gradient wrong (one built with
    ``sparse=True``), in plain DeepSpeed on any number of ranks alike."""
    if not isinstance(model, torch.nn.Module):
        return
    sparse = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
    ]
    if not sparse:
        return
    modules = ", ".join(sparse)
    predivide = ds_config.get("gradient_predivide_factor", 1.0)
    if ds_config.get("prescale_gradients", False) is not True and predivide != 1.0:
        raise FormatError(
            source,
            "gradient_predivide_factor",
            f"1.0, or prescale_gradients true, where the model has embeddings with sparse gradients ({modules}): "
            "DeepSpeed 0.19.8 multiplies a sparse gradient by gradient_predivide_factor / world size where a dense "
            "one gets 1 / world size (runtime/engine.py sparse_allreduce)",
            repr(predivide),
        )
    found = clipping_in_effect(ds_config)
    if found is not None:
        raise FormatError(
            source,
            "gradient_clipping",
            f"0 where the model has embeddings with sparse gradients ({modules}): DeepSpeed 0.19.8 counts a sparse "
            "gradient in the norm but leaves it unclipped (runtime/utils.py clip_grad_norm_ scales p.grad.data, "
            "which a sparse tensor does not pass on)",
            found,
        )


_FEED_YOURSELF = (
    "give a map-style Dataset, or pass no training_data and feed each rank its plan's micro-batches "
    "(engine.rank_plan) yourself"
)


@dataclass(frozen=True, kw_only=True)
class Job(JobBase):
    """What a training job runs, settled on every rank before DeepSpeed builds its engine."""

    plan: Plan
    """Checked for this job on rank 0, the same on every rank."""
    world_size: int
    profile_directory: ProfileDirectory
    """``poplar.profiles`` as rank 0 read it to resolve the plan: re-balancing re-plans from the same reading."""
    steady_profiles: dict[str, dict] = field(default_factory=dict)
    """Emulated device type -> the profile (a dict) its compute is made steady by (rank 0's, sent to all)."""

    @property
    def plan_reason(self) -> str:
        """Where the plan came from, for the plan history."""
        if self.poplar_config.plan is not None:
            return f"the plan file {self.poplar_config.plan}"
        return f"searched at start by the {self.plan.policy} policy from {self.poplar_config.profiles}"


@ends_job_on_user_error
def prepare_job(
    loaded_config: tuple[dict, Path, str],
    *,
    model: Any = None,
    optimizer: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
    mpu: Any = None,
    mesh_param: Any = None,
    init_options: dict | None = None,
    default_global_batch: GlobalBatchRequest | None = None,
    loss_fn: Any = None,
    profiling_ds_config: dict | None = None,
    checkpointing_toggle: CheckpointingToggle | None = None,
    poplar_config: PoplarConfig | None = None,
    training_data_name: str = "training_data",
) -> Job:
    """Everything before DeepSpeed's engine: config, process group, cluster, plan (collective); the same
    ValueError on every rank.

    `loaded_config`: `load_deepspeed_config`'s result; `poplar_config`: its section, where the caller read it
    already. `default_global_batch`: the batch where no config sets one (the Trainer's own);
    `profiling_ds_config`: the config the automatic mode profiles with (default: the user's), and
    `checkpointing_toggle` for a model of the user's there. The caller checks `training_data` (`check_plan_dataset`,
    named as its own caller gave it: training_data, train_dataset, the training DataLoader); a `training_data`
    smaller than the global batch the config sets is refused here, named `training_data_name`, before any profile
    is measured or plan searched (the caller checks it against the plan's batch again).
    """
    ds_config, _, source = loaded_config
    if poplar_config is None:
        poplar_config = read_poplar_section(loaded_config, otherwise="deepspeed.initialize")
    _refuse_other_parallelism(mpu=mpu, mesh_param=mesh_param, model=model, ds_config=ds_config, source=source)
    refuse_unweighted_modes(ds_config, source=source)
    _refuse_wrong_sparse_gradients(model=model, ds_config=ds_config, source=source)
    # Where the config names the stage, before any profiling or search (nominal_deepspeed_config checks the plan's).
    zero = ds_config.get("zero_optimization")
    refuse_unclipped_autocast_scaler(
        ds_config, zero_stage=zero.get("stage") if isinstance(zero, dict) else None, source=source
    )
    # DeepSpeed's own discovery first (launcher, torchrun or mpirun), then this rank's device.
    device = join_job(**(init_options or {}))
    rank, world_size = process_group_rank()
    global_batch = requested_global_batch_size(poplar_config, ds_config, world_size=world_size)
    if training_data is not None and isinstance(global_batch.size, int):  # "auto": the plan's, checked later
        # The config's batch (a plan file's is the same): known now, not after profiling and the search.
        check_holds_global_batch(len(training_data), global_batch.size, f"{training_data_name}: num_samples")
    if global_batch.size is None and default_global_batch is not None:
        global_batch = default_global_batch
    facts, cluster = agreed_job_cluster(device, ds_config, poplar_config, rank=rank)
    if rank == 0:
        check_emulation_range(cluster)  # warns where emulated ranks would wait for cores
        if poplar_config.profiles_defaulted:
            logger.info(
                "poplar: no plan and no profiles named: the automatic mode keeps this job's profiles in %s "
                "(set poplar.profiles, or POPLAR_PROFILES_DIR, to keep them elsewhere)",
                poplar_config.profiles,
            )
    # The config profiles are measured with (the Trainer's has "auto" filled): its dtype is theirs.
    profiling_ds_config = ds_config if profiling_ds_config is None else profiling_ds_config
    model_fingerprint = None
    if poplar_config.profiles is not None and model is not None:
        from poplar_ext.profiler.fingerprint import model_fingerprint as fingerprint_of

        model_fingerprint = fingerprint_of(model)
    measure_missing = None
    if model is not None and training_data is not None and poplar_config.plan is None:
        # Fully automatic mode: missing profiles are measured with this model and data.
        from poplar_ext.profiler.auto import missing_profiles_measurer

        measure_missing = missing_profiles_measurer(
            model=model,
            training_data=training_data,
            collate_fn=collate_fn,
            optimizer=optimizer,
            ds_config=profiling_ds_config,
            profiles_dir=poplar_config.profiles,
            loss_fn=loss_fn,
            # No plan can give one rank more than the global batch.
            micro_batch_size_limit=global_batch.size
            if isinstance(global_batch.size, int)
            else poplar_config.max_global_batch_size,
            checkpointing_toggle=checkpointing_toggle,
            optimizer_offload=poplar_config.optimizer_offload,
            calibration_repeats=poplar_config.calibration.repeats,
        )
    directory = ProfileDirectory(
        poplar_config,
        cluster,
        dtype=training_dtype(profiling_ds_config),
        # The automatic mode reuses a stored profile where its profiler's cache would, not on the dtype alone.
        job_key=None if measure_missing is None else measure_missing.profiles_key(cluster),
    )
    plan = resolve_plan(
        poplar_config,
        cluster,
        world_size=world_size,
        rank=rank,
        zero_stage=requested_zero_stage(poplar_config, ds_config),
        global_batch=global_batch,
        model_fingerprint=model_fingerprint,
        broadcast=broadcast_from_rank0,
        measure_missing=measure_missing,
        directory=directory,
        # Cached profiles are checked with the same model and data (poplar.calibration).
        time_at_sizes=None if measure_missing is None else measure_missing.time_at_sizes,
    )
    if model is not None:
        _check_stage_memory(plan, cluster=cluster, facts=facts, model=model, ds_config=ds_config)
    steady_profiles = steady_from_rank0(cluster, lambda: steady_compute_profiles(plan, cluster, directory), rank=rank)
    return Job(
        ds_config=ds_config,
        source=source,
        poplar_config=poplar_config,
        cluster=cluster,
        plan=plan,
        rank=rank,
        world_size=world_size,
        device=device,
        profile_directory=directory,
        steady_profiles=steady_profiles,
    )


def _check_stage_memory(plan: Plan, *, cluster: Cluster, facts: list, model: Any, ds_config: dict) -> None:
    """`planning.check_stage_memory` with every rank's memory (an emulated type's capacity, else its device's)."""
    capacities = []
    for rank, device_type in enumerate(cluster.rank_device_types):
        emulation = cluster.emulation_of(device_type)
        capacities.append(memory_capacity_bytes(facts, rank) if emulation is None else emulation.memory_capacity_bytes)
    # A model built under deepspeed.zero.Init holds empty placeholders; ds_numel is the full size.
    sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in model.parameters()]
    check_stage_memory(
        plan,
        capacities_bytes=capacities,
        num_parameters=sum(n for n, _ in sizes),
        num_trainable_parameters=sum(n for n, trainable in sizes if trainable),
        dtype=training_dtype(ds_config),
        optimizer_bytes_per_parameter=optimizer_state_bytes(ds_config),
    )


def zero_rebalancer(job: Job) -> Rebalancer | None:
    """`job_rebalancer` for a ZeRO job: rank 0 re-plans from the profiles of the plan's stage and the
    network file beside them."""

    def monitor() -> DriftMonitor:
        profiles, network = load_rebalance_inputs(
            job.poplar_config, job.cluster, job.plan, directory=job.profile_directory
        )
        return DriftMonitor(config=job.poplar_config.rebalance, profiles=profiles, cluster=job.cluster, network=network)

    return job_rebalancer(job, make_monitor=monitor)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: dict | str | None = None,
    mesh_param: Any = None,
    config_params: dict | str | None = None,
    loss_fn: Any = None,
    checkpointing_toggle: CheckpointingToggle | None = None,
) -> tuple[PoplarEngine, Any, torch.utils.data.DataLoader | None, Any]:
    """``deepspeed.initialize`` with the plan of the config's ``poplar`` section, on DeepSpeed ZeRO
    (`poplar_ext.initialize` for every model but a `PoplarPipelineModule`: its arguments, return values and
    errors); the engine is a `PoplarEngine`.

    `loss_fn(engine, batch) -> loss`: the automatic mode's profiling loss where the model does not return one
    (default: the output's ``.loss``, else the output). Each rank's planned ``activation_checkpointing`` is
    applied to `model` before DeepSpeed wraps it: the built-in GPT and Hugging Face models switch by
    themselves, a model of your own needs `checkpointing_toggle` (``toggle(model, enabled)``); a model that
    cannot is refused on every rank. A rank planned with ``optimizer_offload`` gets DeepSpeed's
    ``offload_optimizer`` in its own config.
    """
    check_plan_dataset(training_data, "training_data", otherwise=_FEED_YOURSELF)
    init_options = {} if distributed_port is None else {"distributed_port": distributed_port}
    loaded = load_deepspeed_config(config, config_params=config_params, args=args)
    poplar_config = read_poplar_section(loaded, otherwise="deepspeed.initialize")
    if training_data is not None:
        _refuse_another_drop_last(loaded[0], poplar_config)
    job = prepare_job(
        loaded,
        poplar_config=poplar_config,
        model=model,
        optimizer=optimizer,
        training_data=training_data,
        collate_fn=collate_fn,
        mpu=mpu,
        mesh_param=mesh_param,
        init_options=init_options,
        loss_fn=loss_fn,
        checkpointing_toggle=checkpointing_toggle,
    )
    if training_data is not None:  # before DeepSpeed builds the engine
        check_holds_global_batch(len(training_data), job.plan.global_batch_size, "training_data: num_samples")
    check_job_optimizer_offloads(job, optimizer)
    nominal = nominal_deepspeed_config(job.ds_config, job.plan, job.rank, source=job.source)
    labels, slowdown = set_up_rank(job, model, toggle=checkpointing_toggle)
    rebalancer = zero_rebalancer(job)  # collective; before the build, so that its refusal costs no engine
    # Imported here, once the job is settled: a call refused before (data, config, build locks) imports no deepspeed.
    import deepspeed
    from deepspeed.utils import groups

    # DeepSpeed refuses a config both in args and in config=: it gets this rank's nominal one only.
    ds_args = copy.copy(args)
    if hasattr(ds_args, "deepspeed_config"):
        ds_args.deepspeed_config = None
    # DeepSpeed keeps the last engine's mpu in deepspeed.utils.groups and an engine given none (a ZeRO job takes
    # none) reads its groups there: a pipeline engine built before in this process left its grid, whose pipelines
    # would be this job's data-parallel groups (a crash, or ranks training apart).
    groups.mpu = None
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        args=ds_args,
        config=nominal,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,  # DeepSpeed's engine.collate_fn, deepspeed_io's default, as the caller gave it
        mesh_param=mesh_param,
        **init_options,
    )
    undo_initial_zero_step(engine)  # fp16 at ZeRO 0: DeepSpeed's zero-gradient step at its build
    count_true_global_batch(engine, job.plan)
    wrapped = poplar_engine(job, engine, labels=labels, slowdown=slowdown, rebalancer=rebalancer)
    dataloader = _training_dataloader(wrapped, training_data, collate_fn=collate_fn)
    return wrapped, ds_optimizer, dataloader, ds_scheduler


def _refuse_another_drop_last(ds_config: dict, poplar_config: PoplarConfig) -> None:
    """Refuse DeepSpeed's ``dataloader_drop_last``, which the plan's sampler ignores, unless poplar.drop_last agrees."""
    if ds_config.get("dataloader_drop_last", False) is not False and not poplar_config.drop_last:
        raise FormatError(
            poplar_config.source,
            "dataloader_drop_last",
            "false or unset with training_data (the plan's sampler ends each epoch by poplar.drop_last)",
            f"{ds_config['dataloader_drop_last']!r}; set poplar.drop_last true instead",
        )


def set_up_rank(
    job: Job, model: Any, *, toggle: CheckpointingToggle | None
) -> tuple[tuple[str, ...], ComputeSlowdown | None]:
    """This rank's process settings (as asked) and activation checkpointing (as planned), logged; returns every
    rank's device label and this rank's emulated slowdown (None on a real device)."""
    labels, slowdown = rank_devices(job)
    checkpointing = apply_plan_checkpointing(model, job.plan, job.rank, toggle=toggle, source=job.plan_reason)
    _log_rank_plan(job, labels[job.rank], checkpointing=checkpointing)
    return labels, slowdown


def rank_devices(job: Job) -> tuple[tuple[str, ...], ComputeSlowdown | None]:
    """This rank's process settings (as asked); every rank's device label, and this rank's emulated
    slowdown (None: a real device)."""
    emulation = emulation_for_rank(job.cluster, job.rank)
    on_cpu = on_cpu_accelerator()
    apply_cpu_process_settings(job.poplar_config, on_cpu=on_cpu, emulated=emulation is not None, rank=job.rank)
    labels = tuple(device_label(t, job.cluster.emulation_of(t)) for t in job.cluster.rank_device_types)
    return labels, None if emulation is None else steady_compute(job, emulation, on_cpu=on_cpu)


def steady_compute(job: Job, emulation: Emulation, *, on_cpu: bool) -> ComputeSlowdown:
    """This rank's emulated compute, steady at the times of the profile the plan was made from (or learned)."""
    my_type = job.cluster.rank_device_types[job.rank]
    profile = job.steady_profiles.get(my_type)
    reference = None if profile is None else steady_reference(profile_from_dict(profile, source=f"{my_type} profile"))
    if job.rank == 0 or reference is None:
        logger.info(
            "rank %d: emulated compute steady at %s",
            job.rank,
            "the times learned from its first micro-steps (no profile of its type beside the plan)"
            if reference is None
            else reference.source,
        )
    return ComputeSlowdown(
        emulation,
        clock="thread" if on_cpu else "cuda",
        reference=reference,
        # ZeRO 3's all-gathers fall inside the window: their waits are not the device's work.
        window_waits=job.plan.zero_stage == 3,
    )


def _log_rank_plan(job: Job, label: str, *, checkpointing: bool) -> None:
    rank_plan = job.plan.ranks[job.rank]
    logger.info(
        "rank %d: %s, micro-batch %d x %d accumulation steps%s%s; true global batch %d, ZeRO stage %d",
        job.rank,
        label,
        rank_plan.micro_batch_size,
        rank_plan.gradient_accumulation_steps,
        ", activation checkpointing" if checkpointing else "",
        ", optimizer offloaded to the host" if rank_plan.optimizer_offload else "",
        job.plan.global_batch_size,
        job.plan.zero_stage,
    )


def count_true_global_batch(engine: Any, plan: Plan) -> None:
    """Make a fresh DeepSpeedEngine's bookkeeping (samples/s, global_samples) count the plan's true global batch
    instead of the rank's nominal ``b_r * s_r * W``: its batch checks ran already, nothing later compares them."""
    engine._config.train_batch_size = plan.global_batch_size
    if hasattr(engine, "tput_timer"):
        engine.tput_timer.batch_size = plan.global_batch_size


def wrap_built_engine(
    job: Job,
    engine: Any,
    *,
    labels: tuple[str, ...],
    slowdown: ComputeSlowdown | None,
    sampler: PlanBatchSampler | None = None,
    weights_loss: bool = True,
    log_origin: bool = True,
) -> PoplarEngine:
    """The `PoplarEngine` over a DeepSpeed engine another library built (accelerate, for PoplarAccelerator and the
    Hugging Face Trainer) on this rank's config: counting the true batch, re-balancing (collective), timing
    training forwards, following `sampler` (built before the engine). `log_origin`: False where the caller logged
    the plan's origin already."""
    count_true_global_batch(engine, job.plan)
    follow_unsynchronised_throughput_timer(engine, job.ds_config, source=job.source)
    wrapped = poplar_engine(
        job,
        engine,
        labels=labels,
        slowdown=slowdown,
        rebalancer=zero_rebalancer(job),
        weights_loss=weights_loss,
        log_origin=log_origin,
    )
    if wrapped.compute_timer is not None:  # an emulated device's slowdown, or re-balancing's measurement
        time_training_forwards(engine, wrapped)
    if sampler is not None:
        wrapped.adopt_batch_sampler(sampler)
    return wrapped


def time_training_forwards(module: torch.nn.Module, wrapped: PoplarEngine) -> None:
    """`wrapped`'s compute window opens at each training forward of `module` (called by another library, not
    the engine), keyed by the plan's micro-batch as the engine's own forward keys it; evaluation's forwards are
    not timed."""
    module.register_forward_pre_hook(lambda m, _: wrapped.start_compute_window() if m.training else None)


def follow_unsynchronised_throughput_timer(engine: Any, ds_config: dict, *, source: str = DICT_SOURCE) -> None:
    """On an engine another library built from `ds_config`, the throughput timer that
    `unsynchronised_throughput_timer` gives poplar-ext's own engines (unless the user set it)."""
    timer_config = getattr(getattr(engine, "tput_timer", None), "config", None)
    if timer_config is not None:
        timer_config.synchronized = throughput_timer_synchronized(ds_config, source=source)


def poplar_engine(
    job: Job,
    engine: Any,
    *,
    labels: tuple[str, ...],
    slowdown: ComputeSlowdown | None,
    rebalancer: Rebalancer | None,
    weights_loss: bool = True,
    log_origin: bool = True,
) -> PoplarEngine:
    """The `PoplarEngine` over `engine` (a DeepSpeedEngine built on this rank's nominal config) with
    `set_up_rank`'s labels and slowdown; logs where the plan came from once the engine is built (`log_origin`)."""
    wrapped = PoplarEngine(
        engine,
        plan=job.plan,
        rank=job.rank,
        poplar_config=job.poplar_config,
        device_label=labels[job.rank],
        slowdown=slowdown,
        rank_device_labels=labels,
        plan_reason=job.plan_reason,
        rebalancer=rebalancer,
        weights_loss=weights_loss,
    )
    if job.rank == 0 and log_origin:
        logger.info("poplar plan from step 0: %s", job.plan_reason)
    return wrapped


def _training_dataloader(
    engine: PoplarEngine, training_data: Any, *, collate_fn: Any
) -> torch.utils.data.DataLoader | IterationLoader | None:
    """This rank's micro-batches of `training_data` (None without it), by the engine's batch sampler."""
    if training_data is None:
        return None
    return engine.plan_training_loader(training_data, collate_fn=collate_fn)


__all__ = [
    "Job",
    "count_true_global_batch",
    "initialize",
    "zero_rebalancer",
    "poplar_engine",
    "prepare_job",
    "rank_devices",
    "set_up_rank",
    "time_training_forwards",
    "wrap_built_engine",
]
