"""The ``profile`` step of `poplar-bench gpu`: a GPT of ~136M parameters profiled in bf16 at ZeRO 1 and 3
(docs/gpu.md: the steps, ``profile_trials.jsonl``, the dry run)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import StepContext

MIB = 1 << 20

PROFILED_STAGES = (1, 3)
"""ZeRO 1 (optimizer states sharded, one communication per iteration) and 3 (everything sharded, gathers in
every micro-step): the two ends of what the probe must get right."""


@dataclass(frozen=True, kw_only=True)
class ProfileRun:
    """What step 2 profiles."""

    vocab_size: int
    """The GPT's vocabulary (its embedding and output layer)."""
    sequence_length: int
    num_layers: int
    num_heads: int
    hidden_size: int
    micro_batch_size_limit: int
    """Largest micro-batch tried: above what the GPU holds, so that the probe meets a real out-of-memory error."""
    repeats: int
    """Timed micro-steps per size (median)."""
    cpu_headroom_bytes: int = 256 * MIB
    """Dry run only: the CPU stand-in's declared memory above the rank's resident size."""

    def model_config(self) -> dict[str, int]:
        return {
            k: getattr(self, k) for k in ("vocab_size", "sequence_length", "num_layers", "num_heads", "hidden_size")
        }


GPU_PROFILE = ProfileRun(
    # GPT-2 small's shape with a 32k vocabulary and untied output layer: ~136M parameters.
    vocab_size=32768, sequence_length=1024, num_layers=12, num_heads=12, hidden_size=768,
    micro_batch_size_limit=512, repeats=3,
)  # fmt: skip
DRY_RUN_PROFILE = ProfileRun(
    vocab_size=64, sequence_length=16, num_layers=1, num_heads=2, hidden_size=16, micro_batch_size_limit=2, repeats=1
)

DS_CONFIG = {
    "bf16": {"enabled": True},
    # torch's AdamW: DeepSpeed's fused Adam is a CUDA op it would compile (no nvcc on the GPU machine).
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "gradient_clipping": 1.0,
    "steps_per_print": 1_000_000,
}


def profile_rank(run: ProfileRun, cache_dir: str, trials_path: str) -> dict[str, Any]:
    """One rank: the stages profiled (a line per trial into `trials_path`), then the same call again
    (served by the cache); what each took."""
    import torch

    from poplar_ext.models.toy_gpt import GPT, GPTConfig
    from poplar_ext.plan.formats import profile_to_dict
    from poplar_ext.profiler import profile_model

    from .context import append_json_line

    config = GPTConfig(**run.model_config())
    batches_made = {"first": 0, "second": 0}
    started = time.perf_counter()

    def make_batch(call: str):
        def batch(micro_batch_size: int) -> torch.Tensor:
            batches_made[call] += 1
            return torch.randint(0, config.vocab_size, (micro_batch_size, config.sequence_length + 1))

        return batch

    def trial_line(line: str) -> None:
        append_json_line(Path(trials_path), {"t_s": round(time.perf_counter() - started, 2), "line": line})

    common = dict(
        model_factory=lambda: GPT(config),
        ds_config=DS_CONFIG,
        cluster=_cluster(run),
        zero_stages=PROFILED_STAGES,
        cache_dir=cache_dir,
        model_name=f"gpt-{config.num_layers}x{config.hidden_size}",
        sequence_length=config.sequence_length,
        micro_batch_size_limit=run.micro_batch_size_limit,
        repeats=run.repeats,
        activation_checkpointing="off",  # the stages, not the memory levers, are what this step checks
        progress=trial_line,
    )
    times_s, profiles = {}, {}
    for call in ("first", "second"):
        start = time.perf_counter()
        profiles[call] = profile_model(make_batch=make_batch(call), **common)
        times_s[call] = time.perf_counter() - start
        for profile in profiles[call] if call == "first" else []:
            trial = {"t_s": round(time.perf_counter() - started, 2), "profile": profile_to_dict(profile)}
            append_json_line(Path(trials_path), trial)
    return {
        "profiles": [profile_to_dict(p) for p in profiles["first"]],
        "identical_from_cache": profiles["second"] == profiles["first"],
        "first_call_s": times_s["first"],
        "cached_call_s": times_s["second"],
        "batches_made_by_cached_call": batches_made["second"],
        "num_parameters": sum(p.numel() for p in GPT(config).parameters()),
    }


def _cluster(run: ProfileRun):
    """One device: the GPU as its hardware names it, or the dry run's emulated CPU stand-in."""
    import psutil
    import torch

    from poplar_ext.hardware.devices import hardware_device_type
    from poplar_ext.plan.formats import cluster_from_dict

    if torch.cuda.is_available():
        device_type, types = hardware_device_type(torch.device("cuda", 0)), {}
    else:
        device_type = "cpu-standin"
        capacity = psutil.Process().memory_info().rss + run.cpu_headroom_bytes
        types = {device_type: {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": capacity}}}
    nodes = [{"name": "gpu-node", "devices": [{"device_type": device_type, "count": 1}]}]
    return cluster_from_dict({"schema_version": 1, "nodes": nodes, "device_types": types})


def run_profile_step(context: StepContext) -> dict[str, Any]:
    """The step: the rank's result, each profile summarised (whole in ``profile_trials.jsonl``)."""
    import torch

    from poplar_bench.local_ranks import run_ranks

    run = DRY_RUN_PROFILE if context.settings.dry_run else GPU_PROFILE
    trials_path = context.out / "profile_trials.jsonl"
    trials_path.unlink(missing_ok=True)
    rank = run_ranks(
        profile_rank,
        world_size=1,
        log_dir=context.work_dir / "logs",
        args=(run, str(context.work_dir / "cache"), str(trials_path)),
        timeout_s=context.timeout_s,
        # On CUDA the profiler sets up NCCL itself; a CPU rank gets a gloo group.
        init_process_group=not torch.cuda.is_available(),
    )[0]
    kept = ("num_parameters", "first_call_s", "cached_call_s", "identical_from_cache", "batches_made_by_cached_call")
    result = {
        "settings": asdict(run),
        **{k: rank[k] for k in kept},
        "profiles": [_summary(p) for p in rank["profiles"]],
    }
    result["goals"] = profile_goals(result)
    if not rank["identical_from_cache"] or rank["batches_made_by_cached_call"]:
        result["error"] = "the second call did not come from the cache"
    return result


ALL_STAGES_GOAL_S = 60.0
"""The goal for profiling both stages of the >= 100M-parameter model on the GPU (two minutes for all four)."""
CACHED_GOAL_S = 1.0
"""The goal for the same call served by the cache ("0 s": nothing measured, files read)."""


def profile_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The step's goals, evaluated (reported, never asserted)."""
    from ..report import goal_entry

    first_s, cached_s = result["first_call_s"], result["cached_call_s"]
    return [
        goal_entry("both stages profiled", first_s, f"< {ALL_STAGES_GOAL_S:g} s", first_s < ALL_STAGES_GOAL_S),
        goal_entry(
            "the same call from the cache",
            cached_s,
            f"< {CACHED_GOAL_S:g} s, nothing measured",
            cached_s < CACHED_GOAL_S and result["batches_made_by_cached_call"] == 0,
        ),
    ]


def _summary(profile: dict[str, Any]) -> dict[str, Any]:
    measured = profile["measured_with"]
    return {
        "device_type": profile["device_type"],
        "zero_stage": profile["zero_stage"],
        "dtype": profile["model"].get("dtype"),
        "max_micro_batch_size": profile["max_micro_batch_size"],
        "memory_capacity_bytes": profile["memory_capacity_bytes"],
        "sizes_measured": [s["micro_batch_size"] for s in profile["samples"]],
        **{k: measured.get(k) for k in ("largest_micro_batch_probe", "stage_profiling_time_s", "hardware", "device")},
    }


def profiles_markdown(result: dict[str, Any]) -> list[str]:
    goals = result.get("goals", [])
    lines = [
        f"{result['num_parameters']:,} parameters; ZeRO {' and '.join(map(str, PROFILED_STAGES))} "
        f"{result['first_call_s']:.1f} s, again from the cache "
        f"{result['cached_call_s']:.2f} s (identical: {result['identical_from_cache']}).",
        "",
        *[f"Goal: {g['goal']} {g['target']}: {g['value']:.3g} s ({'met' if g['met'] else 'MISSED'})." for g in goals],
        "",
        "| device type | stage | dtype | largest micro-batch | sizes measured | probe | s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in result["profiles"]:
        probe = _probe_text(p["largest_micro_batch_probe"] or {})
        lines.append(
            f"| {p['device_type']} | {p['zero_stage']} | {p['dtype']} | {p['max_micro_batch_size']} | "
            f"{p['sizes_measured']} | {probe} | {p['stage_profiling_time_s']} |"
        )
    return lines


def _probe_text(probe: dict[str, Any]) -> str:
    """What the largest-size probe found: the largest size that fitted, the smallest that ran out of memory."""
    limited = " (the micro-batch limit, not memory)" if probe.get("limited_by_micro_batch_size_limit") else ""
    return (
        f"fits {probe.get('largest_fitting')}{limited}; out of memory at {probe.get('smallest_failing') or '-'}; "
        f"predicted {probe.get('predicted_largest')}"
    )
