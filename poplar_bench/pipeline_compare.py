"""`poplar-bench pipeline`: the best ZeRO plan against the best pipeline plan, measured and predicted, on an
emulated CPU cluster of two nodes joined by a slow link and by a fast one. See docs/bench.md."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report as report_module

DIM = 768
NUM_LAYERS = 8
GLOBAL_BATCH = 48
FAST_SLOWDOWN = 6.0
SLOW_SLOWDOWN = 12.0
"""Emulated slowdowns: 4 ranks on 2 cores, memory-bound layers and the engine's own work need this much
room (at 3x and 6x the fast ranks' forward and backward ran ~60% past their steady times)."""
ITERATIONS = 6
SLOW_LINK_BYTES_PER_S = 50e6  # the slow link: 50 MB/s (0.4 Gb/s) each way
LINKS = {"slow": SLOW_LINK_BYTES_PER_S, "fast": None}
NODE_OF_RANK = (0, 0, 1, 1)
SIZES = (2, 4, 8, 16, 24, 48)
NAME = "pipeline"


def _cluster(path: Path) -> Path:
    cluster = {
        "schema_version": 1,
        "nodes": [
            {"name": "node0", "devices": [{"device_type": "cpu-fast", "count": 2}]},
            {"name": "node1", "devices": [{"device_type": "cpu-slow", "count": 2}]},
        ],
        "device_types": {
            name: {"emulation": {"slowdown": slowdown, "memory_capacity_bytes": 4_000_000_000}}
            for name, slowdown in (("cpu-fast", FAST_SLOWDOWN), ("cpu-slow", SLOW_SLOWDOWN))
        },
    }
    path.write_text(json.dumps(cluster))
    return path


def _ds_config(**extra: Any) -> dict[str, Any]:
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "train_batch_size": GLOBAL_BATCH,
        **extra,
    }


def _loss_model(layers: Any, loss_fn: Callable[[Any, Any], Any]) -> Any:
    """`layers` run as one model returning its loss (what a ZeRO job and its profile train)."""
    import torch

    class LossModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, inputs: Any, labels: Any) -> Any:
            return loss_fn(self.layers(inputs), labels)

    return LossModel()


def _toy(name: str) -> Any:
    """`name` of the toy pipeline MLP's module (imported when a rank needs it: the CLI imports no torch)."""
    from poplar_ext.models import toy_pipeline

    return getattr(toy_pipeline, name)


GPT_SIZES = {"n_layer": 4, "n_head": 4, "n_embd": 256, "vocab_size": 1024, "n_positions": 64}
"""The bench's GPT-2: 4 blocks 256 wide, sequence 64; as pipeline layers the tied embedding, the positions, the 4
blocks, the final norm and the tied head (8 layers, like the MLP)."""


def _gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**GPT_SIZES, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _gpt_zero_model() -> Any:
    import torch

    class CausalLM(torch.nn.Module):  # (input_ids, labels) -> the model's own token-mean loss
        loss_shifts_labels = True  # its loss predicts labels[..., 1:] (the token counts of token_mean)

        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()

        def forward(self, input_ids: Any, labels: Any) -> Any:
            return self.model(input_ids=input_ids, labels=labels).loss

    return CausalLM()


def _gpt_pipeline() -> tuple[list[Any], Any]:
    from poplar_ext.pipeline import causal_lm_layers

    pipe = causal_lm_layers(_gpt2())
    return pipe.layers, pipe.loss_fn


def _gpt_data(num_samples: int) -> Any:
    from poplar_ext.models.hugging_face import PaddedTokens

    return PaddedTokens(num_samples=num_samples, vocab_size=GPT_SIZES["vocab_size"], length=GPT_SIZES["n_positions"])


def _gpt_zero_data(num_samples: int) -> Any:
    """The same samples as dicts: a ZeRO job counts each micro-batch's label tokens from its ``labels``."""
    tokens = _gpt_data(num_samples)
    return [{"input_ids": tokens.input_ids[i], "labels": tokens.labels[i]} for i in range(num_samples)]


def _gpt_batch(micro_batch_size: int) -> Any:
    data = _gpt_data(micro_batch_size)
    return {"input_ids": data.input_ids, "labels": data.labels}


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """One model the bench compares ZeRO and pipelines on."""

    description: str
    """What the report says the model is."""
    zero_model: Callable[[], Any]
    """The whole model, returning its loss from ``(inputs, labels)``: the ZeRO job's and the profile's."""
    pipeline: Callable[[], tuple[list[Any], Any]]
    """The same model as pipeline layers, and their loss function."""
    make_batch: Callable[[int], Any]
    """A profiling micro-batch of a given size."""
    zero_data: Callable[[int], Any]
    """The ZeRO job's training data set of a given number of samples."""
    pipeline_data: Callable[[int], Any]
    """The pipeline job's: the same samples, as its first and last layers take them."""
    poplar: dict[str, Any]
    """What the model needs in the ``poplar`` section of both jobs (its loss reduction)."""


BENCH_MODELS = {
    "mlp": BenchModel(
        description=f"toy pipeline MLP, {NUM_LAYERS} layers of width {DIM}, fp32, SGD",
        zero_model=lambda: _loss_model(_toy("toy_sequential")(dim=DIM, num_layers=NUM_LAYERS), _toy("mse")),
        pipeline=lambda: (_toy("toy_layers")(dim=DIM, num_layers=NUM_LAYERS), _toy("mse")),
        make_batch=lambda size: _toy("toy_batch")(size, dim=DIM),
        zero_data=lambda count: _toy("RegressionData")(num_samples=count, dim=DIM),
        pipeline_data=lambda count: _toy("RegressionData")(num_samples=count, dim=DIM),
        poplar={},
    ),
    "gpt": BenchModel(
        description=(
            f"GPT-2 from its config ({GPT_SIZES['n_layer']} blocks of width {GPT_SIZES['n_embd']}, sequence "
            f"{GPT_SIZES['n_positions']}, vocabulary {GPT_SIZES['vocab_size']}; head tied to the embedding, "
            "padded random tokens, token-mean loss), fp32, SGD"
        ),
        zero_model=_gpt_zero_model,
        pipeline=_gpt_pipeline,
        make_batch=_gpt_batch,
        zero_data=_gpt_zero_data,
        pipeline_data=_gpt_data,
        poplar={"loss_reduction": "token_mean"},
    ),
}
"""``poplar-bench pipeline --model``'s choices."""


def _median_after_first(stamps: list[float]) -> float:
    durations = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(durations[1:] if len(durations) > 1 else durations)


def _poplar_section(settings: dict[str, Any]) -> dict[str, Any]:
    model = BENCH_MODELS[settings["model"]]
    # As the demo's and the drift bench's jobs: one thread (emulation times the thread's CPU time) and the
    # allocator the profiler measured under; with glibc's default, each iteration's fresh gradient
    # buffers fault in their pages again (the flatten before the all-reduce took 2.5x longer).
    # Calibration off, as in the demo and the predictions bench: an emulated type's compute is steady at its
    # profile by construction, and checking it at start rescaled the profiles by CPU noise (docs/limits.md).
    return {
        "cluster": settings["cluster"],
        "profiles": settings["profiles"],
        "log_interval_steps": 0,
        "cpu_threads": 1,
        "steady_cpu_allocator": True,
        "calibration": {"action": "off"},
        **model.poplar,
    }


def _zero_job(settings: dict[str, Any], data: Any) -> dict[str, Any]:
    import poplar_ext
    from poplar_ext.plan.formats import plan_to_dict

    model = BENCH_MODELS[settings["model"]].zero_model()
    engine, _, loader, _ = poplar_ext.initialize(
        model=model, training_data=data, config=_ds_config(poplar=_poplar_section(settings))
    )
    stamps = [time.perf_counter()]
    while engine.global_steps < ITERATIONS + 1:
        for batch in loader:
            loss = engine(**batch) if isinstance(batch, dict) else engine(*batch)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                stamps.append(time.perf_counter())
            if engine.global_steps == ITERATIONS + 1:
                break
    return {"plan": plan_to_dict(engine.plan), "iteration_s": _median_after_first(stamps)}


def _pipeline_job(settings: dict[str, Any], data: Any) -> dict[str, Any]:
    import poplar_ext
    from poplar_ext.pipeline import PoplarPipelineModule
    from poplar_ext.plan.pipeline_formats import pipeline_plan_to_dict

    config = _ds_config(zero_optimization={"stage": 0}, poplar=_poplar_section(settings))
    layers, loss_fn = BENCH_MODELS[settings["model"]].pipeline()
    model = PoplarPipelineModule(layers, loss_fn=loss_fn, seed_layers=True, config=config, training_data=data)
    engine, _, _, _ = poplar_ext.initialize(model=model, training_data=data, config=config)
    stamps = [time.perf_counter()]
    for _ in range(ITERATIONS + 1):
        engine.train_batch()
        stamps.append(time.perf_counter())
    return {"plan": pipeline_plan_to_dict(engine.plan), "iteration_s": _median_after_first(stamps)}


def _rank(settings: dict[str, Any]) -> dict[str, Any]:
    """One rank of one link's run (forked): link, profiles, the ZeRO job, the pipeline job."""
    from poplar_ext.profiler import profile_model

    from .link_emulation import LinkEmulation, install_link_emulation

    if settings["bandwidth"] is not None:
        install_link_emulation(LinkEmulation(node_of_rank=NODE_OF_RANK, bandwidth_bytes_per_s=settings["bandwidth"]))
    model = BENCH_MODELS[settings["model"]]
    profile_model(
        model_factory=model.zero_model,
        make_batch=model.make_batch,
        ds_config=_ds_config(),
        cluster=settings["cluster"],
        zero_stages=(0, 1),
        micro_batch_sizes=SIZES,
        cache_dir=settings["profiles"],
        progress=None,
        activation_checkpointing="off",
        per_layer=False,
        micro_batch_size_limit=GLOBAL_BATCH,
    )
    num_samples = 4 * GLOBAL_BATCH
    return {
        "zero": _zero_job(settings, model.zero_data(num_samples)),
        "pipeline": _pipeline_job(settings, model.pipeline_data(num_samples)),
    }


def _summary(plan: dict[str, Any]) -> str:
    if plan.get("parallelism") == "pipeline":
        parts = []
        for p in plan["pipelines"]:
            stages = "+".join(f"r{s['rank']}:{s['first_layer']}-{s['last_layer']}" for s in p["stages"])
            parts.append(f"[{stages}] {p['micro_batch_size']}x{p['num_micro_batches']}")
        return f"ZeRO-{plan['zero_stage']}, " + ", ".join(parts)
    ranks = ", ".join(f"{r['micro_batch_size']}x{r['gradient_accumulation_steps']}" for r in plan["ranks"])
    return f"ZeRO-{plan['zero_stage']}, {ranks}"


def run_link(link: str, root: Path, *, log_dir: Path, copy_from: Path | None, model: str = "mlp") -> dict[str, Any]:
    """One link's run on 4 forked ranks; its row of the report."""
    from poplar_bench.local_ranks import run_ranks

    profiles = root / f"profiles-{link}"
    if copy_from is not None and not profiles.exists():
        # Compute profiles do not depend on the link; the network file does (measured again here).
        shutil.copytree(copy_from, profiles, ignore=shutil.ignore_patterns("network*"))
    settings = {
        "model": model,
        "bandwidth": LINKS[link],
        "cluster": str(_cluster(root / "cluster.json")),
        "profiles": str(profiles),
    }
    started = time.monotonic()
    results = run_ranks(_rank, world_size=4, log_dir=log_dir / link, args=(settings,), timeout_s=1500, pg_timeout_s=600)
    row: dict[str, Any] = {"link": link, "bandwidth_bytes_per_s": LINKS[link], "run_s": time.monotonic() - started}
    for kind in ("zero", "pipeline"):
        plan = results[0][kind]["plan"]
        row[kind] = {
            "plan": _summary(plan),
            # The slowest rank's median: every rank waits for it at the step.
            "measured_iteration_s": max(r[kind]["iteration_s"] for r in results),
            "predicted_iteration_s": plan["predicted"]["iteration_time_s"],
        }
    return row


def combined_row(link_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One link's row over its repetitions: each kind's median measured time, every run's, and its plan
    (the same in every run: the profiles are cached after the first; a run with another plan is said)."""
    row = {k: v for k, v in link_runs[0].items() if k not in ("zero", "pipeline")}
    row["run_s"] = sum(run["run_s"] for run in link_runs)
    for kind in ("zero", "pipeline"):
        entries = [run[kind] for run in link_runs]
        measured = [e["measured_iteration_s"] for e in entries]
        row[kind] = {
            **entries[0],
            "measured_iteration_s": statistics.median(measured),
            "measured_runs_s": measured,
            "predicted_runs_s": [e["predicted_iteration_s"] for e in entries],
            "other_plans": sorted({e["plan"] for e in entries} - {entries[0]["plan"]}),
        }
    return row


def run_pipeline_bench(
    *,
    out_dir: Path,
    work_dir: Path | None = None,
    model: str = "mlp",
    repetitions: int = 1,
    progress: Any = print,
) -> list[Path]:
    """Both links on `model` (a key of `BENCH_MODELS`), `repetitions` times (interleaved, the profiles and
    plans of the first reused), the report written into `out_dir` as ``pipeline.*`` (the MLP) or
    ``pipeline_<model>.*``; returns the paths."""
    if model not in BENCH_MODELS:
        raise ValueError(f"model: expected one of {', '.join(BENCH_MODELS)}, found {model!r}")
    if repetitions < 1:
        raise ValueError(f"repetitions: expected at least 1, found {repetitions}")
    name = NAME if model == "mlp" else f"{NAME}_{model}"
    root = Path(work_dir or tempfile.mkdtemp(prefix="poplar-bench-pipeline-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"fast": [], "slow": []}
    first: Path | None = None
    for repetition in range(repetitions):
        for link in runs:
            progress(f"run {repetition + 1}/{repetitions}, {link} link: profiles, the ZeRO job, the pipeline job ...")
            log_dir = root / "logs" / f"run{repetition + 1}"
            runs[link].append(run_link(link, root, log_dir=log_dir, copy_from=first, model=model))
            first = first or root / f"profiles-{link}"
            progress(json.dumps(runs[link][-1]))
    rows = [combined_row(link_runs) for link_runs in runs.values()]
    report = {
        "schema": report_module.REPORT_SCHEMA,
        "benchmark": "pipeline",
        "date": report_module.utc_now(),
        "devices": "emulated",
        "cluster": f"4 CPU ranks on one machine as 2 emulated nodes: node0 2 x cpu-fast (emulated, {FAST_SLOWDOWN:g}x "
        f"slower than a core), node1 2 x cpu-slow (emulated, {SLOW_SLOWDOWN:g}x)",
        "link_emulation": "poplar_bench/link_emulation.py: a sleep of bytes / bandwidth after every transfer and "
        "collective crossing the two emulated nodes (ring bytes per link); the fast link is uncapped loopback gloo",
        "model": f"{BENCH_MODELS[model].description}; global batch {GLOBAL_BATCH}",
        "repetitions": repetitions,
        "machine": report_module.machine_description(),
        "rows": rows,
    }
    return report_module.write_json_and_markdown(report, render_markdown(report), out_dir, name, figure=render_figure)


def render_markdown(report: dict[str, Any]) -> str:
    load = report["machine"].get("load_average")
    cores = report["machine"].get("usable_cpus")
    lines = [
        "# ZeRO against pipelines on an emulated two-node CPU cluster",
        "",
        f"`poplar-bench pipeline`, {report['date']}. Devices **emulated**: {report['cluster']}. "
        f"Times **measured** (wall clock, median of {ITERATIONS} iterations after one, the slowest rank; the "
        f"median over {report.get('repetitions', 1)} run(s), each run's in the last column) and **predicted** "
        "(the plan's own prediction from the measured profiles and network). measured/predicted: the median of "
        "each run's, against the prediction of the plan that run searched.",
        "",
        f"Model: {report['model']}. Link: {report['link_emulation']}.",
        "",
        f"Load average of the {f'{cores}-core ' if cores else ''}machine at the end (the bench's 4 ranks included): "
        f"{', '.join(f'{x:.1f}' for x in load) if load else 'unknown'}."
        + (f" The {code}." if (code := report_module.code_text(report["machine"])) else ""),
        "",
        "| link | parallelism | plan (searched at start) | measured s/iter | predicted s/iter | measured/predicted "
        "| each run's measured/predicted |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        link = (
            "fast (uncapped)"
            if row["bandwidth_bytes_per_s"] is None
            else f"slow ({row['bandwidth_bytes_per_s'] / 1e6:g} MB/s)"
        )
        for kind in ("zero", "pipeline"):
            r = row[kind]
            # Each run against its own plan's prediction (a run may have searched another plan), and the row's
            # ratio their median: the median time over runs of different plans against the first plan's prediction
            # would compare runs with a plan they did not run.
            measured = r.get("measured_runs_s", [])
            predicted = r.get("predicted_runs_s", [r["predicted_iteration_s"]] * len(measured))
            ratios = [m / p for m, p in zip(measured, predicted)]
            ratio = statistics.median(ratios) if ratios else r["measured_iteration_s"] / r["predicted_iteration_s"]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            plan = r["plan"] + "".join(f"; another run: {other}" for other in r.get("other_plans", []))
            lines.append(
                f"| {link} | {kind} | {plan} | {r['measured_iteration_s']:.3f} | {r['predicted_iteration_s']:.3f} "
                f"| {ratio:.2f} | {each} |"
            )
    lines.append("")
    return "\n".join(lines)


def render_figure(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, measured, predicted = [], [], []
    for row in report["rows"]:
        for kind in ("zero", "pipeline"):
            labels.append(f"{row['link']} link\n{kind}")
            measured.append(row[kind]["measured_iteration_s"])
            predicted.append(row[kind]["predicted_iteration_s"])
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured (emulated devices)")
    ax.bar([x + 0.2 for x in xs], predicted, width=0.4, label="predicted")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("seconds per iteration")
    ax.set_title("Best ZeRO plan vs best pipeline plan, 2 emulated nodes (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["run_pipeline_bench"]
