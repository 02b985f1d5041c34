"""`search_pipeline_plan` (exact on small clusters, heuristic beyond) and `check_pipeline_plan` (docs/search.md)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poplar_ext.plan.formats import ZERO_STAGES, Cluster, Prediction, check_measured_alike
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import (
    PIPELINE_POLICY,
    PIPELINE_ZERO_STAGES,
    LayerProfile,
    Pipeline,
    PipelinePlan,
    PipelineStage,
)

from .api import SearchResult, StageReport, check_covered, check_emulation, cluster_problems, listed
from .pipeline_cost import (
    LayerTable,
    Links,
    boundary_lower_bound_s,
    boundary_s,
    checkpoint_where_needed,
    evaluate_plan,
    largest_profiled_size,
    layer_profiles_by_stage,
    layer_table,
    stage_costs,
)
from .pipeline_layouts import Layout, all_layouts, candidate_layouts
from .pipeline_sizing import MAX_SUMSET, PipelineOptions, lower_bound_s, size_pipelines
from .pipeline_split import BalancedSplits, Shape, balanced_split, shape_of, split_options

EXACT_MAX_RANKS = 6
"""The exact search lists every layout of clusters up to this many ranks (4051 layouts at 6)."""
EXACT_MAX_SPLITS = 1500
"""``method="auto"`` searches exactly when the layouts' split combinations are at most this many."""
EXACT_HARD_LIMIT = 500_000
"""``method="exact"`` refuses more split combinations than this (it would take hours)."""
DENSE_SIZES = 32
"""The heuristic tries every micro-batch size up to this, then steps of `SIZE_STEP`."""
SIZE_STEP = 2**0.25
MAX_PIPELINE_MICRO_BATCH = 4096
"""The largest micro-batch a pipeline search considers."""
METHODS = ("auto", "exact", "heuristic")
LAYOUTS = ("auto", "all", "candidates")


@dataclass(frozen=True, kw_only=True)
class _Outcome:
    plan: PipelinePlan | None
    reason: str
    method: str
    layouts: int


# -- Arguments
def _check_arguments(
    cluster: Cluster, global_batch_size: int, zero_stage: int | str, method: str, max_stages: int | None
) -> None:
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster: expected a poplar_ext.plan.formats.Cluster, found {type(cluster).__name__}")
    if (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, (int, np.integer))
        or not 1 <= global_batch_size <= MAX_SUMSET
    ):
        raise ValueError(
            f"global_batch_size: expected an integer from 1 to {MAX_SUMSET} (the pipeline search's limit), found "
            f"{global_batch_size!r}"
        )
    if zero_stage != "auto" and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
        raise ValueError(f"zero_stage: expected 'auto' or one of 0, 1 (pipelines), found {zero_stage!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(map(repr, METHODS))}, found {method!r}")
    if max_stages is not None and (isinstance(max_stages, bool) or not isinstance(max_stages, int) or max_stages < 1):
        raise ValueError(f"max_stages: expected None or an integer >= 1, found {max_stages!r}")


def _sizes(global_batch_size: int, dense: bool) -> np.ndarray:
    """The micro-batch sizes a search tries."""
    cap = min(global_batch_size, MAX_PIPELINE_MICRO_BATCH)
    if dense or cap <= DENSE_SIZES:
        return np.arange(1, cap + 1, dtype=np.int64)
    sizes = list(range(1, DENSE_SIZES + 1))
    while (following := math.ceil(sizes[-1] * SIZE_STEP)) <= cap:
        sizes.append(following)
    return np.array(sizes, dtype=np.int64)


# -- Building plans
def _pipeline(ranks: Sequence[int], types: Sequence[str], firsts: Sequence[int], num_layers: int, b: int, m: int):
    ends = [*firsts[1:], num_layers]
    stages = tuple(
        PipelineStage(rank=r, device_type=types[r], first_layer=f, last_layer=e - 1)
        for r, f, e in zip(ranks, firsts, ends)
    )
    return Pipeline(stages=stages, micro_batch_size=b, num_micro_batches=m)


@dataclass(frozen=True, kw_only=True, eq=False)
class _Context:
    """What one ZeRO stage's search works with."""

    zero_stage: int
    tables: dict[str, LayerTable]
    links: Links
    sizes: np.ndarray
    batch: int
    types: tuple[str, ...]
    """Every rank's device type."""
    fingerprints: dict[str, str]
    """Each device type's layer profile fingerprint (for plans)."""

    @property
    def num_layers(self) -> int:
        return next(iter(self.tables.values())).num_layers


def _plan(pipelines: list[Pipeline], context: _Context) -> PipelinePlan:
    """A plan of `pipelines` (listed by first rank) with its prediction; activation checkpointing on the stages that do
    not fit without it (the sizing allowed their count only so)."""
    pipelines = [checkpoint_where_needed(p, context.tables) for p in pipelines]
    draft = PipelinePlan(
        policy=PIPELINE_POLICY,
        zero_stage=context.zero_stage,
        global_batch_size=context.batch,
        num_layers=context.num_layers,
        pipelines=tuple(sorted(pipelines, key=lambda p: p.stages[0].rank)),
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints=context.fingerprints,
    )
    return dataclasses.replace(draft, predicted=evaluate_plan(draft, context.tables, context.links).summary)


# -- Exact
def _splits(num_layers: int, num_stages: int) -> list[tuple[int, ...]]:
    """Every split of the layers over `num_stages` stages, as each stage's first layer."""
    return [(0, *cut) for cut in itertools.combinations(range(1, num_layers), num_stages - 1)]


def exact_count(layouts: list[Layout], num_layers: int) -> int:
    return sum(math.prod(math.comb(num_layers - 1, len(p) - 1) for p in layout) for layout in layouts)


def _joint_splits(shapes: list[Shape], num_layers: int):
    """Every combination of the pipelines' splits; identical shapes' splits as multisets."""
    groups: dict[Shape, list[int]] = {}
    for index, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(index)
    per_group = [
        list(itertools.combinations_with_replacement(_splits(num_layers, shape.num_stages), len(members)))
        for shape, members in groups.items()
    ]
    for combo in itertools.product(*per_group):
        joint = [()] * len(shapes)
        for members, chosen in zip(groups.values(), combo):
            for index, split in zip(members, chosen):
                joint[index] = split
        yield joint


def _options_for_split(shape, split, count, tables, sizes, global_batch_size) -> PipelineOptions:
    usable_sizes, slowest, limit = split_options(shape, split, tables, sizes)
    usable = np.isfinite(slowest)
    return PipelineOptions(
        num_stages=shape.num_stages,
        sizes=usable_sizes[usable],
        stage_s=slowest[usable],
        max_micro_batches=np.minimum(limit[usable], global_batch_size),
        count=count,
    )


def _search_exact(layouts: list[Layout], context: _Context) -> tuple[list[Pipeline] | None, int]:
    """Every layout and split, sized exactly; the pipelines of the best (None: nothing fits)."""
    tables, links, sizes, batch, types = context.tables, context.links, context.sizes, context.batch, context.types
    num_layers = context.num_layers
    best_s, best = math.inf, None
    for layout in layouts:
        if len(layout) > batch:
            continue
        shapes = [shape_of(p, types, links) for p in layout]
        for joint in _joint_splits(shapes, num_layers):
            keys = list(zip(shapes, joint))
            classes_of = {key: [i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)}
            classes = [
                _options_for_split(shape, split, len(members), tables, sizes, batch)
                for (shape, split), members in classes_of.items()
            ]
            if any(len(c.sizes) == 0 for c in classes):
                continue
            stub = [_pipeline(p, types, split, num_layers, 1, 1) for p, split in zip(layout, joint)]
            boundary = boundary_s(stub, tables, links, len(types))
            if lower_bound_s(classes, batch) + boundary >= best_s:
                continue
            sizing = size_pipelines(classes, batch)
            if sizing is None or sizing.time_s + boundary >= best_s:
                continue
            best_s = sizing.time_s + boundary
            best = []
            for ((_, split), members), picks in zip(classes_of.items(), sizing.choices):
                best += [_pipeline(layout[i], types, split, num_layers, b, m) for i, (b, m) in zip(members, picks)]
    return best, len(layouts)


# -- Heuristic
REGIME_MAX_STAGES = 8
"""Pipelines of up to this many stages are also split for fewer micro-batches in flight (one DP per count)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _ShapeSplits:
    """A shape's balanced splits."""

    regimes: list[tuple[int, BalancedSplits]]
    """``(most micro-batches, splits)``; the first allows any count."""

    @classmethod
    def of(cls, shape: Shape, context: _Context, type_costs: dict) -> _ShapeSplits:
        stages = shape.num_stages
        counts = range(1, stages) if stages <= REGIME_MAX_STAGES else ()
        regimes = [(context.batch, balanced_split(shape, context.tables, context.sizes, cache=type_costs))]
        for k in counts:
            flights = [min(k, stages - s) for s in range(stages)]
            found = balanced_split(shape, context.tables, context.sizes, flights, cache=type_costs)
            regimes.append((k, found))
        return cls(regimes=regimes)

    def options(self, num_stages: int, count: int) -> PipelineOptions:
        usable = [(np.isfinite(found.slowest_stage_s), limit, found) for limit, found in self.regimes]
        return PipelineOptions(
            num_stages=num_stages,
            sizes=np.concatenate([found.sizes[ok] for ok, _, found in usable]),
            stage_s=np.concatenate([found.slowest_stage_s[ok] for ok, _, found in usable]),
            max_micro_batches=np.concatenate(
                [np.full(int(ok.sum()), limit, dtype=np.int64) for ok, limit, _ in usable]
            ),
            count=count,
        )

    def first_layers(self, micro_batch_size: int, num_micro_batches: int) -> tuple[int, ...]:
        """The split of the quickest regime that allows this count at this size."""
        best = None
        for limit, found in self.regimes:
            index = int(np.searchsorted(found.sizes, micro_batch_size))
            time_s = found.slowest_stage_s[index]
            if num_micro_batches <= limit and np.isfinite(time_s) and (best is None or time_s < best[0]):
                best = (time_s, found.first_layers(index))
        assert best is not None, "the sizing picked an allowed option"
        return best[1]


def _heuristic_candidates(layouts: list[Layout], context: _Context) -> list[tuple[float, Layout, list, list]]:
    """Per layout its lower bound, classes and their splits, cheapest bound first."""
    cache: dict[Shape, _ShapeSplits] = {}
    type_costs: dict = {}
    candidates = []
    for layout in layouts:
        if len(layout) > context.batch:
            continue
        members: dict[Shape, list[int]] = {}
        for index, pipeline in enumerate(layout):
            members.setdefault(shape_of(pipeline, context.types, context.links), []).append(index)
        classes, splits = [], []
        for shape, indices in members.items():
            if shape not in cache:
                cache[shape] = _ShapeSplits.of(shape, context, type_costs)
            classes.append(cache[shape].options(shape.num_stages, len(indices)))
            splits.append((cache[shape], indices))
        if all(len(c.sizes) for c in classes):
            bound = lower_bound_s(classes, context.batch) + boundary_lower_bound_s(
                context.tables, context.links, len(layout), min(len(p) for p in layout)
            )
            candidates.append((bound, layout, classes, splits))
    return sorted(candidates, key=lambda c: c[0])


def _search_heuristic(layouts: list[Layout], context: _Context) -> tuple[list[Pipeline] | None, int]:
    best_s, best = math.inf, None
    for bound, layout, classes, splits in _heuristic_candidates(layouts, context):
        if bound >= best_s:
            break
        sizing = size_pipelines(classes, context.batch)
        if sizing is None:
            continue
        pipelines = []
        for (found, indices), picks in zip(splits, sizing.choices):
            for index, (b, m) in zip(indices, picks):
                firsts = found.first_layers(b, m)
                pipelines.append(_pipeline(layout[index], context.types, firsts, context.num_layers, b, m))
        time_s = _plan(pipelines, context).predicted.iteration_time_s
        if time_s < best_s:
            best_s, best = time_s, pipelines
    return best, len(layouts)


# -- search_pipeline_plan
@dataclass(frozen=True, kw_only=True)
class _Request:
    """What the caller asked for, the same at every ZeRO stage."""

    cluster: Cluster
    global_batch_size: int
    network: NetworkProfile | None
    method: str
    layouts: str
    max_stages: int | None


def _method_and_layouts(request: _Request, num_layers: int) -> tuple[bool, list[Layout]]:
    """Whether to search exactly, and the layouts to search."""
    cluster, method = request.cluster, request.method
    stages = min(num_layers, request.max_stages or num_layers)
    small = cluster.world_size <= EXACT_MAX_RANKS
    every = all_layouts(cluster, stages) if small else None
    count = exact_count(every, num_layers) if every is not None else None
    if method == "exact" and (count is None or count > EXACT_HARD_LIMIT):
        raise ValueError(
            f"method: 'exact' searches at most {EXACT_MAX_RANKS} ranks and {EXACT_HARD_LIMIT} split combinations, "
            f"found {cluster.world_size} ranks" + (f" and {count} combinations" if count else "")
        )
    if method == "exact" or (method == "auto" and count is not None and count <= EXACT_MAX_SPLITS):
        return True, every
    if request.layouts == "all" or (request.layouts == "auto" and small):
        return False, every if every is not None else all_layouts(cluster, stages)
    return False, candidate_layouts(cluster, stages)


def _search_stage(profiles: dict[str, LayerProfile], zero_stage: int, request: _Request) -> _Outcome:
    """The best plan at one ZeRO stage (or why there is none)."""
    cluster = request.cluster
    missing = [t for t in cluster.type_counts() if t not in profiles]
    if missing:
        reason = f"No layer profile for {', '.join(missing)} at stage {zero_stage}."
        return _Outcome(plan=None, reason=reason, method=request.method, layouts=0)
    exact, layouts = _method_and_layouts(request, next(iter(profiles.values())).num_layers)
    sizes = _sizes(request.global_batch_size, dense=exact)
    types = tuple(dict.fromkeys(cluster.rank_device_types))
    context = _Context(
        zero_stage=zero_stage,
        tables={t: layer_table(profiles[t], max(int(sizes[-1]), largest_profiled_size(profiles[t]))) for t in types},
        links=Links.of(request.network, cluster),
        sizes=sizes,
        batch=request.global_batch_size,
        types=cluster.rank_device_types,
        fingerprints={t: profiles[t].fingerprint for t in types},
    )
    found, evaluated = (_search_exact if exact else _search_heuristic)(layouts, context)
    name = "exact" if exact else "heuristic"
    if found is None:
        return _Outcome(plan=None, reason=_infeasible_reason(layouts, context), method=name, layouts=evaluated)
    return _Outcome(plan=_plan(found, context), reason="", method=name, layouts=evaluated)


def _infeasible_reason(layouts: list[Layout], context: _Context) -> str:
    fewest = min((len(layout) for layout in layouts), default=0)
    if fewest > context.batch:
        return (
            f"The global batch {context.batch} is smaller than the fewest pipelines of any layout ({fewest}); "
            "every pipeline runs at least one sample."
        )
    return (
        f"In none of the {len(layouts)} layouts tried do the stages fit the devices' memory at any micro-batch size "
        f"(up to {int(context.sizes[-1])}).{_types_holding_no_layer(context)}"
    )


def _types_holding_no_layer(context: _Context) -> str:
    """The device types that cannot hold even a one-layer stage of one sample: what makes every layout fail."""
    named = []
    for device_type, table in context.tables.items():
        smallest = min(table.memory_bytes(layer, layer, 1, 1, checkpointed=True) for layer in range(table.num_layers))
        capacity = table.profile.memory_capacity_bytes
        if smallest > capacity:
            named.append(
                f"{device_type} holds no stage: its smallest, one layer of one sample, needs {_gib(smallest)} of "
                f"its {_gib(capacity)} (base memory {_gib(table.profile.base_memory_bytes)})"
            )
    return "".join(f" {text}." for text in named)


def search_pipeline_plan(
    layer_profiles: Sequence[LayerProfile],
    cluster: Cluster,
    *,
    global_batch_size: int,
    zero_stage: int | str = "auto",
    network: NetworkProfile | None = None,
    method: str = "auto",
    layouts: str = "auto",
    max_stages: int | None = None,
) -> SearchResult:
    """The pipeline plan of `cluster` with the smallest predicted iteration time (docs/search.md).

    `zero_stage` ``"auto"`` tries 0 and 1 where profiled (2 and 3 are infeasible: DeepSpeed's pipeline engine refuses
    them); without a `network` transfers and all-reduces cost 0. `method` ``auto`` is exact where the space is small,
    else heuristic; `layouts` are the heuristic's: ``all`` (up to `EXACT_MAX_RANKS` ranks), ``candidates``
    (`pipeline_layouts.candidate_layouts`) or ``auto`` (all where the cluster is that small); `max_stages` defaults to
    the number of layers. A plan that cannot be made is a status with a reason; bad input (types, profiles of several
    models, a device type without layer profiles, an exact search too large to run) a ValueError.
    """
    _check_arguments(cluster, global_batch_size, zero_stage, method, max_stages)
    if layouts not in LAYOUTS:
        raise ValueError(f"layouts: expected one of {', '.join(map(repr, LAYOUTS))}, found {layouts!r}")
    if layouts == "all" and cluster.world_size > EXACT_MAX_RANKS:
        raise ValueError(
            f"layouts: 'all' lists the layouts of at most {EXACT_MAX_RANKS} ranks, found {cluster.world_size}"
        )
    request = _Request(
        cluster=cluster,
        global_batch_size=int(global_batch_size),
        network=network,
        method=method,
        layouts=layouts,
        max_stages=max_stages,
    )
    by_stage = layer_profiles_by_stage(layer_profiles)
    check_covered(cluster, by_stage, "layer profile")
    if zero_stage in (2, 3):
        reason = f"DeepSpeed's pipeline engine refuses ZeRO stage {zero_stage} (pipelines run at stage 0 or 1)."
        return _result({int(zero_stage): _Outcome(plan=None, reason=reason, method="none", layouts=0)}, False)
    stages = [s for s in PIPELINE_ZERO_STAGES if s in by_stage] if zero_stage == "auto" else [int(zero_stage)]
    check_emulation(cluster, layer_profiles, "layer profile", stages=stages)
    types = cluster.type_counts()
    used = [p for p in layer_profiles if p.device_type in types and p.zero_stage in stages]
    check_measured_alike(used, "layer profile")
    outcomes = {s: _search_stage(by_stage.get(s, {}), s, request) for s in stages}
    # On a tie a bf16 job takes ZeRO 1: DeepSpeed 0.19.8 cannot load the optimizer state a bf16 pipeline saves at
    # stage 0, and stage 1 shards nothing in a pipeline (its layer profiles are stage 0's measurement).
    resumable_first = any(p.model.dtype == "bfloat16" for p in layer_profiles)
    return _result(outcomes, zero_stage == "auto", higher_stage_on_ties=resumable_first)


def _result(outcomes: dict[int, _Outcome], auto: bool, *, higher_stage_on_ties: bool = False) -> SearchResult:
    feasible = {s: o for s, o in outcomes.items() if o.plan is not None}
    if not feasible:
        reasons = " ".join(f"Stage {s}: {o.reason}" for s, o in outcomes.items())
        reports = tuple(StageReport.infeasible(s, o.reason) for s, o in outcomes.items())
        last = list(outcomes.values())[-1]
        return SearchResult.infeasible(
            f"No pipeline plan. {reasons}",
            PIPELINE_POLICY,
            reports,
            parallelism="pipeline",
            method=last.method,
            layouts_evaluated=last.layouts,
        )
    chosen = min(
        feasible, key=lambda s: (feasible[s].plan.predicted.iteration_time_s, -s if higher_stage_on_ties else s)
    )
    best = feasible[chosen]
    plan = best.plan
    return SearchResult(
        status="ok",
        policy=PIPELINE_POLICY,
        parallelism="pipeline",
        message=_message(plan, chosen, auto, best),
        plan=plan,
        zero_stage=chosen,
        stage_reports=tuple(_report(s, o, chosen, plan, len(feasible)) for s, o in outcomes.items()),
        method=best.method,
        layouts_evaluated=best.layouts,
    )


def _report(stage: int, outcome: _Outcome, chosen: int, best: PipelinePlan, feasible: int) -> StageReport:
    if outcome.plan is None:
        return StageReport.infeasible(stage, outcome.reason)
    reason = "Fastest feasible stage." if feasible > 1 else "The only feasible stage."
    rate = best.predicted.samples_per_s
    return StageReport.feasible(stage, chosen, reason, rate, outcome.plan.predicted, outcome.plan.global_batch_size)


def layout_summary(plan: PipelinePlan) -> str:
    """``4 pipelines of 2 stages (A100-80GB, V100-16GB)``: the pipelines by their stages' device types."""
    parts = []
    for types, count in Counter(tuple(stage.device_type for stage in p.stages) for p in plan.pipelines).items():
        runs = []
        for device_type, same in itertools.groupby(types):
            n = len(list(same))
            runs.append(f"{device_type} x{n}" if n > 1 else device_type)
        parts.append(
            f"{count} pipeline{'s' if count > 1 else ''} of {len(types)} stage{'s' if len(types) > 1 else ''} "
            f"({', '.join(runs)})"
        )
    return " + ".join(parts)


def checkpointing_summary(plan: PipelinePlan) -> str:
    """``activation checkpointing on 2 stages (ranks 1, 3)`` ('' when no stage recomputes)."""
    ranks = sorted(s.rank for p in plan.pipelines for s in p.stages if s.activation_checkpointing)
    if not ranks:
        return ""
    plural = "s" if len(ranks) > 1 else ""
    return f"activation checkpointing on {len(ranks)} stage{plural} (rank{plural} {listed([str(r) for r in ranks])})"


def _message(plan: PipelinePlan, stage: int, auto: bool, outcome: _Outcome) -> str:
    predicted = plan.predicted
    share = predicted.samples_per_s / predicted.ideal_samples_per_s
    checkpointing = checkpointing_summary(plan)
    return (
        f"pipelines at ZeRO stage {stage}{' (auto)' if auto else ''}: {layout_summary(plan)}, global batch "
        f"{plan.global_batch_size}{', ' + checkpointing if checkpointing else ''}, predicted "
        f"{predicted.iteration_time_s:.4g} s per iteration, {predicted.samples_per_s:.4g} samples/s "
        f"({100 * share:.1f}% of ideal); {outcome.method} search over {outcome.layouts} layouts."
    )


# -- check_pipeline_plan
def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def check_pipeline_plan(
    plan: PipelinePlan, cluster: Cluster | None, layer_profiles: Sequence[LayerProfile] | None = None
) -> list[str]:
    """Problems that make `plan` unusable on `cluster` (None: the plan alone), as full sentences ([] when fine): ranks,
    stage, samples, layer coverage; with `layer_profiles` their coverage and every stage's memory."""
    problems = ([] if cluster is None else cluster_problems(plan, cluster)) + _check_shape(plan)
    if layer_profiles is not None and not problems:
        problems += _check_memory(plan, layer_profiles)
    return problems


def _check_shape(plan: PipelinePlan) -> list[str]:
    problems = []
    if plan.zero_stage not in PIPELINE_ZERO_STAGES:
        problems.append(
            f"DeepSpeed's pipeline engine runs ZeRO stage 0 or 1, but the plan has stage {plan.zero_stage}."
        )
    total = sum(p.samples_per_iteration for p in plan.pipelines)
    if total != plan.global_batch_size:
        problems.append(
            f"The pipelines run {total} samples per iteration, but the global batch is {plan.global_batch_size}."
        )
    gaps = [
        f"pipeline {index}"
        for index, p in enumerate(plan.pipelines)
        if p.boundaries[0] != 0
        or p.boundaries[-1] != plan.num_layers
        or any(s.first_layer != e.last_layer + 1 for e, s in zip(p.stages, p.stages[1:]))
        or any(s.last_layer < s.first_layer for s in p.stages)
    ]
    if gaps:
        problems.append(
            f"The stages of {listed(gaps)} do not cover layers 0 to {plan.num_layers - 1} in order, each from where "
            "the last ended."
        )
    return problems


def _check_memory(plan: PipelinePlan, layer_profiles: Sequence[LayerProfile]) -> list[str]:
    at_stage = layer_profiles_by_stage(layer_profiles).get(plan.zero_stage, {})
    types = list(dict.fromkeys(plan.rank_device_types))
    missing = [t for t in types if t not in at_stage]
    if missing:
        return [f"No layer profile at ZeRO stage {plan.zero_stage} for {', '.join(missing)}."]
    other = [f"{t} ({at_stage[t].num_layers})" for t in types if at_stage[t].num_layers != plan.num_layers]
    if other:
        return [
            f"The plan has {plan.num_layers} layers, but the layer profiles of {listed(other)} have another number."
        ]
    largest = max(p.micro_batch_size for p in plan.pipelines)
    tables = {t: layer_table(at_stage[t], largest) for t in types}
    links = Links(network=None)
    over = []
    for index, pipeline in enumerate(plan.pipelines):
        for s, (stage, cost) in enumerate(zip(pipeline.stages, stage_costs(pipeline, tables, links))):
            capacity = at_stage[stage.device_type].memory_capacity_bytes
            if cost.memory_bytes > capacity:
                over.append(
                    f"pipeline {index} stage {s} (rank {stage.rank}, {stage.device_type}: {_gib(cost.memory_bytes)} "
                    f"> {_gib(capacity)})"
                )
    if over:
        return [
            f"Stages do not fit their device's memory (base, their layers' parameters and optimizer state, the "
            f"activations of the micro-batches 1F1B keeps in flight, or a checkpointed stage's inputs and one "
            f"micro-batch's activations) at {listed(over)}."
        ]
    return []
