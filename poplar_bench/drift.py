"""`poplar-bench drift`: static poplar against adaptive (``poplar.rebalance``) when a device drifts. See
docs/bench.md (the four runs, the ideal of each moment, the goals)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import write_json_atomic

from .demo_config import DemoSettings
from .drift_settings import DriftSettings, plan_history, poplar_section, timed_rebalancing
from .report import code_text

RUNS = ("static-drift", "adaptive-drift", "static-steady", "adaptive-steady")  # policy-scenario, in order
LOOP_TEXT = {
    "plain": "poplar_ext.initialize and a hand-written loop on the demo's toy GPT, one plan file searched on profiles "
    "measured first; iteration time from a barrier to the rank's last optimizer step, the slowest rank's",
    "trainer": "PoplarTrainer (transformers.Trainer) on a GPT-2 of the same shape from GPT2Config (random weights), "
    "in its automatic mode (profiles from the cache, measured by the first run where missing; the plan searched at "
    "the start of every run); "
    "iteration time: PoplarEngine.last_iteration_time_s (optimizer step to optimizer step, the Trainer's own "
    "per-step work included), the slowest rank's",
}
"""What trained, per `DriftSettings.loop`."""
SHARE_GOAL = 0.9
COST_GOAL = 0.01


# --- The ranks (forked by poplar_bench.demo.run_ranks) ---
def _run_rank(settings: DriftSettings, work: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from poplar_ext.plan.formats import cluster_from_dict, cluster_to_dict, save_cluster, save_plan
    from poplar_ext.plan.network_format import find_network

    from . import demo_worker
    from .report import progress

    rank = dist.get_rank()
    trainer = settings.loop == "trainer"
    if trainer:
        # Imported by each rank, not before the fork, and before the memory baseline is measured: a forked rank's
        # resident memory holds only the parent's pages it has touched since, and the Trainer touches many.
        from poplar_ext.integrations import transformers  # noqa: F401
    plain_path = work / "cluster.json"
    cluster = demo_worker.agreed_cluster(settings, plain_path)
    progress(
        f"{'PoplarTrainer profiles' if trainer else 'profiling'} {', '.join(cluster.type_counts())} at ZeRO stage "
        f"{settings.zero_stage}{' in its first run' if trainer else ''} (cache: {settings.profiles_dir()})",
        "drift",
        rank,
    )
    profiles = [] if trainer else demo_worker.profile_devices(settings, plain_path)[0]
    drifting_path = work / "cluster-drift.json"
    if rank == 0:
        data = cluster_to_dict(cluster)
        drifting_type = cluster.rank_device_types[settings.drift_rank]
        emulation = data["device_types"][drifting_type]["emulation"]
        emulation["slowdown_schedule"] = settings.schedule(emulation["slowdown"])
        save_cluster(cluster_from_dict(data), drifting_path)
        if not trainer:
            network = find_network(settings.profiles_dir(), cluster)
            result = demo_worker.search_policies(settings, profiles, cluster, network, policies=("poplar",))["poplar"]
            if result.status != "ok":
                raise RuntimeError(f"no poplar plan for the drift bench: {result.message}")
            save_plan(result.plan, work / "plan.json")
    dist.barrier()

    from . import drift_trainer

    train = drift_trainer.train if trainer else _train
    runs = {}
    for run in RUNS:
        progress(f"{run}: {settings.drift_iterations} iterations", "drift", rank)
        path = drifting_path if run.endswith("-drift") else plain_path
        runs[run] = train(settings, work, cluster_path=path, adaptive=run.startswith("adaptive"))
    progress("measuring each rank's standalone throughput (the ideal)", "drift", rank)
    device_type = cluster.rank_device_types[rank]
    if trainer:
        standalone = drift_trainer.measure_standalone(settings, cluster, rank)
    else:
        profile = next(p for p in profiles if p.device_type == device_type)
        standalone = demo_worker.measure_standalone(settings, cluster, rank, profile)
    dist.barrier()
    return {
        "rank": rank,
        "device_type": device_type,
        "runs": runs,
        "standalone": standalone,
        "slowdown": cluster.emulation_of(device_type).slowdown,
    }


def _train(settings: DriftSettings, work: Path, *, cluster_path: Path, adaptive: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import poplar_ext
    from poplar_ext.models.toy_gpt import SyntheticTokens

    from . import demo_worker
    from .local_ranks import endless_batches

    config = demo_worker.deepspeed_config(settings)
    config["poplar"] = {
        **poplar_section(settings, cluster_path=cluster_path, adaptive=adaptive),
        "plan": str(work / "plan.json"),
    }
    model = demo_worker.make_model(settings)
    engine, _, _, _ = poplar_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = SyntheticTokens(
        num_samples=settings.global_batch_size * 4,
        sequence_length=settings.model.sequence_length,
        vocab_size=settings.model.vocab_size,
        seed=settings.seed,
    )
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))
    hook_s = timed_rebalancing(engine)
    iteration_s: list[float] = []
    stream = endless_batches(loader, "the drift run's DataLoader (engine.create_batch_sampler)")
    warmup = 1
    for index in range(warmup + settings.drift_iterations):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(engine.rank_plan.gradient_accumulation_steps):
            engine.backward(engine(next(stream)))
            engine.step()
        if index >= warmup:
            iteration_s.append(time.perf_counter() - start)
        if index == warmup - 1:
            hook_s[0] = 0.0
    return {
        "iteration_s": iteration_s,
        "rebalance_hook_s": hook_s[0],
        "history": plan_history(engine),
        "warmup_iterations": warmup,
    }


# --- The report (pure) ---
def summarize(settings: DriftSettings, rank_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-iteration throughput, the ideal of each moment, re-plans and the goals."""
    from .demo import measured_ideal_samples_per_s

    # Each rank's best standalone throughput, as the demo's measured ideal counts it.
    best = [measured_ideal_samples_per_s([r]) for r in rank_results]
    runs: dict[str, Any] = {}
    batch = settings.global_batch_size
    warmup = rank_results[0]["runs"][RUNS[0]]["warmup_iterations"]
    for run in RUNS:
        scenario = run.split("-")[1]
        # The iteration that ran after `step` optimizer steps is step + 1; its time is the slowest rank's.
        times = [max(values) for values in zip(*(r["runs"][run]["iteration_s"] for r in rank_results))]
        steps_done = [warmup + i for i in range(len(times))]
        drifted = [scenario == "drift" and settings.drift_at <= step < settings.recover_at for step in steps_done]
        ideal = [
            sum(b / (settings.factor if d and rank == settings.drift_rank else 1.0) for rank, b in enumerate(best))
            for d in drifted
        ]
        rate = [batch / t for t in times]
        hook_s = max(r["runs"][run]["rebalance_hook_s"] for r in rank_results)
        runs[run] = {
            "steps_done": steps_done,
            "iteration_time_s": times,
            "samples_per_s": rate,
            "ideal_samples_per_s": ideal,
            "share_of_ideal": [r / i for r, i in zip(rate, ideal)],
            "plan_history": rank_results[0]["runs"][run]["history"],
            "replans": len(rank_results[0]["runs"][run]["history"]) - 1,
            "rebalance_cost_share": hook_s / sum(times) if times else None,
        }
    demo_fields = {f.name for f in dataclasses.fields(DemoSettings)}
    adaptive = runs["adaptive-drift"]
    deadline = settings.drift_at + 2 * settings.check_interval_steps
    reached = next(
        (
            step
            for step, share in zip(adaptive["steps_done"], adaptive["share_of_ideal"])
            if settings.drift_at <= step < settings.recover_at and share >= SHARE_GOAL
        ),
        None,
    )
    window, static_window = (
        [s for step, s in zip(run["steps_done"], run["share_of_ideal"]) if deadline <= step < settings.recover_at]
        for run in (adaptive, runs["static-drift"])
    )
    steady = runs["adaptive-steady"]
    goals = [
        {
            "goal": "adaptive reaches >= 0.9 of the new ideal within two check intervals of the change",
            "value": None if not window else statistics.median(window),
            "detail": f"median share over iterations {deadline + 1}-{settings.recover_at} (static: "
            f"{statistics.median(static_window) if static_window else float('nan'):.3f}); first iteration at >= 0.9: "
            f"{'none' if reached is None else reached + 1}",
            "met": bool(window) and statistics.median(window) >= SHARE_GOAL,
        },
        {
            "goal": "without drift, re-balancing costs <= 1% of iteration time",
            "value": steady["rebalance_cost_share"],
            "detail": "time inside the per-step hook (with its collectives) / iteration time",
            "met": steady["rebalance_cost_share"] is not None and steady["rebalance_cost_share"] <= COST_GOAL,
        },
        {"goal": "without drift, no re-plan", "value": steady["replans"], "detail": "", "met": steady["replans"] == 0},
    ]
    return {
        "kind": "drift",
        "devices": "emulated CPU ranks (real DeepSpeed ZeRO, gloo); the ideal from each rank's measured standalone "
        "throughput, the drifted rank's divided by its factor",
        "loop": LOOP_TEXT[settings.loop],
        "model": dataclasses.asdict(settings.model),
        # The drift's own settings, with the demo's stage and batch.
        "settings": {
            k: v
            for k, v in dataclasses.asdict(settings).items()
            if k not in demo_fields or k in ("zero_stage", "global_batch_size")
        },
        "device_types": [r["device_type"] for r in rank_results],
        "standalone_best_samples_per_s": best,
        "runs": runs,
        "goals": goals,
    }


def render_markdown(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        "# Drift: static poplar against adaptive re-balancing"
        + (" through the Hugging Face Trainer" if s.get("loop") == "trainer" else ""),
        "",
        *_provenance_lines(summary),
        f"Devices: {summary['devices']}. Rank {s['drift_rank']} ({summary['device_types'][s['drift_rank']]}) runs "
        f"{s['factor']}x slower from optimizer step {s['drift_at']} to {s['recover_at']}; ZeRO stage "
        f"{s['zero_stage']}, global batch {s['global_batch_size']}; checks every {s['check_interval_steps']} steps, "
        f"threshold {s['threshold']}, {s['sustained_checks']} sustained checks, minimum gain {s['min_gain']}.",
        "",
        "## Goals",
        "",
    ]
    for goal in summary["goals"]:
        value = goal["value"]
        shown = "n/a" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))
        lines.append(f"- {goal['goal']}: **{shown}** ({'met' if goal['met'] else 'NOT met'}). {goal['detail']}")
    lines += [
        "",
        "## Runs",
        "",
        "| run | re-plans | median samples/s | median share of ideal | re-balancing cost |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run, data in summary["runs"].items():
        cost = data["rebalance_cost_share"]
        lines.append(
            f"| {run} | {data['replans']} | {statistics.median(data['samples_per_s']):.1f} | "
            f"{statistics.median(data['share_of_ideal']):.3f} | {'' if not cost else f'{100 * cost:.2f}%'} |"
        )
    lines += ["", "## Plans of the adaptive run with drift", ""]
    lines += [
        f"- from step {h['start_step']}: {h['allocation']} ({h['reason']})"
        for h in summary["runs"]["adaptive-drift"]["plan_history"]
    ]
    lines += [
        "",
        "## Per iteration (samples/s; ideal in brackets)",
        "",
        "| iteration | " + " | ".join(RUNS) + " |",
        "| --- |" + " --- |" * len(RUNS),
    ]
    runs = [summary["runs"][run] for run in RUNS]
    for index, step in enumerate(runs[0]["steps_done"]):
        cells = [f"{r['samples_per_s'][index]:.1f} ({r['ideal_samples_per_s'][index]:.0f})" for r in runs]
        lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _provenance_lines(summary: dict[str, Any]) -> list[str]:
    """What trained, on which machine and under what load (reports before these were recorded have none)."""
    lines = []
    if "loop" in summary:
        m = summary["model"]
        lines += [
            f"Training: {summary['loop']}. Model: {m['num_layers']} layers, width {m['hidden_size']}, "
            f"{m['num_heads']} heads, {m['sequence_length']} tokens, vocabulary {m['vocab_size']}.",
            "",
        ]
    machine = summary.get("machine")
    if machine:
        load = " / ".join(f"{x:.1f}" for x in summary["load_average_at_start"])
        end = " / ".join(f"{x:.1f}" for x in machine["load_average"])
        lines += [
            f"Machine: {machine['hostname']} ({machine['cpu']}, {machine['usable_cpus']} usable CPUs, GPUs: "
            f"{machine.get('gpus') or 'none'}), shared with other work: load average (1 / 5 / 15 min) {load} at the "
            f"start, {end} at the end; the run took {summary['total_s']:.0f} s."
            + (f" The {code}." if (code := code_text(machine)) else ""),
            "",
        ]
    return lines


def render_figure(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for run, style in zip(RUNS, ("-", "-", ":", ":")):
        data = summary["runs"][run]
        axis.plot([s + 1 for s in data["steps_done"]], data["samples_per_s"], style, label=run)
    drift = summary["runs"]["static-drift"]
    iterations = [s + 1 for s in drift["steps_done"]]
    axis.plot(iterations, drift["ideal_samples_per_s"], "k--", linewidth=1, label="ideal (drift)")
    axis.set_xlabel("iteration")
    axis.set_ylabel("samples/s")
    through = " (PoplarTrainer)" if summary["settings"].get("loop") == "trainer" else ""
    axis.set_title(f"Drift on emulated CPU ranks{through}: static poplar vs adaptive re-balancing")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_drift(settings: DriftSettings, *, out_dir: Path, name: str = "drift") -> list[Path]:
    """Run the four runs and write NAME.json, NAME.md and (with matplotlib) NAME.png."""
    import tempfile

    from . import demo
    from .report import machine_description, write_json_and_markdown

    started = time.perf_counter()
    load_at_start = list(os.getloadavg())
    demo.preimport()
    with tempfile.TemporaryDirectory(prefix="poplar-drift-") as tmp:
        rank_results = demo.run_ranks(settings, Path(tmp), target=_run_rank, pg_timeout_s=300.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Minutes of measurement: kept before anything else can fail.
    write_json_atomic(rank_results, out_dir / f"{name}.ranks.json")
    summary = summarize(settings, rank_results)
    summary["total_s"] = time.perf_counter() - started
    summary["load_average_at_start"] = load_at_start
    summary["machine"] = machine_description()
    paths = write_json_and_markdown(summary, render_markdown(summary), out_dir, name, figure=render_figure)
    for goal in summary["goals"]:
        demo.progress(f"goal {goal['goal']}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})", "drift")
    return paths


__all__ = ["RUNS", "DriftSettings", "render_markdown", "run_drift", "summarize"]
