"""What every mode of `poplar-search` shares: its exit statuses, its tables, the network its options choose."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from poplar_ext.plan.network_format import NetworkProfile, find_network, load_network

from .api import SearchResult, predict

EXIT_OK = 0
EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 3


def chosen_network(args: Any, cluster: Any) -> NetworkProfile | None:
    """The network file the options name: none with ``--no-network``, ``--network FILE``, else the one in
    ``--profiles`` measured on `cluster` (none without a cluster)."""
    if args.no_network:
        return None
    if args.network:
        return load_network(args.network)
    return None if cluster is None else find_network(args.profiles, cluster)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def rank_span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def plan_table(result: SearchResult, profiles: Sequence, network: NetworkProfile | None = None) -> str:
    """Groups of consecutive ranks with the same device type and allocation, and the stage reports."""
    plan = result.plan
    assert plan is not None
    busy = predict(plan, profiles, network).rank_busy_time_s
    slowest = max(busy)
    # A column per memory lever only where some rank uses it.
    checkpointing = any(r.activation_checkpointing for r in plan.ranks)
    offload = any(r.optimizer_offload for r in plan.ranks)
    rows = [
        ["ranks", "device type", "micro-batch", "accumulation", "samples/iter", "busy s/iter", "idle"]
        + (["checkpointing"] if checkpointing else [])
        + (["optimizer offload"] if offload else [])
    ]

    def group(r: Any) -> tuple:
        return (
            r.device_type,
            r.micro_batch_size,
            r.gradient_accumulation_steps,
            r.activation_checkpointing,
            r.optimizer_offload,
        )

    start = 0
    for i in range(1, len(plan.ranks) + 1):
        first = plan.ranks[start]
        if i < len(plan.ranks) and group(plan.ranks[i]) == group(first):
            continue
        rows.append(
            [
                rank_span(start, i - 1),
                first.device_type,
                str(first.micro_batch_size),
                str(first.gradient_accumulation_steps),
                str(first.samples_per_iteration),
                f"{busy[start]:.4g}",
                f"{100 * (1 - busy[start] / slowest):.1f}%",
            ]
            + (["on" if first.activation_checkpointing else "off"] if checkpointing else [])
            + (["on" if first.optimizer_offload else "off"] if offload else [])
        )
        start = i
    text = [result.message, "", table(rows)]
    if len(result.stage_reports) > 1:
        stage_rows = [["stage", "status", "global batch", "iteration s", "samples/s", "reason"]]
        for report in result.stage_reports:
            stage_rows.append(
                [
                    str(report.zero_stage),
                    report.status,
                    "-" if report.global_batch_size is None else str(report.global_batch_size),
                    "-" if report.iteration_time_s is None else f"{report.iteration_time_s:.4g}",
                    "-" if report.samples_per_s is None else f"{report.samples_per_s:.4g}",
                    report.reason,
                ]
            )
        text += ["", table(stage_rows)]
    return "\n".join(text)


def comparison_table(results: dict[str, SearchResult]) -> str:
    """One row per policy: stage, batch, predicted time and throughput, against poplar."""
    rows = [["policy", "status", "stage", "global batch", "iteration s", "samples/s", "of ideal", "poplar speed-up"]]
    reference = results["poplar"].plan
    for name, result in results.items():
        plan = result.plan
        if plan is None:
            rows.append([name, "infeasible", "-", "-", "-", "-", "-", result.message])
            continue
        predicted = plan.predicted
        versus = (
            "-"
            if name == "poplar" or reference is None
            else (f"{reference.predicted.samples_per_s / predicted.samples_per_s:.2f}x")
        )
        rows.append(
            [
                name,
                "ok",
                str(plan.zero_stage),
                str(plan.global_batch_size),
                f"{predicted.iteration_time_s:.4g}",
                f"{predicted.samples_per_s:.4g}",
                f"{100 * predicted.samples_per_s / predicted.ideal_samples_per_s:.1f}%",
                versus,
            ]
        )
    return table(rows)
