"""Re-planning for drifted devices: a derived type (``a100@x2.50``) per type and speed factor; pure, the runtime
decides when (docs/search.md, drift)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from poplar_ext.plan.formats import (
    Cluster,
    ClusterNode,
    DeviceGroup,
    DeviceTypeInfo,
    Levers,
    Plan,
    Profile,
)
from poplar_ext.plan.levers import NO_LEVERS, plan_levers
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import LayerProfile, PipelinePlan

AnyProfile = TypeVar("AnyProfile", Profile, LayerProfile)
"""A whole-model profile or a layer profile: what `scaled_types` scales."""

SCALE_DECIMALS = 2
"""Speed factors are rounded to this many decimals, so that ranks drifting alike share a derived type."""


def derived_type(device_type: str, scale: float) -> str:
    """The device type a rank of `device_type` running `scale` times its profile's time plans as."""
    scale = round(scale, SCALE_DECIMALS)
    return device_type if scale == 1.0 else f"{device_type}@x{scale:.{SCALE_DECIMALS}f}"


def scaled_profile(profile: Profile, scale: float, *, device_type: str) -> Profile:
    """`profile` with every time multiplied by `scale`, named `device_type`."""
    samples = tuple(dataclasses.replace(s, micro_step_time_s=s.micro_step_time_s * scale) for s in profile.samples)
    return dataclasses.replace(
        profile, device_type=device_type, samples=samples, optimizer_step_time_s=profile.optimizer_step_time_s * scale
    )


def scaled_problem(
    profiles: Sequence[Profile],
    cluster: Cluster,
    rank_scales: Sequence[float],
    *,
    zero_stage: int,
    levers: Mapping[str, Levers | None] | None = None,
) -> tuple[list[Profile], Cluster, list[str]]:
    """Profiles and cluster in which each rank's device runs `rank_scales[r]` times its profile's time.

    `levers` gives the ``(activation_checkpointing, optimizer_offload)`` whose profile
    each device type keeps (default: neither; `poplar_ext.plan.levers.plan_levers`), so a re-plan
    keeps the running plan's setting: the runtime applies it once, before training. Returns them and
    each rank's derived device type, in rank order (the cluster's nodes and rank order are kept).
    """
    levers = levers or {}
    at_stage = {
        p.device_type: p
        for p in profiles
        if p.zero_stage == zero_stage and p.levers == (levers.get(p.device_type) or NO_LEVERS)
    }
    return scaled_types(cluster, rank_scales, at_stage, scaled_profile)


def scaled_types(
    cluster: Cluster,
    rank_scales: Sequence[float],
    profiles: Mapping[str, AnyProfile],
    scale_profile: Callable[..., AnyProfile],
) -> tuple[list[AnyProfile], Cluster, list[str]]:
    """Each derived device type's profile (`scale_profile(profile, scale, device_type=name)` of its type's in
    `profiles`), the cluster of derived types and each rank's derived type in rank order (`scaled_ranks`): what a scaled
    problem of whole-model profiles (`scaled_problem`) and of layer profiles (`search.pipeline_drift`) share."""
    scaled_cluster, derived = scaled_ranks(cluster, rank_scales)
    scaled: dict[str, AnyProfile] = {}
    for original, name, scale in zip(cluster.rank_device_types, derived, rank_scales):
        if name not in scaled and original in profiles:
            scaled[name] = scale_profile(profiles[original], round(scale, SCALE_DECIMALS), device_type=name)
    return list(scaled.values()), scaled_cluster, derived


def scaled_ranks(cluster: Cluster, rank_scales: Sequence[float]) -> tuple[Cluster, list[str]]:
    """`cluster` with each rank's device type replaced by its derived type (`derived_type`), and those types
    in rank order (nodes, rank order and each type's emulation kept)."""
    rank_types = cluster.rank_device_types
    if len(rank_scales) != len(rank_types):
        raise ValueError(f"rank_scales: expected one factor per rank ({len(rank_types)}), found {len(rank_scales)}")
    bad = [s for s in rank_scales if not s > 0]
    if bad:
        raise ValueError(f"rank_scales: expected factors > 0, found {bad}")
    derived = [derived_type(t, s) for t, s in zip(rank_types, rank_scales)]
    nodes, rank = [], 0
    for node in cluster.nodes:
        names = derived[rank : rank + sum(group.count for group in node.devices)]
        groups = tuple(DeviceGroup(device_type=t, count=len(list(same))) for t, same in itertools.groupby(names))
        nodes.append(ClusterNode(name=node.name, devices=groups))
        rank += len(names)
    device_types = {
        name: cluster.device_types.get(original, DeviceTypeInfo())
        for original, name in zip(rank_types, derived)
        if original in cluster.device_types
    }
    return Cluster(nodes=tuple(nodes), device_types=device_types), derived


def with_rank_types(plan: Plan, rank_types: Sequence[str]) -> Plan:
    """`plan` with each rank's device type replaced (micro-batches, counts and the rest kept)."""
    ranks = tuple(dataclasses.replace(r, device_type=t) for r, t in zip(plan.ranks, rank_types, strict=True))
    return dataclasses.replace(plan, ranks=ranks)


@dataclass(frozen=True, kw_only=True)
class Replan:
    """What `replan` found."""

    status: str
    """``better`` (switch to `plan`), ``not_better`` (the gain is below the minimum) or ``infeasible``."""
    plan: Plan | PipelinePlan | None
    """The new plan, under the cluster's own device types; None when infeasible (a pipeline plan from
    `search.pipeline_drift.recount_pipelines`)."""
    current_iteration_time_s: float
    """The current plan's predicted iteration time under the drifted speeds."""
    new_iteration_time_s: float | None
    gain: float | None
    """``current / new - 1``: the share of throughput the new plan adds."""
    message: str


def replan(
    plan: Plan,
    profiles: Sequence[Profile],
    cluster: Cluster,
    rank_scales: Sequence[float],
    *,
    min_gain: float,
    network: NetworkProfile | None = None,
) -> Replan:
    """Search `plan`'s global batch and stage again with each rank's speed scaled by `rank_scales`."""
    from .api import predict, search_plan

    scaled_profiles, scaled_cluster, rank_types = scaled_problem(
        profiles, cluster, rank_scales, zero_stage=plan.zero_stage, levers=plan_levers(plan)
    )
    current = predict(with_rank_types(plan, rank_types), scaled_profiles, network).iteration_time_s
    result = search_plan(
        scaled_profiles,
        scaled_cluster,
        global_batch_size=plan.global_batch_size,
        zero_stage=plan.zero_stage,
        policy=plan.policy,
        network=network,
    )
    if result.status != "ok" or result.plan is None:
        return replan_outcome(found=None, current_s=current, new_s=None, min_gain=min_gain, why_none=result.message)
    # Made from the same profiles: their fingerprints, and what the check at start did to them, go on.
    found = dataclasses.replace(
        with_rank_types(result.plan, cluster.rank_device_types),
        profile_fingerprints=dict(plan.profile_fingerprints),
        calibration=dict(plan.calibration),
    )
    return replan_outcome(
        found=found, current_s=current, new_s=result.plan.predicted.iteration_time_s, min_gain=min_gain
    )


def replan_outcome(
    *, found: Plan | PipelinePlan | None, current_s: float, new_s: float | None, min_gain: float, why_none: str = ""
) -> Replan:
    """The `Replan` of a search that found `found` (None: nothing, `why_none` says why) predicted at `new_s`
    against the current plan's `current_s`, both under the drifted speeds."""
    if found is None or new_s is None:
        return Replan(
            status="infeasible",
            plan=None,
            current_iteration_time_s=current_s,
            new_iteration_time_s=None,
            gain=None,
            message=f"no plan for the drifted speeds: {why_none}",
        )
    gain = current_s / new_s - 1.0
    return Replan(
        status="better" if gain > min_gain else "not_better",
        plan=found,
        current_iteration_time_s=current_s,
        new_iteration_time_s=new_s,
        gain=gain,
        message=(
            f"predicted {current_s:.4g} s -> {new_s:.4g} s per iteration ({100 * gain:+.1f}% throughput; "
            f"minimum gain {100 * min_gain:.0f}%)"
        ),
    )
