"""Step 3 of `poplar-bench gpu`: uniform, proportional and poplar on ranks of different speed sharing one GPU.

The demo's machinery (`bench.demo`, `bench.demo_worker`): profiles, a plan per policy,
interleaved measured rounds, each rank's standalone throughput (the measured ideal), the
report with speedup, share of the ideal, prediction error and each rank's decomposition.

How the ranks differ in speed, in the order tried:

* ``mps``: real, through CUDA MPS (each rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE limits the
  share of the GPU's multiprocessors it may use), when ``nvidia-cuda-mps-control`` exists and
  its daemon starts; the device types still declare an emulated memory capacity (the ranks
  share the GPU's memory) with no emulated slowdown;
* ``emulated``: the ranks compute on the GPU and each sleeps its emulated slowdown's share of
  its CUDA-timed compute (`poplar_ext.hardware.emulation`);
* ``dry-run``: the demo's emulated CPU ranks with tiny sizes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from poplar_search.formats import read_json

from ..demo_config import MIB, DemoDevice, DemoModel, DemoSettings

MPS_PERCENTAGES = (100, 50, 25)
"""Each rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the ``mps`` mode."""
EMULATED_SLOWDOWNS = (2.0, 4.0, 8.0)
"""The ``emulated`` mode's slowdowns: together the ranks keep the GPU busy 7/8 of the time at most, so that
they rarely wait for each other's kernels."""


def gpu_settings(mode: str, device_type: str, cache_dir: Path) -> DemoSettings:
    """The comparison on the GPU: a GPT of ~50M parameters (fp32), big enough that the GPU's compute, not
    Python's per-step overhead (which no emulation slows), sets the step time; memory declared per type
    (8 GiB over the baseline for the fastest, less for slower types, as on mixed clusters)."""
    if mode == "mps":
        devices = tuple(
            DemoDevice(name=f"{device_type}-mps{p}", slowdown=1.0, memory_headroom_bytes=int(8192 * p / 100) * MIB)
            for p in MPS_PERCENTAGES
        )
    else:
        devices = tuple(
            DemoDevice(name=f"{device_type}-x{s:g}", slowdown=s, memory_headroom_bytes=int(16384 / s) * MIB)
            for s in EMULATED_SLOWDOWNS
        )
    return DemoSettings(
        devices=devices,
        model=DemoModel(vocab_size=8192, sequence_length=512, num_layers=6, num_heads=12, hidden_size=768),
        zero_stage=1,
        global_batch_size=192,
        max_micro_batch_size=64,
        profile_repeats=5,
        iterations=2,
        rounds=3,
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


def policy_rank(settings: DemoSettings, work: Path) -> dict[str, Any]:
    """One rank of the comparison: its MPS share and its CUDA device set before CUDA starts, then the demo's rank."""
    import torch

    from ..demo_worker import run_rank

    rank = int(os.environ["RANK"])
    if os.environ.get("POPLAR_GPU_MPS") == "1":
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(MPS_PERCENTAGES[rank])
    if torch.cuda.is_available():
        from poplar_ext.hardware.devices import cuda_device_index

        # DeepSpeed's engine takes LOCAL_RANK as its CUDA device index.
        os.environ["LOCAL_RANK"] = str(cuda_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
    return run_rank(settings, work)


def start_mps(work_dir: Path) -> str:
    """Start the MPS daemon for this run; '' when it runs, else why not (the comparison is emulated then)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return "nvidia-cuda-mps-control is not installed"
    for name in ("pipe", "log"):
        (work_dir / f"mps-{name}").mkdir(parents=True, exist_ok=True)
    # The ranks (forked from this process) find the daemon through these.
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(work_dir / "mps-pipe")
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(work_dir / "mps-log")
    done = subprocess.run([control, "-d"], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        stop_mps()
        return f"nvidia-cuda-mps-control -d failed ({done.returncode}): {(done.stdout + done.stderr).strip()[-500:]}"
    os.environ["POPLAR_GPU_MPS"] = "1"
    return ""


def stop_mps() -> None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is not None and os.environ.get("POPLAR_GPU_MPS") == "1":
        subprocess.run([control], input="quit\n", text=True, capture_output=True, timeout=60, check=False)
    for name in ("POPLAR_GPU_MPS", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.environ.pop(name, None)


def run_policies(
    *, out_dir: Path, dry_run: bool, device_type: str | None, provenance: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Step 3: the comparison run, its report written as ``gpu_policies.{json,md,png}``; a summary.

    Under MPS when its daemon starts; when that run fails (a container may let the daemon start and
    still refuse its clients), once more emulated, with the MPS run's error in the report.
    """
    from ..report import write_report

    if dry_run:
        mode, why_not_mps = "dry-run", "dry run"
    elif device_type is None:
        raise RuntimeError("no CUDA device: the policy comparison needs one (or --dry-run)")
    else:
        why_not_mps = start_mps(out_dir / "policy-work")
        mode = "emulated" if why_not_mps else "mps"
    started = time.perf_counter()
    try:
        report = _compare(mode, device_type, out_dir, timeout_s=timeout_s / 2 if mode == "mps" else timeout_s)
    except Exception as exc:  # MPS's failure is a finding: recorded, and the emulated comparison still runs
        if mode != "mps":
            raise
        stop_mps()
        mode, why_not_mps = "emulated", f"the run under MPS failed: {type(exc).__name__}: {exc}"[-3000:]
        report = _compare(mode, device_type, out_dir, timeout_s=timeout_s - (time.perf_counter() - started))
    finally:
        stop_mps()
    label_report(report, mode=mode, why_not_mps=why_not_mps, provenance=provenance)
    paths = write_report(report, out_dir, "gpu_policies")
    return {"mode": mode, "why_not_mps": why_not_mps or None, "files": [p.name for p in paths], **_summary(report)}


def _compare(mode: str, device_type: str | None, out_dir: Path, *, timeout_s: float) -> dict[str, Any]:
    """The demo's ranks under `mode`'s settings; the demo's report."""
    from .. import demo

    cache_dir = out_dir / f"policy-cache-{mode}"
    settings = dry_run_settings(cache_dir) if mode == "dry-run" else gpu_settings(mode, str(device_type), cache_dir)
    settings = dataclasses.replace(settings, timeout_s=min(settings.timeout_s, timeout_s))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="poplar-gpu-policies-") as tmp:
        rank_results = demo.run_ranks(settings, Path(tmp), target=policy_rank)
        plans = read_json(Path(tmp) / "plans.json")
    return demo.assemble_report(settings, rank_results, plans, timings={"total_s": time.perf_counter() - started})


def label_report(report: dict[str, Any], *, mode: str, why_not_mps: str, provenance: dict[str, Any]) -> None:
    """Say what the ranks ran on and how their speeds differed, in the report's provenance fields."""
    from .provenance import provenance_line, provenance_short

    how = {
        "mps": "REAL speed differences through CUDA MPS active thread percentages "
        + ", ".join(f"{p}%" for p in MPS_PERCENTAGES)
        + " (memory capacity declared, emulated)",
        "emulated": f"EMULATED speed differences (slowdowns {', '.join(f'{s:g}' for s in EMULATED_SLOWDOWNS)} over "
        f"CUDA-timed compute) on one GPU; MPS not used: {why_not_mps}",
        "dry-run": "DRY RUN: emulated CPU ranks, tiny sizes; nothing measured on a GPU",
    }[mode]
    # The title is the figure's too: it names what the run ran on.
    report["title"] = f"poplar-bench gpu: the policies on ranks sharing one GPU; {provenance_short(provenance)}"
    report["data_source"] = f"measured, {how}, real DeepSpeed"
    report["provenance"] = provenance
    report["machine"]["gpus"] = provenance_line(provenance)
    notes = [f"{len(report['scenarios'][0]['policies'])} policies; ranks: {how}."]
    if mode != "dry-run":
        notes.append(
            "All ranks share one GPU: kernels of different ranks can overlap or wait for each other, which neither "
            "the profiles nor the predictions model. Their collectives run through gloo on CUDA tensors (copied "
            "through host memory): NCCL refuses two ranks on one device. Compute is timed by CUDA events; an "
            "emulated rank sleeps (slowdown - 1) x its CUDA-timed compute; memory is the CUDA allocator's peak."
        )
    # The demo's notes describe CPU ranks (thread CPU time): kept for the dry run only, which is that.
    report["notes"] = notes + [n for n in report["notes"] if mode == "dry-run" or not _about_cpu_ranks(n)]


def _about_cpu_ranks(note: str) -> bool:
    return note.startswith("Devices are emulated") or "thread CPU time" in note


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    scenario = report["scenarios"][0]
    return {
        "policies": {
            e["policy"]: {
                "status": e["status"],
                "samples_per_s_measured": (e.get("measured") or {}).get("samples_per_s"),
                "speedup_over_uniform": e.get("speedup_over_uniform"),
                "share_of_ideal": e.get("share_of_ideal"),
                "prediction_error": e.get("prediction_error"),
            }
            for e in scenario["policies"]
        },
        "goals": scenario["goals"],
    }
