"""`poplar-search --predict PLAN`: where a given plan's time goes (docs/search.md, "Pricing a given plan")."""

from __future__ import annotations

import argparse
import dataclasses
import json
from operator import attrgetter
from typing import Any

from poplar_ext.plan.formats import Cluster, Plan, load_cluster, plan_from_dict, read_json
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.plan.pipeline_formats import (
    PARALLELISMS,
    PipelinePlan,
    layer_profiles_dir,
    load_layer_profiles,
    pipeline_plan_from_dict,
)
from poplar_ext.plan.validation import Node

from .api import PlanPrediction, check_emulation, cluster_problems, predict, rule_problems
from .cli_common import (
    EXIT_OK,
    bad_input,
    chosen_network,
    error,
    idle_text,
    labelled,
    model_profiles,
    of_model,
    rank_span,
    runs,
    table,
)
from .examples import example_cluster_file
from .pipeline_cost import BoundaryTransfer, PipelinePrediction, predict_pipeline
from .pipeline_search import check_pipeline_plan


def run_predict(args: argparse.Namespace) -> int:
    """Price the plan of ``args.predict``; print the table or JSON; returns the exit status."""
    try:
        root = Node(read_json(args.predict), args.predict).obj()  # not an object: bad input, not a TypeError
        parallelism = root.optional("parallelism")
        if parallelism is not None:  # either kind: each reader alone names only its own
            parallelism.string(choices=PARALLELISMS)
        data = root.value
        kind = "pipeline" if "pipelines" in data else "zero"
        cluster = load_cluster(args.cluster) if args.cluster else None
        network = chosen_network(args, cluster)
        read = pipeline_plan_from_dict if kind == "pipeline" else plan_from_dict
        plan: Plan | PipelinePlan = read(data, source=args.predict)
        # The cluster places the ranks on nodes and finds the network: it must be the plan's.
        problems = [] if cluster is None else cluster_problems(plan, cluster)
        if problems:
            example = args.cluster == str(example_cluster_file())
            which = f"{args.cluster} (the example's: give the plan's own with --cluster)" if example else args.cluster
            return error(f"{args.predict}: expected a plan of the cluster {which}: {' '.join(problems)}")
        if kind == "pipeline":
            folder = layer_profiles_dir(args.profiles)
            layers = of_model(args, load_layer_profiles(folder), folder)
            if cluster is not None:  # without it no emulation is declared to hold the profiles to
                check_emulation(cluster, layers, "layer profile", stages=[plan.zero_stage])
            prediction: Any = predict_pipeline(plan, layers, network, cluster=cluster)
            # Refused as a ZeRO plan beyond its profiles' largest micro-batch is: a time for a plan that cannot run.
            problems = check_pipeline_plan(plan, None, layers)
            if problems:
                return error(f"{args.predict}: expected stages that fit their device's memory: {' '.join(problems)}")
        else:
            problems = rule_problems(plan)  # check_plan's and the runtime's: a time for a plan that cannot run
            if problems:
                return error(f"{args.predict}: expected a plan that keeps its stage's rules: {' '.join(problems)}")
            profiles = model_profiles(args)
            if cluster is not None:
                check_emulation(cluster, profiles, "profile", stages=[plan.zero_stage])
            prediction = predict(plan, profiles, network)
    except ValueError as exc:
        return bad_input(exc, f"plan: {args.predict}, profiles: {args.profiles}", args)
    if args.format == "json":
        data = {"plan": str(args.predict), "parallelism": kind, "network_priced": network is not None}
        print(json.dumps({**data, "prediction": _prediction_json(prediction, network)}, indent=2))
    elif kind == "pipeline":
        print(labelled(pipeline_prediction_table(plan, prediction, network, cluster), layers, plan.rank_device_types))
    else:
        text = zero_prediction_table(plan, prediction, network, without_network=_without_network(args, cluster))
        print(labelled(text, profiles, plan.rank_device_types))
    return EXIT_OK


def _without_network(args: argparse.Namespace, cluster: Cluster | None) -> str:
    """Why no network file prices this prediction, as the table says it."""
    if args.no_network:
        return "--no-network"
    if cluster is None:
        return "no --cluster or --network to find a network file by"
    return f"no network file in {args.profiles} measured on this cluster"


def _micro_step_separated(zero_stage: int, network: NetworkProfile | None) -> bool:
    """Whether a ZeRO micro-step's compute and collectives are told apart: without a network, stages 2-3 have
    theirs inside the measured micro-step (stages 0-1 have none there)."""
    return network is not None or zero_stage < 2


def _prediction_json(prediction: Any, network: NetworkProfile | None) -> dict[str, Any]:
    """The prediction as JSON; without a network a ZeRO boundary's parts are null, not a false 0 for the
    collectives (they are inside the measured ``boundary_s``), and ``boundary_separated`` says so; so are a
    micro-step's compute and collectives where they are measured together."""
    data = dataclasses.asdict(prediction)
    if isinstance(prediction, PlanPrediction):
        data["boundary_separated"] = network is not None
        if network is None:
            data["optimizer_step_s"] = data["boundary_communication_s"] = None
        if not _micro_step_separated(prediction.zero_stage, network):
            data["rank_compute_time_s"] = data["micro_step_communication_s"] = None
    return data


def _summary(prediction: Any, network: NetworkProfile | None) -> list[str]:
    priced = "" if network is not None else " (no network file: communication is not priced apart)"
    return [
        f"predicted {prediction.iteration_time_s:.4g} s per iteration, {prediction.samples_per_s:.4g} samples/s, "
        f"{100 * prediction.samples_per_s / prediction.ideal_samples_per_s:.1f}% of ideal{priced}"
    ]


def zero_prediction_table(
    plan: Plan, prediction: PlanPrediction, network: NetworkProfile | None, *, without_network: str = ""
) -> str:
    """Where a ZeRO plan's time goes: each group of alike ranks' compute, communication and idle share,
    then the boundary (optimizer step and collectives; without `network` as profiled, `without_network` why)."""
    rows = [["ranks", "device type", "micro-batch", "accumulation", "compute s", "communication s", "busy s", "idle"]]
    compute = prediction.rank_compute_time_s or prediction.rank_busy_time_s
    separated = _micro_step_separated(plan.zero_stage, network)
    slowest = max(prediction.rank_busy_time_s)
    for start, end in runs(plan.ranks, attrgetter("device_type", "micro_batch_size", "gradient_accumulation_steps")):
        first = plan.ranks[start]
        busy = prediction.rank_busy_time_s[start]
        parts = [f"{compute[start]:.4g}", f"{busy - compute[start]:.4g}"] if separated else ["-", "-"]
        rows.append(
            [rank_span(start, end - 1), first.device_type, str(first.micro_batch_size)]
            + [str(first.gradient_accumulation_steps), *parts, f"{busy:.4g}", idle_text(busy, slowest)]
        )
    boundary = (
        f"boundary {prediction.boundary_s:.4g} s: optimizer step {prediction.optimizer_step_s:.4g} s, "
        f"collectives {prediction.boundary_communication_s:.4g} s"
        if network is not None
        else f"boundary {prediction.boundary_s:.4g} s as profiled (optimizer step and collectives not told apart: "
        f"{without_network or 'no network file'})"
    )
    header = f"ZeRO stage {plan.zero_stage}, global batch {plan.global_batch_size}, {plan.world_size} ranks"
    return "\n".join([header, *_summary(prediction, network), "", table(rows), "", boundary])


def pipeline_prediction_table(
    plan: PipelinePlan, prediction: PipelinePrediction, network: NetworkProfile | None, cluster: Cluster | None = None
) -> str:
    """Where a pipeline plan's time goes: each stage's compute (of it the recompute of a checkpointed stage),
    activation transfers and idle share, when its gradient all-reduce ends and its optimizer step; each
    boundary's link and transfers; each pipeline's 1F1B time."""
    rows = [
        ["pipeline", "stage", "rank", "device type", "layers", "compute s", "recompute s", "transfers s", "busy s"]
        + ["idle"]
        + ["all-reduce ends s", "optimizer s"]
    ]
    slowest = max(prediction.pipeline_time_s)
    for index, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            r = stage.rank
            busy = prediction.rank_busy_time_s[r]
            rows.append(
                [str(index) if s == 0 else "", str(s), str(r), stage.device_type]
                + [f"{stage.first_layer}-{stage.last_layer}", f"{prediction.rank_compute_time_s[r]:.4g}"]
                + [f"{prediction.rank_recompute_time_s[r]:.4g}" if stage.activation_checkpointing else "-"]
                + [f"{prediction.rank_transfer_time_s[r]:.4g}", f"{busy:.4g}"]
                + [idle_text(busy, slowest), f"{prediction.rank_all_reduce_s[r]:.4g}"]
                + [f"{prediction.rank_optimizer_step_s[r]:.4g}"]
            )
    pipelines = ", ".join(f"{t:.4g}" for t in prediction.pipeline_time_s)
    header = f"pipelines at ZeRO stage {plan.zero_stage}, global batch {plan.global_batch_size}"
    lines = [header, *_summary(prediction, network), "", table(rows), ""]
    if prediction.boundary_transfers:
        lines += [_links_table(prediction.boundary_transfers, cluster), ""]
    return "\n".join(lines + [f"pipelines (1F1B) s: {pipelines}; boundary {prediction.boundary_s:.4g} s"])


def _links_table(boundaries: tuple[BoundaryTransfer, ...], cluster: Cluster | None) -> str:
    """Each boundary's link (within a node, or the two nodes it joins) and its transfers per iteration."""
    rows = [["pipeline", "boundary", "ranks", "link", "bandwidth B/s", "transfers s"]]
    for boundary in boundaries:
        if boundary.nodes is None or cluster is None:
            link = "between nodes (no cluster)"
        else:
            first, second = (cluster.nodes[n].name for n in boundary.nodes)
            link = f"within {first}" if boundary.nodes[0] == boundary.nodes[1] else f"{first}-{second}"
        bandwidth = boundary.bandwidth_bytes_per_s
        rows.append(
            [str(boundary.pipeline), f"{boundary.stage}|{boundary.stage + 1}", "->".join(map(str, boundary.ranks))]
            + [link, "not priced" if bandwidth is None else f"{bandwidth:.4g}", f"{boundary.time_s:.4g}"]
        )
    return "activation transfers per link (forward and back, per iteration):\n" + table(rows)
