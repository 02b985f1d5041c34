"""The pipeline cost model: stages from layer curves, 1F1B, transfers, per-layer all-reduces, memory
(docs/search.md, profiles/README.md, docs/pipeline.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from poplar_ext.plan.formats import (
    Cluster,
    Prediction,
    check_measured_alike,
    files_text,
    listed,
    loaded_from,
    mixed_models,
)
from poplar_ext.plan.network_format import CollectiveFit, NetworkProfile, ring_time_s
from poplar_ext.plan.pipeline_formats import PIPELINE_ZERO_STAGES, LayerProfile, Pipeline, PipelinePlan

from .cost import BACKWARD_SHARE
from .curves import fit_points
from .pipeline_layouts import rank_nodes

TRANSFERS_PER_BOUNDARY = 2
"""Per micro-batch a boundary carries the activation forward and its gradient back."""
RECOMPUTE_SHARE = 1.0 - BACKWARD_SHARE
"""What a checkpointed stage adds to its layers' step time: the forward again, a third of it."""


# -- Layer profiles
def layer_profiles_by_stage(layer_profiles: Sequence[LayerProfile]) -> dict[int, dict[str, LayerProfile]]:
    """Layer profiles by ZeRO stage and device type; ValueError for mixed models, layer counts or duplicates."""
    if isinstance(layer_profiles, LayerProfile) or not isinstance(layer_profiles, Sequence):
        raise ValueError(f"layer_profiles: expected a list of LayerProfile, found {type(layer_profiles).__name__}")
    if not layer_profiles:
        raise ValueError("layer_profiles: expected at least one layer profile, found none")
    for index, profile in enumerate(layer_profiles):
        if not isinstance(profile, LayerProfile):
            raise ValueError(f"layer_profiles[{index}]: expected a LayerProfile, found {type(profile).__name__}")
    # Models first: two models' folders hold a layer profile per type each, and that is what to tell.
    mixed = mixed_models(layer_profiles)
    if mixed is not None:
        raise ValueError(
            f"layer_profiles: expected layer profiles of one model, found {mixed[0]}: {mixed[1]} (poplar-search: "
            f"--model NAME or FINGERPRINT picks one){files_text(layer_profiles)}"
        )
    by_stage: dict[int, dict[str, LayerProfile]] = {}
    for profile in layer_profiles:
        at_stage = by_stage.setdefault(profile.zero_stage, {})
        if profile.device_type in at_stage:
            raise ValueError(
                f"layer_profiles: expected one layer profile per (device type, ZeRO stage), found two for "
                f"{profile.device_type!r} at stage {profile.zero_stage}"
            )
        at_stage[profile.device_type] = profile
    counts = sorted({p.num_layers for p in layer_profiles})
    if len(counts) > 1:
        holders = {
            count: ", ".join(
                f"{p.device_type} at stage {p.zero_stage}" for p in layer_profiles if p.num_layers == count
            )
            for count in counts
        }
        which = "; ".join(f"{count} in {names}" for count, names in holders.items())
        files = {
            count: [path for p in layer_profiles if p.num_layers == count and (path := loaded_from(p)) is not None]
            for count in counts
        }
        where = "; ".join(f"{count} layers: {listed(sorted(paths))}" for count, paths in files.items() if paths)
        raise ValueError(
            f"layer_profiles: expected the same number of layers in every layer profile, found {counts}: {which}"
            + (f"; the files: {where}" if where else "")
        )
    return by_stage


@lru_cache(maxsize=4096)
def _layer_curve_table(samples: tuple[tuple[int, float], ...], max_micro_batch_size: int) -> np.ndarray:
    """One layer's monotone times at sizes 1..max (identical layers share the fit)."""
    sizes, times = zip(*samples)
    curve = fit_points(sizes, times, device_type="layer", zero_stage=0, max_micro_batch_size=max_micro_batch_size)
    table = curve.table()
    table.flags.writeable = False
    return table


@dataclass(frozen=True, kw_only=True, eq=False)
class LayerTable:
    """One device type's layers priced for the search: prefix sums over layers, so a stage is two lookups."""

    profile: LayerProfile
    time_prefix_s: np.ndarray
    """``[b - 1, j]``: forward + backward of layers 0..j-1 at micro-batch size b (shape ``(max_b, L + 1)``)."""
    static_prefix_bytes: np.ndarray
    """``[j]``: parameters and optimizer state of layers 0..j-1."""
    activation_prefix_bytes: np.ndarray
    """``[j]``: kept activations per sample of layers 0..j-1."""
    parameter_prefix_bytes: np.ndarray
    """``[j]``: parameters of layers 0..j-1 (what their gradients' all-reduce moves)."""
    optimizer_prefix_s: np.ndarray
    """``[j]``: optimizer step of layers 0..j-1."""
    output_bytes: np.ndarray
    """``[l]``: what a boundary after layer l sends per sample."""
    input_bytes: np.ndarray
    """``[l]``: what a checkpointed stage from layer l keeps per sample of an in-flight micro-batch: layer
    l - 1's output; at layer 0 layer 0's kept activations (they hold the data input, which has no figure)."""

    @property
    def max_micro_batch_size(self) -> int:
        return self.time_prefix_s.shape[0]

    @property
    def num_layers(self) -> int:
        return self.time_prefix_s.shape[1] - 1

    @property
    def free_bytes(self) -> int:
        """Memory left for layers once the base is taken (may be negative)."""
        return self.profile.memory_capacity_bytes - self.profile.base_memory_bytes

    def compute_s(self, first: int, last: int, micro_batch_size: int) -> float:
        return float(
            self.time_prefix_s[micro_batch_size - 1, last + 1] - self.time_prefix_s[micro_batch_size - 1, first]
        )

    def optimizer_s(self, first: int, last: int) -> float:
        """The optimizer step of layers `first`..`last`."""
        return float(self.optimizer_prefix_s[last + 1] - self.optimizer_prefix_s[first])

    def memory_bytes(
        self, first: int, last: int, micro_batch_size: int, in_flight: int, *, checkpointed: bool = False
    ) -> int:
        """A stage of layers `first`..`last` holding `in_flight` micro-batches (docs/search.md)."""
        kept = int(self.activation_prefix_bytes[last + 1] - self.activation_prefix_bytes[first])
        held = (in_flight - 1) * int(self.input_bytes[first]) + kept if checkpointed else in_flight * kept
        static = int(self.static_prefix_bytes[last + 1] - self.static_prefix_bytes[first])
        return self.profile.base_memory_bytes + static + micro_batch_size * held

    def best_samples_per_s(self) -> float:
        """The whole model on one device at its best profiled size (memory aside): what the device could do alone."""
        largest = min(largest_profiled_size(self.profile), self.max_micro_batch_size)
        sizes = np.arange(1, largest + 1)
        return float(np.max(sizes / self.time_prefix_s[:largest, -1]))


def _prefix(values: Sequence[float] | np.ndarray, dtype: type = float) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(values, dtype=dtype))])


def layer_table(profile: LayerProfile, max_micro_batch_size: int) -> LayerTable:
    """`profile`'s layers priced at micro-batch sizes 1..`max_micro_batch_size`."""
    if max_micro_batch_size < 1:
        raise ValueError(f"max_micro_batch_size: expected an integer >= 1, found {max_micro_batch_size!r}")
    columns = [
        _layer_curve_table(tuple((s.micro_batch_size, s.step_time_s) for s in layer.samples), max_micro_batch_size)
        for layer in profile.layers
    ]
    times = np.column_stack(columns)
    layers = profile.layers
    return LayerTable(
        profile=profile,
        time_prefix_s=np.concatenate([np.zeros((max_micro_batch_size, 1)), np.cumsum(times, axis=1)], axis=1),
        static_prefix_bytes=_prefix([x.parameter_bytes + x.optimizer_state_bytes for x in layers], np.int64),
        activation_prefix_bytes=_prefix([x.activation_bytes_per_sample for x in layers], np.int64),
        parameter_prefix_bytes=_prefix([x.parameter_bytes for x in layers], np.int64),
        optimizer_prefix_s=_prefix([x.optimizer_step_time_s for x in layers]),
        output_bytes=np.array([x.output_bytes_per_sample for x in layers], dtype=np.int64),
        input_bytes=np.array(
            [layers[0].activation_bytes_per_sample] + [x.output_bytes_per_sample for x in layers[:-1]], dtype=np.int64
        ),
    )


def largest_profiled_size(profile: LayerProfile) -> int:
    return max(s.micro_batch_size for layer in profile.layers for s in layer.samples)


# -- Prices of moving bytes
@dataclass(frozen=True, kw_only=True)
class LinkPrice:
    """One point-to-point transfer over one link: ``latency_s + bytes x seconds per byte``."""

    latency_s: float
    """One ring hop's latency of the fit the link is priced by."""
    bandwidth_bytes_per_s: float | None
    """The link's bandwidth (None: not priced, no network)."""

    def transfer_s(self, message_bytes: Any) -> Any:
        """One transfer of `message_bytes` (a number, or an array of them)."""
        seconds_per_byte = 0.0 if self.bandwidth_bytes_per_s is None else 1.0 / self.bandwidth_bytes_per_s
        return self.latency_s + message_bytes * seconds_per_byte


@dataclass(frozen=True, kw_only=True)
class Links:
    """What transfers and all-reduces cost between given ranks (docs/search.md)."""

    network: NetworkProfile | None
    rank_nodes: tuple[int, ...] | None = None
    """Node index of every rank (None: unknown, every pair priced as on different nodes)."""
    node_uplinks_bytes_per_s: tuple[float | None, ...] = ()
    """Each node's declared uplink bandwidth (the cluster's; None or absent: not declared)."""

    @classmethod
    def of(cls, network: NetworkProfile | None, cluster: Cluster | None) -> Links:
        if cluster is None:
            return cls(network=network)
        uplinks = tuple(node.uplink_bandwidth_bytes_per_s for node in cluster.nodes)
        return cls(network=network, rank_nodes=rank_nodes(cluster), node_uplinks_bytes_per_s=uplinks)

    def same_node(self, ranks: Sequence[int]) -> bool:
        if self.rank_nodes is None or not len(ranks):
            return False
        return len({self.rank_nodes[r] for r in ranks}) == 1

    def _fit(self, collective: str, same_node: bool, point_to_point: bool) -> CollectiveFit:
        assert self.network is not None
        scopes = self.network.scopes
        if same_node and "within_node" in scopes:
            return scopes["within_node"].collectives[collective]
        if point_to_point and not same_node and "between_nodes" in scopes:
            return scopes["between_nodes"].collectives[collective]
        return self.network.collectives[collective]

    def _bandwidth(self, fit: CollectiveFit, ranks: Sequence[int], same_node: bool) -> float:
        """A ring across nodes runs at its slowest link: the slowest uplink of the nodes it spans, a node
        that declares none at the fit's figure (so that without declared uplinks the fit is the price)."""
        bandwidth = fit.bus_bandwidth_bytes_per_s
        if same_node or self.rank_nodes is None or not self.node_uplinks_bytes_per_s:
            return bandwidth
        uplinks = [self.node_uplinks_bytes_per_s[self.rank_nodes[r]] for r in ranks]
        if all(u is not None for u in uplinks):
            return min(uplinks)
        return min([bandwidth, *(u for u in uplinks if u is not None)])

    def link_price(self, rank_a: int, rank_b: int) -> LinkPrice:
        """One point-to-point transfer between two ranks: the link between their nodes."""
        if self.network is None:
            return LinkPrice(latency_s=0.0, bandwidth_bytes_per_s=None)
        same_node = self.same_node((rank_a, rank_b))
        fit = self._fit("all_gather", same_node, point_to_point=True)
        return LinkPrice(
            latency_s=fit.latency_s, bandwidth_bytes_per_s=self._bandwidth(fit, (rank_a, rank_b), same_node)
        )

    def transfer_prices(self, ranks: Sequence[int]) -> tuple[LinkPrice, ...]:
        """For each pair of consecutive ranks (a pipeline's boundaries), the price of its link."""
        return tuple(self.link_price(a, b) for a, b in zip(ranks, ranks[1:]))

    def transfer_s(self, message_bytes: float, rank_a: int, rank_b: int) -> float:
        return self.link_price(rank_a, rank_b).transfer_s(message_bytes)

    def all_reduce_s(self, message_bytes: float, ranks: Sequence[int]) -> float:
        if self.network is None or len(ranks) <= 1:
            return 0.0
        same_node = self.same_node(ranks)
        fit = self._fit("all_reduce", same_node, point_to_point=False)
        return ring_time_s(fit, "all_reduce", message_bytes, len(ranks), self._bandwidth(fit, ranks, same_node))

    def all_reduce_lower_bound_s(self, message_bytes: float, num_ranks: int) -> float:
        """No all-reduce of `message_bytes` among `num_ranks` ranks costs less (network required)."""
        assert self.network is not None
        whole = self.network.collectives["all_reduce"]
        declared = [u for u in self.node_uplinks_bytes_per_s if u is not None]
        # A ring of declared uplinks may be faster than the whole job's fit: bound it by the fastest.
        fastest = max([whole.bus_bandwidth_bytes_per_s, *declared])
        prices = [ring_time_s(whole, "all_reduce", message_bytes, num_ranks, fastest)]
        node = self.network.scopes.get("within_node")
        if node is not None and num_ranks <= node.group_size:
            prices.append(ring_time_s(node.collectives["all_reduce"], "all_reduce", message_bytes, num_ranks))
        return min(prices)


# -- One pipeline
@dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage of a pipeline at its micro-batch size (seconds per micro-batch, bytes)."""

    compute_s: float
    """Forward + backward, with the forward a checkpointed stage runs again."""
    transfer_s: float
    memory_bytes: int
    recompute_s: float = 0.0
    """Of `compute_s`: the forward a checkpointed stage runs again in its backward (0 without checkpointing)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.transfer_s


def in_flight(num_stages: int, stage: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` of `num_stages` keeps at once under 1F1B."""
    return min(num_micro_batches, num_stages - stage)


def stage_costs(pipeline: Pipeline, tables: dict[str, LayerTable], links: Links) -> list[StageCost]:
    """Each stage's compute, transfers and memory at the pipeline's micro-batch size and count (a stage with
    ``activation_checkpointing`` priced so)."""
    b, m, stages = pipeline.micro_batch_size, pipeline.num_micro_batches, pipeline.stages
    costs = []
    for s, stage in enumerate(stages):
        table = tables[stage.device_type]
        transfer_s = 0.0
        for other, layer in ((s - 1, stage.first_layer - 1), (s + 1, stage.last_layer)):
            if 0 <= other < len(stages):
                bytes_ = b * float(table.output_bytes[layer])
                transfer_s += TRANSFERS_PER_BOUNDARY * links.transfer_s(bytes_, stage.rank, stages[other].rank)
        checkpointed = stage.activation_checkpointing
        compute_s = table.compute_s(stage.first_layer, stage.last_layer, b)
        recompute_s = RECOMPUTE_SHARE * compute_s if checkpointed else 0.0
        memory = table.memory_bytes(
            stage.first_layer, stage.last_layer, b, in_flight(len(stages), s, m), checkpointed=checkpointed
        )
        costs.append(
            StageCost(
                compute_s=compute_s + recompute_s, transfer_s=transfer_s, memory_bytes=memory, recompute_s=recompute_s
            )
        )
    return costs


def checkpoint_where_needed(pipeline: Pipeline, tables: dict[str, LayerTable]) -> Pipeline:
    """`pipeline` with activation checkpointing on exactly the stages that do not fit their device's memory
    without it at its micro-batch size and count (whether they fit with it is the caller's to check)."""
    stages = pipeline.stages
    flags = []
    for s, stage in enumerate(stages):
        table = tables[stage.device_type]
        flight = in_flight(len(stages), s, pipeline.num_micro_batches)
        memory = table.memory_bytes(stage.first_layer, stage.last_layer, pipeline.micro_batch_size, flight)
        flags.append(memory > table.profile.memory_capacity_bytes)
    return dataclasses.replace(
        pipeline,
        stages=tuple(dataclasses.replace(stage, activation_checkpointing=f) for stage, f in zip(stages, flags)),
    )


def stage_block_times(plan: PipelinePlan, layer_profiles: Sequence[LayerProfile]) -> dict[int, dict[str, float]]:
    """Rank -> what the cost model gives its stage: ``compute_s`` (forward + backward of one micro-batch of its
    pipeline), ``recompute_s`` (the forward a checkpointed stage runs again in its backward, else 0) and
    ``optimizer_step_s`` (its layers' optimizer step); what steady emulation runs them at."""
    tables = plan_tables(plan, layer_profiles)
    times = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            table = tables[stage.device_type]
            compute_s = table.compute_s(stage.first_layer, stage.last_layer, pipeline.micro_batch_size)
            times[stage.rank] = {
                "compute_s": compute_s,
                "recompute_s": RECOMPUTE_SHARE * compute_s if stage.activation_checkpointing else 0.0,
                "optimizer_step_s": table.optimizer_s(stage.first_layer, stage.last_layer),
            }
    return times


def pipeline_time_s(num_stages: int, num_micro_batches: int, slowest_stage_s: float) -> float:
    """1F1B: ``(m + S - 1) x`` the slowest stage's time per micro-batch."""
    return (num_micro_batches + num_stages - 1) * slowest_stage_s


# -- The boundary
def segments(pipelines: Sequence[Pipeline], num_layers: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Runs of consecutive layers with the same holders: ``(first, last, holder ranks)``, in layer order."""
    holders = np.empty((num_layers, len(pipelines)), dtype=np.int64)
    for p, pipeline in enumerate(pipelines):
        for stage in pipeline.stages:
            holders[stage.first_layer : stage.last_layer + 1, p] = stage.rank
    rows = [tuple(row) for row in holders.tolist()]
    starts = [0, *(layer for layer in range(1, num_layers) if rows[layer] != rows[layer - 1]), num_layers]
    return [(first, end - 1, rows[first]) for first, end in zip(starts, starts[1:])]


def all_reduce_finish_s(
    pipelines: Sequence[Pipeline], tables: dict[str, LayerTable], links: Links, world_size: int
) -> np.ndarray:
    """When each rank's last gradient all-reduce ends, counted from the start of the boundary."""
    num_layers = tables[pipelines[0].stages[0].device_type].num_layers
    ready = np.zeros(world_size)
    if len(pipelines) <= 1 or links.network is None:
        return ready
    # Every holder of a layer holds the same parameters; any holder's table has their bytes.
    prefix = tables[pipelines[0].stages[0].device_type].parameter_prefix_bytes
    for first, last, ranks in segments(pipelines, num_layers):
        holders = np.array(ranks)
        duration = links.all_reduce_s(float(prefix[last + 1] - prefix[first]), ranks)
        ready[holders] = ready[holders].max() + duration
    return ready


# -- predict_pipeline
@dataclass(frozen=True, kw_only=True)
class BoundaryTransfer:
    """What one boundary between two stages of a pipeline carries over its link in an iteration."""

    pipeline: int
    """The pipeline's index in the plan."""
    stage: int
    """The boundary between stage `stage` and stage ``stage + 1``."""
    ranks: tuple[int, int]
    """The ranks of both stages."""
    nodes: tuple[int, int] | None
    """Their nodes' indices in the cluster (None: no cluster given, priced as on different nodes)."""
    bandwidth_bytes_per_s: float | None
    """The link's bandwidth (within the node, or between both nodes: the slower uplink); None: not priced."""
    time_s: float
    """Per iteration: micro-batches x (the activation forward + its gradient back); both stages pay it."""


@dataclass(frozen=True, kw_only=True)
class PipelinePrediction:
    """What the cost model predicts for a pipeline plan; per-rank tuples are in rank order."""

    zero_stage: int
    pipeline_time_s: tuple[float, ...]
    """Each pipeline's 1F1B time: (m + S - 1) x its slowest stage."""
    rank_stage_time_s: tuple[float, ...]
    """Each rank's stage time per micro-batch: compute + transfers."""
    rank_compute_time_s: tuple[float, ...]
    """Per iteration: micro-batches x the stage's forward + backward (a checkpointed stage's recompute included)."""
    rank_recompute_time_s: tuple[float, ...]
    """Per iteration: of the compute, the forwards a checkpointed stage runs again (0 elsewhere)."""
    rank_activation_checkpointing: tuple[bool, ...]
    """Whether the rank's stage recomputes its forward in its backward (the plan's)."""
    rank_transfer_time_s: tuple[float, ...]
    """Per iteration: micro-batches x the stage's activation transfers."""
    boundary_transfers: tuple[BoundaryTransfer, ...]
    """Each boundary of each pipeline, pipeline by pipeline: its link and its transfers' time."""
    rank_busy_time_s: tuple[float, ...]
    """Per iteration: compute + transfers (what the rank is doing, not waiting)."""
    rank_memory_bytes: tuple[int, ...]
    """Peak memory of each rank's stage (base, its layers, in-flight activations)."""
    rank_all_reduce_s: tuple[float, ...]
    """When the rank's last gradient all-reduce ends, from the start of the boundary."""
    rank_optimizer_step_s: tuple[float, ...]
    """The optimizer step of the rank's layers."""
    boundary_s: float
    """All-reduces and optimizer steps once the pipelines are done."""
    iteration_time_s: float
    """The slowest pipeline + the boundary."""
    samples_per_s: float
    ideal_samples_per_s: float
    """Sum over ranks of their device's best throughput with the whole model (memory and transfers aside)."""

    @property
    def summary(self) -> Prediction:
        """What a plan records of it."""
        return Prediction(
            iteration_time_s=self.iteration_time_s,
            samples_per_s=self.samples_per_s,
            ideal_samples_per_s=self.ideal_samples_per_s,
        )


def plan_tables(plan: PipelinePlan, layer_profiles: Sequence[LayerProfile]) -> dict[str, LayerTable]:
    """Each device type of `plan` priced from its layer profile at the plan's stage (sizes up to the plan's
    largest micro-batch and the profile's largest); ValueError for a missing profile or another layer count."""
    by_stage = layer_profiles_by_stage(layer_profiles)
    at_stage = by_stage.get(plan.zero_stage, {})
    types = list(dict.fromkeys(plan.rank_device_types))
    missing = [t for t in types if t not in at_stage]
    if missing:
        raise ValueError(
            f"layer_profiles: expected a layer profile at ZeRO stage {plan.zero_stage} for every device type of the "
            f"plan, found none for {', '.join(missing)}"
        )
    wrong = [t for t in types if at_stage[t].num_layers != plan.num_layers]
    if wrong:
        raise ValueError(
            f"layer_profiles: expected {plan.num_layers} layers (the plan's num_layers), found "
            f"{at_stage[wrong[0]].num_layers} in the layer profile of {wrong[0]}"
        )
    check_measured_alike([at_stage[t] for t in types], "layer profile")
    largest = max(p.micro_batch_size for p in plan.pipelines)
    return {t: layer_table(at_stage[t], max(largest, largest_profiled_size(at_stage[t]))) for t in types}


def predict_pipeline(
    plan: PipelinePlan,
    layer_profiles: Sequence[LayerProfile],
    network: NetworkProfile | None = None,
    *,
    cluster: Cluster | None = None,
) -> PipelinePrediction:
    """Per-stage busy time and the iteration time the cost model predicts for `plan` (docs/search.md): with `network`
    transfers and all-reduces priced, with `cluster` per link; ValueError for missing or mismatched layer profiles."""
    if plan.zero_stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(f"plan.zero_stage: expected 0 or 1, found {plan.zero_stage!r}")
    return evaluate_plan(plan, plan_tables(plan, layer_profiles), Links.of(network, cluster))


def evaluate_plan(plan: PipelinePlan, tables: dict[str, LayerTable], links: Links) -> PipelinePrediction:
    """`predict_pipeline` with the tables (sizes up to the plan's largest micro-batch) and prices ready."""
    world = plan.world_size
    stage_time, compute, transfer, busy, optimizer, recompute = (np.zeros(world) for _ in range(6))
    memory = np.zeros(world, dtype=np.int64)
    checkpointed = [False] * world
    pipeline_times, boundaries = [], []
    # Pipelines alike in everything but their ranks (and as fast links) cost the same: thousands, a few kinds.
    known: dict[tuple, list[StageCost]] = {}
    for index, pipeline in enumerate(plan.pipelines):
        m = pipeline.num_micro_batches
        prices = links.transfer_prices(pipeline.ranks)
        boundaries += _boundary_transfers(index, pipeline, prices, tables, links)
        key = _cost_key(pipeline, prices)
        costs = known.get(key)
        if costs is None:
            costs = known[key] = stage_costs(pipeline, tables, links)
        for stage, cost in zip(pipeline.stages, costs):
            r = stage.rank
            stage_time[r], compute[r], transfer[r] = cost.time_s, m * cost.compute_s, m * cost.transfer_s
            busy[r], memory[r] = m * cost.time_s, cost.memory_bytes
            recompute[r], checkpointed[r] = m * cost.recompute_s, stage.activation_checkpointing
            optimizer[r] = tables[stage.device_type].optimizer_s(stage.first_layer, stage.last_layer)
        pipeline_times.append(pipeline_time_s(len(costs), m, max(c.time_s for c in costs)))
    finish = all_reduce_finish_s(plan.pipelines, tables, links, world)
    best = {t: tables[t].best_samples_per_s() for t in set(plan.rank_device_types)}
    boundary = float(np.max(finish + optimizer))
    iteration = max(pipeline_times) + boundary
    return PipelinePrediction(
        zero_stage=plan.zero_stage,
        pipeline_time_s=tuple(pipeline_times),
        rank_stage_time_s=tuple(stage_time.tolist()),
        rank_compute_time_s=tuple(compute.tolist()),
        rank_recompute_time_s=tuple(recompute.tolist()),
        rank_activation_checkpointing=tuple(checkpointed),
        rank_transfer_time_s=tuple(transfer.tolist()),
        boundary_transfers=tuple(boundaries),
        rank_busy_time_s=tuple(busy.tolist()),
        rank_memory_bytes=tuple(int(x) for x in memory),
        rank_all_reduce_s=tuple(finish.tolist()),
        rank_optimizer_step_s=tuple(optimizer.tolist()),
        boundary_s=boundary,
        iteration_time_s=iteration,
        samples_per_s=plan.global_batch_size / iteration,
        ideal_samples_per_s=float(sum(best[t] for t in plan.rank_device_types)),
    )


def _cost_key(pipeline: Pipeline, prices: tuple[LinkPrice, ...]) -> tuple:
    return (
        pipeline.micro_batch_size,
        pipeline.num_micro_batches,
        tuple((s.device_type, s.first_layer, s.last_layer, s.activation_checkpointing) for s in pipeline.stages),
        prices,
    )


def _boundary_transfers(
    index: int, pipeline: Pipeline, prices: tuple[LinkPrice, ...], tables: dict[str, LayerTable], links: Links
) -> list[BoundaryTransfer]:
    """Pipeline `index`'s boundaries, each at its link's `prices` (as `stage_costs` prices them)."""
    b, m, stages = pipeline.micro_batch_size, pipeline.num_micro_batches, pipeline.stages
    nodes = links.rank_nodes
    found = []
    for s, (stage, following, price) in enumerate(zip(stages, stages[1:], prices)):
        bytes_ = b * float(tables[stage.device_type].output_bytes[stage.last_layer])
        ranks = (stage.rank, following.rank)
        found.append(
            BoundaryTransfer(
                pipeline=index,
                stage=s,
                ranks=ranks,
                nodes=None if nodes is None else (nodes[ranks[0]], nodes[ranks[1]]),
                bandwidth_bytes_per_s=price.bandwidth_bytes_per_s,
                time_s=m * TRANSFERS_PER_BOUNDARY * price.transfer_s(bytes_),
            )
        )
    return found


def boundary_lower_bound_s(
    tables: dict[str, LayerTable], links: Links, num_pipelines: int, fewest_stages: int
) -> float:
    """No split of `num_pipelines` pipelines, the shortest of `fewest_stages` stages, has a shorter boundary: some
    stage holds 1/S of the parameters (a ring's price is affine: one all-reduce of a sum costs at most its pieces) and
    1/S of the optimizer step."""
    any_table = next(iter(tables.values()))
    optimizer_s = min(float(t.optimizer_prefix_s[-1]) for t in tables.values()) / fewest_stages
    if links.network is None or num_pipelines <= 1:
        return optimizer_s
    share = float(any_table.parameter_prefix_bytes[-1]) / fewest_stages
    return max(links.all_reduce_lower_bound_s(share, num_pipelines), optimizer_s)


def boundary_s(pipelines: Sequence[Pipeline], tables: dict[str, LayerTable], links: Links, world_size: int) -> float:
    """The boundary of pipelines with these stages (what it costs does not depend on micro-batches)."""
    finish = all_reduce_finish_s(pipelines, tables, links, world_size)
    for pipeline in pipelines:
        for stage in pipeline.stages:
            finish[stage.rank] += tables[stage.device_type].optimizer_s(stage.first_layer, stage.last_layer)
    return float(np.max(finish))
