"""The exhaustive optimum of the pipeline cost model, for the pipeline search's tests (tests/unit).

Independent of the search: every ordered partition of the ranks into pipelines, every
split of every pipeline, every (micro-batch size, count) of every pipeline whose samples
sum to the global batch; each plan priced by the cost model (`evaluate_plan`, what
`predict_pipeline` runs), plans whose stages exceed their device's memory left out. A stage
that exceeds it is priced with activation checkpointing instead (the one setting that can
make it fit: checkpointing a stage that fits only adds its recompute).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from poplar_ext.plan.formats import Prediction
from poplar_ext.plan.pipeline_formats import Pipeline, PipelinePlan, PipelineStage
from poplar_ext.search.pipeline_cost import Links, evaluate_plan, layer_table


def ordered_partitions(items):
    if not items:
        yield []
        return
    for rest in ordered_partitions(items[1:]):
        yield [[items[0]], *rest]
        for i, seq in enumerate(rest):
            for pos in range(len(seq) + 1):
                yield [*rest[:i], [*seq[:pos], items[0], *seq[pos:]], *rest[i + 1 :]]


def _splits(num_layers, num_stages):
    for cut in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cut, num_layers)
        yield [(bounds[k], bounds[k + 1] - 1) for k in range(num_stages)]


def _work_choices(batch, count):
    """Every tuple of `count` (b, m) pairs with sum b*m == batch."""
    if count == 0:
        if batch == 0:
            yield ()
        return
    for b in range(1, batch + 1):
        for m in range(1, batch // b + 1):
            for rest in _work_choices(batch - b * m, count - 1):
                yield ((b, m), *rest)


def _checkpointed(plan, ranks):
    """`plan` with activation checkpointing on the stages of `ranks`."""
    pipelines = tuple(
        dataclasses.replace(
            p, stages=tuple(dataclasses.replace(s, activation_checkpointing=s.rank in ranks) for s in p.stages)
        )
        for p in plan.pipelines
    )
    return dataclasses.replace(plan, pipelines=pipelines)


def brute_force(profiles, cluster, batch, zero_stage=0, network=None):
    """(best iteration time, its plan) over the whole space; (inf, None) when nothing fits."""
    by_type = {p.device_type: p for p in profiles if p.zero_stage == zero_stage}
    types = cluster.rank_device_types
    tables = {t: layer_table(by_type[t], batch) for t in set(types)}
    capacity = {t: by_type[t].memory_capacity_bytes for t in by_type}
    num_layers = by_type[types[0]].num_layers
    links = Links.of(network, cluster)
    best, best_plan = math.inf, None
    dummy = Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0)
    for partition in ordered_partitions(list(range(len(types)))):
        if len(partition) > batch or max(map(len, partition)) > num_layers:
            continue
        for splits in itertools.product(*[list(_splits(num_layers, len(p))) for p in partition]):
            for works in _work_choices(batch, len(partition)):
                pipelines = tuple(
                    Pipeline(
                        stages=tuple(
                            PipelineStage(rank=r, device_type=types[r], first_layer=f, last_layer=last)
                            for r, (f, last) in zip(ranks, split)
                        ),
                        micro_batch_size=b,
                        num_micro_batches=m,
                    )
                    for ranks, split, (b, m) in zip(partition, splits, works)
                )
                plan = PipelinePlan(
                    policy="poplar",
                    zero_stage=zero_stage,
                    global_batch_size=batch,
                    num_layers=num_layers,
                    pipelines=pipelines,
                    predicted=dummy,
                    profile_fingerprints={},
                )
                predicted = evaluate_plan(plan, tables, links)
                over = {r for r, mem in enumerate(predicted.rank_memory_bytes) if mem > capacity[types[r]]}
                if over:  # only there checkpointing can help, and it only adds time
                    plan = _checkpointed(plan, over)
                    predicted = evaluate_plan(plan, tables, links)
                if any(mem > capacity[types[r]] for r, mem in enumerate(predicted.rank_memory_bytes)):
                    continue
                if predicted.iteration_time_s < best:
                    best, best_plan = predicted.iteration_time_s, plan
    return best, best_plan
