"""`poplar-bench gpu`: the steps in order, each one's failure recorded without stopping the others.

Every file written goes under the output folder and names the GPU, its driver, CUDA, torch
and DeepSpeed (`bench.gpu.provenance`): ``gpu_run.json`` and ``gpu_run.md`` (every step's
outcome; ``gpu_run_part1``/``_part2`` with --part), ``gpu_run.log``, ``gpu_tests.{xml,log}``
(step 1), ``profiles.json`` and ``profiles/`` (step 2), ``gpu_policies.{json,md,png}`` (step 3),
``logs/`` (the ranks').
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar_search.formats import write_json_atomic

from ..report import machine_description, utc_now

PARTS = {"1": ("tests", "profiles"), "2": ("policies",), "all": ("tests", "profiles", "policies")}
"""Which steps each --part runs: two calls of about 4 minutes each, or one of about 8."""

STEP_TIMEOUTS_S = {"tests": 300.0, "profiles": 240.0, "policies": 480.0}
"""Each step's limit: part 1 stays within a 10-minute call even when both of its steps run to their limits."""

RUN_ENVIRONMENT = {
    # DeepSpeed compiles none of its CUDA ops (the run uses torch's Adam) and does not look for nvcc,
    # which the GPU machine lacks.
    "DS_BUILD_OPS": "0",
    "DS_SKIP_CUDA_CHECK": "1",
    # torch's CUDA availability check through NVML: no CUDA context in the bench's process, which forks ranks.
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


@dataclass(frozen=True, kw_only=True)
class GpuRunSettings:
    """One `poplar-bench gpu` call."""

    output_dir: Path
    """Where every result goes (created)."""
    part: str = "all"
    """``1`` (test tier, profiles), ``2`` (policy comparison) or ``all``."""
    dry_run: bool = False
    """The same code paths on CPU with CPU stand-ins and tiny sizes (the test suite runs it)."""
    repo: Path = field(default_factory=Path.cwd)
    """The repository root: the GPU test tier is its tests/gpu (default: the current directory)."""
    step_timeouts_s: dict[str, float] = field(default_factory=lambda: dict(STEP_TIMEOUTS_S))
    """Longest each step may take before it is stopped and recorded as failed."""

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"part: expected one of {sorted(PARTS)}, found {self.part!r}")

    @property
    def stem(self) -> str:
        """The summary's and the log's file stem: ``gpu_run``, or ``gpu_run_part1``/``_part2``, so that the two
        calls of a split run write beside each other."""
        return "gpu_run" if self.part == "all" else f"gpu_run_part{self.part}"


class RunLog:
    """``gpu_run.log``: every line with its time since the start, also on stderr."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.perf_counter()
        path.write_text("")

    def say(self, message: str) -> None:
        line = f"[poplar-bench gpu {time.perf_counter() - self.started:6.1f} s] {message}"
        with self.path.open("a") as log:
            log.write(line + "\n")
        print(line, file=sys.stderr, flush=True)


def run_gpu(settings: GpuRunSettings) -> int:
    """Every step of `settings.part`; 0 when all succeeded, 1 when any failed (each one is in the results)."""
    os.environ.update(RUN_ENVIRONMENT)
    out = settings.output_dir
    out.mkdir(parents=True, exist_ok=True)
    log = RunLog(out / f"{settings.stem}.log")
    from .provenance import provenance_line, read_provenance

    provenance = read_provenance(dry_run=settings.dry_run)
    log.say(provenance_line(provenance))
    steps = {
        "tests": lambda: _tier(settings),
        "profiles": lambda: _profiles(settings),
        "policies": lambda: _policies(settings, provenance),
    }
    results = {name: run_step(name, steps[name], log) for name in PARTS[settings.part]}
    paths = write_summary(settings, provenance, results, total_s=time.perf_counter() - log.started)
    failed = [name for name, r in results.items() if r["status"] != "ok"]
    log.say(f"wrote {', '.join(p.name for p in paths)}; failed steps: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def run_step(name: str, step: Callable[[], dict[str, Any]], log: RunLog) -> dict[str, Any]:
    """One step, timed; an exception or an ``error`` in its result is its failure, recorded, never raised."""
    log.say(f"step {name}: started")
    start = time.perf_counter()
    try:
        result = step()
        status = "failed" if result.get("error") else "ok"
    except Exception as exc:  # a failed step must not stop the others: it is recorded
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-8000:]}
        status = "failed"
    seconds = time.perf_counter() - start
    log.say(f"step {name}: {status} in {seconds:.1f} s" + (f": {result['error'][:2000]}" if status != "ok" else ""))
    return {"status": status, "seconds": seconds, **result}


def _tier(settings: GpuRunSettings) -> dict[str, Any]:
    from .tier import run_tier

    return run_tier(
        repo=settings.repo,
        out_dir=settings.output_dir,
        dry_run=settings.dry_run,
        timeout_s=settings.step_timeouts_s["tests"],
    )


def _profiles(settings: GpuRunSettings) -> dict[str, Any]:
    from .profiles import DRY_RUN_PROFILE, GPU_PROFILE, run_profiles

    _require_cuda(settings)
    run = DRY_RUN_PROFILE if settings.dry_run else GPU_PROFILE
    return run_profiles(run=run, out_dir=settings.output_dir, timeout_s=settings.step_timeouts_s["profiles"])


def _policies(settings: GpuRunSettings, provenance: dict[str, Any]) -> dict[str, Any]:
    from .policies import run_policies

    _require_cuda(settings)
    return run_policies(
        out_dir=settings.output_dir,
        dry_run=settings.dry_run,
        device_type=provenance.get("device_type"),
        provenance=provenance,
        timeout_s=settings.step_timeouts_s["policies"],
    )


def _require_cuda(settings: GpuRunSettings) -> None:
    import torch

    if not settings.dry_run and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available (torch.cuda.is_available() is False): run with --dry-run on CPU")


def write_summary(
    settings: GpuRunSettings, provenance: dict[str, Any], results: dict[str, Any], *, total_s: float
) -> list[Path]:
    """``gpu_run.json`` and ``gpu_run.md``: provenance, then every step's outcome."""
    from .render import render_summary

    report = {
        "schema": "poplar-bench-gpu/1",
        "kind": "gpu",
        "created_utc": utc_now(),
        "dry_run": settings.dry_run,
        "part": settings.part,
        "provenance": provenance,
        "machine": machine_description(),
        "total_s": total_s,
        "steps": results,
    }
    json_path, md_path = settings.output_dir / f"{settings.stem}.json", settings.output_dir / f"{settings.stem}.md"
    write_json_atomic(report, json_path)
    md_path.write_text(render_summary(report))
    if "profiles" in results and results["profiles"].get("profiles"):
        profiles_path = settings.output_dir / "profiles.json"
        write_json_atomic({"provenance": provenance, **results["profiles"]}, profiles_path)
        return [json_path, md_path, profiles_path]
    return [json_path, md_path]
