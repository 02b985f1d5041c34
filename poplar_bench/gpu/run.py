"""`poplar-bench gpu`: the CUDA path's evidence in one call of at most 7 minutes, each result written as it is made:
the steps in order, each within what is left of the budget; ``gpu_run.md`` (docs/gpu.md)."""

from __future__ import annotations

import importlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import write_json_atomic

from ..report import code_lines, machine_description, utc_now, write_json_and_markdown
from .context import GpuRunSettings, RunLog, StepContext
from .provenance import provenance_line

STEP_LIMITS_S = {"exact": 150.0, "profile": 150.0, "predictions": 150.0, "launcher": 90.0}
"""The longest each step may take; it also gets no more than what is left of the budget."""

STEP_MINIMUM_S = {"exact": 30.0, "profile": 45.0, "predictions": 60.0, "launcher": 45.0}
"""A step is skipped (and says so) when less than this is left of the budget."""

RUN_ENVIRONMENT = {
    # DeepSpeed compiles none of its CUDA ops (the run uses torch's optimizers) and does not look for nvcc.
    "DS_BUILD_OPS": "0",
    "DS_SKIP_CUDA_CHECK": "1",
    # torch's CUDA availability check through NVML: no CUDA context in the bench's process, which forks ranks.
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


def run_gpu(settings: GpuRunSettings) -> int:
    """Every step of `settings`; 0 when none failed (skipped ones did not), 1 otherwise (each is in the results)."""
    os.environ.update(RUN_ENVIRONMENT)
    out = settings.output_dir
    out.mkdir(parents=True, exist_ok=True)
    log = RunLog(out / "gpu_run.log")
    from .provenance import read_provenance  # looked up at the call (a test replaces it)

    provenance = read_provenance(dry_run=settings.dry_run)
    write_json_atomic(provenance, out / "provenance.json")
    log.say(provenance_line(provenance))
    work_dir = settings.work_dir or Path(tempfile.mkdtemp(prefix="poplar-bench-gpu-"))
    log.say(f"work folder (rank logs, caches): {work_dir}")
    results: dict[str, Any] = {}
    for index, name in enumerate(settings.steps):
        # Before the step too: a run killed while it runs (the machine's time up, Ctrl-C) leaves a summary that says
        # it did not finish and which steps it never ended.
        write_summary(settings, provenance, results, total_s=log.elapsed_s(), not_finished=settings.steps[index:])
        left_s = settings.budget_s - log.elapsed_s()
        if left_s < STEP_MINIMUM_S[name]:
            results[name] = {"status": "skipped", "seconds": 0.0, "reason": f"{left_s:.0f} s left of the budget"}
            log.say(f"step {name}: skipped ({results[name]['reason']}; it needs {STEP_MINIMUM_S[name]:g} s)")
        else:
            context = StepContext(
                settings=settings,
                work_dir=work_dir / name,
                timeout_s=min(STEP_LIMITS_S[name], left_s),
                log=log,
                provenance=provenance,
            )
            results[name] = run_step(name, partial(STEP_FUNCTIONS[name], context), log)
        write_summary(settings, provenance, results, total_s=log.elapsed_s(), not_finished=settings.steps[index + 1 :])
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    log.say(f"done in {log.elapsed_s():.0f} s; failed steps: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def run_step(name: str, step: Callable[[], dict[str, Any]], log: RunLog) -> dict[str, Any]:
    """One step, timed; an exception or an ``error`` in its result is its failure, recorded, never raised."""
    log.say(f"step {name}: started")
    start = time.perf_counter()
    try:
        result = step()
        status = "failed" if result.get("error") else "skipped" if result.get("skipped") else "ok"
    except Exception as exc:  # a failed step must not stop the others: it is recorded
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-8000:]}
        status = "failed"
    seconds = time.perf_counter() - start
    told = result.get("error", "")[-3000:] or result.get("reason", "")
    log.say(f"step {name}: {status} in {seconds:.1f} s" + (f": {told}" if told else ""))
    return {"status": status, "seconds": seconds, **result}


def _step(module: str, function: str, *, needs_cuda: bool = False) -> Callable[[StepContext], dict[str, Any]]:
    """A step: `function` of this package's `module`, imported when the step runs."""

    def step(context: StepContext) -> dict[str, Any]:
        if needs_cuda and not context.settings.dry_run:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    "CUDA is not available (torch.cuda.is_available() is False): run with --dry-run on CPU"
                )
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)(context)

    return step


STEP_FUNCTIONS: dict[str, Callable[[StepContext], dict[str, Any]]] = {
    "exact": _step("tier", "run_exactness"),
    "profile": _step("profiles", "run_profile_step", needs_cuda=True),
    "predictions": _step("policies", "run_predictions", needs_cuda=True),
    "launcher": _step("tier", "run_launcher"),
}


def write_summary(
    settings: GpuRunSettings,
    provenance: dict[str, Any],
    results: dict[str, Any],
    *,
    total_s: float,
    not_finished: tuple[str, ...] | list[str] = (),
) -> list[Path]:
    """``gpu_run.json`` and ``gpu_run.md``: provenance, then every step's outcome so far (`not_finished`: the steps
    still to end when it is written, the first of them running; none once the run is over)."""
    report = {
        "schema": "poplar-bench-gpu/2",
        "kind": "gpu",
        "created_utc": utc_now(),
        "dry_run": settings.dry_run,
        "budget_s": settings.budget_s,
        "provenance": provenance,
        "machine": machine_description(),
        "total_s": total_s,
        "steps": results,
        "finished": not not_finished,
        "steps_not_finished": list(not_finished),
    }
    return write_json_and_markdown(report, render_summary(report), settings.output_dir, "gpu_run")


WHAT_EACH_STEP_MEASURES = {
    "exact": "Three ranks sharing the GPU, uneven plan, ZeRO 0-3, against one process on the global batch: fp32 "
    "within 1e-5 of plain torch; bf16 against one DeepSpeed rank in bf16, with the missing-loss-weight mutation "
    "shown to exceed the tolerance at stages 0 and 3 (exact.jsonl).",
    "profile": "A GPT of ~136M parameters profiled in bf16 at ZeRO 1 and 3 with the profiler's real out-of-memory "
    "probe, then the same call again, which must come from the cache (profile_trials.jsonl: a line per trial).",
    "predictions": "uniform, proportional and poplar on two ranks sharing the GPU, one an emulated 3x slower type: "
    "measured against predicted, share of the measured ideal (predictions.md).",
    "launcher": "The deepspeed launcher with bf16 and the cluster read from the hardware.",
}


def render_summary(report: dict[str, Any]) -> str:
    """``gpu_run.md``: the run's provenance and every step's outcome, readable."""
    from .policies import predictions_markdown
    from .profiles import profiles_markdown
    from .tier import exactness_markdown

    provenance = report["provenance"]
    lines = [
        "# poplar-bench gpu" + (" (DRY RUN on CPU)" if report["dry_run"] else ""),
        "",
        f"- {provenance_line(provenance)}",
        f"- compute capability {provenance.get('compute_capability') or '-'}; torch built for "
        f"{', '.join(provenance.get('torch_arch_list') or []) or '-'}",
        f"- made {report['created_utc']}, {report['total_s']:.0f} s in all (budget {report['budget_s']:.0f} s); "
        f"load average {report['machine'].get('load_average')}",
        *code_lines(report["machine"]),
    ]
    not_finished = report.get("steps_not_finished") or []
    if not_finished:
        lines.append(
            f"- **UNFINISHED**: written while the run went on, before {', '.join(not_finished)} ended ("
            f"{not_finished[0]} running or about to); a run that left this file so was stopped (interrupted, killed "
            "or out of time) and has no results for them"
        )
    render_step = {
        "exact": exactness_markdown,
        "profile": profiles_markdown,
        "predictions": predictions_markdown,
        "launcher": lambda result: [],
    }
    for name, result in report["steps"].items():
        lines += ["", f"## {name}: {result['status']} ({result['seconds']:.1f} s)", "", WHAT_EACH_STEP_MEASURES[name]]
        if result.get("reason"):
            lines += ["", f"Skipped: {result['reason']}."]
        if result.get("error"):
            lines += ["", "```", result["error"][-3000:], "```"]
        try:
            lines += [""] + render_step[name](result)
        except (KeyError, TypeError):
            lines += ["", "(no results to show)"]
    return "\n".join(lines) + "\n"
