"""`search_plan`, `check_plan`, `predict`: infeasible is a status, bad input a ValueError (docs/search.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from poplar_ext.plan.formats import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_SIZE,
    MAX_WORLD_SIZE,
    OFFLOAD_STAGES,
    POLICIES,
    ZERO_STAGES,
    Cluster,
    Emulation,
    Plan,
    Prediction,
    Profile,
    RankPlan,
    check_measured_alike,
    files_text,
    levers_text,
    listed,
    mixed_models,
    models_text,
    one_accumulation_count,
)
from poplar_ext.plan.levers import (
    LEVER_NAMES,
    NO_LEVERS,
    Variants,
    lever_choices,
    levers_summary,
    mixed_lever_types,
    plan_levers,
    profiles_for_plan,
)
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import LayerProfile, PipelinePlan, cluster_problems
from poplar_ext.plan.validation import closest

from .allocation import PolicyResult, infeasible
from .cost import StageModel, build_stage_model
from .lever_search import StageOutcome, evaluate_settings, search_levers


@dataclass(frozen=True, kw_only=True)
class StageReport:
    """How one ZeRO stage fared in a search."""

    zero_stage: int
    """The stage."""
    status: str
    """``chosen``, ``slower`` or ``infeasible``."""
    iteration_time_s: float | None
    """Predicted iteration time of the stage's best allocation (None when infeasible)."""
    samples_per_s: float | None
    """Predicted throughput of that allocation (None when infeasible)."""
    global_batch_size: int | None
    """Global batch of that allocation (None when infeasible)."""
    reason: str
    """Why it won, why it lost (how much slower) or why it is infeasible; a full sentence."""

    @classmethod
    def infeasible(cls, zero_stage: int, reason: str) -> StageReport:
        """A stage with no feasible allocation, and why."""
        return cls(
            zero_stage=zero_stage,
            status="infeasible",
            iteration_time_s=None,
            samples_per_s=None,
            global_batch_size=None,
            reason=reason,
        )

    @classmethod
    def feasible(
        cls, zero_stage: int, chosen: int, chosen_reason: str, best_samples_per_s: float, predicted, batch: int
    ) -> StageReport:
        """A stage whose best plan (`predicted` time and samples/s, global `batch`) is the chosen one or slower."""
        if zero_stage == chosen:
            status, reason = "chosen", chosen_reason
        else:
            share = 1.0 - predicted.samples_per_s / best_samples_per_s
            tie = " (a tie: the lower stage is chosen)" if abs(share) <= STAGE_TIE_TOLERANCE else ""
            slower = 100.0 * max(share, 0.0)
            status, reason = "slower", f"{slower:.1f}% lower predicted throughput than stage {chosen}{tie}."
        return cls(
            zero_stage=zero_stage,
            status=status,
            iteration_time_s=predicted.iteration_time_s,
            samples_per_s=predicted.samples_per_s,
            global_batch_size=batch,
            reason=reason,
        )


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The outcome of a search, ZeRO (`search_plan`) or pipelines (`search_pipeline_plan`): a plan, or the reason there
    is none."""

    status: str
    """``ok`` or ``infeasible``."""
    message: str
    """One line for people: what was chosen and why, or why nothing could be."""
    plan: Plan | PipelinePlan | None
    """The plan when status is ``ok``: a `Plan` (ZeRO) or a `PipelinePlan`."""
    policy: str
    """The policy that was run."""
    zero_stage: int | None
    """The stage of the plan (None when infeasible)."""
    stage_reports: tuple[StageReport, ...]
    """One per evaluated stage, in stage order."""
    parallelism: str = "zero"
    """``zero`` (every rank holds the model) or ``pipeline`` (pipelines of stages side by side)."""
    method: str = "exact"
    """``exact`` or ``heuristic``: how the chosen stage was searched (the ZeRO search is exact; the pipeline search is
    exact for small clusters, `poplar_ext.search.pipeline_search`)."""
    layouts_evaluated: int | None = None
    """Pipelines only: the layouts of ranks into pipelines the chosen stage's search considered."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def infeasible(cls, message: str, policy: str, stage_reports: tuple[StageReport, ...], **more: Any) -> SearchResult:
        """No plan, and `message` says why (`more`: the fields that have defaults)."""
        return cls(
            status="infeasible",
            message=message,
            plan=None,
            policy=policy,
            zero_stage=None,
            stage_reports=stage_reports,
            **more,
        )


@dataclass(frozen=True, kw_only=True)
class PlanPrediction:
    """What the cost model predicts for a plan, rank by rank."""

    zero_stage: int
    """The plan's stage."""
    rank_micro_step_time_s: tuple[float, ...]
    """Time of one micro-step of each rank at its micro-batch size."""
    rank_busy_time_s: tuple[float, ...]
    """Per-rank compute per iteration: accumulation steps * micro-step time."""
    boundary_s: float
    """Accumulation boundary: the optimizer step (largest among the plan's device types) and its collectives."""
    iteration_time_s: float
    """Predicted iteration time (see `search.cost`)."""
    samples_per_s: float
    """Global batch / iteration time."""
    ideal_samples_per_s: float
    """Sum over ranks of each device's best standalone throughput at this stage."""
    rank_compute_time_s: tuple[float, ...] = ()
    """Per-rank compute per iteration, communication left out (equal to `rank_busy_time_s` without a network)."""
    micro_step_communication_s: float = 0.0
    """Communication a micro-step waits for (largest over ranks; 0 without a network)."""
    boundary_communication_s: float = 0.0
    """Collectives at the boundary (0 without a network: then inside `boundary_s`)."""
    optimizer_step_s: float = 0.0
    """The boundary's optimizer step (without a network: the measured boundary, collectives included)."""


# -- Input checks
def _check_profiles(profiles: Sequence[Profile]) -> dict[int, dict[str, Variants]]:
    """Profiles by stage, device type and memory levers; ValueError for mixed models or duplicates."""
    if isinstance(profiles, Profile) or not isinstance(profiles, Sequence):
        raise ValueError(
            f"profiles: expected a list of poplar_ext.plan.formats.Profile, found {type(profiles).__name__}"
        )
    for index, profile in enumerate(profiles):
        if not isinstance(profile, Profile):
            raise ValueError(
                f"profiles[{index}]: expected a poplar_ext.plan.formats.Profile, found {type(profile).__name__}"
            )
        if profile.max_micro_batch_size > MAX_MICRO_BATCH_SIZE:
            # Profiles made in Python skip the file checks; the step-time table has one entry per size.
            raise ValueError(
                f"profiles[{index}].max_micro_batch_size: expected at most {MAX_MICRO_BATCH_SIZE} (the search's "
                f"limit), found {profile.max_micro_batch_size}"
            )
    if not profiles:
        raise ValueError("profiles: expected at least one profile, found none")
    mixed = mixed_models(profiles)
    if mixed is not None:
        raise ValueError(
            f"profiles: expected profiles of one model, found {mixed[0]} models: {mixed[1]} (poplar-search: --model "
            f"NAME picks one){files_text(profiles)}"
        )
    by_stage: dict[int, dict[str, Variants]] = {}
    for profile in profiles:
        variants = by_stage.setdefault(profile.zero_stage, {}).setdefault(profile.device_type, {})
        if profile.levers in variants:
            raise ValueError(
                "profiles: expected one profile per (device type, ZeRO stage, activation checkpointing, optimizer "
                f"offload), found two for {profile.device_type!r} at stage {profile.zero_stage}"
                f"{levers_text(*profile.levers)}"
            )
        if profile.optimizer_offload and profile.zero_stage not in OFFLOAD_STAGES:
            raise ValueError(
                f"profiles: expected optimizer_offload only at ZeRO stages 1-2, found it for {profile.device_type!r} "
                f"at stage {profile.zero_stage}"
            )
        variants[profile.levers] = profile
    return by_stage


def _check_arguments(
    cluster: Cluster,
    global_batch_size: int | None,
    zero_stage: int | str,
    policy: str,
    max_global_batch_size: int | None,
) -> None:
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster: expected a poplar_ext.plan.formats.Cluster, found {type(cluster).__name__}")
    for name, value in (("global_batch_size", global_batch_size), ("max_global_batch_size", max_global_batch_size)):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or not 1 <= value <= MAX_GLOBAL_BATCH_SIZE
        ):
            raise ValueError(
                f"{name}: expected None or an integer from 1 to {MAX_GLOBAL_BATCH_SIZE} (the search's limit), found "
                f"{value!r}"
            )
    if cluster.world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"cluster: expected at most {MAX_WORLD_SIZE} ranks (the search's limit), found {cluster.world_size}"
        )
    if zero_stage != "auto" and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
        raise ValueError(f"zero_stage: expected 'auto' or one of 0, 1, 2, 3, found {zero_stage!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(map(repr, POLICIES))}, found {policy!r}")
    if (
        global_batch_size is not None
        and max_global_batch_size is not None
        and global_batch_size > max_global_batch_size
    ):
        raise ValueError(
            f"global_batch_size: expected at most max_global_batch_size ({max_global_batch_size}), found "
            f"{global_batch_size}"
        )


# -- search_plan
def _evaluate_stage(
    stage: int,
    by_stage: dict[int, dict[str, Variants]],
    cluster: Cluster,
    policy: str,
    global_batch_size: int | None,
    max_global_batch_size: int | None,
    network: NetworkProfile | None = None,
) -> StageOutcome:
    """The policy's best allocation at `stage` over the memory levers it may choose (`search.lever_search`)."""
    profiles = by_stage.get(stage, {})
    types = list(cluster.type_counts())
    missing = [t for t in types if t not in profiles]
    if missing:
        # A profile of a type the cluster lacks, close to a missing one's name: a misspelt device_type, likely.
        strangers = [t for t in profiles if t not in types]
        close = {t: closest(t, strangers) for t in missing}
        hints = "".join(
            f" A profile of {c!r} (not in the cluster) is there: {t!r} misspelt?" for t, c in close.items() if c
        )
        return StageOutcome(
            model=None, outcome=infeasible(f"No profile for {', '.join(missing)} at stage {stage}.{hints}"), levers={}
        )
    variants = {t: profiles[t] for t in types}
    if policy == "poplar" and stage != 3:
        # Up to 4 ** types settings: found without listing them (the same outcome as the list).
        return search_levers(
            variants,
            cluster,
            stage,
            global_batch_size=global_batch_size,
            max_global_batch_size=max_global_batch_size,
            network=network,
        )
    settings = lever_choices(variants, stage, choose=policy == "poplar")
    if not settings:
        shown = "; ".join(
            f"{t} {'with' if (True, False) in v else 'without'} only" for t, v in variants.items() if len(v) == 1
        )
        reason = (
            "Stage 3 needs one activation checkpointing setting on every rank, and no setting has a profile of every "
            f"device type ({shown})."
        )
        return StageOutcome(model=None, outcome=infeasible(reason), levers={})
    return evaluate_settings(
        settings, variants, cluster, stage, policy, global_batch_size, max_global_batch_size, network
    )


def _plan(model: StageModel, outcome: PolicyResult, policy: str) -> Plan:
    allocation = outcome.allocation
    assert allocation is not None
    ranks = tuple(
        RankPlan(
            rank=rank,
            device_type=model.devices[int(index)].device_type,
            micro_batch_size=int(micro),
            gradient_accumulation_steps=int(steps),
            activation_checkpointing=model.devices[int(index)].profile.activation_checkpointing,
            optimizer_offload=model.devices[int(index)].profile.optimizer_offload,
        )
        for rank, (index, micro, steps) in enumerate(
            zip(model.rank_device_index, allocation.micro_batch_sizes, allocation.accumulation_steps)
        )
    )
    return Plan(
        policy=policy,
        zero_stage=model.zero_stage,
        global_batch_size=allocation.global_batch_size,
        ranks=ranks,
        predicted=Prediction(
            iteration_time_s=allocation.iteration_time_s,
            samples_per_s=allocation.samples_per_s,
            ideal_samples_per_s=model.ideal_samples_per_s,
        ),
        profile_fingerprints={d.device_type: d.profile.fingerprint for d in model.devices},
    )


def _world_size_note(model: StageModel, world_size: int) -> str:
    sizes = sorted({d.profile.world_size for d in model.devices})
    if sizes == [world_size]:
        return ""
    note = f" Profiles were taken at world size {', '.join(map(str, sizes))}, the cluster has {world_size} ranks: "
    if model.communication is not None:
        return note + (
            "communication and the optimizer step are predicted for it from the network model; memory caps are used "
            "as measured."
        )
    return note + "their memory caps and boundary times are used as measured."


def search_plan(
    profiles: Sequence[Profile],
    cluster: Cluster,
    *,
    global_batch_size: int | None = None,
    zero_stage: int | str = "auto",
    policy: str = "poplar",
    max_global_batch_size: int | None = None,
    network: NetworkProfile | None = None,
) -> SearchResult:
    """Per-rank micro-batches and accumulation counts for `cluster`, from `profiles` of one model (docs/search.md).

    `global_batch_size` None: the best predicted throughput up to `max_global_batch_size`; `zero_stage` ``"auto"``:
    the fastest stage; with a `network` communication is priced for the cluster, without the boundary is as measured.
    An infeasible problem is a status with a reason; bad input (wrong types, profiles of several models, a device
    type of the cluster that no profile covers) a ValueError.
    """
    _check_arguments(cluster, global_batch_size, zero_stage, policy, max_global_batch_size)
    global_batch_size = None if global_batch_size is None else int(global_batch_size)
    max_global_batch_size = None if max_global_batch_size is None else int(max_global_batch_size)
    by_stage = _check_profiles(profiles)
    check_covered(cluster, by_stage, "profile")
    stages = list(ZERO_STAGES) if zero_stage == "auto" else [int(zero_stage)]
    check_emulation(cluster, profiles, "profile", stages=stages)
    types = cluster.type_counts()
    check_measured_alike([p for p in profiles if p.device_type in types and p.zero_stage in stages], "profile")
    evaluated = {
        stage: _evaluate_stage(stage, by_stage, cluster, policy, global_batch_size, max_global_batch_size, network)
        for stage in stages
    }
    feasible = [stage for stage, e in evaluated.items() if e.outcome.ok]
    if not feasible:
        return _infeasible_result(evaluated, policy)
    fixed_batch = global_batch_size is not None
    chosen = _fastest_stage({stage: evaluated[stage].outcome for stage in feasible}, fixed_batch=fixed_batch)
    best = evaluated[chosen]
    assert best.model is not None, "a feasible stage has a cost model"
    plan = _plan(best.model, best.outcome, policy)
    return SearchResult(
        status="ok",
        message=_plan_message(
            plan,
            best,
            stage_was_auto=zero_stage == "auto",
            fixed_batch=fixed_batch,
            max_global_batch_size=max_global_batch_size,
            world_size=cluster.world_size,
        ),
        plan=plan,
        policy=policy,
        zero_stage=chosen,
        stage_reports=_stage_reports(evaluated, chosen, several_evaluated=len(stages) > 1),
    )


def check_covered(cluster: Cluster, by_stage: dict[int, dict[str, object]], kind: str) -> None:
    """A ValueError when a device type of `cluster` has no profile (of `kind`) at any stage."""
    covered = {t for stage in by_stage.values() for t in stage}
    unknown = [t for t in cluster.type_counts() if t not in covered]
    if unknown:
        raise ValueError(
            f"cluster: expected device types that the {kind}s cover ({', '.join(sorted(covered))}), "
            f"found {', '.join(repr(t) for t in unknown)} with no {kind}"
        )


def _emulation_key(emulation: Emulation | None) -> tuple[float, int] | None:
    """What a profile's times and memory depend on: the slowdown and capacity (a drift schedule aside)."""
    return None if emulation is None else (emulation.slowdown, emulation.memory_capacity_bytes)


def _emulation_text(key: tuple[float, int] | None) -> str:
    return "a real device (no emulation)" if key is None else f"slowdown {key[0]:g}, {key[1]} bytes of memory"


def check_emulation(
    cluster: Cluster, profiles: Sequence[Profile | LayerProfile], kind: str, *, stages: Sequence[int]
) -> None:
    """A ValueError where a device type of `cluster` has a profile (of `kind`) at one of `stages` measured emulated
    under another emulation than the cluster declares for it (or none): its times and largest micro-batch are not
    that device's, and the job would emulate the cluster's. A profile that says no emulation (a real device's, a
    modelled or hand-written one) is taken as the cluster's type; other stages' files are not read (a type
    re-profiled at one stage keeps older files of the others)."""
    measured_under: dict[str, set[tuple[float, int] | None]] = {}
    types = cluster.type_counts()
    for profile in profiles:
        if profile.emulated is not None and profile.zero_stage in stages and profile.device_type in types:
            measured_under.setdefault(profile.device_type, set()).add(_emulation_key(profile.emulated))
    problems = []
    for device_type, keys in sorted(measured_under.items()):
        declared = _emulation_key(cluster.emulation_of(device_type))
        other = sorted(keys - {declared}, key=repr)
        if other:
            problems.append(
                f"{device_type}: expected {kind}s measured as the cluster declares it ({_emulation_text(declared)}), "
                f"found {kind}s measured as {' and as '.join(map(_emulation_text, other))}"
            )
    if problems:
        raise ValueError(
            "cluster: " + "; ".join(problems) + f"; measure the {kind}s on this cluster again (poplar-profile), or "
            "declare the emulation they were measured under"
        )


STAGE_TIE_TOLERANCE = 1e-9
"""Stages whose predictions differ by at most this share tie, and the lower stage wins: the cost model prices the
same work at two stages in another order of float sums (stages 1 and 2 at one accumulation step: one
reduce-scatter and one all-gather each), so an equal price may differ in its last digits."""


def _fastest_stage(outcomes: dict[int, PolicyResult], *, fixed_batch: bool) -> int:
    """The stage of the best of `outcomes` (feasible ones, by stage); ties within `STAGE_TIE_TOLERANCE`: the lower."""
    scores = {stage: _stage_score(outcome, stage, fixed_batch=fixed_batch)[0] for stage, outcome in outcomes.items()}
    best = min(scores.values())
    return min(stage for stage, score in scores.items() if score - best <= STAGE_TIE_TOLERANCE * abs(best))


def _stage_score(outcome: PolicyResult, stage: int, *, fixed_batch: bool) -> tuple[float, int]:
    """Smaller is better: the shortest iteration (fixed batch) or the most samples/s; ties: the lower stage."""
    allocation = outcome.allocation
    assert allocation is not None
    return (allocation.iteration_time_s if fixed_batch else -allocation.samples_per_s), stage


def _infeasible_result(evaluated: dict[int, StageOutcome], policy: str) -> SearchResult:
    """No stage has a plan: every stage's reason, stages with the same reason named together."""
    by_reason: dict[str, list[int]] = {}
    for stage, e in evaluated.items():
        by_reason.setdefault(e.outcome.reason, []).append(stage)
    reasons = " ".join(
        f"Stage{'s' if len(group) > 1 else ''} {', '.join(map(str, group))}: {reason}"
        for reason, group in by_reason.items()
    )
    reports = tuple(StageReport.infeasible(stage, e.outcome.reason) for stage, e in evaluated.items())
    return SearchResult.infeasible(f"No feasible plan ({policy}). {reasons}", policy, reports)


def _stage_reports(
    evaluated: dict[int, StageOutcome], chosen: int, *, several_evaluated: bool
) -> tuple[StageReport, ...]:
    """Why each evaluated stage won, lost (how much slower than `chosen`) or is infeasible."""
    best = evaluated[chosen]
    assert best.outcome.allocation is not None
    if sum(e.outcome.ok for e in evaluated.values()) > 1:
        reason = "Fastest feasible stage."
    else:
        reason = "The only feasible stage." if several_evaluated else "The only stage evaluated."
    if levers_summary(best.levers):
        reason = reason[:-1] + f", with {levers_summary(best.levers)}."
    rate = best.outcome.allocation.samples_per_s
    return tuple(
        StageReport.infeasible(stage, e.outcome.reason)
        if (found := e.outcome.allocation) is None
        else StageReport.feasible(stage, chosen, reason, rate, found, found.global_batch_size)
        for stage, e in evaluated.items()
    )


def _plan_message(
    plan: Plan,
    best: StageOutcome,
    *,
    stage_was_auto: bool,
    fixed_batch: bool,
    max_global_batch_size: int | None,
    world_size: int,
) -> str:
    """The one line for people: stage, batch, levers, prediction, and any note on how it was chosen."""
    if fixed_batch:
        batch_text = f"global batch {plan.global_batch_size}"
    else:
        limit = f"up to {max_global_batch_size}" if max_global_batch_size is not None else "in the default range"
        batch_text = f"global batch {plan.global_batch_size} (chosen for the highest predicted throughput {limit})"
    share = plan.predicted.samples_per_s / plan.predicted.ideal_samples_per_s
    levers = levers_summary(best.levers)
    message = (
        f"{plan.policy} at ZeRO stage {plan.zero_stage}{' (auto)' if stage_was_auto else ''}: {batch_text}"
        f"{', ' + levers if levers else ''}, "
        f"predicted {plan.predicted.iteration_time_s:.4g} s per iteration, "
        f"{plan.predicted.samples_per_s:.4g} samples/s ({100 * share:.1f}% of ideal)."
    )
    if best.outcome.note:
        message += f" Note: {best.outcome.note}."
    assert best.model is not None
    return message + _world_size_note(best.model, world_size)


# -- check_plan, predict
def check_plan(plan: Plan, cluster: Cluster, profiles: Sequence[Profile] | None = None) -> list[str]:
    """Problems that make `plan` unusable on `cluster`, as full sentences ([] when fine): world size, device types,
    the stage rule (stages 2-3: one accumulation count), the levers (one setting per device type, at stage 3 one
    checkpointing for every rank, offload only at stages 1-2) and, with `profiles`, their coverage and micro-batch
    caps."""
    problems = cluster_problems(plan, cluster) + rule_problems(plan)
    if profiles is not None:
        settings = plan_levers(plan)
        models = {p.model.fingerprint for p in profiles}
        if len(models) > 1:
            problems.append(
                f"The profiles describe {len(models)} different models; expected one. The models: "
                f"{models_text(profiles)}."
            )
        at_stage = {p.device_type: p for p in profiles_for_plan(plan, profiles)}
        types = list(dict.fromkeys(plan.rank_device_types))
        missing = [t + levers_text(*(settings.get(t) or NO_LEVERS)) for t in types if t not in at_stage]
        if missing:
            problems.append(f"No profile at ZeRO stage {plan.zero_stage} for {', '.join(missing)}.")
        over = [
            f"rank {r.rank} ({r.device_type}: {r.micro_batch_size} > {at_stage[r.device_type].max_micro_batch_size})"
            for r in plan.ranks
            if r.device_type in at_stage and r.micro_batch_size > at_stage[r.device_type].max_micro_batch_size
        ]
        if over:
            problems.append(f"micro_batch_size is above the profile's max_micro_batch_size at {listed(over)}.")
    return problems


def rule_problems(plan: Plan) -> list[str]:
    """The rules of its stage and levers that `plan` breaks (`check_plan`'s, without a cluster or profiles), as
    full sentences."""
    problems = []
    if one_accumulation_count(plan.zero_stage):
        counts = sorted({r.gradient_accumulation_steps for r in plan.ranks})
        if len(counts) > 1:
            problems.append(
                f"ZeRO stage {plan.zero_stage} needs the same gradient_accumulation_steps on every rank, "
                f"but the plan has {', '.join(map(str, counts))}."
            )
    problems += [
        f"Ranks of one device type differ in {name} ({listed(mixed)}); the plan gives each device type one setting."
        for name, mixed in _mixed_levers(plan)
    ]
    offloading = [f"rank {r.rank}" for r in plan.ranks if r.optimizer_offload]
    if offloading and plan.zero_stage not in OFFLOAD_STAGES:
        problems.append(
            f"optimizer_offload is set at {listed(offloading)}, but poplar-ext offloads the optimizer at ZeRO stages "
            f"1-2 only (the plan has stage {plan.zero_stage})."
        )
    if plan.zero_stage == 3 and len({r.activation_checkpointing for r in plan.ranks}) > 1:
        problems.append(
            "ZeRO stage 3 needs the same activation_checkpointing on every rank (a recomputed forward gathers "
            "parameters again, and every rank must issue the same gathers), but the plan mixes them."
        )
    return problems


def _mixed_levers(plan: Plan) -> list[tuple[str, list[str]]]:
    """Each lever some device type's ranks differ in, with those types."""
    return [(name, mixed) for index, name in enumerate(LEVER_NAMES) if (mixed := mixed_lever_types(plan, index))]


def predict(plan: Plan, profiles: Sequence[Profile], network: NetworkProfile | None = None) -> PlanPrediction:
    """Per-rank busy time and the iteration time the cost model predicts for `plan` (with `network`: communication
    priced), each type from its profile at the plan's stage and levers. ValueError when a type has no such profile,
    its ranks differ in a lever, or a micro-batch is outside 1..max_micro_batch_size of its profile."""
    by_stage = _check_profiles(profiles)
    variants = by_stage.get(plan.zero_stage, {})
    settings = plan_levers(plan)
    for name, mixed in _mixed_levers(plan):
        raise ValueError(f"plan: expected one {name} per device type, found both for {', '.join(mixed)}")
    at_stage = {t: variants[t][levers] for t, levers in settings.items() if t in variants and levers in variants[t]}
    missing = [
        t + levers_text(*settings[t]) for t in settings if t not in at_stage or at_stage[t].max_micro_batch_size == 0
    ]
    if missing:
        raise ValueError(
            f"profiles: expected a profile that fits the model at ZeRO stage {plan.zero_stage} for every device "
            f"type of the plan, found none for {', '.join(missing)}"
        )
    check_measured_alike(list(at_stage.values()), "profile")
    model = build_stage_model(at_stage, plan.rank_device_types, plan.zero_stage, network)
    sizes = np.array([r.micro_batch_size for r in plan.ranks], dtype=np.int64)
    steps = np.array([r.gradient_accumulation_steps for r in plan.ranks], dtype=np.int64)
    micro = model.rank_micro_step_times_s(sizes)
    compute_micro = model.rank_compute_micro_step_times_s(sizes)
    iteration = model.iteration_time_s(sizes, steps)
    return PlanPrediction(
        zero_stage=plan.zero_stage,
        rank_micro_step_time_s=tuple(micro.tolist()),
        rank_busy_time_s=tuple((micro * steps).tolist()),
        boundary_s=model.boundary_s,
        iteration_time_s=iteration,
        samples_per_s=plan.global_batch_size / iteration,
        ideal_samples_per_s=model.ideal_samples_per_s,
        rank_compute_time_s=tuple((compute_micro * steps).tolist()),
        micro_step_communication_s=float(np.max(micro - compute_micro)) if len(micro) else 0.0,
        boundary_communication_s=0.0 if model.communication is None else model.communication.boundary_s,
        optimizer_step_s=max(d.optimizer_step_time_s for d in model.devices),
    )
