"""Compare the allocation policies by prediction on clusters of any size (pure: search + numpy/scipy, no torch).

Nothing here is a measurement; the report says so, and which profiles were modelled (docs/bench.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import POLICIES, ZERO_STAGES, Cluster, Profile, load_cluster
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.search import predict, search_plan

from . import gpu_model
from .report import (
    REPORT_SCHEMA,
    derive_comparisons,
    emulation_dict,
    group_ranks,
    infeasible_entry,
    machine_description,
    profile_curve,
    utc_now,
)

DEFAULT_SAMPLES_PER_RANK = 16


@dataclass(frozen=True, kw_only=True)
class SimulationCase:
    """One cluster with the profiles of its device types."""

    name: str
    """Scenario name shown in reports."""
    cluster: Cluster
    profiles: tuple[Profile, ...]
    """Profiles of every device type in the cluster (any stages the search should consider)."""
    global_batch_size: int | None
    """Samples per iteration; None lets each policy's search choose (not comparable across policies)."""
    zero_stage: str | int = "auto"
    """``auto`` (each policy keeps its fastest stage) or a stage 0-3."""
    cluster_file: str | None = None
    """Where the cluster came from, for the report."""
    network: NetworkProfile | None = None
    """Collective times that price communication at the cluster's size (None: the profiles' boundary as is)."""


def modelled_case(
    cluster: Cluster,
    shape: gpu_model.ModelShape,
    *,
    name: str,
    samples_per_rank: int = DEFAULT_SAMPLES_PER_RANK,
    zero_stage: str | int = "auto",
    cluster_file: str | None = None,
    assumptions: gpu_model.Assumptions | None = None,
    checkpointing: tuple[bool, ...] = (False,),
    offload: tuple[bool, ...] = (False,),
) -> SimulationCase:
    """A case whose profiles come from the analytic GPU model at the cluster's world size
    (with `checkpointing` ``(False, True)``: each type modelled without and with activation checkpointing;
    with `offload` ``(False, True)``: also with the optimizer offloaded, at stages 1-2)."""
    if samples_per_rank < 1:
        raise ValueError(f"samples_per_rank: expected an integer >= 1, found {samples_per_rank!r}")
    profiles = gpu_model.modelled_profiles(
        cluster.rank_device_types,
        shape,
        world_size=cluster.world_size,
        assumptions=assumptions,
        checkpointing=checkpointing,
        offload=offload,
    )
    return SimulationCase(
        name=name,
        cluster=cluster,
        profiles=tuple(profiles),
        global_batch_size=samples_per_rank * cluster.world_size,
        zero_stage=zero_stage,
        cluster_file=cluster_file,
        network=gpu_model.modelled_network(assumptions),
    )


def _search(case: SimulationCase, profiles: list[Profile], zero_stage: str | int, policy: str = "poplar") -> Any:
    return search_plan(
        profiles,
        case.cluster,
        global_batch_size=case.global_batch_size,
        zero_stage=zero_stage,
        policy=policy,
        network=case.network,
    )


def _device_sources(case: SimulationCase) -> dict[str, dict[str, Any]]:
    sources: dict[str, dict[str, Any]] = {}
    for device_type in case.cluster.type_counts():
        profile = next((p for p in case.profiles if p.device_type == device_type), None)
        emulation = case.cluster.emulation_of(device_type) or (profile.emulated if profile else None)
        modelled = profile is not None and profile.source == "modelled"
        source = "modelled" if modelled else "measured" if emulation is None else "emulated"
        sources[device_type] = {
            "source": source,
            # Who made a modelled profile: poplar_bench.gpu_model, or whatever its file says.
            "modelled_by": None
            if source != "modelled"
            else str(profile.measured_with.get("model", "unknown (see the profile's measured_with)")),
            "emulation": emulation_dict(emulation),
        }
    return sources


def curves_at_stage(
    profiles: tuple[Profile, ...] | list[Profile], device_types: list[str], zero_stage: int
) -> dict[str, list[dict[str, float]]]:
    """Each device type's profiled samples at `zero_stage`, with samples/s added."""
    at_stage = [p for p in profiles if p.zero_stage == zero_stage]
    return {t: next((profile_curve(p) for p in at_stage if p.device_type == t), []) for t in device_types}


def policy_entry(
    policy: str, result: Any, profiles: tuple[Profile, ...] | list[Profile], network: NetworkProfile | None = None
) -> dict[str, Any]:
    """A report entry for one policy's `SearchResult`, with its predicted per-rank busy times."""
    if result.status != "ok":
        return infeasible_entry(policy, result.status, result.message)
    plan = result.plan
    prediction = predict(plan, list(profiles), network)
    return {
        "policy": policy,
        "status": "ok",
        "message": result.message,
        "zero_stage": plan.zero_stage,
        "global_batch_size": plan.global_batch_size,
        # Consecutive alike ranks are merged (`count`): thousands of ranks stay readable.
        "ranks": group_ranks(
            [
                {
                    "rank": r.rank,
                    "device_type": r.device_type,
                    "micro_batch_size": r.micro_batch_size,
                    "gradient_accumulation_steps": r.gradient_accumulation_steps,
                    "predicted_busy_s": float(prediction.rank_busy_time_s[r.rank]),
                    "measured_busy_s": None,
                }
                for r in plan.ranks
            ]
        ),
        "predicted": {
            "iteration_time_s": float(prediction.iteration_time_s),
            "samples_per_s": float(prediction.samples_per_s),
        },
        "ideal_samples_per_s": plan.predicted.ideal_samples_per_s,
        "measured": None,
    }


def simulate_case(case: SimulationCase, *, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Run the search for every policy on one case; returns a report scenario."""
    profiles = list(case.profiles)
    entries = [
        policy_entry(policy, _search(case, profiles, case.zero_stage, policy), profiles, case.network)
        for policy in policies
    ]
    ok = [e for e in entries if e["status"] == "ok"]
    # Policies may settle on different stages; the ideal is the best any stage allows.
    ideal = max((e["ideal_samples_per_s"] for e in ok), default=None)
    featured = next((e for e in ok if e["policy"] == "poplar"), ok[0] if ok else None)
    device_types = list(case.cluster.type_counts())
    first = profiles[0]
    scenario = {
        "name": case.name,
        "cluster": {
            "world_size": case.cluster.world_size,
            "type_counts": case.cluster.type_counts(),
            "file": case.cluster_file,
        },
        "model": {"name": first.model.name, "num_parameters": first.model.num_parameters},
        "device_types": _device_sources(case),
        "global_batch_size": featured["global_batch_size"] if featured else case.global_batch_size,
        "ideal_samples_per_s": {"predicted": ideal, "measured": None},
        "curves": curves_at_stage(profiles, device_types, featured["zero_stage"]) if featured else {},
        "curves_kind": "profile",
        "policies": entries,
        "goals": [],
    }
    return derive_comparisons(scenario)


STOPS_PAYING_SHARE = 0.9
"""A stage stops paying at the first cluster size where its throughput per GPU falls
below this share of what it gives on the smallest cluster of the series."""


def scaling_series(cases: list[SimulationCase]) -> list[dict[str, Any]]:
    """Poplar at each ZeRO stage alone, as the cluster grows: one series per (device pair, model), whose cases
    differ only in size (shipped files ``<pair>-x<N>.json``); where each stage stops paying (`STOPS_PAYING_SHARE`)."""
    groups: dict[tuple[str, str], list[SimulationCase]] = {}
    for case in cases:
        stem = Path(case.cluster_file).stem.rpartition("-x")[0] if case.cluster_file else case.name
        groups.setdefault((stem or case.name, case.profiles[0].model.name), []).append(case)
    series = []
    for (pair, model_name), members in groups.items():
        rows = []
        for case in sorted(members, key=lambda c: c.cluster.world_size):
            world_size = case.cluster.world_size
            stages: dict[str, Any] = {}
            for stage in ZERO_STAGES:
                result = _search(case, list(case.profiles), stage)
                if not result.ok:
                    stages[str(stage)] = {"status": "infeasible", "reason": result.message}
                    continue
                prediction = predict(result.plan, list(case.profiles), case.network)
                steps = max(r.gradient_accumulation_steps for r in result.plan.ranks)
                communication_s = prediction.micro_step_communication_s * steps + prediction.boundary_communication_s
                stages[str(stage)] = {
                    "status": "ok",
                    "samples_per_s_per_gpu": prediction.samples_per_s / world_size,
                    "share_of_ideal": prediction.samples_per_s / prediction.ideal_samples_per_s,
                    "communication_share": communication_s / prediction.iteration_time_s,
                    "iteration_time_s": prediction.iteration_time_s,
                }
            feasible = {k: v for k, v in stages.items() if v["status"] == "ok"}
            best = max(feasible, key=lambda k: feasible[k]["samples_per_s_per_gpu"]) if feasible else None
            rows.append(
                {
                    "world_size": world_size,
                    "global_batch_size": case.global_batch_size,
                    "stages": stages,
                    "fastest_stage": None if best is None else int(best),
                }
            )
        stops = {}
        for stage in map(str, ZERO_STAGES):
            cells = [(r["world_size"], r["stages"][stage]) for r in rows if r["stages"][stage]["status"] == "ok"]
            rates = [(size, cell["samples_per_s_per_gpu"]) for size, cell in cells]
            stops[stage] = next((size for size, rate in rates if rate < STOPS_PAYING_SHARE * rates[0][1]), None)
        series.append(
            {
                "name": f"{pair}, {model_name}",
                "rows": rows,
                "stops_paying_at_world_size": stops,
                "network": None if members[0].network is None else members[0].network.measured_with,
            }
        )
    return series


def simulation_report(
    cases: list[SimulationCase],
    *,
    title: str = "poplar-bench simulate: policies compared by prediction",
    scaling: bool = True,
    checkpointing_cases: list[SimulationCase] | None = None,
    parallelism: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A full report over `cases` (see `poplar_bench.report` for the layout); with `scaling`, each stage as clusters
    grow; with `checkpointing_cases` (profiled both ways), `checkpointing_effect` on them, and `offload_effect`
    where they also have offloaded profiles; with `parallelism` (`poplar_bench.simulate_pipelines`), ZeRO against
    pipelines."""
    scenarios = [simulate_case(case) for case in cases]
    modelled: dict[str, set[str]] = {}
    measured = False
    for scenario in scenarios:
        for device_type, info in scenario["device_types"].items():
            if info["source"] == "modelled":
                modelled.setdefault(info["modelled_by"], set()).add(device_type)
            measured = measured or info["source"] != "modelled"
    networks = {c.network.measured_with.get("note", c.network.source) for c in cases if c.network is not None}
    # Measured profiles were run, on their devices, before: this report ran nothing.
    ran = " for this report (its measured profiles were, before)" if measured else ""
    emulated = sorted({p.device_type for c in cases for p in c.profiles if p.emulated is not None})
    devices = "devices" if emulated else "GPUs"
    notes = [f"Every figure is a prediction of the search's cost model; nothing was run on these {devices}{ran}."]
    if emulated:
        notes.append(
            f"Profiles of {', '.join(emulated)} were measured on EMULATED devices (a CPU slowed down, its memory "
            "capped: poplar_ext.hardware.emulation), not on the devices they name."
        )
    notes += [
        f"Communication is priced by a network model for each cluster's size: MODELLED network ({note})."
        for note in sorted(networks)
    ]
    for modelled_by, types in sorted(modelled.items()):
        how = (
            "from vendor datasheet figures with the assumptions in poplar_bench.gpu_model (assumed MFU, network "
            "bandwidth, overheads)"
            if modelled_by == gpu_model.MODEL_VERSION
            else f"by {modelled_by}"
        )
        notes.append(f"Profiles of {', '.join(sorted(types))} are MODELLED {how}, not measured.")
    return {
        "schema": REPORT_SCHEMA,
        "kind": "simulation",
        "title": title,
        "created_utc": utc_now(),
        "machine": machine_description(),
        "data_source": "predicted" + (" from modelled profiles" if modelled else " from the given profiles"),
        "notes": notes,
        "scenarios": scenarios,
        **({"scaling": scaling_series(cases)} if scaling else {}),
        **({"checkpointing": checkpointing_effect(checkpointing_cases)} if checkpointing_cases else {}),
        **(
            {"offload": offload_effect(checkpointing_cases)}
            if checkpointing_cases and any(p.optimizer_offload for c in checkpointing_cases for p in c.profiles)
            else {}
        ),
        **({"parallelism": parallelism} if parallelism else {}),
    }


def shipped_cases(
    cluster_files: list[Path],
    shapes: list[gpu_model.ModelShape],
    *,
    samples_per_rank: int = DEFAULT_SAMPLES_PER_RANK,
    zero_stage: str | int = "auto",
    checkpointing: tuple[bool, ...] = (False,),
    offload: tuple[bool, ...] = (False,),
) -> list[SimulationCase]:
    """Modelled cases for every (cluster file, model shape)."""
    return [
        modelled_case(
            load_cluster(path),
            shape,
            name=f"{Path(path).stem}, {shape.name}",
            samples_per_rank=samples_per_rank,
            zero_stage=zero_stage,
            cluster_file=str(path),
            checkpointing=checkpointing,
            offload=offload,
        )
        for shape in shapes
        for path in cluster_files
    ]


CHECKPOINTING_CLUSTERS = "v100-16gb+t4-16gb"
"""The shipped clusters whose small memories make the memory levers worth showing."""


def checkpointing_effect(cases: list[SimulationCase]) -> list[dict[str, Any]]:
    """For cases profiled both ways: poplar with the per-type checkpointing choice against poplar without it, at
    each stage and ``auto``: a row holds both's predicted samples/s, which types checkpoint and each type's
    micro-batch (offloaded profiles left out of both: `offload_effect` shows that lever)."""
    return _lever_effect(cases, allowed=lambda p: not p.optimizer_offload)


def offload_effect(cases: list[SimulationCase]) -> list[dict[str, Any]]:
    """As `checkpointing_effect`, for optimizer offload: poplar with the per-type offload choice
    (no checkpointing) against poplar with neither lever."""
    return _lever_effect(cases, allowed=lambda p: not p.activation_checkpointing)


def _lever_effect(cases: list[SimulationCase], *, allowed: Any) -> list[dict[str, Any]]:
    """poplar over the profiles `allowed` keeps against poplar over those with no memory lever."""
    rows = []
    for case in cases:
        plain = [p for p in case.profiles if p.levers == (False, False)]
        chosen_from = [p for p in case.profiles if allowed(p)]
        row: dict[str, Any] = {
            "name": case.name,
            "world_size": case.cluster.world_size,
            "global_batch_size": case.global_batch_size,
            "stages": {},
        }
        for stage in ("auto", *ZERO_STAGES):
            cell: dict[str, Any] = {}
            for label, profiles in (("with_choice", chosen_from), ("without", plain)):
                result = _search(case, profiles, stage)
                if not result.ok:
                    cell[label] = {"status": "infeasible"}
                    continue
                plan = result.plan
                kept = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing")
                by_type: dict[str, dict[str, Any]] = {}
                for r in plan.ranks:
                    by_type.setdefault(r.device_type, {k: getattr(r, k) for k in (*kept, "optimizer_offload")})
                cell[label] = {
                    "status": "ok",
                    "zero_stage": plan.zero_stage,
                    "samples_per_s": plan.predicted.samples_per_s,
                    "types": by_type,
                }
            both = cell["with_choice"], cell["without"]
            cell["gain"] = (
                both[0]["samples_per_s"] / both[1]["samples_per_s"] if all(c["status"] == "ok" for c in both) else None
            )
            row["stages"][str(stage)] = cell
        rows.append(row)
    return rows
