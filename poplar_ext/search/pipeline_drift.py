"""A pipeline plan re-counted for drifted ranks: the same pipelines, micro-batches moved (docs/pipeline.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from poplar_ext.plan.formats import Cluster
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import LayerProfile, PipelinePlan

from .drift import Replan, replan_outcome, scaled_types
from .pipeline_cost import Links, PipelinePrediction, evaluate_plan, plan_tables
from .pipeline_sizing import PipelineOptions, size_pipelines
from .pipeline_split import shape_of, split_costs


def scaled_layer_profile(profile: LayerProfile, scale: float, *, device_type: str) -> LayerProfile:
    """`profile` with every layer's time and optimizer step multiplied by `scale`, named `device_type`."""
    layers = tuple(
        dataclasses.replace(
            layer,
            samples=tuple(dataclasses.replace(s, step_time_s=s.step_time_s * scale) for s in layer.samples),
            optimizer_step_time_s=layer.optimizer_step_time_s * scale,
        )
        for layer in profile.layers
    )
    return dataclasses.replace(profile, device_type=device_type, layers=layers)


def scaled_layer_problem(
    layer_profiles: Sequence[LayerProfile], cluster: Cluster, rank_scales: Sequence[float], *, zero_stage: int
) -> tuple[list[LayerProfile], Cluster, list[str]]:
    """Layer profiles (at `zero_stage`) and cluster in which each rank runs `rank_scales[r]` times its type's
    layer times, and each rank's derived device type in rank order."""
    at_stage = {p.device_type: p for p in layer_profiles if p.zero_stage == zero_stage}
    return scaled_types(cluster, rank_scales, at_stage, scaled_layer_profile)


def with_stage_types(plan: PipelinePlan, rank_types: Sequence[str]) -> PipelinePlan:
    """`plan` with each stage's device type replaced by its rank's in `rank_types` (the rest kept)."""
    pipelines = tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, device_type=rank_types[s.rank]) for s in p.stages))
        for p in plan.pipelines
    )
    return dataclasses.replace(plan, pipelines=pipelines)


def predict_drifted(
    plan: PipelinePlan,
    layer_profiles: Sequence[LayerProfile],
    cluster: Cluster,
    rank_scales: Sequence[float],
    *,
    network: NetworkProfile | None = None,
) -> PipelinePrediction:
    """What the cost model predicts for `plan` with each rank's layers `rank_scales[r]` times as long."""
    return _Drifted.of(plan, layer_profiles, cluster, rank_scales, network).predict(plan)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Drifted:
    """A plan's device types priced at the drifted speeds."""

    rank_types: list[str]
    """Each rank's derived device type."""
    tables: dict
    """Derived device type -> its `LayerTable`."""
    links: Links
    """What transfers and all-reduces cost (the network's prices, the cluster's nodes)."""

    @classmethod
    def of(cls, plan, layer_profiles, cluster, rank_scales, network) -> _Drifted:
        profiles, _, rank_types = scaled_layer_problem(layer_profiles, cluster, rank_scales, zero_stage=plan.zero_stage)
        tables = plan_tables(with_stage_types(plan, rank_types), profiles)
        return cls(rank_types=rank_types, tables=tables, links=Links.of(network, cluster))

    def predict(self, plan: PipelinePlan) -> PipelinePrediction:
        """`plan` (of the same pipelines and sizes) at the drifted speeds."""
        return evaluate_plan(with_stage_types(plan, self.rank_types), self.tables, self.links)

    def options(self, plan: PipelinePlan) -> list[PipelineOptions]:
        """Per pipeline, the counts it can run at its own micro-batch size and split."""
        classes = []
        for pipeline in plan.pipelines:
            size = np.array([pipeline.micro_batch_size], dtype=np.int64)
            shape = shape_of(pipeline.ranks, self.rank_types, self.links)
            firsts = [s.first_layer for s in pipeline.stages]
            checkpointing = [s.activation_checkpointing for s in pipeline.stages]
            slowest, limit = split_costs(shape, firsts, self.tables, size, checkpointing)
            usable = np.isfinite(slowest) & (limit >= 1)
            classes.append(
                PipelineOptions(
                    num_stages=len(pipeline.stages),
                    sizes=size[usable],
                    stage_s=slowest[usable],
                    max_micro_batches=np.minimum(limit[usable], plan.global_batch_size),
                )
            )
        return classes


def recount_pipelines(
    plan: PipelinePlan,
    layer_profiles: Sequence[LayerProfile],
    cluster: Cluster,
    rank_scales: Sequence[float],
    *,
    min_gain: float,
    network: NetworkProfile | None = None,
) -> Replan:
    """Each pipeline's micro-batch count searched again for `plan`'s global batch with each rank's layer
    times scaled by `rank_scales` (docs/search.md); ``better`` when the new counts' predicted iteration
    is shorter by more than `min_gain`."""
    drifted = _Drifted.of(plan, layer_profiles, cluster, rank_scales, network)
    current_s = drifted.predict(plan).iteration_time_s
    sizing = size_pipelines(drifted.options(plan), plan.global_batch_size)
    if sizing is None:
        why = "no micro-batch counts of the pipelines' sizes sum to the global batch within memory"
        return replan_outcome(found=None, current_s=current_s, new_s=None, min_gain=min_gain, why_none=why)
    counts = [picks[0][1] for picks in sizing.choices]
    recounted = dataclasses.replace(
        plan,
        pipelines=tuple(dataclasses.replace(p, num_micro_batches=m) for p, m in zip(plan.pipelines, counts)),
    )
    predicted = drifted.predict(recounted).summary
    found = dataclasses.replace(recounted, predicted=predicted)
    return replan_outcome(found=found, current_s=current_s, new_s=predicted.iteration_time_s, min_gain=min_gain)
