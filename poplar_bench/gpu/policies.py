"""The ``predictions`` step of `poplar-bench gpu`: the policies measured against their predictions on one GPU
(docs/gpu.md)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poplar_ext.plan.formats import read_json

from ..demo_config import MIB, DemoDevice, DemoModel, DemoSettings
from ..report import num_text

if TYPE_CHECKING:
    from .context import StepContext

EMULATED_SLOWDOWNS = (1.0, 3.0)
"""Each rank's slowdown over the GPU's own speed: the GPU as it is, and one emulated slower type."""


def gpu_settings(device_type: str, cache_dir: Path) -> DemoSettings:
    """The comparison on the GPU: a GPT of ~50M parameters (fp32), big enough that the GPU's compute, not
    Python's per-step overhead (which no emulation slows), sets the step time; memory declared per type
    (more for the faster, as on mixed clusters)."""
    devices = tuple(
        DemoDevice(name=f"{device_type}-x{s:g}", slowdown=s, memory_headroom_bytes=int(16384 / s) * MIB)
        for s in EMULATED_SLOWDOWNS
    )
    return DemoSettings(
        devices=devices,
        model=DemoModel(vocab_size=8192, sequence_length=512, num_layers=6, num_heads=12, hidden_size=768),
        zero_stage=1,
        global_batch_size=128,
        max_micro_batch_size=64,
        profile_repeats=3,
        iterations=2,
        rounds=1,
        standalone_repeats=3,
        cache_dir=cache_dir,
        timeout_s=480.0,
    )


def dry_run_settings(cache_dir: Path) -> DemoSettings:
    """The same code path on two emulated CPU ranks, sizes as small as they go."""
    return DemoSettings(
        devices=(
            DemoDevice(name="cpu-standin-x2", slowdown=2.0, memory_headroom_bytes=96 * MIB),
            DemoDevice(name="cpu-standin-x4", slowdown=4.0, memory_headroom_bytes=48 * MIB),
        ),
        model=DemoModel(vocab_size=64, sequence_length=16, num_layers=1, num_heads=2, hidden_size=16),
        zero_stage=1,
        global_batch_size=12,
        max_micro_batch_size=2,
        profile_repeats=1,
        iterations=1,
        warmup_iterations=0,
        rounds=1,
        standalone_repeats=1,
        cache_dir=cache_dir,
        timeout_s=300.0,
    )


def run_predictions(context: StepContext) -> dict[str, Any]:
    """The comparison; its report written as ``predictions.{json,md}``; a summary for ``gpu_run.json``."""
    from .. import demo
    from ..report import render_markdown, write_json_and_markdown

    device_type = context.provenance.get("device_type")
    if not context.settings.dry_run and device_type is None:
        raise RuntimeError("no CUDA device: the comparison needs one (or --dry-run)")
    cache_dir = context.work_dir / "cache"
    settings = dry_run_settings(cache_dir) if context.settings.dry_run else gpu_settings(str(device_type), cache_dir)
    settings = dataclasses.replace(settings, timeout_s=min(settings.timeout_s, context.timeout_s))
    started = time.perf_counter()
    ranks_dir = context.work_dir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    rank_results = demo.run_ranks(settings, ranks_dir)
    plans = read_json(ranks_dir / "plans.json")
    report = demo.assemble_report(settings, rank_results, plans, timings={"total_s": time.perf_counter() - started})
    label_report(report, dry_run=context.settings.dry_run, provenance=context.provenance)
    paths = write_json_and_markdown(report, render_markdown(report), context.out, "predictions")
    return {"files": [p.name for p in paths], **_summary(report)}


def label_report(report: dict[str, Any], *, dry_run: bool, provenance: dict[str, Any]) -> None:
    """Say what the ranks ran on and how their speeds differed, in the report's provenance fields."""
    from .provenance import provenance_short

    if dry_run:
        how = "DRY RUN: emulated CPU ranks, tiny sizes; nothing measured on a GPU"
    else:
        how = (
            f"REAL GPU compute, speeds EMULATED (slowdowns {', '.join(f'{s:g}' for s in EMULATED_SLOWDOWNS)} over "
            "CUDA-timed compute) on one GPU"
        )
    report["title"] = f"poplar-bench gpu: the policies on ranks sharing one GPU; {provenance_short(provenance)}"
    report["data_source"] = f"measured, {how}, real DeepSpeed"
    report["provenance"] = provenance
    report["machine"]["gpus"] = provenance_short(provenance)  # after "GPUs: " in the report's machine line
    notes = [f"{len(report['scenarios'][0]['policies'])} policies; ranks: {how}."]
    if not dry_run:
        notes.append(
            "Both ranks share one GPU: kernels of different ranks can overlap or wait for each other, which neither "
            "the profiles nor the predictions model. Their collectives run through gloo on CUDA tensors (copied "
            "through host memory): NCCL refuses two ranks on one device. Compute is timed by CUDA events; each "
            "rank pads each micro-step's compute to its slowdown x the profile's time for it (steady emulation: "
            "the GPU type's slowdown is 1); memory is the CUDA allocator's peak."
        )
    # The demo's notes describe CPU ranks (thread CPU time): kept for the dry run only, which is that.
    report["notes"] = notes + [
        n for n in report["notes"] if dry_run or not (n.startswith("Devices are emulated") or "thread CPU time" in n)
    ]


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    scenario = report["scenarios"][0]
    return {
        "policies": {
            e["policy"]: {
                "status": e["status"],
                "samples_per_s_measured": (e.get("measured") or {}).get("samples_per_s"),
                "iteration_s_measured": ((e.get("measured") or {}).get("iteration_time_s") or {}).get("median"),
                "iteration_s_predicted": (e.get("predicted") or {}).get("iteration_time_s"),
                "speedup_over_uniform": e.get("speedup_over_uniform"),
                "share_of_ideal": e.get("share_of_ideal"),
                "prediction_error": e.get("prediction_error"),
            }
            for e in scenario["policies"]
        },
        "goals": scenario["goals"],
    }


def predictions_markdown(result: dict[str, Any]) -> list[str]:
    """The step's lines of the run's markdown report."""
    lines = [
        "| policy | status | iteration s measured / predicted | samples/s | speedup over uniform | share of ideal "
        "| prediction error |",
        "| --- " * 7 + "|",
    ]
    for policy, p in result["policies"].items():
        cells = [p["samples_per_s_measured"], p["speedup_over_uniform"], p["share_of_ideal"], p["prediction_error"]]
        times = f"{num_text(p.get('iteration_s_measured'))} / {num_text(p.get('iteration_s_predicted'))}"
        lines.append(f"| {policy} | {p['status']} | {times} | {' | '.join(map(num_text, cells))} |")
    return lines + ["", f"Full report: {', '.join(result['files'])}"]
