"""`poplar-search --parallelism pipeline|auto`: the pipeline search, or both searches and the faster plan
(docs/search.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, load_cluster, plan_to_dict
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import (
    PIPELINE_POLICY,
    PIPELINE_ZERO_STAGES,
    PipelinePlan,
    layer_profiles_dir,
    load_layer_profiles,
    pipeline_plan_to_dict,
)

from .api import SearchResult, search_plan
from .cli_common import (
    EXIT_INFEASIBLE,
    PROG,
    bad_input,
    chosen_network,
    emit,
    error,
    idle_text,
    labelled,
    model_profiles,
    of_model,
    or_dash,
    plan_row,
    plan_table,
    rank_span,
    runs,
    stage_table,
    table,
)
from .pipeline_cost import predict_pipeline
from .pipeline_search import search_pipeline_plan
from .pipeline_sizing import MAX_SUMSET


def _argument_problem(args: argparse.Namespace) -> str | None:
    if args.policy != PIPELINE_POLICY:
        return f"--policy: expected {PIPELINE_POLICY} with --parallelism {args.parallelism}, found {args.policy}"
    if args.parallelism == "pipeline" and args.global_batch_size is None:
        return "--global-batch-size: required with --parallelism pipeline (the pipeline search sizes a given batch)"
    batch = args.global_batch_size
    if batch is not None and batch > MAX_SUMSET:
        limit = f"at most {MAX_SUMSET} with --parallelism {args.parallelism} (the pipeline search's limit)"
        return f"--global-batch-size: expected {limit}, found {batch}"
    if args.parallelism == "pipeline" and args.zero_stage not in ("auto", *PIPELINE_ZERO_STAGES):
        stages = " or ".join(map(str, PIPELINE_ZERO_STAGES))
        return (
            f"--zero-stage: expected auto, {stages} with --parallelism pipeline (DeepSpeed's pipeline engine refuses "
            f"stage {args.zero_stage})"
        )
    return None


def _search(args: argparse.Namespace) -> tuple[SearchResult | None, SearchResult | None, Any]:
    """Both searches (ZeRO only with auto); raises FormatError / ValueError for bad input."""
    cluster = load_cluster(args.cluster)
    layers = layer_profiles_dir(args.profiles)
    if args.parallelism == "auto" and not layers.exists():
        raise ValueError(
            f"{layers}: (directory): expected a directory of layer profiles, found no such directory; "
            f"--parallelism auto searches pipelines from them (poplar-profile --per-layer), --parallelism zero "
            f"searches {args.profiles} without them"
        )
    layer_profiles = of_model(args, load_layer_profiles(layers), layers)
    network = chosen_network(args, cluster)
    if args.parallelism == "auto" and network is None:
        # Without one a pipeline's transfers and all-reduces would cost nothing while ZeRO's collectives stay in its
        # profiles' measured times: a comparison leaning to pipelines, whatever the job's network.
        raise ValueError(
            "--parallelism auto: expected a network file (--network FILE, or one in DIR/network/ measured on the "
            f"cluster), found {'--no-network' if args.no_network else 'none'}: the choice depends on communication, "
            "which only a network file prices alike for both (--parallelism zero or pipeline searches one alone)"
        )
    zero, profiles = None, None
    batch = args.global_batch_size
    if args.parallelism == "auto":
        try:
            profiles = model_profiles(args)
        except FormatError as exc:
            if not (layer_profiles and exc.field == "(directory)" and exc.found == "none"):
                raise
            # A pipeline model's folder: its layer profiles alone.
            hint = f"none; --parallelism pipeline searches {layers} alone"
            raise FormatError(exc.source, exc.field, exc.expected, hint) from None
        zero = search_plan(
            profiles,
            cluster,
            global_batch_size=batch,
            zero_stage=args.zero_stage,
            max_global_batch_size=args.max_global_batch_size,
            network=network,
        )
        if batch is None and zero.ok:
            batch = zero.plan.global_batch_size
    pipeline = None
    if batch is not None and args.global_batch_size is None and batch > MAX_SUMSET:
        # The ZeRO search's own batch, not the user's: beyond the pipeline sizing, not bad input.
        reason = f"The ZeRO search's global batch {batch} is above the pipeline search's limit ({MAX_SUMSET})."
        pipeline = SearchResult.infeasible(reason, PIPELINE_POLICY, (), parallelism="pipeline")
    elif batch is not None:
        pipeline = search_pipeline_plan(
            layer_profiles, cluster, global_batch_size=batch, zero_stage=args.zero_stage, network=network
        )
    return zero, pipeline, (cluster, layer_profiles, network, profiles)


def _chosen(zero: SearchResult | None, pipeline: SearchResult | None) -> str | None:
    """``zero`` or ``pipeline``: the faster feasible plan (ties: ZeRO); None when neither is feasible."""
    times = {
        name: result.plan.predicted.iteration_time_s
        for name, result in (("zero", zero), ("pipeline", pipeline))
        if result is not None and result.ok
    }
    return min(times, key=times.get) if times else None  # ties: the first, ZeRO


def run_pipelines(args: argparse.Namespace) -> int:
    """`poplar-search` with ``--parallelism pipeline`` or ``auto``; returns the exit status."""
    problem = _argument_problem(args)
    if problem:
        return error(f"{problem} (see --help)")
    try:
        zero, pipeline, (cluster, layer_profiles, network, profiles) = _search(args)
    except ValueError as exc:
        return bad_input(exc, f"profiles: {args.profiles}, cluster: {args.cluster}", args)
    chosen = _chosen(zero, pipeline)
    if chosen is None:
        reasons = [f"{name}: {r.message}" for name, r in (("zero", zero), ("pipeline", pipeline)) if r is not None]
        if pipeline is None:
            reasons.append("pipeline: not searched (no global batch: the ZeRO search found none to take)")
        print(f"{PROG}: infeasible: {' '.join(reasons)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    if chosen == "pipeline":
        note_bf16_zero0(args, pipeline.plan, layer_profiles)
    data = _plan_dict(zero if chosen == "zero" else pipeline)
    auto = args.parallelism == "auto"
    shown = {"chosen": chosen, "zero": _plan_dict(zero), "pipeline": _plan_dict(pipeline)} if auto else data

    def text() -> str:
        if chosen == "zero":
            plan = plan_table(zero, profiles, network)  # the ZeRO plan exists with --parallelism auto alone
        else:
            plan = pipeline_plan_table(pipeline, layer_profiles, network, cluster)
        shown = parallelism_table(zero, pipeline, chosen) + "\n\n" + plan if auto else plan
        priced = layer_profiles if not auto else [*layer_profiles, *(profiles or [])]  # auto compares both kinds
        return labelled(shown, priced, list(cluster.type_counts()), under_table=auto)

    return emit(args, data, shown, text)


def note_bf16_zero0(args: argparse.Namespace, plan: PipelinePlan, layer_profiles: Any) -> None:
    """A note on stderr for a plan whose stage the search chose (``--zero-stage auto``) at 0 from bf16 layer
    profiles: such a job's checkpoints do not resume with their optimizer state (the runtime refuses it at the
    load, after the run; at ZeRO 1, which shards nothing in a pipeline, they do)."""
    if args.zero_stage != "auto" or plan.zero_stage != 0:
        return
    if not any(p.model.dtype == "bfloat16" and p.zero_stage == 0 for p in layer_profiles):
        return
    print(
        f"{PROG}: note: the plan is at ZeRO stage 0 from bfloat16 layer profiles: DeepSpeed 0.19.8 cannot load the "
        "optimizer state a bf16 pipeline saves at stage 0, so its checkpoints resume with the weights alone; "
        "--zero-stage 1 plans one that resumes exactly (ZeRO 1 shards nothing in a pipeline: no memory cost)",
        file=sys.stderr,
    )


def _plan_dict(result: Any) -> dict[str, Any] | None:
    if result is None or not result.ok:
        return None
    return pipeline_plan_to_dict(result.plan) if isinstance(result.plan, PipelinePlan) else plan_to_dict(result.plan)


# -- Tables
def parallelism_table(zero: SearchResult | None, pipeline: SearchResult | None, chosen: str) -> str:
    """One row per parallelism: status, ZeRO stage, batch, predicted time and throughput."""
    rows = [["parallelism", "status", "stage", "global batch", "iteration s", "samples/s", "of ideal", "note"]]
    for name, result in (("zero", zero), ("pipeline", pipeline)):
        if result is None or not result.ok:
            message = "not searched: no global batch" if result is None else result.message
            rows.append(plan_row(name, "infeasible", None, message))
        else:
            status, note = ("chosen", "faster predicted plan") if name == chosen else ("slower", "")
            rows.append(plan_row(name, status, result.plan, note))
    return table(rows)


def _ranks_text(ranks: list[int], limit: int = 3) -> str:
    """``0-3, 8-11`` (runs of consecutive ranks), the first `limit` runs and how many ranks in all."""
    ranks = sorted(ranks)
    spans = [(ranks[a], ranks[b - 1]) for a, b in runs(range(len(ranks)), lambda i: ranks[i] - i)]
    shown = ", ".join(rank_span(a, b) for a, b in spans[:limit])
    return shown + (f", ... ({len(ranks)} ranks)" if len(spans) > limit else "")


def pipeline_plan_table(
    result: SearchResult, layer_profiles: Any, network: NetworkProfile | None, cluster: Cluster
) -> str:
    """Consecutive alike pipelines together, one row per stage: ranks, type, layers, micro-batches, busy (of it
    the recompute of a checkpointed stage), idle, memory."""
    plan = result.plan
    predicted = predict_pipeline(plan, layer_profiles, network, cluster=cluster)
    rows = [
        ["pipelines", "stage", "ranks", "device type", "layers", "micro-batch", "micro-batches", "busy s/iter"]
        + ["idle", "memory GiB", "recompute s/iter"]
    ]

    def alike(p: Any) -> tuple:
        stages = tuple((s.device_type, s.first_layer, s.last_layer, s.activation_checkpointing) for s in p.stages)
        return stages, p.micro_batch_size, p.num_micro_batches

    slowest = max(predicted.pipeline_time_s)
    for start, end in runs(plan.pipelines, alike):
        group = plan.pipelines[start:end]
        for s, stage in enumerate(group[0].stages):
            r = stage.rank
            busy = predicted.rank_busy_time_s[r]
            recompute = predicted.rank_recompute_time_s[r] if predicted.rank_activation_checkpointing[r] else None
            rows.append(
                [rank_span(start, end - 1) if s == 0 else "", str(s), _ranks_text([p.stages[s].rank for p in group])]
                + [stage.device_type, f"{stage.first_layer}-{stage.last_layer}", str(group[0].micro_batch_size)]
                + [str(group[0].num_micro_batches), f"{busy:.4g}", idle_text(busy, slowest)]
                + [f"{predicted.rank_memory_bytes[r] / 2**30:.3g}", or_dash(recompute, ".4g")]
            )
    text = [result.message]
    if network is None:
        text.append("No network file: transfers and the gradient all-reduces between pipelines are not priced.")
    text += ["", table(rows)]
    if len(result.stage_reports) > 1:
        text += ["", stage_table(result.stage_reports, with_batch=False)]
    return "\n".join(text)
