"""``poplar-bench overhead``: `poplar_ext.initialize` against raw `deepspeed.initialize` (docs/bench.md)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .cluster_files import write_uniform_cpu_job
from .report import code_lines, machine_description, progress, utc_now, write_json_and_markdown

GOAL_RATIO = 1.02
WORLD_SIZE = 2
MICRO_BATCH_SIZE = 4
ACCUMULATION_STEPS = 2
ZERO_STAGE = 1
MODEL_SHAPE = {"vocab_size": 256, "sequence_length": 32, "num_layers": 2, "num_heads": 2, "hidden_size": 64}


def _files(directory: Path) -> dict[str, Any]:
    """Cluster, uniform plan and the two DeepSpeed configs (the same apart from ``poplar``)."""
    cluster, plan = write_uniform_cpu_job(
        directory,
        world_size=WORLD_SIZE,
        micro_batch_size=MICRO_BATCH_SIZE,
        accumulation_steps=ACCUMULATION_STEPS,
        zero_stage=ZERO_STAGE,
    )
    raw = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": ACCUMULATION_STEPS,
        "train_batch_size": WORLD_SIZE * MICRO_BATCH_SIZE * ACCUMULATION_STEPS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": ZERO_STAGE},
        "steps_per_print": 10**9,
    }
    wrapped = dict(raw, poplar={"cluster": str(cluster), "plan": str(plan), "log_interval_steps": 0})
    return {"raw": raw, "wrapped": wrapped}


def _iterations(engine, batches, count: int) -> tuple[list[float], list[float]]:
    """Train `count` iterations; wall and process CPU time of each (step to step)."""
    wall, cpu = [], []
    last_wall, last_cpu = time.perf_counter(), time.process_time()
    while len(wall) < count:
        tokens = next(batches)
        engine.backward(engine(tokens))
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            now_wall, now_cpu = time.perf_counter(), time.process_time()
            wall.append(now_wall - last_wall)
            cpu.append(now_cpu - last_cpu)
            last_wall, last_cpu = now_wall, now_cpu
    return wall, cpu


def _rank_main(directory: str, blocks: int, block_iterations: int, warmup: int) -> dict[str, Any] | None:
    """One rank (spawned: a clean interpreter, as a user's job has); rank 0 returns the times."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import poplar_ext
    from poplar_ext.collectives import broadcast_from_rank0
    from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens

    from .local_ranks import endless_batches

    rank = dist.get_rank()
    configs = broadcast_from_rank0(_files(Path(directory)) if rank == 0 else None)
    shape = GPTConfig(**MODEL_SHAPE)
    data = SyntheticTokens(num_samples=4096, sequence_length=shape.sequence_length, vocab_size=shape.vocab_size)
    engines = {}
    model = GPT(shape)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=configs["raw"]
    )
    # The loader a user writes for raw DeepSpeed, in the main process like poplar_ext's
    # (DeepSpeed's own loader would start worker processes and measure those instead).
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH_SIZE, sampler=sampler)
    engines["raw"] = (engine, endless_batches(loader, "raw DeepSpeed's DataLoader (DistributedSampler)"))
    model = GPT(shape)
    engine, _, loader, _ = poplar_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
        training_data=data,
        config=configs["wrapped"],
    )
    engines["wrapped"] = (engine, endless_batches(loader, "poplar_ext.initialize's DataLoader"))
    times: dict[str, list[list[float]]] = {"raw": [], "wrapped": []}
    cpu_times: dict[str, list[float]] = {"raw": [], "wrapped": []}
    for block in range(blocks):
        # The order flips every block: whatever favours the first (or second) engine of
        # a block favours both alike.
        order = ("raw", "wrapped") if block % 2 == 0 else ("wrapped", "raw")
        for name in order:
            engine, batches = engines[name]
            wall, cpu = _iterations(engine, batches, warmup + block_iterations)
            times[name].append(wall[warmup:])
            cpu_times[name] += cpu[warmup:]
    dist.barrier()
    return {"blocks": times, "cpu": cpu_times} if rank == 0 else None


class _NoOpEngine:
    """Stands in for DeepSpeed's engine to time what the wrapper adds around it."""

    def __init__(self) -> None:
        self.micro_steps = 0
        self.global_steps = 0

    def __call__(self, x):
        return x

    def backward(self, loss, **kwargs):
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % ACCUMULATION_STEPS == 0

    def step(self) -> None:
        self.global_steps += self.is_gradient_accumulation_boundary()
        self.micro_steps += 1


def measure_wrapper_cost(*, iterations: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """CPU time the wrapper adds per iteration: the same loop on a bare no-op engine and through `PoplarEngine`
    (with the sampler), free of the noise of a real step."""
    import torch

    from poplar_ext.plan.formats import plan_from_dict
    from poplar_ext.runtime.config import poplar_config_from_dict
    from poplar_ext.runtime.data import PlanBatchSampler
    from poplar_ext.zero.engine import PoplarEngine

    with tempfile.TemporaryDirectory() as directory:
        _files(Path(directory))
        plan = plan_from_dict(json.loads((Path(directory) / "plan.json").read_text()))
    config = poplar_config_from_dict(
        {"cluster": "c.json", "plan": "p.json", "log_interval_steps": 0}, base_dir=Path(".")
    )
    sampler = PlanBatchSampler.from_plan(plan, rank=0, num_samples=4096)
    loss = torch.ones((), requires_grad=True)

    def loop(engine, with_sampler: bool) -> float:
        start = time.process_time()
        for iteration in range(iterations):
            if with_sampler:
                sampler.micro_batches(iteration)
            for _ in range(ACCUMULATION_STEPS):
                engine.backward(engine(loss))
                engine.step()
        return (time.process_time() - start) / iterations

    proxy = dict(plan=plan, rank=0, poplar_config=config, device_label="cpu (real)", slowdown=None)
    bare, wrapped = [], []
    for _ in range(repeats):
        bare.append(loop(_NoOpEngine(), with_sampler=False))
        wrapped.append(loop(PoplarEngine(_NoOpEngine(), **proxy), with_sampler=True))
    return {"added_cpu_per_iteration_s": statistics.median(wrapped) - statistics.median(bare)}


def run_overhead(
    *, blocks: int = 30, block_iterations: int = 8, warmup: int = 1, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Measure both engines (see docs/bench.md); returns the report as a dict."""
    from poplar_bench.local_ranks import run_ranks

    progress(
        f"{WORLD_SIZE} ranks: {blocks} blocks of {block_iterations} iterations per engine",
        bench="overhead",
    )
    with tempfile.TemporaryDirectory() as directory:
        times = run_ranks(
            _rank_main,
            world_size=WORLD_SIZE,
            log_dir=Path(directory) / "ranks",
            args=(directory, blocks, block_iterations, warmup),
            start_method="spawn",
            timeout_s=timeout_s,
            pg_timeout_s=120.0,
            capture_output=False,
        )[0]
    report = summarise(times["blocks"], times["cpu"], blocks=blocks, block_iterations=block_iterations, warmup=warmup)
    progress("the wrapper's own cost, around a no-op engine", bench="overhead")
    added_s = measure_wrapper_cost()["added_cpu_per_iteration_s"]
    report["wrapper_cost"] = {
        "added_cpu_per_iteration_s": added_s,
        "fraction_of_raw_median_iteration": added_s / report["raw_deepspeed"]["median_iteration_s"],
        "method": "the same loop around a no-op engine, bare and through PoplarEngine with the batch sampler; "
        "median of 5 repeats of 20000 iterations, process CPU time",
    }
    return report


def summarise(
    blocks_s: dict[str, list[list[float]]],
    cpu_s: dict[str, list[float]],
    *,
    blocks: int,
    block_iterations: int,
    warmup: int,
) -> dict[str, Any]:
    """The report from per-block wall times and per-iteration CPU times of both engines."""
    every_s = {name: [t for block in blocks for t in block] for name, blocks in blocks_s.items()}
    # Paired by block: the machine's load drifts slowly, so a block of one engine is
    # compared with the neighbouring block of the other.
    block_ratios = [statistics.median(w) / statistics.median(r) for r, w in zip(blocks_s["raw"], blocks_s["wrapped"])]
    ratio = statistics.median(block_ratios)
    return {
        "benchmark": "runtime_overhead",
        "created_utc": utc_now(),
        "machine": machine_description(),
        "device": f"CPU, {WORLD_SIZE} ranks (gloo), real devices (no emulation), one torch thread per rank",
        "method": (
            f"toy GPT {MODEL_SHAPE}, ZeRO stage {ZERO_STAGE}, fp32, AdamW, uniform micro-batch {MICRO_BATCH_SIZE} x "
            f"{ACCUMULATION_STEPS} accumulation steps per rank; data: DataLoader + DistributedSampler (raw) "
            f"and poplar_ext's dataloader, no worker processes; {blocks} blocks of {block_iterations} iterations per "
            f"engine (after {warmup} warm-up iterations each), alternating and flipping order every block; "
            "iteration = wall time between optimizer steps on rank 0; overhead ratio = median over blocks of "
            "(wrapper's block median / the paired raw block median); also the ratio of the medians of rank 0's "
            "process CPU time per iteration, which machine load disturbs less"
        ),
        **{
            key: {
                "median_iteration_s": statistics.median(every_s[name]),
                "median_cpu_per_iteration_s": statistics.median(cpu_s[name]),
                "iterations_s": every_s[name],
            }
            for key, name in (("raw_deepspeed", "raw"), ("poplar_ext", "wrapped"))
        },
        "block_ratios": block_ratios,
        "overhead_ratio": ratio,
        "cpu_time_ratio": statistics.median(cpu_s["wrapped"]) / statistics.median(cpu_s["raw"]),
        "goal": {
            "goal": "poplar_ext iteration time <= 1.02 x raw DeepSpeed's (median of paired blocks)",
            "target_ratio": GOAL_RATIO,
            "met": ratio <= GOAL_RATIO,
        },
        "load_average_1_5_15_min": list(os.getloadavg()),
    }


def _noise_note(report: dict[str, Any]) -> str:
    low, _, high = statistics.quantiles(report["block_ratios"], n=4)
    if high - low <= 2 * (GOAL_RATIO - 1):
        return "The paired block ratios are tight enough to resolve the 2% goal."
    return (
        f"Caution: the paired block ratios spread from {low:.3f} to {high:.3f} (interquartile), wider than the "
        "2% goal: on this machine at this load the wall-time figure cannot resolve 2%. The CPU-time ratio, "
        "which waiting for a core does not inflate, and the wrapper's own work timed in isolation (below) "
        "are the better estimates of the wrapper's cost."
    )


def _wrapper_cost_note(report: dict[str, Any]) -> str:
    cost = report.get("wrapper_cost")
    if cost is None:
        return ""
    return (
        f"The wrapper's own work, timed around a no-op engine ({cost['method']}): "
        f"{1e6 * cost['added_cpu_per_iteration_s']:.1f} us per iteration, "
        f"{100 * cost['fraction_of_raw_median_iteration']:.3f}% of raw DeepSpeed's median iteration here."
    )


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    libraries = machine["libraries"]
    goal = report["goal"]
    return "\n".join(
        [
            "# Runtime overhead: poplar_ext against raw DeepSpeed",
            "",
            f"- made {report['created_utc']} on {machine.get('cpu')} ({machine.get('usable_cpus')} usable CPUs), "
            f"torch {libraries.get('torch')}, deepspeed {libraries.get('deepspeed')}",
            *code_lines(machine),
            f"- device: {report['device']}",
            f"- {report['method']}",
            f"- load average (1, 5, 15 min) when the run ended: {report['load_average_1_5_15_min']}",
            "",
            "| engine | median iteration (ms) | median CPU time per iteration, rank 0 (ms) | iterations measured |",
            "| --- | ---: | ---: | ---: |",
            *(
                f"| {label} | {1000 * report[key]['median_iteration_s']:.2f} | "
                f"{1000 * report[key]['median_cpu_per_iteration_s']:.2f} | {len(report[key]['iterations_s'])} |"
                for key, label in (("raw_deepspeed", "raw DeepSpeed"), ("poplar_ext", "poplar_ext"))
            ),
            "",
            f"CPU-time ratio (poplar_ext / raw): {report['cpu_time_ratio']:.4f}. Paired block ratios: quartiles "
            f"{', '.join(f'{q:.3f}' for q in statistics.quantiles(report['block_ratios'], n=4))} "
            f"over {len(report['block_ratios'])} blocks (their spread is the machine's noise).",
            "",
            f"Overhead ratio (poplar_ext / raw, median of paired blocks): **{report['overhead_ratio']:.4f}**; goal <= "
            f"{goal['target_ratio']}: {'met' if goal['met'] else 'NOT met'}.",
            "",
            _noise_note(report),
            "",
            _wrapper_cost_note(report),
            "",
        ]
    )


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``runtime_overhead.json`` and ``runtime_overhead.md`` into `out_dir`; returns the paths."""
    return write_json_and_markdown(report, render_markdown(report), out_dir, "runtime_overhead")
