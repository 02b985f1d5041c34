"""Which plan a ZeRO job runs: a plan file, or searched at start from profiles (docs/training.md)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from poplar_ext.collectives import decided_by_rank0
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import ZERO_STAGES, Cluster, Plan, Profile, load_profiles, plan_from_dict, plan_to_dict
from poplar_ext.plan.levers import plan_levers
from poplar_ext.profiler.auto import MeasureMissing, TimeAtSizes
from poplar_ext.profiler.calibration import (
    REMEASURED,
    RESCALED,
    TRUSTED,
    CalibrationCheck,
    apply_checks,
    check_profiles,
    plan_sizes,
    rescaled_profile,
    with_calibration,
)
from poplar_ext.runtime.config import AUTO, SECTION, GlobalBatchRequest, PoplarConfig
from poplar_ext.runtime.job_start import job_plan_problems, read_plan_file
from poplar_ext.runtime.rebalance import RebalanceUnavailable
from poplar_ext.search.model_states import cannot_hold, model_states, shortfall

if TYPE_CHECKING:
    from poplar_ext.plan.network_format import NetworkProfile
    from poplar_ext.profiler.cache import JobKey


logger = logging.getLogger(__name__)


class StalePlanWarning(UserWarning):
    """A plan was made from other profiles than the ones the job has (see docs/training.md)."""


def stale_profile_types(plan: Plan, profiles: list[Profile]) -> list[str]:
    """Device types whose profile at the plan's stage and levers is not the one the plan was made from
    (as `profile_of_plan` finds it: rescaled where the plan's calibration rescaled it, among several models')."""
    from poplar_ext.plan.levers import profiles_for_plan

    at_stage = profiles_for_plan(plan, profiles)
    present = {p.device_type for p in at_stage}
    return [
        device_type
        for device_type, fingerprint in plan.profile_fingerprints.items()
        if device_type in present
        and getattr(profile_of_plan(plan, at_stage, device_type), "fingerprint", None) != fingerprint
    ]


def runtime_plan_problems(
    plan: Plan,
    cluster: Cluster,
    *,
    world_size: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest | None = None,
) -> list[str]:
    """What makes `plan` unrunnable in this job (sentences; [] when fine), in this order: the config's global batch
    (an ``"auto"`` one compares nothing), the job's and the cluster's number of ranks, the config's ZeRO stage.

    Only what the runtime alone knows (`job_plan_problems`): a plan file's batch above
    ``poplar.max_global_batch_size`` is `read_plan_file`'s refusal (the search keeps within it). The rest (device
    types, the stage 2/3 rule of one accumulation count, whose breach would hang the job, micro-batch caps) is
    `search.check_plan`'s.
    """
    job = job_plan_problems(plan, cluster, world_size=world_size, zero_stage=zero_stage, global_batch=global_batch)
    return job["batch"] + job["counts"] + job["stage"]


def check_plan_for_job(
    plan: Plan,
    cluster: Cluster,
    *,
    world_size: int,
    zero_stage: int | None,
    profiles: list[Profile] | None = None,
    source: str = "plan",
    global_batch: GlobalBatchRequest | None = None,
) -> None:
    """Raise ValueError listing every reason `plan` cannot run in this job: `runtime_plan_problems`, then the
    search's `check_plan` (device types, the stage 2/3 rule, micro-batch caps)."""
    from poplar_ext.search import check_plan

    problems = runtime_plan_problems(
        plan, cluster, world_size=world_size, zero_stage=zero_stage, global_batch=global_batch
    )
    problems += [p for p in check_plan(plan, cluster, profiles) if p not in problems]
    if problems:
        raise ValueError(f"{source}: this plan cannot run: " + " ".join(problems))


def obtain_missing_profiles(
    missing: list[tuple[str, int]],
    *,
    poplar_config: PoplarConfig,
    cluster: Cluster,
    measure_missing: MeasureMissing | None = None,
) -> list[Profile]:
    """Profiles for the (device type, ZeRO stage) pairs in `missing`, measured by `measure_missing` (collective;
    the automatic mode); without it, a ValueError saying what is missing and what to run."""
    if measure_missing is not None:
        return measure_missing(missing, cluster)
    by_stage: dict[int, list[str]] = {}
    for device_type, stage in missing:
        by_stage.setdefault(stage, []).append(device_type)
    lacking = "; ".join(f"stage {stage}: {', '.join(types)}" for stage, types in sorted(by_stage.items()))
    stages = ",".join(str(s) for s in sorted(by_stage))
    # Without poplar.cluster the job reads its cluster from the hardware, and so does poplar-profile without --cluster.
    cluster_option = "" if poplar_config.cluster is None else f"--cluster {poplar_config.cluster} "
    raise ValueError(
        f"{poplar_config.profiles_setting}: no plan was given and {poplar_config.profiles} lacks profiles for these "
        f"device types and ZeRO stages ({lacking}). Measure them with poplar-profile under your training launcher: "
        f"deepspeed --num_gpus N --module poplar_ext.profiler --deepspeed_config DS.json {cluster_option}"
        f"--model MODULE:FACTORY --batch MODULE:FACTORY --zero-stages {stages} --output-dir {poplar_config.profiles}; "
        "or give poplar.plan; or pass training_data to poplar_ext.initialize to measure them automatically."
    )


def _read_profiles(poplar_config: PoplarConfig) -> list[Profile]:
    """Every profile in ``poplar.profiles`` ([] when there is no such directory)."""
    directory = poplar_config.profiles
    if directory is None or not directory.exists():
        return []
    if not directory.is_dir():
        raise ValueError(
            f"{poplar_config.profiles_setting}: expected a directory of profiles (one is made when missing), "
            f"found the file {directory}"
        )
    try:
        return load_profiles(directory)
    except FormatError as exc:
        if not any(directory.glob("*.json")):
            return []
        raise ValueError(f"poplar.profiles: {exc}") from exc


_UNREAD = object()


@dataclass
class ProfileDirectory:
    """``poplar.profiles`` as rank 0 reads it during one job's start: its profiles and network file, each read
    once, on first use, then passed along; profiles measured meanwhile are added, not read back."""

    poplar_config: PoplarConfig
    cluster: Cluster
    dtype: str | None = None
    """The job's training dtype; None: any. The model's fingerprint is taken before DeepSpeed casts it, so a
    profile of the same model in another dtype is not this job's."""
    job_key: JobKey | None = None
    """The automatic mode's key of this job's profiles: a stored profile counts only where its cache would reuse
    it; None: the model's profiles in `dtype`."""
    _stored: list[Profile] | None = field(default=None, init=False, repr=False)
    _measured: list[Profile] = field(default_factory=list, init=False, repr=False)
    _network: Any = field(default=_UNREAD, init=False, repr=False)

    def profiles(self, model_fingerprint: str | None = None) -> list[Profile]:
        """The directory's profiles (of the model `model_fingerprint` when given), then the measured ones, each in
        place of the stored one of its model and `Profile.key`: rank 0 stored it over that file, which may hold
        another dtype's (`Profile.key` has none)."""
        if self._stored is None:
            self._stored = _read_profiles(self.poplar_config)
        stored = _replaced_by(self._stored, self._measured)
        return [p for p in stored if model_fingerprint is None or self._jobs(p, model_fingerprint)] + self._measured

    def _jobs(self, profile: Profile, model_fingerprint: str) -> bool:
        if profile.model.fingerprint != model_fingerprint:
            return False
        return self.job_key.holds(profile) if self.job_key is not None else self.dtype in (None, profile.model.dtype)

    def parked(self, model_fingerprint: str | None = None) -> list[Profile]:
        """The profiles of this cluster's world size that another world size's replaced in the directory
        (`poplar_ext.profiler.cache.parked_profiles`): the profiler's lookup moves them back, cached."""
        from poplar_ext.profiler.cache import parked_profiles

        if self.poplar_config.profiles is None:
            return []
        parked = parked_profiles(self.poplar_config.profiles, self.cluster.world_size)
        return [p for p in parked if model_fingerprint is None or p.model.fingerprint == model_fingerprint]

    def add_measured(self, profiles: list[Profile]) -> None:
        """Profiles measured since the directory was read, returned in place of those of the same model and key."""
        self._measured = _replaced_by(self._measured, profiles) + profiles

    def network(self) -> NetworkProfile | None:
        """The network file measured on the cluster beside the profiles, or None."""
        from poplar_ext.plan.network_format import find_network

        if self._network is _UNREAD:
            profiles_dir = self.poplar_config.profiles
            self._network = None if profiles_dir is None else find_network(profiles_dir, self.cluster)
        return self._network


def _replaced_by(profiles: list[Profile], newer: list[Profile]) -> list[Profile]:
    """`profiles` without those of a model and `Profile.key` that `newer` holds."""
    replaced = {(p.model.fingerprint, p.key) for p in newer}
    return [p for p in profiles if (p.model.fingerprint, p.key) not in replaced]


def _profile_gaps(
    profiles: list[Profile], cluster: Cluster, zero_stage: int | None
) -> tuple[list[tuple[str, int]], list[int]]:
    """The (device type, stage) pairs without a profile, and the stages where no type lacks one."""
    stages = ZERO_STAGES if zero_stage is None else (zero_stage,)
    have = {(p.device_type, p.zero_stage) for p in profiles}
    missing = [(t, s) for s in stages for t in cluster.type_counts() if (t, s) not in have]
    return missing, [s for s in stages if all(stage != s for _, stage in missing)]


def _searchable(profiles: list[Profile], cluster: Cluster, zero_stage: int | None) -> list[Profile]:
    """The profiles of the cluster's types at the stages every type has; ValueError when there are none."""
    # A measurement may come back without some (type, stage): recount, never assume.
    missing, complete = _profile_gaps(profiles, cluster, zero_stage)
    if not complete:
        still = "; ".join(f"{t} at stage {s}" for t, s in missing)
        raise ValueError(
            f"poplar.profiles: after profiling, no ZeRO stage has a profile of every device type (missing: {still})"
        )
    return [p for p in profiles if p.zero_stage in complete and p.device_type in cluster.type_counts()]


def profile_of_plan(plan: Plan, profiles: list[Profile], device_type: str) -> Profile | None:
    """`device_type`'s profile among `profiles` as the plan was made from it (rescaled where its calibration
    rescaled it), or the only one there is; None when there is none, or several and the plan names none."""
    candidates = [p for p in profiles if p.device_type == device_type]
    named = plan.profile_fingerprints.get(device_type)
    check = plan.calibration.get(device_type, {})
    if check.get("outcome") == RESCALED:
        # The plan names the rescaled profile (the cache keeps the measured one): rescale as its search did.
        ratio = check["measured_over_profiled"]
        candidates = [p if p.fingerprint == named else rescaled_profile(p, ratio) for p in candidates]
    matching = [p for p in candidates if p.fingerprint == named]
    if matching or len(candidates) == 1:
        return (matching or candidates)[0]
    return None


def steady_compute_profiles(plan: Plan, cluster: Cluster, directory: ProfileDirectory) -> dict[str, dict]:
    """Rank 0: each emulated device type's profile (a dict) the plan was made from, its compute made steady by."""
    from poplar_ext.plan.formats import profile_to_dict
    from poplar_ext.plan.levers import profiles_for_plan

    emulated = [t for t in cluster.type_counts() if cluster.emulation_of(t) is not None]
    if not emulated or directory.poplar_config.profiles is None:
        return {}
    try:
        profiles = profiles_for_plan(plan, directory.profiles())
    except ValueError:  # an unreadable directory: the plan's check said so already where it matters
        return {}
    found = {t: profile_of_plan(plan, profiles, t) for t in emulated}
    return {t: profile_to_dict(p) for t, p in found.items() if p is not None and p.max_micro_batch_size > 0}


def load_rebalance_inputs(
    poplar_config: PoplarConfig, cluster: Cluster, plan: Plan, *, directory: ProfileDirectory | None = None
) -> tuple[list[Profile], Any]:
    """What re-balancing re-plans from (rank 0 reads it): each device type's profile at the plan's stage and
    levers, as the plan was made from it (`profile_of_plan`: drift is measured against what the plan predicted),
    and the cluster's network file (or None). `RebalanceUnavailable`/ValueError when a profile is missing
    (re-balancing scales each rank's profiled curve) or ambiguous. `directory`: default, read now."""
    from poplar_ext.plan.levers import profiles_for_plan

    where = f"{poplar_config.source}: {SECTION}.rebalance.enabled"
    if poplar_config.profiles is None:
        raise RebalanceUnavailable(
            f"{where}: expected {SECTION}.profiles too (the profiles a re-balanced plan is searched from), found none",
            plain=f"no {SECTION}.profiles is named (this job runs a plan file alone)",
        )
    directory = directory or ProfileDirectory(poplar_config, cluster)
    profiles = profiles_for_plan(plan, directory.profiles())
    types = {p.device_type for p in profiles if p.max_micro_batch_size > 0}
    missing = [t for t in cluster.type_counts() if t not in types]
    if missing:
        raise RebalanceUnavailable(
            f"{where}: expected a profile of every device type at ZeRO stage {plan.zero_stage} in "
            f"{poplar_config.profiles}, found none for {', '.join(missing)}",
            plain=f"{poplar_config.profiles} has no profile of {', '.join(missing)} at ZeRO stage {plan.zero_stage}",
        )
    chosen = [profile_of_plan(plan, profiles, device_type) for device_type in cluster.type_counts()]
    for device_type, found in zip(cluster.type_counts(), chosen):
        if found is None:
            candidates = [p for p in profiles if p.device_type == device_type]
            raise ValueError(
                f"{where}: expected one profile of {device_type} at ZeRO stage {plan.zero_stage} in "
                f"{poplar_config.profiles}, or the one the plan was made from, found {len(candidates)} "
                "(several models?) and a plan that names none of them"
            )
    return chosen, directory.network()


def resolve_plan(
    poplar_config: PoplarConfig,
    cluster: Cluster,
    *,
    world_size: int,
    rank: int,
    zero_stage: int | None,
    global_batch: GlobalBatchRequest | None = None,
    model_fingerprint: str | None = None,
    broadcast: Callable[[Any], Any],
    measure_missing: MeasureMissing | None = None,
    directory: ProfileDirectory | None = None,
    time_at_sizes: TimeAtSizes | None = None,
) -> Plan:
    """The plan this job runs, checked; raises the same ValueError on every rank if it cannot.

    `zero_stage`: the config's stage, or None (the plan's, or the search's). `global_batch`: the batch the
    config asks for (default: ``poplar.global_batch_size``): a plan file must have it, the search uses it.
    `broadcast(obj)` returns rank 0's `obj` on every rank. `directory`: rank 0's reading of ``poplar.profiles``,
    passed on to re-balancing (default: a fresh one). `time_at_sizes` (collective): given, a plan searched from
    cached profiles is checked against timed micro-steps first (``poplar.calibration``, docs/training.md).
    Only rank 0 reads files (the other ranks' nodes need none of them); it decides (`decided_by_rank0`) the plan,
    the profiles to measure, or the error.
    """
    assert directory is None or (directory.poplar_config, directory.cluster) == (poplar_config, cluster)
    request = _PlanRequest(
        poplar_config=poplar_config,
        cluster=cluster,
        directory=directory or ProfileDirectory(poplar_config, cluster),
        world_size=world_size,
        zero_stage=zero_stage,
        global_batch=GlobalBatchRequest(size=poplar_config.global_batch_size, origin=f"{SECTION}.global_batch_size")
        if global_batch is None
        else global_batch,
        model_fingerprint=model_fingerprint,
    )
    above = poplar_config.batch_above_bound(request.global_batch)
    if above is not None:
        raise above
    if poplar_config.plan is not None:
        return _plan_from_file(request, rank=rank, broadcast=broadcast)
    return _plan_searched_at_start(
        request, rank=rank, broadcast=broadcast, measure_missing=measure_missing, time_at_sizes=time_at_sizes
    )


_SEARCHED_AT_START = "<plan searched at start>"  # how messages name it


@dataclass(frozen=True, kw_only=True)
class _PlanRequest:
    """What `resolve_plan` was asked for; rank 0 decides with it."""

    poplar_config: PoplarConfig
    cluster: Cluster
    directory: ProfileDirectory
    """Rank 0's reading of ``poplar.profiles`` (of `poplar_config`, for `cluster`)."""
    world_size: int
    zero_stage: int | None
    global_batch: GlobalBatchRequest
    model_fingerprint: str | None

    def checked(self, plan: Plan, profiles: list[Profile] | None, source: str) -> Plan:
        check_plan_for_job(
            plan,
            self.cluster,
            world_size=self.world_size,
            zero_stage=self.zero_stage,
            profiles=profiles,
            source=source,
            global_batch=self.global_batch,
        )
        return plan


def _plan_from_file(request: _PlanRequest, *, rank: int, broadcast: Callable[[Any], Any]) -> Plan:
    """``poplar.plan``, read and checked by rank 0; warns on every rank when made from other profiles."""
    plan_path = request.poplar_config.plan

    def read_and_check() -> dict[str, Any]:
        plan = read_plan_file(request.poplar_config, pipeline=False)
        profiles = request.directory.profiles(request.model_fingerprint) or None
        request.checked(plan, profiles, str(plan_path))
        return {"plan": plan_to_dict(plan), "stale": [] if profiles is None else stale_profile_types(plan, profiles)}

    decision = decided_by_rank0(read_and_check, rank=rank, broadcast=broadcast)
    if decision["stale"]:
        warnings.warn(
            f"{plan_path}: this plan was made from other profiles of {', '.join(decision['stale'])} than those in "
            f"{request.poplar_config.profiles}: it fits them, but its predicted times are not theirs; search the plan "
            "again with poplar-search to plan from the profiles you have",
            StalePlanWarning,
            stacklevel=3,  # resolve_plan's caller
        )
    return plan_from_dict(decision["plan"], source=str(plan_path))


def _plan_searched_at_start(
    request: _PlanRequest,
    *,
    rank: int,
    broadcast: Callable[[Any], Any],
    measure_missing: MeasureMissing | None,
    time_at_sizes: TimeAtSizes | None = None,
) -> Plan:
    """Rank 0 says which profiles are missing, every rank measures them, rank 0 searches."""
    poplar_config = request.poplar_config
    if request.global_batch.size is None:
        left_auto = " and ".join(request.global_batch.left_auto)
        auto = (
            f'"{AUTO}" in {left_auto} was not filled in (the Hugging Face Trainer and accelerate fill it from '
            "their batch size; poplar_ext.initialize does not): give a number there instead, or "
        )
        raise ValueError(
            f"{poplar_config.source}: no global batch for the plan search: {auto if left_auto else ''}set "
            f"train_batch_size (or train_micro_batch_size_per_gpu and gradient_accumulation_steps) or "
            f"{SECTION}.global_batch_size, "
            f'or {SECTION}.global_batch_size: "{AUTO}" to let the search pick the fastest'
        )
    # A missing profile that cannot be measured raises on every rank before anyone measures.
    missing = decided_by_rank0(
        lambda: _profiles_to_measure(request, measurable=measure_missing is not None), rank=rank, broadcast=broadcast
    )
    measured_now: set[tuple] = set()  # every profile key the measurer measured, not only those missing
    if missing:
        # Rank 0 reads the profiles, before and after: a type whose cache entry it refused is measured too;
        # one the profiler moves back from another world size's folder is cached, not measured.
        fingerprint = request.model_fingerprint
        before = request.directory.profiles(fingerprint) + request.directory.parked(fingerprint) if rank == 0 else []
        request.directory.add_measured(measure_missing(missing, request.cluster))  # collective

        def anew() -> set[tuple]:
            return {p.key for p in request.directory.profiles(request.model_fingerprint) if p not in before}

        measured_now = decided_by_rank0(anew, rank=rank, broadcast=broadcast)

    def search() -> dict[str, Any]:
        profiles = _searchable(
            request.directory.profiles(request.model_fingerprint), request.cluster, request.zero_stage
        )
        return plan_to_dict(request.checked(_search(request, profiles), profiles, _SEARCHED_AT_START))

    plan = plan_from_dict(decided_by_rank0(search, rank=rank, broadcast=broadcast), source=_SEARCHED_AT_START)
    if time_at_sizes is None or poplar_config.calibration.action == "off":
        return plan
    levers = plan_levers(plan)  # the profile the plan was made from: its type's, at its stage and levers
    cached = {
        t: s for t, s in plan_sizes([plan]).items() if (t, plan.zero_stage, *(levers[t] or (None,))) not in measured_now
    }
    if not cached:
        return plan  # every profile was measured just now
    return _calibrated(
        request, plan, cached, rank=rank, broadcast=broadcast, time_at_sizes=time_at_sizes, measure=measure_missing
    )


def calibration_outcome_text(outcome: str, ratio: float) -> str:
    """What a calibration outcome means for this job, in a log line's words."""
    meaning = {
        TRUSTED: "within poplar.calibration.threshold: the cached profile is used as it is",
        RESCALED: f"its cached times are multiplied by {ratio:.2f} for this job's search (the cache is unchanged; "
        "a ratio far from 1 means the device, its load or the software changed since it was profiled)",
        REMEASURED: "profiled again now, and the cache updated",
    }
    return f"{outcome} ({meaning[outcome]})" if outcome in meaning else outcome


def _calibrated(
    request: _PlanRequest,
    plan: Plan,
    sizes: dict[str, list[int]],
    *,
    rank: int,
    broadcast: Callable[[Any], Any],
    time_at_sizes: TimeAtSizes,
    measure: MeasureMissing | None,
) -> Plan:
    """`plan`, or searched again from the cached profiles checked against micro-steps timed now at `sizes`
    (collective); the result records the checks."""
    settings = request.poplar_config.calibration
    levers = plan_levers(plan)
    if None in levers.values() or len({offload for _, offload in levers.values()}) > 1:
        # One engine config times every rank: their optimizer offload must agree (checkpointing may differ by type).
        logger.info(
            "poplar.calibration: not checked (the plan offloads the optimizer on some ranks only, or gives ranks "
            "of one device type different memory levers)"
        )
        return plan
    measured = time_at_sizes(sizes, plan, request.cluster)  # collective

    def decide() -> dict[str, CalibrationCheck]:
        from poplar_ext.plan.levers import profiles_for_plan

        profiles = profiles_for_plan(plan, request.directory.profiles(request.model_fingerprint))
        return check_profiles(profiles, measured, threshold=settings.threshold, action=settings.action)

    checks = decided_by_rank0(decide, rank=rank, broadcast=broadcast)
    if rank == 0:  # every rank holds the same checks: said once
        for check in checks.values():
            logger.info(
                "poplar.calibration: %s ran %.2fx its cached profile at micro-batch %s: %s",
                check.device_type,
                check.measured_over_profiled,
                ", ".join(map(str, check.sizes)),
                calibration_outcome_text(check.outcome, check.measured_over_profiled),
            )
    if all(c.outcome == TRUSTED for c in checks.values()):
        return with_calibration(plan, checks)
    remeasure = [(t, plan.zero_stage) for t, c in sorted(checks.items()) if c.outcome == REMEASURED]
    assert not remeasure or measure is not None, "initialize passes time_at_sizes with the measurer it belongs to"
    if remeasure:  # rank 0 stored them over the cached files: what re-balancing and steady emulation read after
        request.directory.add_measured(measure(remeasure, request.cluster, force=True))

    def search_again() -> dict[str, Any]:
        profiles = apply_checks(request.directory.profiles(request.model_fingerprint), checks)
        searchable = _searchable(profiles, request.cluster, request.zero_stage)
        again = request.checked(_search(request, searchable), searchable, _SEARCHED_AT_START)
        return plan_to_dict(with_calibration(again, checks))

    return plan_from_dict(decided_by_rank0(search_again, rank=rank, broadcast=broadcast), source=_SEARCHED_AT_START)


def _profiles_to_measure(request: _PlanRequest, *, measurable: bool) -> list[tuple[str, int]]:
    """The (device type, stage) pairs the directory lacks; ValueError when they cannot be measured here."""
    profiles = request.directory.profiles(request.model_fingerprint)
    missing, complete = _profile_gaps(profiles, request.cluster, request.zero_stage)
    if complete:
        return []
    if not measurable:
        obtain_missing_profiles(missing, poplar_config=request.poplar_config, cluster=request.cluster)  # raises
    return missing


def _search(request: _PlanRequest, profiles: list[Profile]) -> Plan:
    """The search's plan; ValueError with the reason when there is none."""
    from poplar_ext.search import search_plan

    batch = request.global_batch.size
    result = search_plan(
        profiles,
        request.cluster,
        global_batch_size=None if batch == AUTO else batch,  # None: the search picks
        zero_stage="auto" if request.zero_stage is None else request.zero_stage,
        policy=request.poplar_config.policy,
        max_global_batch_size=request.poplar_config.max_global_batch_size,
        # The network file the profiler measured on this cluster, if any: communication priced.
        network=request.directory.network(),
    )
    if result.status != "ok":
        raise ValueError(f"poplar: the plan search found no feasible plan: {result.message}")
    return result.plan


def check_stage_memory(
    plan: Plan,
    *,
    capacities_bytes: Sequence[int],
    num_parameters: int,
    num_trainable_parameters: int,
    dtype: str,
    optimizer_bytes_per_parameter: int,
) -> None:
    """Refuse `plan` where a rank's memory (`capacities_bytes`, rank order) cannot hold the model states alone at
    the plan's stage, with the same ValueError on every rank naming each such rank: run before DeepSpeed builds
    the engine, where running out of memory would leave the others waiting in a collective."""
    problems = []
    for rank_plan, capacity in zip(plan.ranks, capacities_bytes):
        states = model_states(
            num_parameters=num_parameters,
            num_trainable_parameters=num_trainable_parameters,
            zero_stage=plan.zero_stage,
            world_size=len(plan.ranks),
            dtype=dtype,
            optimizer_bytes_per_parameter=optimizer_bytes_per_parameter,
            optimizer_offload=rank_plan.optimizer_offload,
        )
        if cannot_hold(states, capacity_bytes=capacity):
            problems.append(
                f"rank {rank_plan.rank} ({rank_plan.device_type}): {shortfall(states, capacity_bytes=capacity)}"
            )
    if problems:
        raise ValueError(
            "plan: expected every rank to hold the model at its ZeRO stage, found "
            + "; ".join(problems)
            + ". Use a higher ZeRO stage, optimizer offload for those ranks, or profiles that show it (the "
            "search then chooses)"
        )


__all__ = [
    "StalePlanWarning",
    "check_stage_memory",
    "load_rebalance_inputs",
    "check_plan_for_job",
    "obtain_missing_profiles",
    "ProfileDirectory",
    "resolve_plan",
    "runtime_plan_problems",
    "stale_profile_types",
]
