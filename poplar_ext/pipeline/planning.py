"""Which pipeline plan a job runs, and what it refuses before training, alike on every rank (docs/pipeline.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster
from poplar_ext.plan.pipeline_formats import (
    PIPELINE_POLICY,
    PIPELINE_ZERO_STAGES,
    LayerProfile,
    PipelinePlan,
    cluster_problems,
    layer_profiles_dir,
    load_layer_profiles,
    pipeline_plan_from_dict,
    pipeline_plan_to_dict,
)
from poplar_ext.runtime.config import (
    AUTO,
    SECTION,
    GlobalBatchRequest,
    PoplarConfig,
    deepspeed_train_batch_size,
    requested_zero_stage,
)
from poplar_ext.runtime.job_start import job_plan_problems, read_plan_file

if TYPE_CHECKING:
    from poplar_ext.profiler.cache import JobKey
    from poplar_ext.runtime.rebalance import PipelineDriftMonitor


def requested_pipeline_batch(poplar_config: PoplarConfig, ds_config: dict) -> GlobalBatchRequest | None:
    """The global batch the config sets explicitly: ``poplar.global_batch_size``, else ``train_batch_size``; None
    when neither does (the per-rank keys are the plan's in a pipeline job)."""
    if isinstance(poplar_config.global_batch_size, int):
        return GlobalBatchRequest(size=poplar_config.global_batch_size, origin=f"{SECTION}.global_batch_size")
    given = deepspeed_train_batch_size(ds_config, source=poplar_config.source)
    return None if given is None else GlobalBatchRequest(size=given, origin="train_batch_size")


def check_pipeline_config(ds_config: dict, poplar_config: PoplarConfig) -> None:
    """ValueError listing what a pipeline job cannot run, from the config alone (no process group needed)."""
    source = poplar_config.source
    given = deepspeed_train_batch_size(ds_config, source=source)  # FormatError where it is no batch
    problems = []
    requested = requested_pipeline_batch(poplar_config, ds_config)
    if poplar_config.plan is None and requested is None and poplar_config.global_batch_size != AUTO:
        problems.append(
            f"{SECTION}.global_batch_size (or train_batch_size): expected the global batch to search a pipeline plan "
            "at start (no poplar.plan), found none"
        )
    if poplar_config.plan is None and poplar_config.policy != PIPELINE_POLICY:
        # The search at start would silently run its own (a plan file's policy is checked where it is read).
        problems.append(
            f"{SECTION}.policy: expected {PIPELINE_POLICY} with pipelines (the pipeline search's one policy), "
            f"found {poplar_config.policy}"
        )
    stage = requested_zero_stage(poplar_config, ds_config)
    if stage is not None and stage not in PIPELINE_ZERO_STAGES:
        problems.append(
            f"zero_optimization.stage (or {SECTION}.zero_stage): expected 0 or 1 with pipelines, found {stage} "
            "(DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3)"
        )
    if poplar_config.global_batch_size == AUTO:
        # Beside a plan it is refused where the section is read (`poplar_config_from_dict`).
        problems.append(
            f"{SECTION}.global_batch_size: expected a number or none with pipelines (the pipeline search sizes a "
            f"given batch), found {AUTO!r}"
        )
    if (
        isinstance(poplar_config.global_batch_size, int)
        and given is not None
        and given != poplar_config.global_batch_size
    ):
        # Only the first would be checked against the plan, the other silently replaced.
        problems.append(
            f"{SECTION}.global_batch_size: expected train_batch_size's {given} or no {SECTION}.global_batch_size, "
            f"found {poplar_config.global_batch_size}"
        )
    if requested is not None and (above := poplar_config.batch_above_bound(requested)) is not None:
        problems.append(above.detail)  # the file is named once, before every problem
    if problems:
        raise ValueError(f"{source}: this pipeline job cannot run: " + "; ".join(problems))


def pipeline_plan_problems(
    plan: PipelinePlan,
    cluster: Cluster,
    *,
    world_size: int,
    num_layers: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest | None = None,
) -> list[str]:
    """What makes `plan` unrunnable in this job, as sentences ([] when fine), in this order: its ranks against the
    job's and the cluster's (`job_plan_problems`), each rank's device type against the cluster's (where the counts
    agree), its layers against the model's, its stage and global batch against the config's."""
    job = job_plan_problems(plan, cluster, world_size=world_size, zero_stage=zero_stage, global_batch=global_batch)
    problems = list(job["counts"])
    if not problems:  # the counts agree: each rank's type, as a ZeRO job's check_plan_for_job (the search's check)
        problems += cluster_problems(plan, cluster)
    if plan.num_layers != num_layers:
        problems.append(
            f"The plan splits {plan.num_layers} layers but the model has {num_layers} (the layers given to "
            "PoplarPipelineModule): its stages would not cover the model."
        )
    return problems + job["stage"] + job["batch"]


def resolve_pipeline_plan(
    poplar_config: PoplarConfig,
    cluster: Cluster,
    *,
    world_size: int,
    rank: int,
    num_layers: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest | None,
    broadcast: Callable[[Any], Any],
    layers_fingerprint: Callable[[], str] | None = None,
    measure_missing: MeasureMissingLayers | None = None,
    dtype: str | None = None,
) -> PipelinePlan:
    """The pipeline plan of ``poplar.plan``, read and checked by rank 0, on every rank; the same ValueError on
    every rank when it cannot run (`pipeline_plan_problems`, or a ZeRO plan).

    Without ``poplar.plan``, `plan_searched_at_start`: `layers_fingerprint()` (rank 0) says which layer profiles
    are the model's (in `dtype`, the job's training dtype, when given: the fingerprint is taken before DeepSpeed
    casts), `measure_missing` measures those missing (None: the error says what to run)."""
    from poplar_ext.collectives import decided_by_rank0

    plan_path = poplar_config.plan
    if plan_path is None:
        assert global_batch is not None, "check_pipeline_config refuses a search without a global batch"
        return plan_searched_at_start(
            poplar_config,
            cluster,
            world_size=world_size,
            rank=rank,
            num_layers=num_layers,
            zero_stage=zero_stage,
            global_batch=global_batch,
            broadcast=broadcast,
            layers_fingerprint=layers_fingerprint,
            measure_missing=measure_missing,
            dtype=dtype,
        )

    def read() -> dict[str, Any]:
        plan = read_plan_file(poplar_config, pipeline=True)
        problems = pipeline_plan_problems(
            plan,
            cluster,
            world_size=world_size,
            num_layers=num_layers,
            zero_stage=zero_stage,
            global_batch=global_batch,
        )
        if problems:
            raise ValueError(f"{plan_path}: this pipeline plan cannot run: " + " ".join(problems))
        return pipeline_plan_to_dict(plan)

    return pipeline_plan_from_dict(decided_by_rank0(read, rank=rank, broadcast=broadcast), source=str(plan_path))


MeasureMissingLayers = Callable[[list[str], Cluster, tuple[int, ...]], None]
"""``measure(device_types, cluster, zero_stages)``: layer profiles of those types written into
``poplar.profiles``/layers/ (collective: every rank calls it alike)."""

SEARCHED_AT_START = "<pipeline plan searched at start>"
"""How messages and the plan history name a plan searched at start."""


def plan_searched_at_start(
    poplar_config: PoplarConfig,
    cluster: Cluster,
    *,
    world_size: int,
    rank: int,
    num_layers: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest,
    broadcast: Callable[[Any], Any],
    layers_fingerprint: Callable[[], str] | None,
    measure_missing: MeasureMissingLayers | None,
    dtype: str | None = None,
) -> PipelinePlan:
    """Rank 0 says which device types lack layer profiles, every rank measures them (when it can), rank 0
    searches and every rank receives the plan, or the same ValueError."""
    from poplar_ext.collectives import decided_by_rank0

    stages = PIPELINE_ZERO_STAGES if zero_stage is None else (zero_stage,)
    fingerprint = decided_by_rank0(lambda: layers_fingerprint and layers_fingerprint(), rank=rank, broadcast=broadcast)
    # The automatic mode counts a stored layer profile where its profiler's cache would reuse it (the config,
    # optimizer, emulation, versions too), not on the model and dtype alone.
    key_of = getattr(measure_missing, "profiles_key", None)
    job_key = None if key_of is None or fingerprint is None else key_of(cluster, fingerprint)
    ours = _LayerProfilesOf(num_layers=num_layers, fingerprint=fingerprint, dtype=dtype, job_key=job_key)

    def missing() -> list[str]:
        have = {(p.device_type, p.zero_stage) for p in ours.stored(poplar_config)}
        types = [t for t in cluster.type_counts() if not all((t, s) in have for s in stages)]
        if types and measure_missing is None:
            raise ValueError(_cannot_measure_message(poplar_config, types, stages))
        return types

    types = decided_by_rank0(missing, rank=rank, broadcast=broadcast)
    if types:
        measure_missing(types, cluster, stages)  # collective

    def search() -> dict[str, Any]:
        from poplar_ext.plan.network_format import find_network
        from poplar_ext.search.pipeline_search import search_pipeline_plan

        profiles = ours.stored(poplar_config)
        result = search_pipeline_plan(
            [p for p in profiles if p.zero_stage in stages],
            cluster,
            global_batch_size=global_batch.size,
            zero_stage="auto" if zero_stage is None else zero_stage,
            network=find_network(poplar_config.profiles, cluster),
        )
        if result.plan is None:
            raise ValueError(f"{SECTION}.profiles: no pipeline plan can run: {result.message}")
        problems = pipeline_plan_problems(
            result.plan,
            cluster,
            world_size=world_size,
            num_layers=num_layers,
            zero_stage=zero_stage,
            global_batch=global_batch,
        )
        assert not problems, problems  # the search plans for this cluster, batch and stage
        return pipeline_plan_to_dict(result.plan)

    return pipeline_plan_from_dict(decided_by_rank0(search, rank=rank, broadcast=broadcast), source=SEARCHED_AT_START)


def steady_stage_times(plan: PipelinePlan, cluster: Cluster, poplar_config: PoplarConfig) -> dict[int, dict]:
    """Rank 0: each emulated rank's stage blocks from the layer profiles the plan was made from, with the
    slowdown they were measured at; {} where there are none."""
    from poplar_ext.search.pipeline_cost import stage_block_times

    emulated = {t for t in cluster.type_counts() if cluster.emulation_of(t) is not None}
    if not emulated or poplar_config.profiles is None:
        return {}
    by_type = {p.device_type: p for p in plan_layer_profiles(plan, poplar_config)}
    if any(t not in by_type for t in set(plan.rank_device_types)):
        return {}
    times = stage_block_times(plan, list(by_type.values()))
    types = plan.rank_device_types
    return {
        rank: {**blocks, "profile_slowdown": by_type[types[rank]].emulated.slowdown, "type": types[rank]}
        for rank, blocks in times.items()
        if types[rank] in emulated and by_type[types[rank]].emulated is not None
    }


def plan_layer_profiles(plan: PipelinePlan, poplar_config: PoplarConfig) -> list[LayerProfile]:
    """The layer profiles in ``poplar.profiles`` at the plan's stage and layer count: for each device type
    the one the plan was made from where it names one (its ``profile_fingerprints``)."""
    wanted = plan.profile_fingerprints
    return [
        p
        for p in _LayerProfilesOf(num_layers=plan.num_layers).stored(poplar_config)
        if p.zero_stage == plan.zero_stage and (p.device_type not in wanted or wanted[p.device_type] == p.fingerprint)
    ]


def pipeline_drift_monitor(plan: PipelinePlan, cluster: Cluster, poplar_config: PoplarConfig) -> PipelineDriftMonitor:
    """Rank 0: the `PipelineDriftMonitor` that re-balances `plan` from the layer profiles it was made from and
    the network file beside them; `RebalanceUnavailable` where a device type has none (`job_rebalancer` turns
    ``auto`` off then, with a note)."""
    from poplar_ext.plan.network_format import find_network
    from poplar_ext.runtime.rebalance import PipelineDriftMonitor, RebalanceUnavailable

    where = f"{poplar_config.source}: {SECTION}.rebalance.enabled"
    if poplar_config.profiles is None:
        raise RebalanceUnavailable(
            f"{where}: expected {SECTION}.profiles too (the layer profiles micro-batches are re-counted from), "
            "found none",
            plain=f"no {SECTION}.profiles is named (this job runs a plan file alone)",
        )
    by_type = {p.device_type: p for p in plan_layer_profiles(plan, poplar_config)}
    missing = [t for t in cluster.type_counts() if t not in by_type]
    if missing:
        directory = layer_profiles_dir(poplar_config.profiles)
        raise RebalanceUnavailable(
            f"{where}: expected a layer profile of every device type at ZeRO stage {plan.zero_stage} in "
            f"{directory}, found none for {', '.join(missing)}",
            plain=f"{directory} has no layer profile of {', '.join(missing)} at ZeRO stage {plan.zero_stage}",
        )
    return PipelineDriftMonitor(
        config=poplar_config.rebalance,
        profiles=[by_type[t] for t in cluster.type_counts()],
        cluster=cluster,
        network=find_network(poplar_config.profiles, cluster),
    )


@dataclass(frozen=True, kw_only=True)
class _LayerProfilesOf:
    """Which stored layer profiles are a model's: its layer count, fingerprint (when known), then those `job_key`
    holds (the automatic mode's), else those in `dtype` (None: any)."""

    num_layers: int
    fingerprint: str | None = None
    dtype: str | None = None
    job_key: JobKey | None = None

    def stored(self, poplar_config: PoplarConfig) -> list[LayerProfile]:
        directory = layer_profiles_dir(poplar_config.profiles)
        if not directory.is_dir():
            return []
        try:
            profiles = load_layer_profiles(directory)
        except FormatError as exc:
            raise ValueError(f"{SECTION}.profiles: {exc}") from exc
        return [p for p in profiles if p.num_layers == self.num_layers and self._models(p)]

    def _models(self, profile: LayerProfile) -> bool:
        if self.fingerprint is None:
            return True
        if profile.model.fingerprint != self.fingerprint:
            return False
        return self.job_key.holds(profile) if self.job_key is not None else self.dtype in (None, profile.model.dtype)


def _cannot_measure_message(poplar_config: PoplarConfig, types: list[str], stages: tuple[int, ...]) -> str:
    # poplar-profile requires --deepspeed_config, and profiles the types of --cluster (else the hardware's).
    cluster_option = "" if poplar_config.cluster is None else f"--cluster {poplar_config.cluster} "
    return (
        f"{poplar_config.profiles_setting}: no plan was given and {layer_profiles_dir(poplar_config.profiles)} "
        f"lacks layer profiles of this model for {', '.join(types)} at ZeRO stage {' and '.join(map(str, stages))}; "
        "give PoplarPipelineModule training_data= to measure them at start (the module is built before "
        "poplar_ext.initialize, so create the dataset first and pass it to both), or measure them first: "
        f"poplar-profile --per-layer --deepspeed_config DS.json {cluster_option}--model MODULE:LAYERS "
        "--batch MODULE:FACTORY --zero-stages "
        f"{','.join(map(str, stages))} --output-dir {poplar_config.profiles} (under the job's launcher)"
    )


__all__ = [
    "SEARCHED_AT_START",
    "MeasureMissingLayers",
    "check_pipeline_config",
    "plan_searched_at_start",
    "pipeline_drift_monitor",
    "pipeline_plan_problems",
    "plan_layer_profiles",
    "requested_pipeline_batch",
    "resolve_pipeline_plan",
]
