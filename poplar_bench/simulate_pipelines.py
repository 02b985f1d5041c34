"""ZeRO or pipelines: the best predicted plan of each on the shipped clusters, network slow and fast (docs/bench.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import Cluster, load_cluster
from poplar_ext.search import search_plan
from poplar_ext.search.pipeline_search import layout_summary, search_pipeline_plan

from . import gpu_layer_model, gpu_model

NETWORKS: dict[str, tuple[str, gpu_model.Assumptions]] = {
    "slow": ("10 Gb/s Ethernet per GPU between nodes", gpu_model.Assumptions(network_bytes_per_s=1.25e9)),
    "fast": ("100 Gb/s InfiniBand per GPU between nodes", gpu_model.Assumptions()),
}


def _entry(result: Any, summary: str) -> dict[str, Any]:
    if not result.ok:
        return {"status": "infeasible", "message": result.message}
    predicted = result.plan.predicted
    return {
        "status": "ok",
        "zero_stage": result.plan.zero_stage,
        "plan": summary,
        "iteration_time_s": predicted.iteration_time_s,
        "samples_per_s": predicted.samples_per_s,
        "share_of_ideal": predicted.samples_per_s / predicted.ideal_samples_per_s,
    }


def compare(
    cluster: Cluster,
    shape: gpu_model.ModelShape,
    *,
    network: str,
    global_batch_size: int,
    name: str,
) -> dict[str, Any]:
    """The best ZeRO and the best pipeline plan of one case, and which is faster."""
    label, assumptions = NETWORKS[network]
    gpus_per_node = max(sum(g.count for g in node.devices) for node in cluster.nodes)
    priced = gpu_layer_model.two_level_network(assumptions, gpus_per_node=gpus_per_node)
    types = list(cluster.type_counts())
    profiles = gpu_model.modelled_profiles(types, shape, world_size=cluster.world_size, assumptions=assumptions)
    zero = search_plan(profiles, cluster, global_batch_size=global_batch_size, network=priced)
    layers = gpu_layer_model.modelled_layer_profiles(types, shape, assumptions=assumptions)
    pipeline = search_pipeline_plan(layers, cluster, global_batch_size=global_batch_size, network=priced)
    row = {
        "name": name,
        "model": shape.name,
        "world_size": cluster.world_size,
        "network": network,
        "network_label": label,
        "global_batch_size": global_batch_size,
        "zero": _entry(zero, "" if not zero.ok else f"ZeRO-{zero.plan.zero_stage}"),
        "pipeline": _entry(pipeline, layout_summary(pipeline.plan) if pipeline.ok else ""),
    }
    rates = {k: row[k]["samples_per_s"] for k in ("zero", "pipeline") if row[k]["status"] == "ok"}
    row["winner"] = max(rates, key=lambda k: (rates[k], k == "zero")) if rates else None
    row["pipeline_over_zero"] = rates["pipeline"] / rates["zero"] if len(rates) == 2 else None
    return row


def parallelism_comparison(
    cluster_files: Sequence[Path],
    shapes: Sequence[gpu_model.ModelShape],
    *,
    samples_per_rank: int,
    global_batch_size: int | None = None,
    networks: Sequence[str] = tuple(NETWORKS),
) -> list[dict[str, Any]]:
    """`compare` for every (model, cluster file, network), at `global_batch_size` (None: `samples_per_rank` x
    world size)."""
    rows = []
    for shape in shapes:
        for path in cluster_files:
            cluster = load_cluster(path)
            pair = Path(path).stem.rpartition("-x")[0] or Path(path).stem
            for network in networks:
                rows.append(
                    compare(
                        cluster,
                        shape,
                        network=network,
                        global_batch_size=global_batch_size or samples_per_rank * cluster.world_size,
                        name=pair,
                    )
                )
    return rows


NOTES = (
    "ZeRO or pipelines, predicted from MODELLED profiles (whole-model: poplar_bench.gpu_model; layer by layer: "
    "poplar_bench.gpu_layer_model, whose head is modelled untied: its own copy of the vocabulary matrix). Both at "
    "the same global batch, priced by the same modelled network: between nodes as named, within a node "
    f"{gpu_layer_model.INTRA_NODE_BYTES_PER_S / 1e9:.0f} GB/s; every GPU its own link (per-stage all-reduces of "
    "pipelines do not share one). Pipelines at ZeRO stage 0 (stage 1 shards nothing in poplar-ext's pipelines)."
)


def _rate(entry: dict[str, Any]) -> str:
    return "infeasible" if entry["status"] != "ok" else f"{entry['samples_per_s']:.3g}"


def render_parallelism(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per network, each case's best ZeRO and pipeline plan; then where each wins."""
    lines = ["", "## ZeRO or pipelines (predicted)", "", NOTES, ""]
    for network, (label, _) in NETWORKS.items():
        mine = [r for r in rows if r["network"] == network]
        if not mine:
            continue
        lines += [
            f"### Network {network}: {label}",
            "",
            "| cluster | model | GPUs | global batch | ZeRO samples/s | ZeRO plan | pipeline samples/s | "
            "pipeline plan | winner | pipeline / ZeRO |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in mine:
            ratio = "-" if r["pipeline_over_zero"] is None else f"{r['pipeline_over_zero']:.2f}x"
            lines.append(
                f"| {r['name']} | {r['model']} | {r['world_size']} | {r['global_batch_size']} | {_rate(r['zero'])} | "
                f"{r['zero'].get('plan', '')} | {_rate(r['pipeline'])} | {r['pipeline'].get('plan', '')} | "
                f"{r['winner'] or '-'} | {ratio} |"
            )
        lines.append("")
    lines += ["### Where each wins", ""]
    for network in NETWORKS:
        for winner in ("pipeline", "zero"):
            cases = [
                f"{r['name']} x{r['world_size']} {r['model']}"
                for r in rows
                if r["network"] == network and r["winner"] == winner
            ]
            lines.append(f"- network {network}, {winner} faster ({len(cases)}): {', '.join(cases) or 'none'}")
    return lines + [""]
