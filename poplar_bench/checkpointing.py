"""`poplar-bench checkpointing`: activation checkpointing chosen per device type, measured. See docs/bench.md."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .demo_config import MIB, DemoDevice, DemoModel, DemoSettings
from .report import made_line

PLANS = ("poplar", "poplar-no-checkpointing")
CASES = ("tight", "roomy")
# What the report keeps of each rank of a plan.
RANK_KEYS = ("device_type", "micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing")


def case_settings(case: str, *, cache_dir: Path | None = None, rounds: int = 3) -> DemoSettings:
    """The demo's settings for one case (its own profile cache: the clusters differ)."""
    if case not in CASES:
        raise ValueError(f"case: expected one of {', '.join(CASES)}, found {case!r}")
    # The optimizer step alone peaks ~70 MiB above the rounded baseline on this model; a
    # plain micro-step adds ~9 MiB per sample, a checkpointed one ~3 MiB.
    fast_headroom = 96 * MIB if case == "tight" else 768 * MIB
    devices = tuple(
        DemoDevice(name=name, slowdown=slowdown, memory_headroom_bytes=fast_headroom if slowdown == 3.0 else 768 * MIB)
        for name, slowdown in (("cpu-fast", 3.0), ("cpu-medium", 6.0), ("cpu-slow", 12.0))
    )
    root = cache_dir if cache_dir is not None else DemoSettings().cache_root().parent / "checkpointing"
    return DemoSettings(
        devices=devices,
        # 8 blocks of 128 tokens: ~8 MiB of activations per sample without checkpointing.
        model=DemoModel(vocab_size=256, sequence_length=128, num_layers=8, num_heads=4, hidden_size=128),
        zero_stage=2,
        global_batch_size=96,
        max_micro_batch_size=32,
        profile_repeats=3,
        iterations=2,
        warmup_iterations=1,
        rounds=rounds,
        cache_dir=Path(root) / case,
        activation_checkpointing="both",
        timeout_s=1800.0,
    )


# --- The ranks (forked by poplar_bench.demo.run_ranks) ---
def _run_rank(settings: DemoSettings, work: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from poplar_ext.plan.formats import read_json, write_json_atomic

    from . import demo_worker
    from .report import progress

    rank = dist.get_rank()
    cluster_path = work / "cluster.json"
    cluster = demo_worker.agreed_cluster(settings, cluster_path)
    progress(
        f"profiling {', '.join(cluster.type_counts())} at ZeRO stage {settings.zero_stage} without and with "
        f"activation checkpointing (cache: {settings.profiles_dir()})",
        "checkpointing",
        rank,
    )
    profiles, _ = demo_worker.profile_devices(settings, cluster_path)
    if rank == 0:
        write_json_atomic(search_plans(settings, profiles, cluster, work), work / "plans.json")
    dist.barrier()
    plans = read_json(work / "plans.json")
    runs = {name: demo_worker.build_engine(settings, cluster_path, work / f"plan-{name}.json") for name in PLANS}
    measured = demo_worker.train_rounds(settings, runs, rank, "checkpointing")
    dist.barrier()
    return {
        "rank": rank,
        "device_type": cluster.rank_device_types[rank],
        "iteration_time_s": {name: m["iteration_time_s"] for name, m in measured.items()},
        "plans_seen": sorted(plans),
    }


def search_plans(settings: DemoSettings, profiles: list[Any], cluster: Any, work: Path) -> dict[str, Any]:
    """Rank 0: both plans, written to ``plan-<name>.json``, and what the report needs of them."""
    from poplar_ext.plan.formats import plan_to_dict, save_plan
    from poplar_ext.plan.network_format import find_network

    from .demo_worker import search_policies

    network = find_network(settings.profiles_dir(), cluster)
    out: dict[str, Any] = {
        "profiles": [
            {
                "device_type": p.device_type,
                "activation_checkpointing": p.activation_checkpointing,
                "max_micro_batch_size": p.max_micro_batch_size,
                "curve": [[s.micro_batch_size, s.micro_step_time_s, s.peak_memory_bytes] for s in p.samples],
                "memory_capacity_bytes": p.memory_capacity_bytes,
            }
            for p in profiles
        ]
    }
    without = [p for p in profiles if not p.activation_checkpointing]
    for name, chosen_from in zip(PLANS, (profiles, without)):
        result = search_policies(settings, chosen_from, cluster, network, policies=("poplar",))["poplar"]
        if not result.ok:
            raise RuntimeError(f"no {name} plan: {result.message}")
        save_plan(result.plan, work / f"plan-{name}.json")
        out[name] = {"message": result.message, "plan": plan_to_dict(result.plan)}
    return out


# --- The parent ---
def run_case(case: str, *, cache_dir: Path | None = None, rounds: int = 3) -> dict[str, Any]:
    """Profile, plan and train one case; its part of the report."""
    from poplar_ext.plan.formats import read_json

    from .demo import measured_iteration_times_s, run_ranks

    settings = case_settings(case, cache_dir=cache_dir, rounds=rounds)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"poplar-checkpointing-{case}-") as tmp:
        results = run_ranks(settings, Path(tmp), target=_run_rank, pg_timeout_s=600.0)
        plans = read_json(Path(tmp) / "plans.json")
    rank_results = [{"policies": {n: {"iteration_time_s": r["iteration_time_s"][n]} for n in PLANS}} for r in results]
    out: dict[str, Any] = {
        "case": case,
        "settings": {
            "devices": [dataclasses.asdict(d) for d in settings.devices],
            "model": dataclasses.asdict(settings.model),
            "zero_stage": settings.zero_stage,
            "global_batch_size": settings.global_batch_size,
            "iterations_per_round": settings.iterations,
            "rounds": settings.rounds,
        },
        "profiles": plans["profiles"],
        "plans": {},
        "wall_s": None,
    }
    for name in PLANS:
        times = measured_iteration_times_s(rank_results, name)
        plan = plans[name]["plan"]
        out["plans"][name] = {
            "message": plans[name]["message"],
            "ranks": [{k: r[k] for k in RANK_KEYS} for r in plan["ranks"]],
            "predicted_samples_per_s": plan["predicted"]["samples_per_s"],
            "measured_iteration_times_s": times,
            "measured_samples_per_s": settings.global_batch_size / statistics.median(times),
        }
    chosen, without = (out["plans"][name] for name in PLANS)
    out["checkpointed_types"] = sorted({r["device_type"] for r in chosen["ranks"] if r["activation_checkpointing"]})
    out["measured_ratio"] = chosen["measured_samples_per_s"] / without["measured_samples_per_s"]
    out["predicted_ratio"] = chosen["predicted_samples_per_s"] / without["predicted_samples_per_s"]
    out["wall_s"] = time.perf_counter() - started
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Activation checkpointing per device type (poplar-bench checkpointing)",
        "",
        report["data_source"],
        "",
        made_line(report.get("created_utc"), report.get("machine")),
        "",
        "| case | plan | checkpointing on | per-rank micro-batch x steps | predicted samples/s | measured samples/s |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for case in report["cases"]:
        for name in PLANS:
            plan = case["plans"][name]
            on = ", ".join(r["device_type"] for r in plan["ranks"] if r["activation_checkpointing"]) or "none"
            shape = ", ".join(f"{r['micro_batch_size']}x{r['gradient_accumulation_steps']}" for r in plan["ranks"])
            lines.append(
                f"| {case['case']} | {name} | {on} | {shape} | {plan['predicted_samples_per_s']:.2f} | "
                f"{plan['measured_samples_per_s']:.2f} |"
            )
    lines += ["", "Largest micro-batch per profile (without / with checkpointing):", ""]
    for case in report["cases"]:
        caps: dict[str, dict[bool, int]] = {}
        for p in case["profiles"]:
            caps.setdefault(p["device_type"], {})[p["activation_checkpointing"]] = p["max_micro_batch_size"]
        shown = "; ".join(f"{t} {c.get(False)} / {c.get(True)}" for t, c in caps.items())
        lines.append(f"- {case['case']}: {shown}")
    lines += ["", "Measured: poplar (with the choice) against the best plan without checkpointing:", ""]
    for case in report["cases"]:
        types = ", ".join(case["checkpointed_types"]) or "no type"
        lines.append(
            f"- {case['case']}: the search checkpoints {types}; measured {case['measured_ratio']:.3f}x, "
            f"predicted {case['predicted_ratio']:.3f}x"
        )
    lines += ["", report["notes"], ""]
    return "\n".join(lines)


def run_checkpointing(*, out_dir: Path, cache_dir: Path | None = None, rounds: int = 3) -> list[Path]:
    """Both cases; writes ``checkpointing.json`` and ``checkpointing.md`` into `out_dir`."""
    from .report import machine_description, progress, write_json_and_markdown

    cases = []
    for case in CASES:
        progress(f"case {case}", "checkpointing")
        cases.append(run_case(case, cache_dir=cache_dir, rounds=rounds))
    report = {
        "kind": "checkpointing",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_description(),
        "data_source": "Measured on emulated devices: 3 CPU ranks (gloo, one thread each), compute slowed 3x/6x/12x "
        "against a core, memory capped by emulation (the profiler's process peak against the emulated "
        "capacity); real DeepSpeed 0.19.8 ZeRO-2, the project's toy GPT with random weights.",
        "notes": "Each plan trains `rounds` rounds of `iterations_per_round` iterations after a warm-up iteration per "
        "round, alternating with the other plan in the same processes; measured samples/s is the global "
        "batch over the median of the slowest rank's iteration times.",
        "cases": cases,
    }
    return write_json_and_markdown(report, markdown(report), out_dir, "checkpointing")


__all__ = ["CASES", "PLANS", "case_settings", "run_case", "run_checkpointing", "search_plans"]
